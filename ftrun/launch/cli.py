"""`ftrun launch`: a lighthouse and R replicas x K ranks of a training script on this machine.

    ftrun launch --replicas 3 --ranks-per-replica 2 --steps 500 --kill-every 30s [--baseline] [--json] \\
        [-m] SCRIPT [ARGS...]

Each rank process gets torchrun-compatible environment variables plus ftrun's (see worker_env.py) and
FTRUN_MAX_STEPS. Rank processes are forked from a zygote that has the script's imports loaded
(zygote.py; `--start-method spawn` starts fresh interpreters instead). The supervisor restarts a replica
whose process dies (waiting twice as long after each crash in a row, from --restart-delay), injects
failures (`--kill-every`, `--kill-random-mean`, `--kill-at`; a kill SIGKILLs every rank of a replica,
which restarts after --restart-delay), shows live progress and writes into --out: events.jsonl (every event), metrics.jsonl (one line per step), report.png and the ranks'
stdout/stderr under logs/.

Ranks report JSON event lines on stdout: the Manager's {"event": "commit"|"abort"|"quorum", "step", ...}
and, optionally, {"event": "step", "step", "committed", "loss", "param_hash", "healed"} after each step
(ftrun.train.ft_worker does) and {"event": "final", "loader_state"} at a clean exit. From them the
report computes step efficiency next to its theoretical value for the kill rate (theory.py:
E = 1 - D/(R*T)), the identical-state check (every replica that committed a step shows the same
param_hash, per rank) and, from run_dir/audit-*.jsonl, the exactly-once audit. `--baseline` first runs
the same job (seed, steps, script arguments) without failures and compares the losses at the same number
of batches trained. With --json the last stdout line is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass

import torch.distributed as dist
from tqdm import tqdm

from ftrun.cli import emit_json
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.launch.faults import KillAt, KillPlan, parse_duration
from ftrun.launch.procs import ForkServer, Launcher, SpawnLauncher
from ftrun.launch.report import final_state, print_report, read_audit, summarize, write_metrics, write_plots
from ftrun.launch.stats import RunStats
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse

FINISH_GRACE_S = 5.0  # after the job's last step: how long replicas get to exit by themselves


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--ranks-per-replica", type=int, default=1)
    p.add_argument("--steps", type=int, required=True, help="the job ends when it has committed this many steps")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="smallest quorum, and the fewest healthy replicas a kill may leave (default: a majority)")
    p.add_argument("--kill-every", type=parse_duration, default=None, metavar="DURATION")
    p.add_argument("--kill-random-mean", type=parse_duration, default=None, metavar="DURATION")
    p.add_argument("--kill-at", type=KillAt.parse, action="append", default=[], metavar="step=N[,replica=ID]")
    p.add_argument("--max-kills", type=int, default=None,
                   help="inject this many kills, then end the job (needs --stop-file) or let it run to --steps")
    p.add_argument("--stop-file", default=None, help="to end early, the supervisor writes the last step here "
                   "(pass the same path to the script, e.g. ft_worker --stop-file)")
    p.add_argument("--restart-delay", type=parse_duration, default=0.5, metavar="DURATION")
    p.add_argument("--start-method", choices=("fork-server", "spawn"), default="fork-server")
    p.add_argument("--baseline", action="store_true", help="first run the same job without failures")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of victims and kill times")
    p.add_argument("--timeout", type=parse_duration, default=3600.0, metavar="DURATION")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--out", default=None, help="folder for events, metrics, report.png and rank logs")
    p.add_argument("--json", action="store_true")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT names a module to run as python -m")
    p.add_argument("script", help="training script (or module, with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)


@dataclass
class JobResult:
    stats: RunStats
    wall_s: float
    out: str
    goal: int  # the step the job was to end at


class _Job:
    """One running job: lighthouse, replicas, the kill plan, restarts, the event log and its stats."""

    def __init__(self, env: RealEnv, args: argparse.Namespace, out: str, launcher: Launcher, *, inject: bool) -> None:
        self.env, self.args, self.out, self.inject = env, args, out, inject
        self.min_up = args.min_replicas or args.replicas // 2 + 1
        self.token = secrets.token_hex(16)
        self.lighthouse = Lighthouse(env=env, token=self.token, config=LighthouseConfig(
            min_replicas=self.min_up, timeouts=Timeouts()))
        self.lighthouse.start()
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self.stats = RunStats(args.replicas)
        self.events = env.queue()
        os.makedirs(os.path.join(out, "logs"), exist_ok=True)
        self.event_log = open(os.path.join(out, "events.jsonl"), "w")
        argv = (["-m", args.script] if args.module else [args.script]) + list(args.script_args)
        self.replicas = {f"r{i}": ReplicaProcesses(
            env=env, events=self.events, log_dir=os.path.join(out, "logs"), argv=argv, launcher=launcher,
            spec=WorkerSpec(replica_id=f"r{i}", replica_index=i, num_replicas=args.replicas, rank=0,
                            ranks_per_replica=args.ranks_per_replica, incarnation=0, lighthouse=self.lighthouse.addr,
                            token=self.token,
                            store_addr="127.0.0.1", store_port=self.store.port, run_dir=out, max_steps=args.steps))
            for i in range(args.replicas)}
        self.down_until: dict[str, float] = {}  # replica -> when to restart it
        self.done: set[str] = set()  # exited cleanly, or stopped at the end
        self.live: dict[str, int] = {rid: 0 for rid in self.replicas}  # replica -> incarnation running now
        self.last_commit: dict[str, int] = {}  # replica -> step count after its live incarnation's last commit
        self.crashes_in_a_row: dict[str, int] = {}  # replica -> crashes since it last committed
        self.quorum_of: dict[str, list[str]] = {}  # replica -> participants of its latest quorum
        self.finished_at: float | None = None
        self.stopping = False
        self.goal = args.steps  # the step the job ends at (earlier with --max-kills and --stop-file)
        self.steady = False  # every replica has committed a step
        self.closed = False
        self.plan = KillPlan(every_s=args.kill_every, random_mean_s=args.kill_random_mean,
                             at_steps=list(args.kill_at), min_up=self.min_up, seed=args.seed) if inject else None

    def start(self) -> None:
        if self.inject and self.args.stop_file and os.path.exists(self.args.stop_file):
            os.remove(self.args.stop_file)  # a previous run's: it would stop the new one at once
        for rep in self.replicas.values():
            rep.start()

    def close(self) -> None:
        """Stop the lighthouse and every rank (idempotent); the event log stays open until the stats are in."""
        if not self.closed:
            self.closed = True
            self.lighthouse.stop()
        for rep in self.replicas.values():
            rep.kill()

    def record(self, ev: dict) -> None:
        self.event_log.write(json.dumps(ev) + "\n")
        self.stats.add(ev)
        rid, kind = ev.get("replica_id"), ev.get("event")
        current = rid in self.live and ev.get("incarnation") == self.live[rid]  # not a killed incarnation's late line
        if kind == "quorum" and current:
            self.quorum_of[rid] = list(ev.get("participants", []))
        elif kind == "commit" and current and ev.get("rank", 0) == 0:
            self.last_commit[rid] = ev["step"]
            self.crashes_in_a_row.pop(rid, None)
            if ev["step"] >= self.goal and self.finished_at is None:
                self._finish(rid)
        if not self.steady and self.stats.steady_step is not None:
            self.steady = True
            if self.plan is not None:
                self.plan.start(self.env.clock.now())  # kill clocks start once every replica has joined
            self.record({"event": "steady", "t": self.env.clock.now(), "step": self.stats.steady_step})

    def healthy(self) -> list[str]:
        """Replicas holding the job's state: their running incarnation committed the job's last step (or the
        one before: the others may be a step ahead). Fresh or healing replicas are not, whatever they say."""
        return [r for r, step in self.last_commit.items() if step >= self.stats.max_step - 1]

    def _finish(self, rid: str) -> None:
        """The job committed its last step: stop replicas that were not in that step's quorum.

        They cannot finish (the others exit) and must not go on alone from an older state."""
        self.finished_at = self.env.clock.now()
        final_quorum = set(self.quorum_of.get(rid, self.replicas))
        for other in self.replicas:
            if other not in final_quorum and other not in self.done:
                self.replicas[other].kill()
                self.done.add(other)
                self.down_until.pop(other, None)

    def _end_early(self) -> None:
        """After --max-kills: once every replica is back, tell the script to stop a few steps later."""
        if self.args.stop_file is None or self.stopping or len(self.healthy()) < len(self.replicas):
            return
        self.stopping = True
        self.goal = min(self.stats.max_step + 3, self.args.steps)
        tmp = self.args.stop_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(self.goal))
        os.replace(tmp, self.args.stop_file)  # the script reads the whole number or nothing
        self.record({"event": "stop", "t": self.env.clock.now(), "step": self.goal})

    def kill(self, rid: str, why: str) -> None:
        now, rep = self.env.clock.now(), self.replicas[rid]
        rep.kill()
        self.live.pop(rid, None)
        self.last_commit.pop(rid, None)
        backoff = 2 ** min(self.crashes_in_a_row.get(rid, 0), 6)  # a replica that keeps crashing waits longer
        self.down_until[rid] = now + self.args.restart_delay * backoff
        self.record({"event": "kill", "replica_id": rid, "incarnation": rep.spec.incarnation, "t": now, "why": why,
                     "step": self.stats.max_step})

    def tick(self) -> None:
        now = self.env.clock.now()
        for rid, at in list(self.down_until.items()):
            if now >= at:
                del self.down_until[rid]
                self.replicas[rid].restart()
                self.live[rid] = self.replicas[rid].spec.incarnation
                self.record({"event": "restart", "replica_id": rid, "t": now,
                             "incarnation": self.replicas[rid].spec.incarnation})
        for rid, rep in self.replicas.items():
            codes = rep.exited()
            if rid in self.down_until or rid in self.done or all(c is None for c in codes):
                continue
            crashed = any(c not in (None, 0) for c in codes)
            if self.finished_at is not None or (not crashed and all(c == 0 for c in codes)):
                self.done.add(rid)
            elif crashed:
                self.crashes_in_a_row[rid] = self.crashes_in_a_row.get(rid, 0) + 1
                self.kill(rid, f"rank exited with {codes}")  # a crash: the whole replica restarts
        if self.plan is None or self.finished_at is not None:
            return  # the job reached its goal: no more injected failures
        if self.args.max_kills is not None and self.stats.num_kills >= self.args.max_kills:
            self._end_early()
            return
        up = [r for r in self.replicas if r not in self.down_until and r not in self.done]
        victim = self.plan.due(now, self.stats.max_step, up, self.healthy())
        if victim is not None:
            self.kill(victim, "injected")

    def running(self) -> bool:
        if len(self.done) == len(self.replicas):
            return False
        return self.finished_at is None or self.env.clock.now() - self.finished_at < FINISH_GRACE_S


def run_job(env: RealEnv, args: argparse.Namespace, out: str, launcher: Launcher, *, inject: bool,
            label: str) -> JobResult:
    job = _Job(env, args, out, launcher, inject=inject)
    started = env.clock.now()
    bar = tqdm(total=args.steps, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True,
               disable=args.no_progress)
    try:
        job.start()
        while job.running() and env.clock.now() - started < args.timeout:
            job.tick()
            try:
                ev = job.events.get(timeout=0.05)
            except EnvTimeout:
                continue
            job.record(ev)
            if ev.get("event") in ("commit", "step"):
                _progress(bar, job)
        job.close()  # then take in what the ranks wrote before they exited ("final" events)
        for rep in job.replicas.values():
            rep.drain()
        while True:
            try:
                job.record(job.events.get(timeout=0.0))
            except EnvTimeout:
                break
    finally:
        bar.close()
        job.close()
        job.event_log.close()
    return JobResult(job.stats, env.clock.now() - started, out, job.goal)


def _progress(bar: tqdm, job: _Job) -> None:
    s = job.stats
    if s.max_step > bar.n:
        bar.update(min(s.max_step, bar.total) - bar.n)
    row = s.rows.get(s.max_step - 1)
    committed, total = s.efficiency()
    bar.set_postfix(replicas=len(row.committed) if row else 0, committed=f"{100 * committed / max(total, 1):.1f}%",
                    loss=f"{row.loss:.3f}" if row and row.loss is not None else "-", kills=s.num_kills, refresh=False)


def make_launcher(env: RealEnv, args: argparse.Namespace, out: str) -> Launcher:
    if args.start_method == "spawn":
        return SpawnLauncher()
    return ForkServer(env=env, script=args.script, module=args.module, cwd=os.getcwd(),
                      log_path=os.path.join(out, "zygote.log"), run_dir=out)


def run(args: argparse.Namespace) -> int:
    env = RealEnv()
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="ftrun-launch-"))
    os.makedirs(out, exist_ok=True)
    launcher = make_launcher(env, args, out)
    base = None
    try:
        if args.baseline:
            base = run_job(env, args, os.path.join(out, "baseline"), launcher, inject=False, label="baseline")
        result = run_job(env, args, out, launcher, inject=True, label="ftrun launch")
    finally:
        launcher.close()
    report = read_audit(out, final_state(result.stats))
    base_report = read_audit(base.out, final_state(base.stats)) if base else None
    figures = summarize(result.stats, steps=result.goal, wall_s=result.wall_s,
                        kill_interval_s=args.kill_every or args.kill_random_mean, report=report,
                        baseline=base.stats if base else None, baseline_report=base_report)
    write_metrics(result.stats, os.path.join(out, "metrics.jsonl"))
    figures["report_png"] = write_plots(result.stats, os.path.join(out, "report.png"), report=report,
                                        baseline=base.stats if base else None, baseline_report=base_report)
    figures["out"] = out
    figures["start_method"] = getattr(launcher, "fallback_reason", None) and "spawn (fallback)" or args.start_method
    if base is not None:
        figures["baseline_steps_reached"] = base.stats.max_step
        figures["baseline_replicas_identical"] = base.stats.replicas_identical
    figures["steps_goal"] = result.goal
    print_report(figures)
    if args.json:
        emit_json(figures)
    return 0 if figures["complete"] else 1
