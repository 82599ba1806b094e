"""`ftrun demo`: a lighthouse and R replicas x K ranks as real processes on 127.0.0.1.

Each rank runs the real trainer (ftrun.train.ft_worker: a tiny LM, catch-up, FTAR, 2PC, the data ledger;
--step-time adds modeled compute per step), forked from the same zygote `ftrun launch` uses, so a restart
costs a fork rather than a python + torch start (`--start-method spawn` measures the latter). It SIGKILLs one replica part way, restarts it, and reports per-step participants,
committed steps, how fast the failure was detected and how long the replica took to rejoin.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
from collections import defaultdict

from ftrun.cli import emit_json
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.base import EnvTimeout
from ftrun.env.real import RealEnv
from ftrun.env.real_store import bound_store
from ftrun.launch.procs import ForkServer, Launcher, SpawnLauncher
from ftrun.launch.supervisor import ReplicaProcesses
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.service import Lighthouse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--ranks-per-replica", type=int, default=2)
    p.add_argument("--after-rejoin", type=int, default=10,
                   help="stop once the restarted replica has committed this many steps")
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--kill-step", type=int, default=10, help="kill a replica once the job commits this step")
    p.add_argument("--restart-after", type=float, default=1.0, help="seconds between the kill and the restart")
    p.add_argument("--timeout", type=float, default=180.0, help="give up after this many seconds")
    p.add_argument("--start-method", choices=("fork-server", "spawn"), default="fork-server",
                   help="fork rank processes from a preloaded zygote (as ftrun launch does), or spawn fresh "
                        "interpreters (default: %(default)s)")
    p.add_argument("--prepared-spares", action=argparse.BooleanOptionalAction, default=True,
                   help="the zygote's spares run the worker up to init_from_env (arguments, data, model) before "
                        "the restart claims them, as `ftrun launch --prepared-spares` (default: %(default)s)")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    env = RealEnv()
    token = secrets.token_hex(16)
    lighthouse = Lighthouse(env=env, config=LighthouseConfig(min_replicas=2, timeouts=Timeouts()), token=token)
    lighthouse.start()
    store = bound_store("127.0.0.1", timeout_s=30)  # loopback only: the store has no authentication
    events = env.queue()
    run_dir = tempfile.mkdtemp(prefix="ftrun-demo-")
    launcher: Launcher = SpawnLauncher() if args.start_method == "spawn" else ForkServer(
        env=env, script="ftrun.train.ft_worker", module=True, cwd=os.getcwd(),
        log_path=os.path.join(run_dir, "zygote.log"), run_dir=run_dir, sharded=args.ranks_per_replica > 1,
        spares=args.ranks_per_replica, prepared_spares=args.prepared_spares)
    replicas = [
        ReplicaProcesses(env=env, events=events, log_dir=run_dir,
                         argv=["-m", "ftrun.train.ft_worker", "--steps", "1000000",
                               "--step-time", str(args.step_time)],
                         spec=WorkerSpec(replica_id=f"r{i}", replica_index=i, num_replicas=args.replicas, rank=0,
                                         ranks_per_replica=args.ranks_per_replica, incarnation=0,
                                         lighthouse=lighthouse.addr, token=token, store_addr="127.0.0.1",
                                         store_port=store.port, run_dir=run_dir),
                         launcher=launcher)
        for i in range(args.replicas)
    ]
    print(f"ftrun demo: lighthouse {lighthouse.addr}, {args.replicas} replicas x {args.ranks_per_replica} ranks, "
          f"replica r1 is SIGKILLed at step {args.kill_step} and restarted {args.restart_after}s later. Logs in {run_dir}", flush=True)
    try:
        for r in replicas:
            r.start()
        log, marks = _drive(env, args, replicas, events)
    finally:
        lighthouse.stop()  # first, so the replicas' exits are not reported as failures
        for r in replicas:
            r.kill()
        launcher.close()
    figures = _report(args, log, marks, list(lighthouse.history))
    figures["start_method"] = "spawn (fallback)" if getattr(launcher, "fallback_reason", None) else args.start_method
    if args.json:
        emit_json(figures)
    return 0 if figures["complete"] else 1


def _drive(env, args, replicas, events) -> tuple[list[dict], dict[str, float]]:
    """Feed events; kill r1 at kill_step, restart it, stop once it has committed `after_rejoin` steps."""
    victim, log, marks = replicas[1], [], {}
    deadline = env.clock.now() + args.timeout
    rejoined_commits = 0
    while rejoined_commits < args.after_rejoin and env.clock.now() < deadline:
        if "kill" in marks and "restart" not in marks and env.clock.now() >= marks["kill"] + args.restart_after:
            marks["restart"] = env.clock.now()
            victim.restart()
            print(f"[demo] restarted {victim.spec.replica_id} (incarnation {victim.spec.incarnation})", flush=True)
        try:
            ev = events.get(timeout=0.05)
        except EnvTimeout:
            continue
        log.append(ev)
        if ev["event"] != "commit":
            continue
        if ev["replica_id"] == victim.spec.replica_id and ev["incarnation"] == 1:
            rejoined_commits += 1
        if ev["replica_id"] == "r0" and ev["step"] % 10 == 0:
            print(f"[demo] step {ev['step']} committed (quorum {ev['quorum_id']})", flush=True)
        if ev["step"] >= args.kill_step and "kill" not in marks:
            marks["kill"] = env.clock.now()
            victim.kill()
            print(f"[demo] SIGKILLed {victim.spec.replica_id} ({args.ranks_per_replica} processes)", flush=True)
    return log, marks


def _report(args, log: list[dict], marks: dict[str, float], history: list[dict]) -> dict:
    commits = [e for e in log if e["event"] == "commit"]
    by_step: dict[int, set[str]] = defaultdict(set)
    quorum_of: dict[int, int] = {}
    for e in commits:
        by_step[e["step"] - 1].add(e["replica_id"])
        quorum_of[e["step"] - 1] = e["quorum_id"]
    _print_participants(by_step, quorum_of)
    kill, restart = marks.get("kill"), marks.get("restart")
    lost_events = [h for h in history if h["event"] == "member_lost" and kill and h["t"] >= kill]
    lost = [h["t"] for h in lost_events]
    detection = lost[0] - kill if lost else None
    survivors = [e["t"] for e in commits if e["replica_id"] != "r1" and kill and e["t"] > kill]
    next_commit = min(survivors) - kill if survivors else None
    rejoin = [e for e in log if e["replica_id"] == "r1" and e.get("incarnation") == 1]
    ready = next((e["t"] for e in rejoin if e["event"] == "ready"), None)
    first_commit = next((e["t"] for e in rejoin if e["event"] == "commit"), None)
    healed = next((e for e in rejoin if e["event"] == "heal"), None)
    per_replica = {r: sum(1 for e in commits if e["replica_id"] == r) for r in sorted({e["replica_id"] for e in commits})}
    rejoined = sum(1 for e in rejoin if e["event"] == "commit")
    complete = rejoined >= args.after_rejoin and any(len(ids) == args.replicas for s, ids in by_step.items()
                                                     if healed and s >= healed["to_step"])
    gaps = _survivor_gaps(commits, kill)
    figures = {
        "complete": complete,
        "steps_committed": per_replica,
        "detection_s": detection,
        "detected_by": lost_events[0].get("why") if lost_events else None,  # "lost": a closed connection
        "survivor_next_commit_s": next_commit,
        "survivor_max_gap_s": max(gaps) if gaps else None,
        "step_time_s": args.step_time,
        "rejoin_s": first_commit - restart if first_commit and restart else None,
        "restart_to_ready_s": ready - restart if ready and restart else None,
        "rejoin_breakdown": rejoin_breakdown(restart, rejoin) if restart else None,
        # the restarted ranks were prepared spares (ran the worker up to init_from_env before the restart)
        "rejoin_prepared": [bool((e.get("startup") or {}).get("prepared")) for e in rejoin if e["event"] == "ready"],
        "healed_from_to": [healed["from_step"], healed["to_step"]] if healed else None,
        "quorum_ids": sorted({e["quorum_id"] for e in commits}),
        **consistency(log, "r1"),
        "failed_commits": sum(1 for e in log if e["event"] == "abort"),
    }
    print("\nreport")
    print(f"  steps committed per replica: {per_replica}")
    print(f"  failure detected by the lighthouse {_ms(detection)} after the SIGKILL (pushed by connection loss)")
    print(f"  survivors committed their next step {_ms(next_commit)} after the SIGKILL; their longest gap between "
          f"commits around the kill was {_ms(figures['survivor_max_gap_s'])} (step time {_ms(args.step_time)})")
    print(f"  restarted replica: ready {_ms(figures['restart_to_ready_s'])} after restart (process start), "
          f"first commit {_ms(figures['rejoin_s'])} after restart; healed steps {figures['healed_from_to']}")
    if figures["rejoin_breakdown"]:
        print("  rejoin breakdown: " + ", ".join(f"{k[:-2]} {_ms(v)}" for k, v in figures["rejoin_breakdown"].items()))
    print(f"  failed commits (a peer died mid-exchange; step retried): {figures['failed_commits']}")
    print(f"  quorum ids seen: {figures['quorum_ids']}; {'complete' if complete else 'INCOMPLETE'}")
    return figures


REJOIN_STAGES = ("fork_s", "start_s", "join_replica_s", "build_s", "quorum_wait_s", "catchup_s", "first_step_s")


def rejoin_breakdown(restart: float, events: list[dict]) -> dict[str, float | None]:
    """Where a restarted replica's rejoin went, from its new incarnation's events (pure). The stages
    follow its slowest rank up to `ready`, then its leader's quorum, heal and first commit, so they add
    up to rejoin_s (restart -> first commit):
      fork_s          restart -> the last rank forked (the zygote; None for spawned ranks)
      start_s         -> the last rank entered init_from_env (the script's start after the fork)
      join_replica_s  -> the last rank joined its replica's groups (store, gloo, FSDP group)
      build_s         -> the last rank was ready (model, sharding, optimizer, catch-up/FTAR servers)
      quorum_wait_s   -> the leader got the quorum (check-in, lighthouse, the healthy replicas' next step)
      catchup_s       -> healed (the snapshot fetched and loaded)
      first_step_s    -> the first commit (the healthy replicas' compute, the exchange, the vote)
    A stage whose events are missing is None."""
    ready = [e for e in events if e.get("event") == "ready"]
    startup = [e.get("startup") or {} for e in ready]

    def last(key: str) -> float | None:
        times = [s.get(key) for s in startup]
        return max(times) if times and None not in times else None

    def first(kind: str) -> float | None:
        return next((e["t"] for e in events if e.get("event") == kind), None)

    forked = last("forked")
    marks = [restart, forked, last("init"), last("joined"), max((e["t"] for e in ready), default=None),
             first("quorum"), first("heal"), first("commit")]
    out: dict[str, float | None] = {}
    for i, name in enumerate(REJOIN_STAGES):
        begin = marks[i] if marks[i] is not None or name != "start_s" else restart  # spawned: from the restart
        end = marks[i + 1]
        out[name] = end - begin if begin is not None and end is not None else None
    return out


def consistency(log: list[dict], rejoined: str) -> dict:
    """Whether every rank's parameters agree across replicas after each committed step (the `step`
    events' param_hash), and how many (rank, step) pairs of the restarted replica's new incarnation
    were compared with another replica's. Pure."""
    hashes: dict[tuple[int, int], dict[tuple[str, int], str]] = defaultdict(dict)
    for e in log:
        if e["event"] == "step" and e.get("param_hash"):
            hashes[(e["rank"], e["step"])][(e["replica_id"], e["incarnation"])] = e["param_hash"]
    compared = [by for by in hashes.values() if len(by) > 1]
    return {"replicas_consistent": all(len(set(by.values())) == 1 for by in compared),
            "rejoined_steps_compared": sum(1 for by in compared if any(r == rejoined and i > 0 for r, i in by))}


def _survivor_gaps(commits: list[dict], kill: float | None) -> list[float]:
    """Gaps between consecutive commits of each survivor from one step before the kill to 2 s after."""
    if kill is None:
        return []
    gaps = []
    for rid in {e["replica_id"] for e in commits} - {"r1"}:
        times = sorted(e["t"] for e in commits if e["replica_id"] == rid and kill - 1.0 <= e["t"] <= kill + 2.0)
        gaps += [b - a for a, b in zip(times, times[1:])]
    return gaps


def _print_participants(by_step: dict[int, set[str]], quorum_of: dict[int, int]) -> None:
    """Per-step participants, runs of equal steps folded into ranges."""
    print("\nsteps        quorum  committed by")
    steps = sorted(by_step)
    i = 0
    while i < len(steps):
        j = i
        while (j + 1 < len(steps) and steps[j + 1] == steps[j] + 1 and by_step[steps[j + 1]] == by_step[steps[i]]
               and quorum_of[steps[j + 1]] == quorum_of[steps[i]]):
            j += 1
        span = f"{steps[i]}-{steps[j]}" if j > i else f"{steps[i]}"
        print(f"{span:12s} {quorum_of[steps[i]]:6d}  {' '.join(sorted(by_step[steps[i]]))}")
        i = j + 1


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"
