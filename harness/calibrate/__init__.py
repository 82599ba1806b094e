"""`ftrun calibrate [SCRIPT.py] [--profile P] --out PROFILE.toml [--quick] [--json]`: measure this machine
and write a scale profile for it.

Measures (harness.calibrate.measure, harness.calibrate.procs): the step compute time of the model (the toy
LM `ftrun.train.ft_worker` trains, in this process; with SCRIPT.py or `-m MODULE`, the median quorum-to-commit
time of that script run by `ftrun launch` as one replica of one rank), 127.0.0.1 TCP and Unix socket
one-way latency and bandwidth, shared-memory bandwidth, how the step slows with N rank processes computing at
once (the machine's effective cores for ranks), the real HTTP catch-up's cost per fetch and per
byte (from a source process that trains meanwhile), a local atomic file write (loader_state, audit), the
CPU FTAR kernels' reduce and copy throughput, zygote-forked and spawned process start, and crash
detection (SIGKILL to the launcher seeing the exit, and to a TCP peer seeing the reset; with SCRIPT, also a
killed rank of the script, from its kill to its job's lighthouse losing the connection: that teardown, slower
than an idle child's, sets network.crash_fin_delay_s). The script's runs print every rank's phase events
(FTRUN_PHASE_EVENTS=1): from them, a rank's compute phase at 1 and 2 replicas (their difference beyond the
contention model sets train.replica_compute_extra_s), the spread of the ranks' starts of a step in its 2-replica
run (train.rank_start_skew_s: `start_skews`) and of the replicas' commits (train.rank_exchange_skew_s:
`exchange_skews`), the loader_state write as its own writer met it there (`writer_writes`:
storage.local_write_latency_s, and what the bookkeeping leaves out) and, with more than one rank, the commit vote
over the replica's comm (network.replica_collective_pass_s) and the decision broadcast's lag (for reading).

Writes --out: the --profile (default ci-small) with the measured keys set (harness.calibrate.provenance
says which figure sets which key) and a [calibration] table where every value says how and when it was
measured. `ftrun emulate --profile`-style loading (`ftrun emulate OUT.toml`) reads it back; the emulator
charges the new keys (ftar.kernel_reduce_gb_s / kernel_copy_gb_s, train.catchup_fetch_extra_s,
scheduler.crash_detect_s, network.crash_fin_delay_s, storage.local_write_latency_s,
network.replica_collective_pass_s, train.replica_compute_extra_s, train.rank_start_skew_s,
train.rank_exchange_skew_s). `--quick` takes
fewer samples, serves the catch-up from an idle in-process server and starts children without torch
(for tests: ~15 s of CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from statistics import median

from ftrun.cli import UsageError, emit_json
from harness.calibrate.measure import (Figure, WriteSampler, catchup_costs, concurrent_steps, ftar_kernels, ftar_rebuild,
                                       shm_bandwidth, step_compute, storage_append, storage_read, storage_write, stream_pair)
from harness.calibrate.procs import process_figures
from harness.calibrate.provenance import calibrated_document, median_abs_diff_max_exp, to_toml

DEFAULT_PROFILE = "ci-small"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("script", nargs="?", default=None,
                   help="training script whose step to time (run by `ftrun launch` as 1 replica x 1 rank); "
                        "default: the toy LM of ftrun.train.ft_worker, timed in this process")
    p.add_argument("--profile", default=DEFAULT_PROFILE,
                   help="profile whose layout, model and other keys the calibrated profile keeps (default %(default)s)")
    p.add_argument("--out", required=True, metavar="PROFILE.toml", help="where to write the calibrated profile")
    p.add_argument("--quick", action="store_true", help="fewer samples (seconds, for tests)")
    p.add_argument("-m", dest="module", action="store_true",
                   help="SCRIPT is a module name (e.g. ftrun.train.ft_worker), as with `python -m`")
    p.add_argument("--script-steps", type=int, default=30, help="with SCRIPT.py: steps to run (default %(default)s)")
    p.add_argument("--script-ranks", type=int, default=1,
                   help="with SCRIPT.py: ranks of the one replica it runs as (default %(default)s)")
    p.add_argument("--json", action="store_true")


def commit_to_quorum_s(events: list[dict], participants: int | None = None) -> list[float]:
    """Per step of each rank-0 incarnation: from its commit of a step to its quorum event of the next (the
    script's and the runtime's per-step work after the commit: ledger, loader_state, audit, the step event,
    the next quorum request); with `participants`, only to quorums of that many replicas. Pure."""
    commit: dict[tuple, float] = {}
    out = []
    for e in sorted((e for e in events if e.get("rank", 0) == 0 and "t" in e), key=lambda e: e["t"]):
        key = (e.get("replica_id"), e.get("incarnation", 0))
        if e.get("event") == "commit":
            commit[key + (e["step"],)] = e["t"]
        elif e.get("event") == "quorum" and key + (e["step"],) in commit and (
                participants is None or len(e.get("participants", ())) == participants):
            out.append(e["t"] - commit[key + (e["step"],)])
    return out


def quorum_to_commit_s(events: list[dict]) -> list[float]:
    """Per step of each rank-0 incarnation: from its quorum event to its commit of that step (the step's
    compute plus the single replica's all-reduce and commit; not the bookkeeping between a commit and the
    next quorum, which the emulator models itself). Pure."""
    quorum: dict[tuple, float] = {}
    out = []
    for e in sorted((e for e in events if e.get("rank", 0) == 0 and "t" in e), key=lambda e: e["t"]):
        key = (e.get("replica_id"), e.get("incarnation", 0))
        if e.get("event") == "quorum":
            quorum[key + (e["step"],)] = e["t"]
        elif e.get("event") == "commit" and key + (e["step"] - 1,) in quorum:
            out.append(e["t"] - quorum[key + (e["step"] - 1,)])
    return out


def _phase_pairs(events: list[dict], start: str, end: str, field: str) -> Iterator[tuple[tuple, dict, dict]]:
    """Per attempt of a step on every rank, (its (replica_id, incarnation, rank), its `start` phase event, its next
    `end` phase event of the same step), over the phase events (FTConfig.phase_events) that carry `field`, in time
    order. Pure."""
    began: dict[tuple, dict] = {}
    for e in sorted((e for e in events if e.get("event") == "phase" and "t" in e and field in e), key=lambda e: e["t"]):
        key = (e.get("replica_id"), e.get("incarnation", 0), e.get("rank", 0))
        if e["phase"] == start:
            began[key] = e
        elif e["phase"] == end and key in began and began[key]["step"] == e["step"]:
            yield key, began.pop(key), e


def phase_spans(events: list[dict], start: str, end: str) -> list[float]:
    """Per attempt of a step on every rank (its "phase" events, FTConfig.phase_events), the time from its `start`
    phase to its next `end` phase of the same step (e.g. "forward" -> "exchange": the rank's compute). Pure."""
    return [b["t"] - a["t"] for _, a, b in _phase_pairs(events, start, end, "t")]


def phase_cpu(events: list[dict], start: str, end: str, participants: int | None = None) -> list[float]:
    """Per attempt of a step on every rank, the rank process's CPU seconds (its phase events' `cpu`) from its `start`
    phase to its next `end` phase of the same step (e.g. "exchange" -> "before_commit": its gradient all-reduce);
    with `participants`, only the steps that are `full_steps`. Events without a `cpu` are left out. Pure."""
    full = full_steps(events, participants) if participants is not None else None
    return [b["cpu"] - a["cpu"] for key, a, b in _phase_pairs(events, start, end, "cpu")
            if full is None or (*key[:2], b["step"]) in full]


def full_steps(events: list[dict], participants: int) -> set[tuple]:
    """(replica_id, incarnation, step) of every step whose first quorum (its leader's quorum event) had `participants`
    replicas and none of them behind: the steps a run with kills trained with every replica up. Pure."""
    first: dict[tuple, dict] = {}
    for e in events:
        if e.get("event") == "quorum" and e.get("rank", 0) == 0 and "step" in e:
            first.setdefault((e.get("replica_id"), e.get("incarnation", 0), e["step"]), e)
    return {key for key, e in first.items() if len(e.get("participants", ())) == participants and not e.get("behind")}


def cpu_steps(events: list[dict], participants: int | None = None) -> list[tuple[float, float]]:
    """Per step of every rank (its first "quorum" phase event of a step and of the next, each with the rank process's
    `cpu`: ftrun.train.wiring), (CPU seconds, wall seconds) between the two. Steps without a `cpu` (older events) are
    left out; with `participants`, so is a step unless it and the next are `full_steps` (in a 2-replica run with kills,
    a survivor's steps alone and a joiner's catch-up are not what 2 replicas cost). Pure."""
    full = full_steps(events, participants) if participants is not None else None
    first: dict[tuple, dict[int, tuple[float, float]]] = {}
    for e in events:
        if e.get("event") == "phase" and e.get("phase") == "quorum" and "t" in e and "cpu" in e:
            key = (e.get("replica_id"), e.get("incarnation", 0), e.get("rank", 0))
            first.setdefault(key, {}).setdefault(e["step"], (e["t"], e["cpu"]))
    out = []
    for key, by_step in first.items():
        for step, (t, cpu) in by_step.items():
            nxt = by_step.get(step + 1)
            if nxt is not None and nxt[0] > t and (full is None or {(*key[:2], step), (*key[:2], step + 1)} <= full):
                out.append((nxt[1] - cpu, nxt[0] - t))
    return out


def retry_cpus(events: list[dict], after: int = 5) -> list[float]:
    """Per step a rank retried with fewer replicas than it last tried (a replica of its quorum died: its first attempt
    whose leader's quorum event has fewer participants than the attempt before it), its process's CPU seconds in that
    attempt (its "quorum" phase to the next, as `cpu_steps`) less the median of its next `after` attempts' with as many
    participants; a retry without them is left out. Pure."""
    asks: dict[tuple, list[tuple[float, float]]] = {}
    decided: dict[tuple, list[tuple[float, int]]] = {}
    for e in events:
        key = (e.get("replica_id"), e.get("incarnation", 0))
        if e.get("event") == "phase" and e.get("phase") == "quorum" and "t" in e and "cpu" in e:
            asks.setdefault(key + (e.get("rank", 0),), []).append((e["t"], e["cpu"]))
        elif e.get("event") == "quorum" and e.get("rank", 0) == 0 and "t" in e and e.get("participants"):
            decided.setdefault(key, []).append((e["t"], len(e["participants"])))
    out = []
    for key, xs in asks.items():
        xs.sort()
        qs = sorted(decided.get(key[:2], ()))
        tried = []  # per attempt: (its participants, its CPU seconds)
        for (t0, c0), (t1, c1) in zip(xs, xs[1:]):
            n = next((n for t, n in qs if t0 < t < t1), None)
            tried.append((n, c1 - c0))
        for i in range(1, len(tried)):
            n, cpu = tried[i]
            if n is None or tried[i - 1][0] is None or n >= tried[i - 1][0]:
                continue
            nxt = [c for m, c in tried[i + 1:i + 1 + after] if m == n]
            if len(nxt) == after:
                out.append(cpu - median(nxt))
    return out


def cpu_shares(events: list[dict], participants: int | None = None) -> list[float]:
    """Per step of every rank (`cpu_steps`), its busy share: its process's CPU seconds over the wall seconds. Pure."""
    return [cpu / wall for cpu, wall in cpu_steps(events, participants)]


def _at_commits(events: list[dict], phase: str) -> list[tuple[float, dict[int, float]]]:
    """Per leader commit of a replica of more than one rank: (its time, {rank: that rank's last `phase` event of
    the committed step before it}); only commits where every rank of the replica has one. Pure."""
    marks: dict[tuple, dict[int, list[float]]] = {}
    ranks: dict[tuple, set[int]] = {}
    for e in events:
        if e.get("event") == "phase" and "t" in e:
            key = (e.get("replica_id"), e.get("incarnation", 0))
            ranks.setdefault(key, set()).add(e.get("rank", 0))
            if e.get("phase") == phase:
                marks.setdefault(key + (e["step"],), {}).setdefault(e.get("rank", 0), []).append(e["t"])
    out = []
    for c in (e for e in events if e.get("event") == "commit" and e.get("rank", 0) == 0 and "t" in e):
        key = (c.get("replica_id"), c.get("incarnation", 0))
        by_rank = marks.get(key + (c["step"] - 1,), {})  # a commit event names the step it commits to
        last = {r: max((t for t in ts if t <= c["t"]), default=None) for r, ts in by_rank.items()}
        if len(ranks.get(key, ())) > 1 and set(last) == ranks[key] and None not in last.values():
            out.append((c["t"], last))
    return out


def commit_votes(events: list[dict]) -> list[float]:
    """Per committed step of a replica of more than one rank, the commit vote (the Manager's all-reduce of the
    ranks' votes over the replica's comm, gloo for real): from the last rank's "before_commit" phase to the
    leader's commit event, so a wait for a later rank is not in it. Pure."""
    return [t - max(last.values()) for t, last in _at_commits(events, "before_commit")]


def decision_broadcasts(events: list[dict]) -> list[float]:
    """Per committed step of a replica of more than one rank, how much later than its leader the other ranks
    had the quorum decision (the leader's broadcast over the replica's comm): the latest of their "started"
    phases less the leader's. Pure."""
    return [max(t for r, t in last.items() if r != 0) - last[0]
            for _, last in _at_commits(events, "started") if 0 in last]


def writer_writes(events: list[dict]) -> list[float]:
    """Per committed step of more than one replica, the loader_state write as the job's own writer met it: the
    writer's (`checkpoint_writer`: the lowest replica id of the step's quorum) rank-0 time from its "after_commit"
    phase to its next "quorum" phase, less the median of the other replicas' (the same ledger, audit and step
    bookkeeping, without the write). A sampler's write in another process was 0.5-2x it under the job's load
    (benchmarks/results/fidelity.md). Pure."""
    after: dict[tuple, float] = {}  # (replica, incarnation, step) -> after_commit
    ask: dict[tuple, float] = {}  # (replica, incarnation, step) -> the next step's quorum phase
    participants: dict[int, list[str]] = {}  # step -> its last quorum's replicas
    for e in sorted((e for e in events if e.get("rank", 0) == 0 and "t" in e), key=lambda e: e["t"]):
        key = (e.get("replica_id"), e.get("incarnation", 0))
        if e.get("event") == "quorum" and e.get("participants"):
            participants[e["step"]] = list(e["participants"])
        elif e.get("event") == "phase" and e.get("phase") == "after_commit":
            after[key + (e["step"],)] = e["t"]
        elif e.get("event") == "phase" and e.get("phase") == "quorum" and key + (e["step"] - 1,) in after:
            ask.setdefault(key + (e["step"] - 1,), e["t"])
    gaps: dict[int, dict[str, float]] = {}
    for (rid, _, step), t in ask.items():
        gaps.setdefault(step, {})[rid] = t - after[(rid, _, step)]
    out = []
    for step, by in sorted(gaps.items()):
        writer = min(participants.get(step, ()), default=None)
        others = [g for rid, g in by.items() if rid != writer]
        if writer in by and others:
            out.append(by[writer] - median(others))
    return out


def start_skews(events: list[dict]) -> list[float]:
    """Per step that every rank of the run started (its first "started" phase of the step), |a - b| over every
    pair of its ranks' started times: how far apart the ranks begin a step. For ranks whose starts are
    independent exponential delays of mean m, each |a - b| is exponential of mean m too, so m = median / ln 2
    (`provenance`'s train.rank_start_skew_s). Pure."""
    at: dict[int, dict[tuple, float]] = {}
    for e in events:
        if e.get("event") == "phase" and e.get("phase") == "started" and "t" in e:
            key = (e.get("replica_id"), e.get("incarnation", 0), e.get("rank", 0))
            at.setdefault(e["step"], {}).setdefault(key, e["t"])
    n = max((len(by) for by in at.values()), default=0)
    return [abs(a - b) for by in at.values() if n > 1 and len(by) == n
            for i, a in enumerate(by.values()) for b in list(by.values())[i + 1:]]


def exchange_skews(events: list[dict]) -> list[float]:
    """Per step that every replica of the run committed (its leader's first commit event of the step), |a - b| over
    every pair of the replicas' commit times: how far apart the replicas leave a step's all-reduce and vote (each
    rank wakes from the ring at its own time, and a replica's vote waits for its later rank). For replicas of K ranks
    whose wakes are independent exponential delays of mean m, m = median / `provenance.median_abs_diff_max_exp(K)`
    (train.rank_exchange_skew_s). Pure."""
    at: dict[int, dict[tuple, float]] = {}
    for e in events:
        if e.get("event") == "commit" and e.get("rank", 0) == 0 and "t" in e:
            at.setdefault(e["step"], {}).setdefault((e.get("replica_id"), e.get("incarnation", 0)), e["t"])
    n = max((len(by) for by in at.values()), default=0)
    return [abs(a - b) for by in at.values() if n > 1 and len(by) == n
            for i, a in enumerate(by.values()) for b in list(by.values())[i + 1:]]


# Kills of the 2-replica run whose median is the script's crash detection.
CRASH_KILLS = 3


def crash_detections(events: list[dict]) -> list[float]:
    """Per kill event, the time to r0's first abort or error event after it (none: that kill is left out). Pure."""
    kills = sorted(e["t"] for e in events if e.get("event") == "kill")
    noticed = sorted(e["t"] for e in events if e.get("replica_id") == "r0" and e.get("event") in ("abort", "error"))
    out = []
    for k in kills:
        first = next((t for t in noticed if t >= k), None)
        if first is not None:
            out.append(first - k)
    return out


def teardowns(trace: dict) -> list[float]:
    """Per kill of a `ftrun launch` job's trace.json (its "kill" instants), the time until the lighthouse lost
    that replica's leader connection ("member_lost", why "lost": the connection reset): the killed rank's OS
    teardown as the job's load made it. A kill with no such loss before that replica's next kill is left out
    (a later loss is the later kill's). Pure."""
    ev = trace.get("traceEvents") or []
    kills = sorted((e["ts"], e["args"].get("replica_id")) for e in ev if e.get("name") == "kill" and "args" in e)
    lost = sorted((e["ts"], e["args"].get("replica_id")) for e in ev if e.get("cat") == "quorum"
                  and str(e.get("name", "")).startswith("member_lost") and e.get("args", {}).get("why") == "lost")
    out = []
    for t, rid in kills:
        until = next((u for u, r in kills if r == rid and u > t), float("inf"))
        seen = next((u for u, r in lost if r == rid and t <= u < until), None)
        if seen is not None:
            out.append((seen - t) / 1e6)  # trace.json's microseconds
    return out


def _script_events(script: str, steps: int, module: bool, ranks: int, replicas: int,
                   extra: tuple[str, ...] = ()) -> tuple[dict, list[dict], dict]:
    """(figures, events, trace.json) of SCRIPT run by `ftrun launch` as `replicas` x `ranks` (fault-free unless
    `extra` says)."""
    with tempfile.TemporaryDirectory(prefix="ftrun-calibrate-") as out:
        cmd = [sys.executable, "-m", "ftrun.cli", "launch", "--replicas", str(replicas), "--ranks-per-replica", str(ranks),
               "--min-replicas", "1", "--steps", str(steps), "--out", out, "--no-progress", "--json", *extra]
        cmd += ["-m", script] if module else [script]
        env = {**os.environ, "FTRUN_PHASE_EVENTS": "1"}  # every rank's phases: where its step's time goes
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        lines = proc.stdout.strip().splitlines()
        try:
            figures = json.loads(lines[-1])
            with open(os.path.join(out, "events.jsonl")) as f:
                events = [json.loads(line) for line in f if line.strip()]
            trace_path = os.path.join(out, "trace.json")
            trace = {}
            if os.path.exists(trace_path):
                with open(trace_path) as f:
                    trace = json.load(f)
        except (IndexError, json.JSONDecodeError, OSError):
            raise UsageError(f"SCRIPT {script}: `ftrun launch` printed no figures (exit {proc.returncode}): "
                             f"{proc.stderr.strip()[-500:]}") from None
    return figures, events, trace


def _script_step(script: str, steps: int, module: bool = False, ranks: int = 1) -> list[Figure]:
    """The script's step figures (the module docstring), and `script_write_s`: the loader_state write as the
    script's runs met it (sampled while they ran: a shared machine's disk is slower under the job's own load than
    alone, and the commit-to-quorum those runs measure holds the writer's write as it was then)."""
    sampler = WriteSampler().start()
    try:
        out = _script_runs(script, steps, module, ranks)
    finally:
        sampler.stop()
    write = sampler.figure("script_write_s", f"{script} ran as 1 and 2 replicas x {ranks} ranks")
    return out + ([write] if write is not None else [])


def _script_runs(script: str, steps: int, module: bool, ranks: int) -> list[Figure]:
    figures, events, _ = _script_events(script, steps, module, ranks, 1)
    spans, after = quorum_to_commit_s(events), commit_to_quorum_s(events)
    period = figures.get("median_step_s")
    if not spans or not period:
        raise UsageError(f"SCRIPT {script}: `ftrun launch` measured no step time (steps reached: "
                         f"{figures.get('steps_reached')})")
    how = (f"{script} run by `ftrun launch --replicas 1 --ranks-per-replica {ranks} --steps {steps}`")
    return [Figure("step_s", median(spans), "s", f"median time from a step's quorum to its commit of {how} (the "
                   "script's compute plus one replica's all-reduce and commit)", len(spans)),
            Figure("script_step_period_s", float(period), "s", f"median commit-to-commit step time of {how}", steps),
            Figure("script_ranks", float(ranks), "ranks", f"the ranks of the one replica of {how} (not measured: "
                   "the step's CPU contention is that of this many ranks)", 1),
            *([Figure("script_commit_to_quorum_s", median(after), "s", f"median time from a step's commit to the next "
                      f"step's quorum of {how}", len(after))] if after else []),
            *phase_figures(events, how, ""),
            *_ftar_hop(script, steps, module, ranks, median(spans))]


def phase_figures(events: list[dict], how: str, suffix: str, participants: int | None = None) -> list[Figure]:
    """From the phase events of `how`'s run: the ranks' compute (`script_compute{suffix}`), and with more than one
    rank the commit vote (`script_commit_vote{suffix}`) and the decision broadcast's lag
    (`script_decision_broadcast{suffix}`), and every rank's busy share of a step (`script_cpu_share{suffix}`), CPU
    seconds per step (`script_cpu_step{suffix}_s`) and CPU seconds in its all-reduce (`script_allreduce_cpu{suffix}_s`,
    all three over the steps of `participants` replicas where given), medians (the module's pure functions say how
    each is cut)."""
    full = "" if participants is None else f" (the steps all {participants} replicas trained)"
    out = []
    for name, xs, what in (
            (f"script_compute{suffix}_s", phase_spans(events, "forward", "exchange"), "from a rank's forward phase "
             "to its exchange phase (its forward, backward and gradient gather), over every rank's steps"),
            (f"script_commit_vote{suffix}_s", commit_votes(events), "from the last rank's before_commit phase to "
             "the leader's commit event (the commit vote, an all-reduce over the replica's gloo comm)"),
            (f"script_decision_broadcast{suffix}_s", decision_broadcasts(events), "of the other ranks' started "
             "phase less the leader's (the quorum decision's broadcast over the replica's gloo comm)"),
            (f"script_cpu_share{suffix}", cpu_shares(events, participants), f"over every rank's steps{full} of its "
             "process's CPU seconds over the wall seconds from its quorum phase of a step to that of the next (the "
             "phase events' cpu: time.process_time, every thread of the rank)"),
            (f"script_cpu_step{suffix}_s", [cpu for cpu, _ in cpu_steps(events, participants)], f"over every rank's "
             f"steps{full} of its process's CPU seconds from its quorum phase of a step to that of the next (the phase "
             "events' cpu)"),
            (f"script_allreduce_cpu{suffix}_s", phase_cpu(events, "exchange", "before_commit", participants),
             f"over every rank's steps{full} of its process's CPU seconds from its exchange phase to its before_commit "
             "phase (its cross-replica gradient all-reduce; the phase events' cpu)")):
        if xs:
            share = name.startswith("script_cpu_share")
            out.append(Figure(name, median(xs), "share" if share else "s", f"median {'' if share else 'time '}{what}, "
                              f"{how} with FTRUN_PHASE_EVENTS=1", len(xs)))
    return out


def _ftar_hop(script: str, steps: int, module: bool, ranks: int, one_replica_s: float) -> list[Figure]:
    """What a real cross-replica all-reduce costs beyond the modeled network and kernels (waiting for the
    slower peer on a loaded machine, the runtime's per-message work and wake-ups): the same script as 2
    replicas, the rise of its median quorum-to-commit time over one replica's. In the same run (CRASH_KILLS x
    `steps` steps) r1 is killed CRASH_KILLS times, `steps` steps apart, and restarted at once: the script's start
    (restart to its rank 0's ready event: the fork, the script's imports and set-up) is measured there, and, as
    r1 dies mid-step, how long r0 takes to notice, the median over the kills (one kill is as noisy as the machine's
    load): for reading, not a profile key (r0's notice can wait for its own way to the all-reduce, which the emulator
    models); and the killed rank's teardown, from the kill to the lighthouse's loss of its connection (`teardowns`):
    the FINs' delay of a real rank of the script, under the job's own load."""
    kills = [x for i in range(1, CRASH_KILLS + 1) for x in ("--inject", f"kill replica=1 step={i * steps} at=0.5")]
    _, events, trace = _script_events(script, (CRASH_KILLS + 1) * steps, module, ranks, 2,
                                      (*kills, "--restart-delay", "0s"))
    spans = quorum_to_commit_s(events)
    if not spans:
        return []
    two = median(spans)
    restarts = {(e["replica_id"], e["incarnation"]): e["t"] for e in events if e.get("event") == "restart"}
    starts = [e["t"] - restarts[(e.get("replica_id"), e.get("incarnation"))] for e in events
              if e.get("event") == "ready" and e.get("rank", 0) == 0 and (e.get("replica_id"), e.get("incarnation")) in restarts]
    started = [Figure("script_start_s", median(starts), "s", f"median time from the supervisor's restart of a killed "
                      f"replica to its rank 0's ready event ({script} as 2 replicas x {ranks} ranks: the zygote's fork, "
                      f"the script's own imports and set-up)", len(starts))] if starts else []
    noticed = crash_detections(events)
    detect = [Figure("script_crash_detect_s", median(noticed), "s", f"median over {len(noticed)} mid-step kills of r1 "
                     f"(`--inject kill ... at=0.5`) of the time to the first abort or error of r0 after it ({script} as 2 "
                     f"replicas x {ranks} ranks: the killed rank's teardown and the survivor's notice)",
                     len(noticed))] if noticed else []
    down = teardowns(trace)
    teardown = [Figure("script_peer_reset_s", median(down), "s", f"median over {len(down)} mid-step kills of r1 "
                       f"(`--inject kill ... at=0.5`) of the time from the kill to the lighthouse's loss of r1's "
                       f"connection (its reset: the killed rank's OS teardown under the job's own load; {script} as 2 "
                       f"replicas x {ranks} ranks)", len(down))] if down else []
    phased = phase_figures(events, f"{script} as 2 replicas x {ranks} ranks", "_2_replicas", participants=2)
    skews = start_skews(events)
    if skews:
        phased.append(Figure("script_start_skew_s", median(skews) / math.log(2), "s", f"the median over "
                             f"{len(skews)} pairs of ranks in a step of |a - b| of their started phases, / ln 2 (the "
                             f"mean of exponential start delays that gives it; {script} as 2 replicas x {ranks} ranks "
                             "with FTRUN_PHASE_EVENTS=1)", len(skews)))
    left = exchange_skews(events)
    if left:
        spread = median_abs_diff_max_exp(ranks)
        phased.append(Figure("script_exchange_skew_s", median(left) / spread, "s", f"the median over {len(left)} "
                             f"steps of |a - b| of the 2 replicas' commits, / {spread:.4g} (the median |a - b| of the "
                             f"latest of {ranks} exponential draws of mean 1 each: the mean of the ranks' late wakes "
                             f"from the all-reduce that gives it; {script} as 2 replicas x {ranks} ranks)", len(left)))
    writes = writer_writes(events)
    if writes:
        phased.append(Figure("script_writer_write_s", max(median(writes), 0.0), "s", f"median over {len(writes)} steps "
                             f"of the writer's after_commit -> next quorum phase less the other replica's (its "
                             f"loader_state write as the job met it; {script} as 2 replicas x {ranks} ranks with "
                             "FTRUN_PHASE_EVENTS=1), floored at 0", len(writes)))
    retries = retry_cpus(events)
    if retries:
        phased.append(Figure("script_retry_cpu_2_replicas_s", max(median(retries), 0.0), "s", f"median over "
                             f"{len(retries)} retries of a rank of r0 after a kill of r1 of its CPU seconds in the retry "
                             f"(its quorum phase to the next) less the median of its next 5 steps' alone ({script} as 2 "
                             f"replicas x {ranks} ranks with FTRUN_PHASE_EVENTS=1), floored at 0", len(retries)))
    after = commit_to_quorum_s(events, participants=2)
    after_2 = [Figure("script_commit_to_quorum_2_replicas_s", median(after), "s", f"median time from a step's commit to "
                      f"the next step's quorum of 2 replicas, {script} as 2 replicas x {ranks} ranks (a 1-replica run's "
                      "is longer on a loaded machine: its rank never waits in an all-reduce)", len(after))] if after else []
    return started + detect + teardown + after_2 + phased + [Figure("script_step_2_replicas_s", two, "s", f"median time from a step's quorum to its commit of {script} "
                   f"run by `ftrun launch --replicas 2 --ranks-per-replica {ranks} --steps {steps}`", len(spans)),
            Figure("ftar_sync_overhead_s", max(two - one_replica_s, 0.0), "s",
                   f"measured.script_step_2_replicas_s ({two:.6g} s) minus the one-replica step ({one_replica_s:.6g} s), "
                   "floored at 0", len(spans))]


def measure_all(*, quick: bool, script: str | None, script_steps: int, module: bool = False, script_ranks: int = 1,
                progress=lambda name: None) -> dict[str, Figure]:
    """Every figure, by name. Order: cheap in-process ones first, processes last."""
    figures: list[Figure] = []

    def take(name: str, fn, *args, **kwargs) -> None:
        progress(name)
        out = fn(*args, **kwargs)
        figures.extend(out if isinstance(out, (list, tuple)) else [out])

    if script is not None:
        take("step (script)", _script_step, script, script_steps, module, script_ranks)
    else:
        take("step", step_compute, reps=10 if quick else 50, warmup=3 if quick else 10)
    take("contention", concurrent_steps, max_procs=2 if quick else 4, reps=5 if quick else 15,
         warmup=2 if quick else 3, seconds=0.2 if quick else 1.0)
    mb = 16 << 20 if quick else 128 << 20
    take("tcp", stream_pair, "tcp", pings=300 if quick else 3000, nbytes=mb, reps=3 if quick else 7)
    take("unix", stream_pair, "unix", pings=300 if quick else 3000, nbytes=mb, reps=3 if quick else 7)
    take("shm", shm_bandwidth, nbytes=mb, reps=3 if quick else 7)
    take("storage", storage_write, reps=10 if quick else 30)
    take("storage append", storage_append, reps=50 if quick else 200)
    take("storage read", storage_read, reps=50 if quick else 200)
    take("ftar kernels", ftar_kernels, nbytes=4 << 20 if quick else 8 << 20, reps=5 if quick else 30)
    take("ftar rebuild", ftar_rebuild, reps=5 if quick else 15)
    # quick: still up to 32 MiB, so the bytes' time stands above a loaded box's per-fetch noise (with 8 MiB at most,
    # 2 of each, the slope came out <= 0 under a CI run's load: catchup_ns_per_byte 0)
    take("catch-up", catchup_costs, sizes_mb=(0.0625, 4, 32) if quick else (0.0625, 4, 16, 32),
         reps=3 if quick else 5, shard_mb=8, busy_source=not quick)
    take("processes", process_figures, zygote_reps=3 if quick else 7, spawn_reps=0 if quick else 2,
         import_torch=not quick)
    return {f.name: f for f in figures}


def run(args: argparse.Namespace) -> int:
    from harness.profile import _to_dict, load_profile

    if args.module and args.script is None:
        raise UsageError("-m needs a module name as SCRIPT")
    if args.script is not None and not args.module and not Path(args.script).is_file():
        raise UsageError(f"SCRIPT {args.script!r} is not a file")
    if args.script_steps < 3:
        raise UsageError(f"--script-steps must be >= 3, got {args.script_steps}")
    out = Path(args.out)
    if out.suffix != ".toml":
        raise UsageError(f"--out {args.out!r} must name a .toml file")
    if not out.parent.is_dir():
        raise UsageError(f"--out {args.out!r}: no such directory {str(out.parent)!r}")
    try:
        base = load_profile(args.profile)
    except FileNotFoundError:
        raise UsageError(f"--profile {args.profile!r}: no such scale profile or file") from None
    except ValueError as e:
        raise UsageError(f"--profile {args.profile!r}: {e}") from None
    started = time.monotonic()
    measured_at = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    if args.script_ranks < 1:
        raise UsageError(f"--script-ranks must be >= 1, got {args.script_ranks}")
    figures = measure_all(quick=args.quick, script=args.script, script_steps=args.script_steps, module=args.module,
                          script_ranks=args.script_ranks,
                          progress=lambda name: print(f"ftrun calibrate: measuring {name} ...", file=sys.stderr,
                                                      flush=True))
    command = "ftrun calibrate " + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["calibrate"] else sys.argv[1:])
    doc = calibrated_document(_to_dict(base), figures, measured_at=measured_at, host=platform.node(),
                              command=command, quick=args.quick)
    header = (f"{doc['name']}: written by `{command}` at {measured_at} on {platform.node()} "
              f"({os.cpu_count()} CPUs).\nEvery measured value is listed with its method under [[calibration.values]].")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(to_toml(doc, header))
    load_profile(tmp)  # it must load back as a valid profile before it replaces anything
    os.replace(tmp, out)
    wall = time.monotonic() - started
    rows = [(f.name, f.value, f.unit) for f in figures.values()]
    print(f"ftrun calibrate: {len(rows)} figures in {wall:.1f} s -> {out}")
    for name, value, unit in rows:
        print(f"  {name:<22} {value:12.6g} {unit}")
    if args.json:
        emit_json({"out": str(out), "profile": doc["name"], "wall_s": round(wall, 3), "quick": args.quick,
                   "figures": {f.name: f.value for f in figures.values()},
                   "units": {f.name: f.unit for f in figures.values()},
                   "keys": {v["key"]: v["value"] for v in doc["calibration"]["values"]
                            if not v["key"].startswith("measured.")}})
    return 0
