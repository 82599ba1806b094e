"""`ftrun slurm`: run an ftrun job on Slurm, one batch job per replica plus one for the lighthouse.

    ftrun slurm submit --replicas 3 --ranks-per-replica 8 [--partition P] [--time T] train.py [ARGS...]

writes the batch scripts (ftrun.launch.slurm_plan, pure) under RUN_DIR/slurm and submits them with
sbatch, printing the job ids. The job token reaches the jobs as a 0600 file in the run dir (or the
FTRUN_TOKEN_FILE given), never on a command line. The scripts call three small wrappers of this module:

- `replica`: one per replica job, on its first node. Hosts the replica's rendezvous store (like torchrun's
  agent) and runs the ranks as an srun step; a failed step is replaced by a new one (the next
  incarnation) up to FTRUN_SLURM_MAX_RESTARTS times, then the job requeues itself (a new allocation) up
  to FTRUN_SLURM_MAX_REQUEUES times. Writes --done-file when it finishes for good.
- `task`: every srun task; maps SLURM_* onto the worker variables and execs the rank's command.
- `lighthouse`: runs `ftrun lighthouse` on a free port, publishes its address in --addr-file for the
  replica wrappers, and stops it once every replica's done file exists.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys

from ftrun.launch.slurm_plan import (SlurmJobPlan, StepAction, incarnation, lighthouse_script, replica_script,
                                     resolve_host, srun_command, step_decision, task_environ)

SBATCH = "sbatch"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="slurm_command", required=True, metavar="{submit}")
    s = sub.add_parser("submit", help="write the batch scripts and submit them with sbatch")
    s.add_argument("--replicas", type=int, required=True)
    s.add_argument("--ranks-per-replica", type=int, required=True, help="srun tasks (ranks) per replica")
    s.add_argument("--nodes-per-replica", type=int, default=1)
    s.add_argument("--partition", default=None)
    s.add_argument("--time", dest="time_limit", default=None, help="each job's time limit (sbatch --time)")
    s.add_argument("--max-restarts", type=int, default=3,
                   help="new srun steps for a replica whose step failed, per allocation (requeues come on top)")
    s.add_argument("--max-requeues", type=int, default=1,
                   help="then requeue the replica's job (a new allocation) up to this many times")
    s.add_argument("--min-replicas", type=int, default=None, help="lighthouse quorum size (default: --replicas)")
    s.add_argument("--run-dir", default="ftrun-slurm-run", help="a folder every node sees (token, logs, audit)")
    s.add_argument("--bind-host", default="@node",
                   help="address every listener binds; @node (default): the node's Slurm name")
    s.add_argument("--lighthouse", default=None, help="host:port of a running lighthouse (then no lighthouse job)")
    s.add_argument("--sbatch-arg", action="append", default=[], help="extra #SBATCH option for every job, "
                   "e.g. --sbatch-arg=--gpus-per-task=1 (repeatable)")
    s.add_argument("--dry-run", action="store_true", help="write the scripts, do not submit")
    s.add_argument("--json", action="store_true")
    s.add_argument("-m", "--module", action="store_true", help="SCRIPT names a module to run as python -m")
    s.add_argument("script")
    s.add_argument("script_args", nargs=argparse.REMAINDER)
    r = sub.add_parser("replica", help=argparse.SUPPRESS)
    r.add_argument("--done-file", required=True)
    r.add_argument("--lighthouse-wait", type=float, default=600.0)
    r.add_argument("command", nargs=argparse.REMAINDER)
    t = sub.add_parser("task", help=argparse.SUPPRESS)
    t.add_argument("command", nargs=argparse.REMAINDER)
    h = sub.add_parser("lighthouse", help=argparse.SUPPRESS)
    h.add_argument("--addr-file", required=True)
    h.add_argument("--state-dir", required=True)
    h.add_argument("--min-replicas", type=int, required=True)
    h.add_argument("--done-file", action="append", default=[])


def run(args: argparse.Namespace) -> int:
    return {"submit": submit, "replica": run_replica, "task": run_task, "lighthouse": run_lighthouse}[
        args.slurm_command](args)


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.command)
    return cmd[1:] if cmd[:1] == ["--"] else cmd


# ---- submit ----------------------------------------------------------------------------------------

def _token_file(run_dir: str) -> str:
    """FTRUN_TOKEN_FILE when set (checked), else RUN_DIR/token, created 0600 (from FTRUN_TOKEN or new)."""
    from ftrun.net import read_token_file, write_token_file

    path = os.environ.get("FTRUN_TOKEN_FILE")
    if path:
        path = os.path.abspath(path)
    else:
        path = os.path.join(run_dir, "token")
        if not os.path.exists(path):
            write_token_file(path, os.environ.get("FTRUN_TOKEN") or secrets.token_hex(16))
    read_token_file(path)  # refuses a group- or world-readable file
    return path


def plan_from_args(args: argparse.Namespace, *, python: str = sys.executable) -> SlurmJobPlan:
    run_dir = os.path.abspath(args.run_dir)
    os.makedirs(os.path.join(run_dir, "slurm"), exist_ok=True)
    script = args.script if args.module else os.path.abspath(args.script)
    if not args.module and not os.path.isfile(script):
        raise ValueError(f"training script {args.script!r} not found")
    command = (python, *(["-m"] if args.module else []), script, *args.script_args)
    return SlurmJobPlan(replicas=args.replicas, ranks_per_replica=args.ranks_per_replica, command=command,
                        python=python, run_dir=run_dir, token_file=_token_file(run_dir), workdir=os.getcwd(),
                        nodes_per_replica=args.nodes_per_replica, partition=args.partition,
                        time_limit=args.time_limit, max_restarts=args.max_restarts,
                        max_requeues=args.max_requeues, min_replicas=args.min_replicas,
                        bind_host=args.bind_host, lighthouse=args.lighthouse, sbatch_args=tuple(args.sbatch_arg))


def write_scripts(plan: SlurmJobPlan) -> dict[str, str]:
    """name -> path of each batch script written ("lighthouse" first when there is one, then r0, r1...)."""
    scripts = {} if plan.lighthouse else {"lighthouse": lighthouse_script(plan)}
    scripts.update({f"r{i}": replica_script(plan, i) for i in range(plan.replicas)})
    paths = {}
    for name, text in scripts.items():
        paths[name] = os.path.join(plan.slurm_dir(), f"{name}.sbatch")
        with open(paths[name], "w") as f:
            f.write(text)
    return paths


def _sbatch(path: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "FTRUN_TOKEN"}  # the token never enters the job's env
    try:
        done = subprocess.run([SBATCH, "--parsable", path], env=env, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise RuntimeError("sbatch not found: run on a Slurm login node (or install Slurm's client)") from None
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {path} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]


def submit(args: argparse.Namespace) -> int:
    from ftrun.cli import UsageError, emit_json
    from ftrun.net import TokenError

    try:
        plan = plan_from_args(args)
    except TokenError as e:
        print(f"ftrun slurm submit: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        raise UsageError(str(e)) from None
    paths = write_scripts(plan)
    jobs: dict[str, str] = {}
    if not args.dry_run:
        for stale in [plan.lighthouse_file(), *(plan.done_file(i) for i in range(plan.replicas))]:
            if os.path.exists(stale):
                os.remove(stale)
        try:
            for name, path in paths.items():
                jobs[name] = _sbatch(path)
                print(f"{name}: job {jobs[name]} ({path})", flush=True)
        except RuntimeError as e:
            print(f"ftrun slurm submit: {e}" + (f" (already submitted: {jobs}; scancel them)" if jobs else ""),
                  file=sys.stderr)
            return 1
    else:
        for name, path in paths.items():
            print(f"{name}: {path}")
    print(f"run dir {plan.run_dir}; token file {plan.token_file}; job output in {plan.slurm_dir()}", flush=True)
    if args.json:
        emit_json({"run_dir": plan.run_dir, "scripts": paths, "jobs": jobs, "submitted": not args.dry_run})
    return 0


# ---- the wrappers inside the jobs ------------------------------------------------------------------

def _event(env, **fields) -> None:
    print(json.dumps({"event": "slurm", "t": env.clock.now(), **fields}, sort_keys=True), flush=True)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _wait_lighthouse(env, environ, limit_s: float) -> str:
    if environ.get("FTRUN_LIGHTHOUSE"):
        return environ["FTRUN_LIGHTHOUSE"]
    path = environ.get("FTRUN_SLURM_LIGHTHOUSE_FILE")
    if not path:
        raise ValueError("neither FTRUN_LIGHTHOUSE nor FTRUN_SLURM_LIGHTHOUSE_FILE is set: give the replica the "
                         "lighthouse's host:port")
    deadline = env.clock.now() + limit_s
    while True:
        try:
            with open(path) as f:
                addr = f.read().strip()
            if addr:
                return addr
        except FileNotFoundError:
            pass
        if env.clock.now() > deadline:
            raise ValueError(f"the lighthouse's address did not appear in {path} within {limit_s:.0f}s "
                             "(is the lighthouse job running?)")
        env.clock.sleep(0.5)


class _Replica:
    """The replica's batch script: hosts the store and runs srun steps, restarted as new incarnations."""

    def __init__(self, env, environ: dict[str, str], command: list[str]) -> None:
        from ftrun.net import NetConfig

        if not command:
            raise ValueError("no command to run after --")
        self.env, self.environ, self.command = env, environ, command
        self.rid = environ.get("FTRUN_REPLICA_ID", "?")
        self.max_restarts = int(environ.get("FTRUN_SLURM_MAX_RESTARTS", "0"))
        self.max_requeues = int(environ.get("FTRUN_SLURM_MAX_REQUEUES", "0"))
        self.restarts = int(environ.get("SLURM_RESTART_COUNT") or 0)
        self.net = NetConfig(bind_host=resolve_host(environ.get("FTRUN_BIND_HOST") or "127.0.0.1", environ),
                             advertise_host=environ.get("FTRUN_ADVERTISE_HOST") or None)
        self.store = None  # the running step's: a fresh one per incarnation (run_step)
        self.stopping = env.event()
        self.current: subprocess.Popen | None = None

    def stop(self, signum, _frame) -> None:
        """scancel or a requeue: end the step and start no other (Slurm decides what comes next)."""
        self.stopping.set()
        if self.current is not None and self.current.poll() is None:
            self.current.send_signal(signum)

    def requeue(self) -> bool:
        """Ask Slurm to requeue this job, then wait for it to end this run. False when it refused."""
        job = self.environ.get("SLURM_JOB_ID", "")
        done = subprocess.run(["scontrol", "requeue", job], stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"ftrun slurm replica: scontrol requeue {job} failed: {done.stderr.strip()}", file=sys.stderr)
            return False
        self.stopping.wait(timeout=300.0)  # Slurm sends SIGTERM (then SIGKILL) to this batch script
        return True

    def run_step(self, attempt: int, lighthouse_wait_s: float) -> int:
        from ftrun.env.real_store import bound_store

        lighthouse = _wait_lighthouse(self.env, self.environ, lighthouse_wait_s)
        self.store = bound_store(self.net.bind_host)  # the last step's ranks are gone: its store goes with them
        srun = srun_command(self.environ, self.command, sys.executable)
        child = {**self.environ, "MASTER_ADDR": self.net.advertised, "MASTER_PORT": str(self.store.port),
                 "FTRUN_SLURM_ATTEMPT": str(attempt), "FTRUN_LIGHTHOUSE": lighthouse}
        _event(self.env, replica=self.rid, attempt=attempt, phase="start", lighthouse=lighthouse,
               incarnation=incarnation(self.restarts, attempt, self.max_restarts), job=self.environ.get("SLURM_JOB_ID"))
        self.current = subprocess.Popen(srun, env=child, stdin=subprocess.DEVNULL)
        return self.current.wait()


def run_replica(args: argparse.Namespace) -> int:
    from ftrun.env.real import RealEnv

    try:
        replica = _Replica(RealEnv(), dict(os.environ), _command(args))
        signal.signal(signal.SIGTERM, replica.stop)
        signal.signal(signal.SIGINT, replica.stop)
        attempt = 0
        while True:
            rc = replica.run_step(attempt, args.lighthouse_wait)
            decision = step_decision(rc, attempt, replica.max_restarts, stopping=replica.stopping.is_set(),
                                     requeues=replica.restarts, max_requeues=replica.max_requeues)
            _event(replica.env, replica=replica.rid, attempt=attempt, phase="end", returncode=rc,
                   decision=decision.action.value, reason=decision.reason)
            if decision.action is StepAction.REQUEUE and replica.requeue():
                return 1  # Slurm ends this run of the job and starts the next (no done file)
            if decision.action is not StepAction.RESTART:
                break
            attempt += 1
    except ValueError as e:
        print(f"ftrun slurm replica: {e}", file=sys.stderr)
        return 2
    if not replica.stopping.is_set():  # finished for good (a requeued job runs again and decides then)
        _write_atomic(args.done_file, f"{rc}\n")
    return 0 if rc == 0 else 1


def run_task(args: argparse.Namespace) -> int:
    command = _command(args)
    try:
        if not command:
            raise ValueError("no command to run after --")
        extra = task_environ(os.environ)
    except ValueError as e:
        print(f"ftrun slurm task: {e}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    os.execvpe(command[0], command, {**os.environ, **extra})
    return 127  # not reached


def run_lighthouse(args: argparse.Namespace) -> int:
    from ftrun.env.real import RealEnv

    env = RealEnv()
    try:
        bind = resolve_host(os.environ.get("FTRUN_BIND_HOST") or "127.0.0.1", os.environ)
    except ValueError as e:
        print(f"ftrun slurm lighthouse: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.state_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "ftrun.cli", "lighthouse", "--bind", f"{bind}:0", "--state-dir", args.state_dir,
           "--min-replicas", str(args.min_replicas)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    stopping = env.event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    line = proc.stdout.readline() if proc.stdout else ""
    print(line.rstrip(), flush=True)
    prefix = "lighthouse listening on "
    if not line.startswith(prefix):
        proc.kill()
        print(f"ftrun slurm lighthouse: the lighthouse did not start (exit {proc.wait()})", file=sys.stderr)
        return 1
    _write_atomic(args.addr_file, line[len(prefix):].split(";")[0].strip() + "\n")
    while proc.poll() is None and not stopping.is_set():
        if all(os.path.exists(p) for p in args.done_file):
            print("every replica has finished: stopping the lighthouse", flush=True)
            break
        stopping.wait(timeout=1.0)
    if proc.poll() is None:
        proc.terminate()
    rc = proc.wait()
    return 0 if rc in (0, -signal.SIGTERM) else 1


if __name__ == "__main__":  # the batch scripts run `python -m ftrun.launch.slurm replica|task|lighthouse`
    from ftrun.cli import main

    sys.exit(main(["slurm", *sys.argv[1:]]))
