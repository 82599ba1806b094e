"""`ftrun fidelity [--replicas R --ranks-per-replica K] [--profile CALIBRATED.toml] [--json]`: one small job
run for real (`ftrun launch` of ftrun.train.ft_worker on this machine) and emulated (`harness.run` with the
calibrated profile, same layout, steps, kill and restart delay), the same figures from both event streams
side by side with emulated/real.

Faults, the same in both: replica r1 is SIGKILLed --kills times, F x a step into its step once the job has
committed --kill-step, --kill-step + --kill-step-interval, ... steps (`--inject kill replica=1 step=S at=F` in
both worlds, F = --kill-at-fraction: F x the victim's compute after its quorum, the real rank timing it on its
own compute, the emulator on its modeled one), its state fetches are served --slow-fetch-delay slower, and it
restarts after --restart-delay (real `--restart-delay`; emulated scheduler.alloc_delay_warm_s). The replicas start
as the real runs' did (`ftrun launch` forks the ranks one after another: the first replica trains alone until the
others are up, and they join behind and heal): each starts in the emulated job at its median offset in the real
runs (`start_offsets`, scheduler.first_start_s). One kill is as
noisy as the machine's load: the per-fault figures are medians over the kills (KILLS by default), and `--json`
gives each one's spread over them (`spread`). The kills are --kill-step-interval steps apart, by default
`spaced_interval`: the replica's recovery (teardown, restart delay, start, slow fetch) in steps of the fastest step
measured, plus LOCAL_GAPS + 1 steady steps, so each kill finds the job recovered from the last (`recoveries` says
whether it did, per kill, in both worlds; `--json` `recoveries`). With --repeat N the real job runs N times: the
real figures are medians over the
runs (the per-fault ones over all their faults), and each row's `real_spread` (the runs' largest |ln(a/b)|
among themselves) and `inside_noise` say which ratios are inside this machine's own run-to-run noise.
The emulated job runs --emulated-seeds times (seeds 0, 1, ...; EMULATED_SEEDS by default), its figures pooled
the same way (`repeated`): its ranks' late wakes and jitter are seeded draws, and one run's 10 kills are too few
for a stable median of a stall.

Figures (`metrics`, pure, over either event stream: leader/rank-0 events with replica_id, incarnation, t):
- step_s: median time between consecutive commits of one replica incarnation;
- get_quorum_s: median, over (incarnation, step), from its commit of step s to its quorum event of step s+1;
- detection_s: from the kill to the first abort or error event of a surviving replica or, where there is
  none (the lighthouse dropped the replica before the next quorum), to the first quorum without it;
- stall_per_failure_s: the time a failure loses: the longest commit-to-commit interval of a surviving replica
  containing the kill, less that replica's step just before it (`per_fault`);
- catchup_s: median catch-up fetch time of a restarted replica (real: the trainer's catchup event; emulated: the
  heal span), the failure's catch-up: a replica that started late and healed at the job's start is left out (those
  fetches are fast unless the slow fetch is on, and mixed in they flip the median with the number of rejoins);
- rejoin_stall_s: the same as the stall, for the interval containing the restarted replica's first quorum;
- effective_training_time: committed non-healed replica-steps x step_s over replicas x (first quorum to
  last commit).
`max_abs_log_ratio` is the largest |ln(emulated/real)| over the figures both runs have (> 0).

For reading a stall miss, `stall_phases` cuts each failure's stalled interval at the events both worlds emit
(commit, quorum, kill, error, abort); the run prints their medians side by side, `--json` gives them as
`stall_phases`, and `--out` keeps the emulated events (emulated/events.jsonl, emulated-2/, ...) beside the
real runs'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from statistics import median
from typing import Any, Iterable

from ftrun.cli import UsageError, emit_json
from ftrun.launch.checks import replica_ids
from harness.calibrate.measure import Figure, WriteSampler

# The real worker's data-plane settings, passed to it explicitly and given to the emulator as the same keys
# (ftrun.train.ft_worker --chunk-bytes / --max-shard-bytes; FTConfig.ftar, ftrun.config.FtarConfig).
CHUNK_BYTES, SHARD_BYTES, NUM_CHUNKS = 2048, 8192, 2
# The real worker's timeouts (ftrun.config.Timeouts) that the emulated job is given: `real_timeouts`.
TIMEOUT_KEYS = ("heartbeat_interval_s", "heartbeat_timeout_s", "commit_timeout_s", "ftar_timeout_s", "quorum_timeout_s",
                "catchup_timeout_s", "join_timeout_s", "connect_timeout_s")


def real_timeouts() -> dict[str, float]:
    """TIMEOUT_KEYS as the real worker of `_real` configures them (ftrun.train.ft_worker's own FTConfig)."""
    from ftrun.train.ft_worker import config_from, parse_args

    timeouts = config_from(parse_args(["--steps", "1"])).timeouts
    return {key: getattr(timeouts, key) for key in TIMEOUT_KEYS}

NAMES = ("step_s", "get_quorum_s", "detection_s", "stall_per_failure_s", "catchup_s", "rejoin_stall_s",
         "effective_training_time")
FAULT_NAMES = ("detection_s", "stall_per_failure_s", "catchup_s", "rejoin_stall_s")  # per fault (`per_fault`)


def normalize(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Leader (rank 0) and supervisor events, time-ordered; a real run's "restart" becomes "start"."""
    out = []
    for e in events:
        if e.get("rank", 0) != 0 or "t" not in e:
            continue
        if e.get("event") == "restart":
            e = {**e, "event": "start"}
        out.append(e)
    return sorted(out, key=lambda e: e["t"])


# Commit gaps before a fault whose median is the step a stall is measured against.
LOCAL_GAPS = 10
# Kills of r1 per real run by default. One kill's detection and stall vary 2-4x from the next under a shared
# machine's load (benchmarks/results/fidelity.md): the per-fault figures are medians over them.
KILLS = 10
# Emulated runs (seeds) per fidelity run. One emulated run's stall per failure, a median over its 10 kills, moved
# 0.71-1.06 x real over seeds 0-4 on the same real runs (fid7 4 x 2; benchmarks/results/fidelity.md); 5 runs pool
# 50 kills for ~7-10 s of emulation each.
EMULATED_SEEDS = 5


def spaced_interval(recovery_s: float, period_s: float) -> int:
    """Steps between two kills so that the second finds the job recovered from the first (`recoveries`): the
    replica's recovery (`recovery_s`: its teardown, restart delay, start and catch-up) in steps of `period_s`,
    plus LOCAL_GAPS + 1 steady steps (the step a stall is measured against). `period_s` should be the fastest a
    step runs (`recovery_inputs`): the recovery is a time, and a job whose steps run faster takes more of them to
    cover it (fid4's fixed 40 steps: a 3 x 1 kill came 1-14 steps after the last rejoin). Pure."""
    if recovery_s < 0 or period_s <= 0:
        raise ValueError(f"spaced_interval needs recovery_s >= 0 and period_s > 0, got {recovery_s}, {period_s}")
    return math.ceil(recovery_s / period_s) + LOCAL_GAPS + 1


def recovery_inputs(keys: dict[str, float], figures: dict[str, float], args: argparse.Namespace) -> tuple[float, float]:
    """(recovery_s, period_s) for `spaced_interval` from a calibrated profile's keys (flat, "section.key") and
    measured figures (by name): the killed rank's teardown (network.crash_fin_delay_s) + --restart-delay + the
    script's start (scheduler.process_start_s) + --slow-fetch-delay + 2 catch-up requests
    (train.catchup_fetch_extra_s); the period: the shorter of the script's 1-replica step period
    (`script_step_period_s`) and its 2-replica one (`script_step_2_replicas_s` +
    `script_commit_to_quorum_2_replicas_s`), where measured (either alone swings under load: a lone replica's
    commit-to-quorum read 2.6 and 13.8 ms in two runs minutes apart, benchmarks/results/fidelity.md), else the
    emulator's lone step (train.step_compute_s + train.step_bookkeeping_s). Pure."""
    recovery = (keys.get("network.crash_fin_delay_s", 0.0) + args.restart_delay
                + keys.get("scheduler.process_start_s", 0.0) + args.slow_fetch_delay
                + 2 * keys.get("train.catchup_fetch_extra_s", 0.0))
    two = ([figures["script_step_2_replicas_s"] + figures["script_commit_to_quorum_2_replicas_s"]]
           if "script_step_2_replicas_s" in figures and "script_commit_to_quorum_2_replicas_s" in figures else [])
    periods = [x for x in [figures.get("script_step_period_s"), *two] if x]
    lone = keys.get("train.step_compute_s", 0.0) + keys.get("train.step_bookkeeping_s", 0.0)
    period = min(periods) if periods else lone
    return recovery, period


def per_fault(events: Iterable[dict[str, Any]]) -> dict[str, list[float]]:
    """Per fault (every kill; every restarted replica's rejoin; every catch-up), in time order, the figures
    `metrics` takes medians of: detection_s, stall_per_failure_s, rejoin_stall_s, catchup_s. A stall is the
    time lost: the longest commit-to-commit interval of a surviving replica containing the kill (the rejoin:
    its first quorum) less that replica's step just before it (the median of its LOCAL_GAPS commit gaps before
    the interval: the step at the load of the moment; a run-wide step would count the first steps' warm-up and
    the load's drift). Pure."""
    ev = normalize(events)
    return _per_fault(ev, *_by_incarnation(ev))


def _by_incarnation(ev: list[dict[str, Any]]) -> tuple[dict, dict]:
    """Per (replica, incarnation): its commits as (step, t) in time order, and its first quorum time per step."""
    commits: dict[tuple[str, int], list[tuple[int, float]]] = defaultdict(list)
    quorums: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
    for e in ev:
        key = (e.get("replica_id"), e.get("incarnation", 0))
        if e["event"] == "commit":
            commits[key].append((e["step"], e["t"]))
        elif e["event"] == "quorum":
            quorums[key].setdefault(e["step"], e["t"])
    return commits, quorums


def _stalled(commits: dict, t: float, exclude: str) -> tuple[float, tuple[str, int], int] | None:
    """The stall at time t: (gap, incarnation, i) of the longest commit-to-commit interval cs[i] -> cs[i + 1]
    containing t of a replica other than `exclude` that has commit gaps before it; None without one."""
    around = [(b[1] - a[1], key, i) for key, cs in commits.items() if key[0] != exclude
              for i, (a, b) in enumerate(zip(cs, cs[1:])) if a[1] <= t <= b[1] and i > 0]
    return max(around) if around else None


def _gaps_before(cs: list[tuple[int, float]], i: int) -> list[float]:
    """The (up to) LOCAL_GAPS commit gaps that end at commit cs[i]."""
    window = cs[max(i - LOCAL_GAPS, 0):i + 1]
    return [y[1] - x[1] for x, y in zip(window, window[1:])]


def _per_fault(ev: list[dict[str, Any]], commits: dict, quorums: dict) -> dict[str, list[float]]:
    """per_fault over normalized events and their `_by_incarnation` index (metrics builds it once)."""

    def lost_at(t: float, exclude: str) -> float | None:
        hit = _stalled(commits, t, exclude)
        return None if hit is None else hit[0] - median(_gaps_before(commits[hit[1]], hit[2]))

    out: dict[str, list[float]] = {"detection_s": [], "stall_per_failure_s": [], "rejoin_stall_s": [],
                                   "catchup_s": [e["seconds"] for e in ev if e["event"] == "catchup" and "seconds" in e
                                                 and e.get("incarnation", 0) > 0]}  # a restarted replica's
    for k in (e for e in ev if e["event"] == "kill"):
        rid = k["replica_id"]
        noticed = [e["t"] for e in ev if e["t"] >= k["t"] and e.get("replica_id") != rid
                   and (e["event"] in ("abort", "error")
                        or (e["event"] == "quorum" and rid not in e.get("participants", [rid])))]
        if noticed:
            out["detection_s"].append(min(noticed) - k["t"])
        s = lost_at(k["t"], rid)
        if s is not None:
            out["stall_per_failure_s"].append(s)
    for st in (e for e in ev if e["event"] == "start" and e.get("incarnation", 0) > 0):
        key = (st["replica_id"], st["incarnation"])
        if quorums.get(key):
            s = lost_at(min(quorums[key].values()), st["replica_id"])
            if s is not None:
                out["rejoin_stall_s"].append(s)
    return out


def recoveries(events: Iterable[dict[str, Any]]) -> list[int | None]:
    """Per kill (time order), the steps the job committed (its highest commit step) from the last join before it
    (any replica incarnation's first quorum: the replicas' start, the previous victim's rejoin) to the kill; None
    where the previous kill's replica had not rejoined by then. A kill after fewer than LOCAL_GAPS + 1 such steps
    is measured against a step that still holds the last recovery (`per_fault`'s step before the stall), and its
    stall and detection meet a job that is not in its steady state. Pure."""
    ev = normalize(events)
    joins = sorted({(e.get("replica_id"), e.get("incarnation", 0)): e["t"] for e in reversed(ev)
                    if e["event"] == "quorum"}.items(), key=lambda kv: kv[1])
    commits = [(e["t"], e["step"]) for e in ev if e["event"] == "commit"]

    def step_at(t: float) -> int:
        return max((s for tc, s in commits if tc <= t), default=0)

    kills = [e for e in ev if e["event"] == "kill"]
    out: list[int | None] = []
    for i, k in enumerate(kills):
        prev = kills[i - 1] if i else None
        if prev is not None and not any(rid == prev["replica_id"] and inc > prev.get("incarnation", 0)
                                        and prev["t"] < t < k["t"] for (rid, inc), t in joins):
            out.append(None)
            continue
        last = max((t for _, t in joins if t < k["t"]), default=None)
        out.append(None if last is None else step_at(k["t"]) - step_at(last))
    return out


def recovered(steps: list[int | None]) -> int:
    """How many of `recoveries`' kills found the job recovered: LOCAL_GAPS + 1 steps or more since the last
    join. Pure."""
    return sum(1 for s in steps if s is not None and s > LOCAL_GAPS)


STALL_PHASES = ("commit_to_quorum", "quorum_to_kill", "detection", "vote", "requorum", "more_quorums", "retry_step")


def stall_phases(events: Iterable[dict[str, Any]]) -> list[dict[str, float | None]]:
    """Per kill (time order), where the stalled survivor's interval goes (`per_fault`'s stall: the survivor
    whose commit-to-commit interval containing the kill is longest), cut at its own events: its commit before
    the kill -> its quorum of the step (`commit_to_quorum`; None when the kill came before that quorum) -> the
    kill (`quorum_to_kill`, never negative) -> its first error or abort (`detection`) -> its abort (`vote`) -> its
    next quorum (`requorum`: the bookkeeping, the lighthouse's wait for the membership change, the reply) -> its last
    quorum before the commit (`more_quorums`: retries past the first, 0 with none) -> the commit
    (`retry_step`). A phase whose end event is missing is None and its time goes to the next phase present.
    Also `step`, the median of the LOCAL_GAPS commit gaps before the interval (what the stall subtracts), and
    its parts `step_commit_to_quorum` / `step_quorum_to_commit` (medians over those steps), and `stall`
    (the interval less `step`). Pure."""
    ev = normalize(events)
    commits, _ = _by_incarnation(ev)
    out = []
    for k in (e for e in ev if e["event"] == "kill"):
        hit = _stalled(commits, k["t"], k["replica_id"])
        if hit is None:
            continue
        gap, key, i = hit
        cs = commits[key]
        (_, t_a), (_, t_b) = cs[i], cs[i + 1]
        mine = [e for e in ev if (e.get("replica_id"), e.get("incarnation", 0)) == key and t_a < e["t"] <= t_b]
        quorums = [e["t"] for e in mine if e["event"] == "quorum"]
        q0 = quorums[0] if quorums and quorums[0] <= k["t"] else None
        noticed = next((e["t"] for e in mine if e["t"] >= k["t"] and e["event"] in ("error", "abort")), None)
        abort = next((e["t"] for e in mine if noticed is not None and e["t"] >= noticed and e["event"] == "abort"), None)
        after = [t for t in quorums if t >= (abort if abort is not None else k["t"])]
        marks = [("commit_to_quorum", q0), ("quorum_to_kill", k["t"]), ("detection", noticed), ("vote", abort),
                 ("requorum", after[0] if after else None), ("more_quorums", after[-1] if after else None),
                 ("retry_step", t_b)]
        row: dict[str, float | None] = {}
        last = t_a
        for name, t in marks:
            row[name] = None if t is None else t - last
            last = last if t is None else t
        window = cs[max(i - LOCAL_GAPS, 0):i + 1]
        parts = []  # per step of the window: (its commit -> its next quorum, that quorum -> the next commit)
        for (_, x), (_, y) in zip(window, window[1:]):
            q = next((e["t"] for e in ev if e["event"] == "quorum" and x < e["t"] <= y
                      and (e.get("replica_id"), e.get("incarnation", 0)) == key), None)
            if q is not None:
                parts.append((q - x, y - q))
        row["step"] = median(_gaps_before(cs, i))
        row["step_commit_to_quorum"] = median(a for a, _ in parts) if parts else None
        row["step_quorum_to_commit"] = median(b for _, b in parts) if parts else None
        row["stall"] = gap - row["step"]
        out.append(row)
    return out


STALL_COLUMNS = (*STALL_PHASES, "step", "step_commit_to_quorum", "step_quorum_to_commit", "stall")


def runs_stall_phases(runs: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """`stall_phases` of several runs of one job, their faults pooled: `stall_phase_medians` of every run's rows. Pure."""
    return stall_phase_medians([row for ev in runs for row in stall_phases(ev)])


def stall_phase_medians(rows: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Per column of `stall_phases` rows (of one or more runs), the median over the faults that have it. Pure."""
    return {c: median(xs) if (xs := [r[c] for r in rows if r.get(c) is not None]) else None for c in STALL_COLUMNS}


def metrics(events: Iterable[dict[str, Any]], *, num_replicas: int,
            catchup_s: list[float] | None = None) -> dict[str, float | None]:
    """The fidelity figures (module docstring) of one run: the per-fault ones are medians over the run's
    faults (`per_fault`). Pure."""
    ev = normalize(events)
    commits, quorums = _by_incarnation(ev)
    gaps = [b[1] - a[1] for cs in commits.values() for a, b in zip(cs, cs[1:])]
    step = median(gaps) if gaps else None
    gq = [quorums[key][s] - t for key, cs in commits.items() for s, t in cs if s in quorums.get(key, {})]
    faults = _per_fault(ev, commits, quorums)
    if catchup_s is not None:
        faults["catchup_s"] = list(catchup_s)
    healed = {(e["replica_id"], e.get("incarnation", 0), e["to_step"]) for e in ev if e["event"] == "heal"}
    contributing = sum(1 for (rid, inc), cs in commits.items() for s, _ in cs if (rid, inc, s) not in healed)
    first_q = min((e["t"] for e in ev if e["event"] == "quorum"), default=None)
    last_c = max((t for cs in commits.values() for _, t in cs), default=None)
    effective = None
    if step is not None and first_q is not None and last_c is not None and last_c > first_q:
        effective = contributing * step / (num_replicas * (last_c - first_q))

    def med(xs: list[float]) -> float | None:
        return median(xs) if xs else None

    return {"step_s": step, "get_quorum_s": med(gq), **{name: med(xs) for name, xs in faults.items()},
            "effective_training_time": effective}


def spread(values: dict[str, list[float]]) -> dict[str, dict[str, float | int]]:
    """Per figure, the spread of its per-fault values (n, min, median, max), for a reader to see the noise. Pure."""
    return {name: {"n": len(xs), "min": min(xs), "median": median(xs), "max": max(xs)}
            for name, xs in values.items() if xs}


def phases(events: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """Where a step's time goes, medians over every (replica incarnation, step) of either stream (for
    reading a disagreement, not a fidelity figure): `quorum_to_commit_s` (compute, all-reduce, vote) and
    `commit_to_quorum_s` (after the commit: ledger, loader_state, audit, the next quorum request). Pure."""
    last: dict[tuple, dict[str, float]] = defaultdict(dict)
    q2c: list[float] = []
    c2q: list[float] = []
    for e in normalize(events):
        key = (e.get("replica_id"), e.get("incarnation", 0))
        if e["event"] == "quorum":
            if "commit" in last[key]:
                c2q.append(e["t"] - last[key].pop("commit"))
            last[key]["quorum"] = e["t"]
        elif e["event"] == "commit":
            if "quorum" in last[key]:
                q2c.append(e["t"] - last[key].pop("quorum"))
            last[key]["commit"] = e["t"]
    return {"quorum_to_commit_s": median(q2c) if q2c else None, "commit_to_quorum_s": median(c2q) if c2q else None}


def runs_phases(runs: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """`phases` of several runs of one job: per phase, the median of the runs' medians. Pure."""
    each = [phases(ev) for ev in runs]
    return {name: median(xs) if (xs := [ph[name] for ph in each if ph[name] is not None]) else None
            for name in ("quorum_to_commit_s", "commit_to_quorum_s")}


def rank_phases(runs: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """From the real runs' every-rank phase events (FTRUN_PHASE_EVENTS), medians over all their steps: a rank's
    compute (forward -> exchange), its all-reduce (exchange -> before_commit), the commit vote and the decision
    broadcast's lag (harness.calibrate's pure cuts). For reading, not a fidelity figure. Pure."""
    from harness.calibrate import commit_votes, decision_broadcasts, phase_spans

    cuts = {"compute_s": lambda ev: phase_spans(ev, "forward", "exchange"),
            "all_reduce_s": lambda ev: phase_spans(ev, "exchange", "before_commit"),
            "commit_vote_s": commit_votes, "decision_broadcast_s": decision_broadcasts}
    return {name: median(xs) if (xs := [x for ev in runs for x in cut(ev)]) else None for name, cut in cuts.items()}


def start_offsets(runs: list[list[dict[str, Any]]], replica_ids: list[str]) -> list[float] | None:
    """Per replica (in `replica_ids` order), when its first incarnation's rank 0 was ready, after the first
    replica's (a real launcher starts the rank processes one after another): the median over the runs that
    have every replica's ready event, less the smallest of those medians (the first starts at 0). None when no
    run has them. The emulated job starts each replica that much later (scheduler.first_start_s). Pure."""
    per: dict[str, list[float]] = defaultdict(list)
    for ev in runs:
        ready = {}
        for e in ev:
            if e.get("event") == "ready" and e.get("rank", 0) == 0 and e.get("incarnation", 0) == 0:
                ready.setdefault(e.get("replica_id"), e["t"])
        if all(rid in ready for rid in replica_ids):
            first = min(ready[rid] for rid in replica_ids)
            for rid in replica_ids:
                per[rid].append(ready[rid] - first)
    if not per:
        return None
    medians = [median(per[rid]) for rid in replica_ids]
    return [m - min(medians) for m in medians]


def toy_model_overrides(num_params: int) -> list[str]:
    """[model] keys whose parameter count (harness's dense estimate, fp32) is `num_params` as closely as the
    estimate allows, for an emulated job with the toy LM's gradient and state sizes: one layer of hidden 16
    (3072 parameters besides the embeddings) and 2 x 16 x vocab of embeddings. Pure."""
    vocab = max(1, round((num_params - 3072) / 32))
    return ["model.layers=1", "model.hidden=16", "model.heads=1", "model.kv_heads=0", "model.ffn_hidden=64",
            "model.mlp_matrices=2", f"model.vocab={vocab}", "model.dtype=fp32"]


def repeated(runs: list[list[dict[str, Any]]], *, num_replicas: int,
             catchups: list[list[float]] | None = None) -> tuple[dict[str, float | None], list[dict]]:
    """The figures of several runs of the same job (the real runs of --repeat, the emulated ones of
    --emulated-seeds) and each run's own: the per-fault figures (`per_fault`) are medians over every run's faults
    together, the others (step_s, get_quorum_s, effective_training_time) the median of the runs' figures.
    `catchups`: per run, its catch-up times where its events do not carry them (the emulator's heal spans). Pure."""
    each = [metrics(ev, num_replicas=num_replicas, catchup_s=None if catchups is None else catchups[i])
            for i, ev in enumerate(runs)]
    faults = pooled_faults(runs, catchups)
    out: dict[str, float | None] = {}
    for name in NAMES:
        xs = faults[name] if name in FAULT_NAMES else [m[name] for m in each if m[name] is not None]
        out[name] = median(xs) if xs else None
    return out, each


def pooled_faults(runs: list[list[dict[str, Any]]],
                  catchups: list[list[float]] | None = None) -> dict[str, list[float]]:
    """`per_fault` of several runs, each figure's values of every run together (`catchups` as `repeated`'s). Pure."""
    out: dict[str, list[float]] = {name: [] for name in FAULT_NAMES}
    for i, ev in enumerate(runs):
        for name, xs in per_fault(ev).items():
            out[name].extend(catchups[i] if catchups is not None and name == "catchup_s" else xs)
    return out


def noise(each: list[dict[str, float | None]]) -> dict[str, float | None]:
    """Per figure, the real runs' spread among themselves: the largest |ln(a/b)| over pairs of runs that have
    it (None with fewer than two): how far one real run is from another on this machine now. Pure."""
    out: dict[str, float | None] = {}
    for name in NAMES:
        xs = [m[name] for m in each if m.get(name) is not None and m[name] > 0]
        out[name] = math.log(max(xs) / min(xs)) if len(xs) >= 2 else None
    return out


def side_by_side(real: dict[str, float | None], emulated: dict[str, float | None],
                 real_noise: dict[str, float | None] | None = None) -> dict[str, Any]:
    """`--json`'s shape: metrics [{name, real, emulated, ratio}] and max_abs_log_ratio; with `real_noise`
    (`noise` of repeated real runs), each row's `real_spread` and `inside_noise` (|ln ratio| <= real_spread)
    and the table's `real_vs_real_max_abs_log_ratio`. Pure."""
    rows, logs, spreads = [], [], []
    for name in NAMES:
        r, e = real.get(name), emulated.get(name)
        ratio = e / r if r is not None and e is not None and r > 0 and e > 0 else None
        if ratio is not None:
            logs.append(abs(math.log(ratio)))
        row = {"name": name, "real": r, "emulated": e, "ratio": ratio}
        if real_noise is not None:
            sp = real_noise.get(name)
            spreads += [sp] if sp is not None else []
            row |= {"real_spread": sp,
                    "inside_noise": None if sp is None or ratio is None else abs(math.log(ratio)) <= sp}
        rows.append(row)
    table = {"metrics": rows, "max_abs_log_ratio": max(logs) if logs else None}
    if real_noise is not None:
        table["real_vs_real_max_abs_log_ratio"] = max(spreads) if spreads else None
    return table


# -- the two runs ------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--ranks-per-replica", type=int, default=1)
    p.add_argument("--steps", type=int, default=None,
                   help="steps of the job (default: --kill-step + --kills x --kill-step-interval, so the last kill "
                        "recovers as the others do)")
    p.add_argument("--kill-step", type=int, default=15, help="kill replica r1 once the job committed this step")
    p.add_argument("--kills", type=int, default=KILLS,
                   help="kill r1 this many times, --kill-step-interval steps apart; the per-fault figures are "
                        "medians over them (default %(default)s)")
    # Steps and a fraction of a step, as in the fault grammar's step=S at=F: not `ftrun launch`'s --kill-every
    # (a duration between random kills) or --kill-at (step=N[,replica=ID]), which these flags used to shadow.
    p.add_argument("--kill-step-interval", type=int, default=None, metavar="STEPS",
                   help="steps between one kill's step=S and the next's (default: `spaced_interval` of the "
                        "profile's recovery in its fastest measured step period, so each kill finds the job "
                        "recovered from the last; `recoveries` checks it)")
    p.add_argument("--kill-at-fraction", type=float, default=0.5, metavar="F",
                   help="each kill's at=F: F x a step's compute after r1's commit of step S (default %(default)s)")
    p.add_argument("--slow-fetch-delay", type=float, default=0.2, metavar="SECONDS",
                   help="r1's state fetches are served this much slower (0: no slow fetch) (default %(default)s)")
    p.add_argument("--restart-delay", type=float, default=0.5, help="seconds before the killed replica restarts")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the real job N times: its figures are medians over the runs (the per-fault ones over "
                        "every run's faults) and each figure's real_spread, the runs' largest |ln(a/b)| among "
                        "themselves, says which emulated/real ratios are inside this machine's noise "
                        "(default %(default)s)")
    p.add_argument("--emulated-seeds", type=int, default=EMULATED_SEEDS, metavar="N",
                   help="emulate the job N times, with seeds 0..N-1: its figures pool the runs' faults as the real "
                        "runs' do (one emulated run's random draws, its ranks' late wakes, move its 10-kill stall "
                        "median by up to 1.5x) (default %(default)s)")
    p.add_argument("--profile", default=None, metavar="CALIBRATED.toml",
                   help="a profile from `ftrun calibrate` (default: calibrate now, with the real per-step time of "
                        "ftrun.train.ft_worker as 1 replica x 1 rank)")
    p.add_argument("--quick-calibration", action="store_true",
                   help="calibrate with --quick (its crash figures then come from a child without torch, whose "
                        "teardown is much faster than a rank's)")
    p.add_argument("--restep", action="store_true",
                   help="with --profile: re-measure the script's step, bookkeeping, all-reduce overhead, start "
                        "and a killed process's teardown (peer reset) just before and just after the real run (on a shared "
                        "machine the load moves them most) and emulate with the mean of the two, and the loader_state "
                        "write as the real runs' own writer met it (its phase events; else a write sampled while they ran: the "
                        "disk swings most), the killed rank's teardown as the real runs' kills met it (their trace.json; "
                        "else the re-measured one); keep the rest")
    p.add_argument("--cpu-charging", choices=("on", "off"), default="off",
                   help="charge the emulator's real CPU time to emulated hosts (default off: deterministic)")
    p.add_argument("--out", default=None, help="folder for the real run and the calibrated profile")
    p.add_argument("--json", action="store_true")


def _real(args: argparse.Namespace, out: str) -> tuple[dict, list[dict], dict]:
    cmd = [sys.executable, "-m", "ftrun.cli", "launch", "--replicas", str(args.replicas), "--ranks-per-replica",
           str(args.ranks_per_replica), "--steps", str(total_steps(args)), "--min-replicas", "1",
           "--restart-delay", f"{args.restart_delay}s", *(x for spec in fault_specs(args) for x in ("--inject", spec)),
           "--out", out, "--no-progress", "--json", "-m", "ftrun.train.ft_worker",
           "--chunk-bytes", str(CHUNK_BYTES), "--max-shard-bytes", str(SHARD_BYTES)]
    env = {**os.environ, "FTRUN_PHASE_EVENTS": "1"}  # every rank's phases, for reading where a step goes
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    try:
        figures = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"ftrun fidelity: the real run printed no figures (exit {proc.returncode}): "
                         f"{proc.stderr.strip()[-800:]}") from None
    with open(os.path.join(out, "events.jsonl")) as f:
        events = [json.loads(line) for line in f if line.strip()]
    return figures, events, read_trace(out)


def read_trace(out: str) -> dict:
    """A `ftrun launch --out` folder's trace.json ({} without one)."""
    path = os.path.join(out, "trace.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def check_kills_fit(args: argparse.Namespace) -> None:
    """UsageError unless every kill step is inside the job."""
    if kill_steps(args)[-1] >= total_steps(args):
        raise UsageError(f"every kill step ({kill_steps(args)}: --kill-step + i x --kill-step-interval) must be in "
                         f"1..--steps-1 ({total_steps(args) - 1})")


def total_steps(args: argparse.Namespace) -> int:
    """The job's steps: --steps, else --kill-step + --kills x --kill-step-interval (the last kill has an interval
    to recover in, as the others). Pure."""
    if args.steps is None and args.kill_step_interval is None:
        raise ValueError("total_steps: neither --steps nor --kill-step-interval is set yet")
    return args.steps if args.steps is not None else args.kill_step + args.kills * args.kill_step_interval


def kill_steps(args: argparse.Namespace) -> list[int]:
    """The steps at which r1 is killed: --kills of them from --kill-step, --kill-step-interval apart. Pure."""
    if args.kill_step_interval is None and args.kills > 1:
        raise ValueError("kill_steps: --kill-step-interval is not set yet")
    return [args.kill_step + i * (args.kill_step_interval or 0) for i in range(args.kills)]


def fault_specs(args: argparse.Namespace) -> list[str]:
    """The faults of both runs, in the one fault grammar (`ftrun launch --inject` / `ftrun emulate --inject`)."""
    out = [f"kill replica=1 step={step} at={args.kill_at_fraction:g}" for step in kill_steps(args)]
    if args.slow_fetch_delay > 0:
        out.append(f"slow fetch replica=1 delay={args.slow_fetch_delay:g}")
    return out


def emulated_overrides(args: argparse.Namespace, num_params: int) -> list[str]:
    """The profile keys that make the emulated job the real one: layout, steps, the toy LM's sizes, FTAR
    chunking, timeouts, the restart delay. Pure."""
    k = args.ranks_per_replica
    return ([f"replicas={args.replicas}", f"ranks_per_replica={k}", f"topology.gpus_per_host={k}",
             f"train.steps={total_steps(args)}", "train.min_replicas=1", "failures.mode=none",
             f"scheduler.alloc_delay_warm_s={args.restart_delay}",
             f"ftar.engine.chunk_bytes={CHUNK_BYTES}", f"ftar.engine.num_chunks={NUM_CHUNKS}",
             "checkpoint=none",  # the real worker runs without --checkpoint-every
             "storage.lighthouse_persists=false",  # `ftrun launch`'s lighthouse keeps its state in memory
             f"emulation.cpu_charging={'true' if args.cpu_charging == 'on' else 'false'}"]
            + [f"timeouts.{key}={value}" for key, value in real_timeouts().items()] + toy_model_overrides(num_params))


def _toy_params() -> int:
    from ftrun.train.toy import ToyConfig, make_model

    return sum(p.numel() for p in make_model(ToyConfig()).parameters())


# The keys `ftrun calibrate SCRIPT` sets from the script's own runs, the loader_state write and the crash teardown:
# what the load on a shared machine moves most between a calibration and the real run (re-measured just before
# and after it, with --profile and --restep).
SCRIPT_KEYS = ("train.step_compute_s", "train.step_bookkeeping_s", "ftar.sync_overhead_s", "scheduler.process_start_s",
               "storage.local_write_latency_s", "network.crash_fin_delay_s", "network.replica_collective_pass_s",
               "train.replica_compute_extra_s", "train.rank_start_skew_s", "train.rank_exchange_skew_s",
               "train.rank_cpu_share", "train.rank_cpu_share_ranks", "train.rank_cpu_step_s",
               "train.rank_ring_cpu_s", "train.rank_retry_cpu_s")


def restep_values(profile_path: str, ranks: int, steps: int = 30) -> tuple[dict[str, float], dict[str, float]]:
    """SCRIPT_KEYS measured now (the toy worker as 1 and 2 replicas of `ranks` ranks, as `ftrun calibrate -m
    ftrun.train.ft_worker` does, the loader_state write, a killed process's teardown and an FTAR ring's rebuild with
    the real worker's data-plane settings), the profile's other figures kept; and the figures they were derived from,
    by name."""
    from ftrun.config import FtarConfig
    from harness.calibrate import _script_step
    from harness.calibrate.measure import Figure, ftar_rebuild, storage_write
    from harness.calibrate.procs import process_figures
    from harness.calibrate.provenance import profile_keys
    from harness.profile import load_profile

    p = load_profile(profile_path)
    measured = {v.key.removeprefix("measured."): v for v in (p.calibration.values if p.calibration else ())}
    figures = {f.name: f for f in _script_step("ftrun.train.ft_worker", steps, True, ranks)}
    if "script_writer_write_s" not in figures and "script_write_s" not in figures:  # no write the script met: one now
        figures["storage_write_s"] = storage_write(reps=20)
    figures["ftar_rebuild_cpu_s"] = ftar_rebuild(config=FtarConfig(chunk_bytes=CHUNK_BYTES, num_chunks=NUM_CHUNKS),
                                                 nbytes=4 * _toy_params())
    if "script_peer_reset_s" not in figures:  # the script's killed rank's teardown not seen: an idle child's, now
        figures.update((f.name, f) for f in process_figures(zygote_reps=5, spawn_reps=0) if f.name == "peer_reset_s")
    for name, key in (("storage_append_s", "storage.local_append_latency_s"),
                      ("tcp_one_way_us", "network.base_latency_us"), ("cpu_cores_effective", "train.shared_cpu_cores")):
        v = measured.get(key) or measured.get(name)
        if v is not None:
            figures[name] = Figure(name, v.value, v.unit, v.method, v.samples)
    keys = profile_keys(figures)
    return {key: keys[key][0] for key in SCRIPT_KEYS if key in keys}, {name: f.value for name, f in figures.items()}


def mean_values(before: dict[str, float], after: dict[str, float], keys: tuple[str, ...] = SCRIPT_KEYS,
                scale: float = 1.0) -> dict[str, float]:
    """Each of `keys` measured before or after the real run: the mean of the two (the load the real run met lies
    between them), or the one measured, times `scale` (`real_cpu_speed`'s ratio for CPU_WORK_KEYS: the resteps' CPU
    work at the speed the real runs met), in the order of `keys`. Pure."""
    return {k: scale * (before.get(k, after.get(k)) + after.get(k, before.get(k))) / 2
            for k in keys if k in before or k in after}


def mean_overrides(before: dict[str, float], after: dict[str, float], keys: tuple[str, ...] = SCRIPT_KEYS,
                   scale: float = 1.0) -> list[str]:
    """`mean_values` as profile overrides (KEY=VALUE strings). Pure."""
    return [f"{k}={v!r}" for k, v in mean_values(before, after, keys, scale).items()]


WRITE_KEY = "storage.local_write_latency_s"


def with_override(overrides: list[str], key: str, value: float | None) -> list[str]:
    """`overrides` (KEY=VALUE strings) with `key` set to `value` (replaced where it is there, else added; None:
    unchanged). Pure."""
    if value is None:
        return list(overrides)
    return [o for o in overrides if o.split("=", 1)[0] != key] + [f"{key}={value!r}"]


def real_write(runs: list[list[dict[str, Any]]], sampled: Figure | None) -> Figure | None:
    """The loader_state write the real runs met: their own writer's (`harness.calibrate.writer_writes` over
    every run's phase events, the median, floored at 0), else `sampled` (a write timed in this process while they
    ran). Pure."""
    from harness.calibrate import writer_writes

    writes = [w for ev in runs for w in writer_writes(ev)]
    if not writes:
        return sampled
    return Figure("real_writer_write_s", max(median(writes), 0.0), "s", f"the median over {len(writes)} steps of "
                  "the real runs' writer's after_commit -> next quorum phase less the other replicas'", len(writes))


TEARDOWN_KEY = "network.crash_fin_delay_s"
SKEW_KEYS = ("train.rank_start_skew_s", "train.rank_exchange_skew_s")


def real_skews(runs: list[list[dict[str, Any]]], ranks: int) -> dict[str, Figure]:
    """The ranks' late starts and late wakes from the all-reduce as the real runs met them (SKEW_KEYS, by key), from
    their phase and commit events with `ftrun calibrate`'s own estimators over every run's steps
    (`harness.calibrate.start_skews` / `exchange_skews`), for reading beside the restep's: they grow with the rank
    processes on the CPUs (2.4-2.9 ms at 3 x 1 and 10-13 ms at 4 x 2 where the 2-replica restep runs read 0.1 and
    2.8-3.6 ms), but emulating with them on top of the restep's step and overhead counts the CPU queueing twice
    (the real 3 x 1 step's quorum-to-commit equalled the 2-replica one's: 7.3 against 6.6-7.3 ms; emulated with
    them it came out 1.5-1.7x the real: benchmarks/results/fidelity.md). A key without pairs is left out. Pure."""
    from harness.calibrate import exchange_skews, start_skews
    from harness.calibrate.provenance import median_abs_diff_max_exp

    starts = [x for ev in runs for x in start_skews(ev)]
    left = [x for ev in runs for x in exchange_skews(ev)]
    out = {}
    if starts:
        out[SKEW_KEYS[0]] = Figure("real_start_skew_s", median(starts) / math.log(2), "s", f"the median over "
                                   f"{len(starts)} pairs of the real runs' ranks in a step of |a - b| of their "
                                   "started phases, / ln 2", len(starts))
    if left:
        spread = median_abs_diff_max_exp(ranks)
        out[SKEW_KEYS[1]] = Figure("real_exchange_skew_s", median(left) / spread, "s", f"the median over "
                                   f"{len(left)} pairs of the real runs' replicas in a step of |a - b| of their "
                                   f"commits, / {spread:.4g} (median_abs_diff_max_exp({ranks}))", len(left))
    return out


# The keys that hold a rank's CPU work (its compute, bookkeeping and CPU per step): what a machine's speed scales.
CPU_WORK_KEYS = ("train.step_compute_s", "train.step_bookkeeping_s", "train.replica_compute_extra_s",
                 "train.rank_cpu_step_s", "train.rank_ring_cpu_s", "train.rank_retry_cpu_s")


def real_cpu_speed(runs: list[list[dict[str, Any]]], replicas: int, before: dict[str, float],
                   after: dict[str, float]) -> tuple[float, float] | None:
    """(real, predicted): a rank's CPU seconds per step in the real runs (the median over every run's steps all
    `replicas` replicas trained, `harness.calibrate.cpu_steps`) and what the resteps put it at with that many
    replicas up (the mean of before's and after's, `harness.run.job.rank_cpu_at` of their train.rank_cpu_step_s and
    train.rank_ring_cpu_s, as the emulator takes it). Their ratio is the machine's speed during the real runs against
    the resteps' (plus the ring term's error): for reading a step miss. None without both. Pure."""
    from harness.calibrate import cpu_steps
    from harness.run.job import rank_cpu_at

    cpu = [c for ev in runs for c, _ in cpu_steps(ev, replicas)]
    snaps = [x for x in (before, after) if "train.rank_cpu_step_s" in x]
    if not cpu or not snaps:
        return None
    pred = sum(rank_cpu_at(x["train.rank_cpu_step_s"], x.get("train.rank_ring_cpu_s", 0.0), replicas)
               for x in snaps) / len(snaps)
    return median(cpu), pred


def real_teardown(traces: list[dict]) -> Figure | None:
    """The killed rank's teardown the real runs met: per kill of each run's trace.json, from the kill to its
    lighthouse's loss of the killed replica's connection (`harness.calibrate.teardowns`, what `ftrun calibrate
    SCRIPT` times in 3 kills of its 2-replica run), the median over every run's kills; None without one. One
    kill's teardown varies 2-4x from the next under a shared machine's load (3 kills before and 3 after the real
    runs gave 18.5 and 58.4 ms around real runs whose 8 kills had a median of 26.6: benchmarks/results/fidelity.md),
    so the real runs' own kills are the steadier figure. Pure."""
    from harness.calibrate import teardowns

    down = [x for trace in traces for x in teardowns(trace)]
    if not down:
        return None
    return Figure("real_teardown_s", median(down), "s", f"the median over {len(down)} kills of the real runs of the "
                  "time from the kill to the lighthouse's loss of the killed replica's connection (trace.json)", len(down))


def _recovery_of(profile_path: str, restep: dict[str, float], figures: dict[str, float],
                 args: argparse.Namespace) -> tuple[float, float]:
    """`recovery_inputs` from the profile (its keys and [calibration] figures), the restep's where re-measured."""
    from harness.profile import _to_dict, load_profile

    p = load_profile(profile_path)
    flat: dict[str, float] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                flat[f"{prefix}{k}"] = float(v)

    walk(_to_dict(p), "")
    measured = {v.key.removeprefix("measured."): v.value for v in (p.calibration.values if p.calibration else ())}
    return recovery_inputs({**flat, **restep}, {**measured, **figures}, args)


def _emulated(args: argparse.Namespace, profile_path: str, extra: list[str] = (),
              seed: int = 0) -> tuple[dict, list[dict], list[float]]:
    from harness.cli import execute
    from harness.profile import apply_overrides, load_profile
    from harness.run import JobOptions
    from harness.run.options import parse_inject, split_faults

    base = load_profile(profile_path)
    p = apply_overrides(base, [*emulated_overrides(args, _toy_params()), *extra])
    kills, others = split_faults([parse_inject(spec) for spec in fault_specs(args)])
    f, job = execute(p, JobOptions(steps=total_steps(args), kills=kills, faults=others, seed=seed))
    heals = [b - a for _, number, name, a, b in (job.recorder.spans or [])
             if name == "ftrun::catchup::heal" and number > 0]  # a restarted replica's (per_fault's catchup_s)
    return f, job.recorder.events, heals


def emulated_runs(args: argparse.Namespace, profile_path: str, extra: list[str] = (),
                  seeds: int = EMULATED_SEEDS) -> list[tuple[dict, list[dict], list[float]]]:
    """`_emulated` with seeds 0..seeds-1, each run's (figures, events, heals), with progress on stderr."""
    out = []
    for seed in range(seeds):
        print(f"ftrun fidelity: emulated run {seed + 1} of {seeds} ...", file=sys.stderr, flush=True)
        out.append(_emulated(args, profile_path, extra, seed=seed))
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def run(args: argparse.Namespace) -> int:
    if args.replicas < 2 or args.ranks_per_replica < 1:
        raise UsageError(f"--replicas must be >= 2 and --ranks-per-replica >= 1, got {args.replicas}, "
                         f"{args.ranks_per_replica}")
    if args.kills < 1 or (args.kill_step_interval is not None and args.kill_step_interval < 1):
        raise UsageError(f"--kills and --kill-step-interval must be >= 1, got {args.kills}, {args.kill_step_interval}")
    if args.kill_step < 1:
        raise UsageError(f"--kill-step must be >= 1, got {args.kill_step}")
    if args.kill_step_interval is not None:
        check_kills_fit(args)
    if not 0 <= args.kill_at_fraction < 1:
        raise UsageError(f"--kill-at-fraction must be in [0, 1), got {args.kill_at_fraction}")
    if args.slow_fetch_delay < 0:
        raise UsageError(f"--slow-fetch-delay must be >= 0, got {args.slow_fetch_delay}")
    if args.restart_delay < 0:
        raise UsageError(f"--restart-delay must be >= 0, got {args.restart_delay}")
    if args.repeat < 1:
        raise UsageError(f"--repeat must be >= 1, got {args.repeat}")
    if args.emulated_seeds < 1:
        raise UsageError(f"--emulated-seeds must be >= 1, got {args.emulated_seeds}")
    if args.profile is not None and not os.path.isfile(args.profile):
        raise UsageError(f"--profile {args.profile!r} is not a file")  # before a temp folder is made for the run
    out = args.out or tempfile.mkdtemp(prefix="ftrun-fidelity-")
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    profile = args.profile
    if profile is None:
        profile = os.path.join(out, "calibrated.toml")
        cmd = [sys.executable, "-m", "ftrun.cli", "calibrate", "-m", "ftrun.train.ft_worker", "--out", profile,
               "--script-ranks", str(args.ranks_per_replica)]
        cmd += ["--quick"] if args.quick_calibration else []
        print(f"ftrun fidelity: calibrating ({' '.join(cmd[3:])}) ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"ftrun fidelity: calibration failed: {proc.stderr.strip()[-800:]}")
    restep: list[str] = []
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    figures_before: dict[str, float] = {}
    figures_after: dict[str, float] = {}
    if args.profile is not None and args.restep:
        print("ftrun fidelity: re-measuring the script's step (1 and 2 replicas) ...", file=sys.stderr, flush=True)
        before, figures_before = restep_values(profile, args.ranks_per_replica)
    if args.kill_step_interval is None:
        args.kill_step_interval = spaced_interval(*_recovery_of(profile, before, figures_before, args))
        print(f"ftrun fidelity: kills {args.kill_step_interval} steps apart ({total_steps(args)} steps)",
              file=sys.stderr, flush=True)
        check_kills_fit(args)
    reals = []
    sampler = WriteSampler().start() if before else None  # the loader_state write while the real runs run
    try:
        for i in range(args.repeat):
            print(f"ftrun fidelity: real run {i + 1} of {args.repeat} (ftrun launch) ...", file=sys.stderr, flush=True)
            reals.append(_real(args, os.path.join(out, "real" if i == 0 else f"real-{i + 1}")))
    finally:
        if sampler is not None:
            sampler.stop()
    real_complete = all(f.get("complete") for f, _, _ in reals)
    real_evs = [ev for _, ev, _ in reals]
    sampled = sampler.figure() if sampler is not None else None
    write = real_write(real_evs, sampled)
    teardown = real_teardown([trace for _, _, trace in reals])
    skews = real_skews(real_evs, args.ranks_per_replica)
    if before:
        print("ftrun fidelity: re-measuring the script's step after the real run ...", file=sys.stderr, flush=True)
        after, figures_after = restep_values(profile, args.ranks_per_replica)
        restep = with_override(mean_overrides(before, after), WRITE_KEY, write.value if write is not None else None)
        restep = with_override(restep, TEARDOWN_KEY, teardown.value if teardown is not None else None)
    offsets = start_offsets(real_evs, replica_ids(args.replicas))
    starts = [] if offsets is None else [f"scheduler.first_start_s={offsets!r}"]
    emus = emulated_runs(args, profile, [*restep, *starts], args.emulated_seeds)
    for i, (_, ev, _) in enumerate(emus):
        folder = os.path.join(out, "emulated" if i == 0 else f"emulated-{i + 1}")
        os.makedirs(folder, exist_ok=True)  # beside real/events.jsonl, for reading a miss
        with open(os.path.join(folder, "events.jsonl"), "w") as f:
            f.writelines(json.dumps(e, default=str) + "\n" for e in ev)
    emu_complete = all(f.get("complete") for f, _, _ in emus)
    emu_evs, heals = [ev for _, ev, _ in emus], [h for _, _, h in emus]
    real, real_each = repeated(real_evs, num_replicas=args.replicas)
    emulated, emu_each = repeated(emu_evs, num_replicas=args.replicas, catchups=heals)
    real_spread, emu_spread = spread(pooled_faults(real_evs)), spread(pooled_faults(emu_evs, heals))
    table = side_by_side(real, emulated, noise(real_each) if args.repeat > 1 else None)
    print(f"ftrun fidelity: {args.replicas} replicas x {args.ranks_per_replica} ranks, {total_steps(args)} steps, "
          f"faults {'; '.join(fault_specs(args))}, restart after {args.restart_delay} s; profile {profile}; "
          f"real runs: {args.repeat}, emulated runs: {args.emulated_seeds}")
    print(f"  {'metric':<24} {'real':>12} {'emulated':>12} {'emu/real':>9}"
          + (f" {'|ln|':>6} {'real-vs-real |ln|':>18}" if args.repeat > 1 else ""))
    for row in table["metrics"]:
        cells = [("-" if row[k] is None else f"{row[k]:.4g}") for k in ("real", "emulated", "ratio")]
        line = f"  {row['name']:<24} {cells[0]:>12} {cells[1]:>12} {cells[2]:>9}"
        if "real_spread" in row:
            ln = "-" if row["ratio"] is None else f"{abs(math.log(row['ratio'])):.3f}"
            sp = "-" if row["real_spread"] is None else f"{row['real_spread']:.3f}"
            line += f" {ln:>6} {sp:>18}" + (" (inside)" if row["inside_noise"] else "")
        print(line)
    real_ph, emu_ph = runs_phases(real_evs), runs_phases(emu_evs)
    rank_ph = rank_phases(real_evs)
    for name in real_ph:
        cells = [("-" if v is None else f"{v:.4g}") for v in (real_ph[name], emu_ph[name])]
        print(f"  ({name:<22} {cells[0]:>12} {cells[1]:>12})")
    print("  (real ranks' phases, ms, medians: " + "; ".join(f"{k} {_ms(v)}" for k, v in rank_ph.items()) + ")")
    for name, sp in real_spread.items():
        print(f"  (real {name:<19} over {sp['n']} faults: {sp['min']:.4g} .. {sp['max']:.4g})")
    stall_ph = {"real": runs_stall_phases(real_evs), "emulated": runs_stall_phases(emu_evs)}
    print("  (where a failure's stall goes, ms, medians over the faults: "
          + "; ".join(f"{c} {_ms(stall_ph['real'][c])} / {_ms(stall_ph['emulated'][c])}" for c in STALL_COLUMNS)
          + " (real / emulated))")
    recs = {"real": [recoveries(ev) for ev in real_evs], "emulated": [recoveries(ev) for ev in emu_evs]}
    print(f"  (steps from the last join to each kill, real runs / emulated: {recs['real']} / {recs['emulated'][0]}"
          f"{' ...' if len(emu_evs) > 1 else ''}; {sum(recovered(r) for r in recs['real'])} of "
          f"{sum(len(r) for r in recs['real'])} real kills and {sum(recovered(r) for r in recs['emulated'])} of "
          f"{sum(len(r) for r in recs['emulated'])} emulated found the job recovered, more than {LOCAL_GAPS} steps)")
    if offsets is not None:
        print(f"  (first start of each replica, median of the real runs: {', '.join(f'{o:.3f}' for o in offsets)} s)")
    for key in before:
        print(f"  (restep {key:<34} before {before[key]:.4g}, after {after.get(key, float('nan')):.4g})")
    if write is not None:
        print(f"  (restep {WRITE_KEY:<34} emulated with {write.value:.4g}: {write.method})")
    if before and teardown is not None:
        print(f"  (restep {TEARDOWN_KEY:<34} emulated with {teardown.value:.4g}: {teardown.method})")
    speed = real_cpu_speed(real_evs, args.replicas, before, after) if before else None
    if speed is not None:
        print(f"  (real runs' CPU per rank-step         {speed[0]:.4g}, the resteps' {speed[1]:.4g} with {args.replicas} "
              f"replicas: x{speed[0] / speed[1]:.3f}; `benchmarks/fidelity_ab.py --speed-from-real` emulates at it)")
    for key, f in skews.items():  # for reading: the restep's are what the emulator takes (real_skews says why)
        print(f"  (real runs' {key:<29} {f.value:.4g}: {f.method})")
    mx, noise_mx = table["max_abs_log_ratio"], table.get("real_vs_real_max_abs_log_ratio")
    print(f"  max |ln(emulated/real)| = {'-' if mx is None else format(mx, '.3f')}"
          + (f", real vs real {'-' if noise_mx is None else format(noise_mx, '.3f')}" if args.repeat > 1 else "")
          + f"; real complete: {real_complete}, emulated complete: {emu_complete}; "
          f"wall {time.monotonic() - started:.1f} s")
    if args.json:
        emit_json({**table, "replicas": args.replicas, "ranks_per_replica": args.ranks_per_replica,
                   "steps": total_steps(args), "kill_step_interval": args.kill_step_interval, "profile": profile,
                   "out": out, "real_complete": real_complete,
                   "emulated_complete": emu_complete, "repeat": args.repeat, "real_runs": real_each,
                   "emulated_seeds": args.emulated_seeds, "emulated_runs": emu_each,
                   "phases": {"real": real_ph, "emulated": emu_ph}, "real_rank_phases": rank_ph, "stall_phases": stall_ph, "restep": restep,
                   "restep_before": before, "restep_after": after,
                   "restep_figures": {"before": figures_before, "after": figures_after}, "first_start_s": offsets,
                   "write_during_real_s": None if write is None else write.value,
                   "write_sampled_s": None if sampled is None else sampled.value,
                   "teardown_during_real_s": None if teardown is None else teardown.value,
                   "real_skews_s": {key: f.value for key, f in skews.items()}, "recoveries": recs,
                   "cpu_per_rank_step_s": None if speed is None else {"real": speed[0], "restep": speed[1]},
                   "spread": {"real": real_spread, "emulated": emu_spread}, "kills": args.kills, "wall_s": round(time.monotonic() - started, 3)})
    return 0 if real_complete and emu_complete else 1
