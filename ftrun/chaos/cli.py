"""`ftrun chaos`: real small jobs under seeded random fault schedules, Jepsen-style.

    ftrun chaos --schedules 20 --seed 1 [--replicas 3] [--ranks-per-replica 1] [--steps 12] [--json]
    ftrun chaos --seed 1 --seed-of 17          # replay schedule 17 of seed 1 alone

Schedule i of seed S is drawn by ftrun.chaos.schedule (SIGKILL, SIGSTOP/SIGCONT and slow ranks at random
phases, lighthouse kill/restart, a joiner arriving mid-job, a corrupted loader_state slot), run with real
processes by ftrun.chaos.driver and checked by ftrun.chaos.invariants (no fork, exactly-once data,
identical state among the replicas that finished, services up, nothing leaked). One progress line per
schedule on stderr; a schedule with a violation keeps its folder (rank logs, events) under --out.
Where network namespaces can be built (root, iproute2: netns.available) and --partitions is not off,
each replica runs on its own namespace host and the lighthouse on another, and partition faults (a
replica's host link cut for a few seconds) are drawn too; elsewhere partitions are off, the run is as
without them, and the run says why (stderr, and the JSON's `partitions`).
With --json the last stdout line is one object: schedules, faults_injected (partitions_injected of them
partitions), partitions ("on" or "off (why)"), violations (each with its
seed, index and schedule), duplicate_batches, forks, rewinds (the lighthouse's deliberate full restarts,
after which the steps are retrained on a new lineage: not forks), and more. Exit 0 when no schedule violated anything.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

from ftrun.cli import UsageError, emit_json
from ftrun.launch.checks import non_negative_int, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedules", type=positive_int, default=10, help="how many schedules (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the run (default: %(default)s)")
    p.add_argument("--seed-of", type=non_negative_int, default=None, metavar="I",
                   help="run schedule I of --seed alone (to replay a violation) (default: all)")
    p.add_argument("--replicas", type=positive_int, default=3, help="replicas per job, 2-8 (default: %(default)s)")
    p.add_argument("--ranks-per-replica", type=positive_int, default=1, help="1-4 (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=12, help="steps per job, >= 6 (default: %(default)s)")
    p.add_argument("--schedule-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="a job not finished after this long is a liveness violation (default: %(default)s)")
    p.add_argument("--out", default=None, help="folder for the schedules' run dirs (default: a temporary one; "
                   "kept only for schedules with violations)")
    p.add_argument("--keep", action="store_true", help="keep every schedule's folder, not only failing ones")
    p.add_argument("--partitions", choices=("auto", "off"), default="auto",
                   help="auto: namespace hosts and partition faults where namespaces can be built "
                   "(default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    _check(args)
    out = os.path.abspath(args.out) if args.out else tempfile.mkdtemp(prefix="ftrun-chaos-")
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {args.out}: cannot create it ({e.strerror})") from None
    from ftrun.chaos.driver import WORKER
    from ftrun.env.real import RealEnv
    from ftrun.launch.procs import ForkServer

    if args.log_level.upper() == "WARNING":  # the in-process lighthouse warns at every injected fault
        logging.getLogger("ftrun.quorum").setLevel(logging.ERROR)
    env = RealEnv()
    launcher = ForkServer(env=env, script=WORKER, module=True, cwd=os.getcwd(),
                          log_path=os.path.join(out, "zygote.log"), run_dir=out)
    try:
        hosts, partitions = _hosts(args)
    except BaseException:
        launcher.close()
        raise
    print(f"ftrun chaos: partitions {partitions}", file=sys.stderr, flush=True)
    totals = {"schedules": 0, "faults_injected": 0, "violations": [], "duplicate_batches": 0, "forks": 0,
              "skipped_batches": 0, "rewinds": 0, "seed": args.seed, "replicas": args.replicas,
              "ranks_per_replica": args.ranks_per_replica, "steps": args.steps, "out": out,
              "partitions": partitions, "partitions_injected": 0}
    indices = [args.seed_of] if args.seed_of is not None else list(range(args.schedules))
    t0 = env.clock.now()
    try:
        for n, i in enumerate(indices):
            line = _run_one(args, i, env=env, launcher=launcher, out=out, totals=totals, hosts=hosts)
            print(f"ftrun chaos: schedule {i} ({n + 1}/{len(indices)}) {line}; total {env.clock.now() - t0:.0f}s, "
                  f"{len(totals['violations'])} violating)", file=sys.stderr, flush=True)
    finally:
        launcher.close()
        if hosts is not None:
            hosts.teardown()
    if hosts is not None:
        left = _namespaces_left(hosts)
        if left:
            totals["violations"].append({"seed": args.seed, "index": None, "schedule": {"describe": "after all"},
                                         "run_dir": out, "violations": [f"namespaces left after teardown: {left}"]})
    totals["wall_s"] = round(env.clock.now() - t0, 1)
    _print_summary(totals)
    if args.json:
        emit_json(totals)
    if not totals["violations"] and not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if totals["violations"] else 0


def _check(args: argparse.Namespace) -> None:
    from ftrun.chaos.schedule import check_shape

    try:
        check_shape(args.replicas, args.ranks_per_replica, args.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not args.schedule_timeout > 0:
        raise UsageError(f"--schedule-timeout must be > 0, got {args.schedule_timeout}")


def _hosts(args: argparse.Namespace):
    """(NetnsHosts of replicas + 1 hosts, or None; "on" or "off (why)")."""
    if args.partitions == "off":
        return None, "off (--partitions off)"
    from ftrun.launch.netns import NetnsConfig, NetnsError, NetnsHosts, available

    ok, why = available()
    if not ok:
        return None, f"off (network namespaces cannot be created here: {why})"
    hosts = NetnsHosts(NetnsConfig(num_hosts=args.replicas + 1))
    try:
        hosts.__enter__()
    except NetnsError as e:
        return None, f"off (building the namespace hosts failed: {e})"
    return hosts, "on"


def _namespaces_left(hosts) -> list[str]:
    import subprocess

    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [h.namespace for h in hosts.hosts if h.namespace in done.stdout.split()]


def _run_one(args: argparse.Namespace, index: int, *, env, launcher, out: str, totals: dict, hosts=None) -> str:
    """Run and check schedule `index`, add it to `totals`; returns its progress line (without the total)."""
    from ftrun.chaos.driver import ScheduleRun
    from ftrun.chaos.invariants import Verdict, check
    from ftrun.chaos.schedule import generate

    schedule = generate(args.seed, index, replicas=args.replicas, ranks_per_replica=args.ranks_per_replica,
                        steps=args.steps, partitions=hosts is not None)
    started = env.clock.now()
    driver = ScheduleRun(schedule, env=env, launcher=launcher, workdir=out, timeout_s=args.schedule_timeout,
                         hosts=hosts)
    rewinds = 0
    try:
        obs = driver.run()
        verdict, rewinds = check(obs), len(obs.rewinds)
    except Exception as e:  # noqa: BLE001 (the driver failed: report it with the schedule, go on)
        verdict = Verdict(violations=[f"driver error: {type(e).__name__}: {e}"])
    totals["schedules"] += 1
    totals["rewinds"] += rewinds
    totals["faults_injected"] += driver.faults_injected
    totals["partitions_injected"] += driver.partitions_injected
    totals["duplicate_batches"] += verdict.duplicate_batches
    totals["skipped_batches"] += verdict.skipped_batches
    totals["forks"] += verdict.forks
    if verdict.violations:
        totals["violations"].append({"seed": args.seed, "index": index, "schedule": schedule.as_json(),
                                     "violations": verdict.violations, "run_dir": driver.run_dir})
    elif not args.keep:
        shutil.rmtree(driver.run_dir, ignore_errors=True)
    goal = "-" if driver.t_goal is None else f"{driver.t_goal:.1f}"
    return (f"{schedule.describe()}: {driver.faults_injected} faults, "
            + (f"{rewinds} full restart(s), " if rewinds else "")
            + ("ok" if verdict.ok else "VIOLATION: " + " | ".join(verdict.violations))
            + f" ({env.clock.now() - started:.1f}s, goal at {goal}s")


def _print_summary(totals: dict) -> None:
    print(f"ftrun chaos: {totals['schedules']} schedules, {totals['faults_injected']} faults injected "
          f"({totals['partitions_injected']} partitions; partitions {totals['partitions']}), "
          f"{len(totals['violations'])} with violations, {totals['forks']} forks, "
          f"{totals['duplicate_batches']} duplicate batches, {totals['skipped_batches']} skipped; {totals['rewinds']} "
          f"full restarts (every replica holding the state died: the job rewound on purpose) ({totals['wall_s']}s)")
    for v in totals["violations"][:10]:
        print(f"  seed {v['seed']} schedule {v['index']} ({v['schedule']['describe']}): "
              + " | ".join(v["violations"]) + f"\n    replay: ftrun chaos --seed {v['seed']} --seed-of {v['index']}"
              f"  (folder {v['run_dir']})")
