"""The emulated job's report: figures from the recorder (pure), the text summary, and the JSON figures.

Definitions (all modeled, i.e. virtual, seconds):
- get_quorum latency, per quorum round (quorum_id, step): from the last participating leader's request
  to the lighthouse until the last rank of every participating replica holds the decision (the decision
  broadcast down each replica's tree included). p50 / p99 over rounds; also p99 over the rounds that did
  not wait out the join timeout for a live replica that had not asked (a restarted one still in its
  first step, say), which measure the protocol rather than the wait. Also given: the leaders' round
  trip (ask -> decision, which includes waiting for the other replicas) and every rank's start_step time.
- normal step: the median time between consecutive commits of one replica incarnation.
- stall per failure: the longest commit-to-commit interval of a surviving replica that contains the
  kill, minus a normal step (retraining the lost step and detection, plus any quorum wait); detection:
  from the kill to the lighthouse marking the replica lost.
- rejoin stall: the same for the interval that contains the quorum in which the restarted replica
  rejoined (behind); rejoin time: from its processes starting to its first commit.
- effective training time: committed contributing replica-steps x normal step, over replicas x the time
  from the first quorum to the last commit (1.0: every replica trained all the time at full speed).
- where the time went: the replica leaders' time in each phase span, as fractions ("heal" includes the
  step a caught-up replica spends waiting to contribute its zero gradient).
- replicas_consistent / quorum_history_consistent: harness.run.consistency's checks (each live replica
  of the last quorum ends at the final step with the same history digest; no step committed with two
  histories; quorum ids monotonic, one participant set per id, across lighthouse restarts).
"""

from __future__ import annotations

from collections import defaultdict
from statistics import median
from typing import Any

from harness.profile import Profile
from harness.run.consistency import check_quorum_history, check_replicas
from harness.run.record import Recorder

PHASES = {"ftrun::train::forward_backward": "compute", "ftrun::replica::start_step": "quorum",
          "ftrun::ftar::all_reduce": "ftar", "ftrun::replica::should_commit": "commit",
          "ftrun::catchup::heal": "heal", "ftrun::catchup::zero_grad_step": "heal"}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 3)


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


class _Commits:
    """Commit times per replica incarnation, and which replicas committed (and healed) each step."""

    def __init__(self, events: list[dict[str, Any]], fallback_step_s: float) -> None:
        self.commits = [e for e in events if e["event"] == "commit"]
        self.by_inc: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.by_step: dict[int, set[str]] = defaultdict(set)
        for e in self.commits:
            self.by_inc[(e["replica_id"], e["incarnation"])].append(e["t"])
            self.by_step[e["step"] - 1].add(e["replica_id"])
        self.healed = {(e["replica_id"], e["to_step"]) for e in events if e["event"] == "heal"}
        gaps = [b - a for ts in self.by_inc.values() for a, b in zip(ts, ts[1:])]
        self.normal = median(gaps) if gaps else fallback_step_s

    def extension_at(self, t: float, exclude: str) -> float | None:
        """How much longer than normal the other replicas' step around time t was (the longest)."""
        around = [b - a for (rid, _), ts in self.by_inc.items() if rid != exclude
                  for a, b in zip(ts, ts[1:]) if a <= t <= b]
        return max(around) - self.normal if around else None


def _failures(ev: list[dict[str, Any]], c: _Commits) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"stalls": [], "detections": [], "rejoins": [], "rejoin_stalls": []}
    for k in (e for e in ev if e["event"] == "kill"):
        s = c.extension_at(k["t"], k["replica_id"])
        if s is not None:
            out["stalls"].append(s)
        lost = [e["t"] for e in ev if e["event"] == "lighthouse_member_lost" and e["t"] >= k["t"]
                and e.get("replica_id") == k["replica_id"]]
        if lost:
            out["detections"].append(min(lost) - k["t"])
    for st in (e for e in ev if e["event"] == "start" and e["incarnation"] > 0):
        key = (st["replica_id"], st["incarnation"])
        if c.by_inc.get(key):
            out["rejoins"].append(c.by_inc[key][0] - st["t"])
        # its first two quorums: the step it heals in (a zero gradient) and its first computing step, where
        # a first-step effect not warmed up before check-in (paper §5) lands
        joined = [e["t"] for e in ev if e["event"] == "quorum" and (e["replica_id"], e["incarnation"]) == key]
        stalls = [s for t in joined[:2] if (s := c.extension_at(t, st["replica_id"])) is not None]
        if stalls:
            out["rejoin_stalls"].append(max(stalls))
    return out


def _time_split(rec: Recorder) -> dict[str, float | None]:
    phase: dict[str, float] = defaultdict(float)
    for name, seconds in rec.phase_s.items():
        phase[PHASES.get(name, name)] += seconds
    phase["quorum"] -= rec.phase_s.get("ftrun::catchup::heal", 0.0)  # catch-up runs inside start_step
    total = sum(phase.values()) or 1.0
    return {k: _r(v / total, 4) for k, v in sorted(phase.items())}


def figures(rec: Recorder, *, profile: Profile, steps: int, folded: bool, kills: list[str],
            comm: str = "tree") -> dict[str, Any]:
    """Every figure of the report, JSON-ready and deterministic for a deterministic run."""
    ev = rec.events
    c = _Commits(ev, profile.train.step_compute_s)
    fail = _failures(ev, c)
    steps_done = sorted(s for s in c.by_step if s < steps)
    contributing = sum(1 for s in steps_done for rid in c.by_step[s] if (rid, s + 1) not in c.healed)
    quorum_times = [e["t"] for e in ev if e["event"] == "quorum"]
    span = (max(e["t"] for e in c.commits) - min(quorum_times)) if c.commits and quorum_times else 0.0
    by_round = rec.round_latency_by_key()
    waited = {(e["quorum_id"], e["max_step"]) for e in ev
              if e["event"] == "lighthouse_quorum" and e.get("reason", "").startswith("join timeout")}
    rounds, rtt, starts = list(by_round.values()), list(rec.leader_rtt_s), list(rec.start_step_s)
    prompt = [v for k, v in by_round.items() if k not in waited]
    worst = lambda xs: _r(max(xs)) if xs else None  # noqa: E731
    leads = min(profile.topology.gpus_per_host, profile.ranks_per_replica)
    return {
        "profile": profile.name, "ranks": profile.num_ranks, "replicas": profile.replicas,
        "ranks_per_replica": profile.ranks_per_replica, "steps": steps, "complete": len(steps_done) >= steps,
        "steps_done": len(steps_done),  # steps the job committed (by any replica)
        "steps_committed": {rid: sum(1 for s in steps_done if rid in c.by_step[s])  # per replica
                            for rid in sorted({e["replica_id"] for e in c.commits})},
        "participants_per_step": [len(c.by_step[s]) for s in steps_done],
        "get_quorum_p50_ms": _ms(_pct(rounds, 0.5)), "get_quorum_p99_ms": _ms(_pct(rounds, 0.99)),
        "get_quorum_max_ms": _ms(max(rounds) if rounds else None), "quorum_rounds": len(rounds),
        "get_quorum_no_wait_p99_ms": _ms(_pct(prompt, 0.99)), "quorum_rounds_waited": len(rounds) - len(prompt),
        "leader_quorum_rtt_p50_ms": _ms(_pct(rtt, 0.5)), "leader_quorum_rtt_p99_ms": _ms(_pct(rtt, 0.99)),
        "start_step_p50_ms": _ms(_pct(starts, 0.5)), "start_step_p99_ms": _ms(_pct(starts, 0.99)),
        "step_time_s": _r(c.normal), "kills": len(kills), "injected": kills, "num_failures": len(fail["stalls"]),
        "stall_per_failure_s": worst(fail["stalls"]), "stalls_s": [_r(s) for s in fail["stalls"]],
        "detection_s": worst(fail["detections"]), "rejoin_s": worst(fail["rejoins"]),
        "rejoin_stall_s": worst(fail["rejoin_stalls"]),
        "effective_training_time": _r(contributing * c.normal / (profile.replicas * span), 4) if span > 0 else 0.0,
        "time_split": _time_split(rec),
        "modeled_s": _r(max((e["t"] for e in ev), default=0.0)),
        "ftar": (f"folded: the real FTAR engine runs the rings of each replica's first host ({leads} of "
                 f"{profile.ranks_per_replica} rings); every other ring is identical and mirrors one of them"
                 if folded else f"full: every ring runs ({profile.ranks_per_replica} rings)"),
        "replica_comm": comm, "unexpected_errors": list(rec.errors[:20]),
        **_consistency(ev),
    }


def _consistency(ev: list[dict[str, Any]]) -> dict[str, Any]:
    r, q = check_replicas(ev), check_quorum_history(ev)
    return {"replicas_consistent": r.consistent, "quorum_history_consistent": q.consistent,
            "consistency": {"final_step": r.final_step, "final_digest": r.final_digest,
                            "live_replicas": r.live_replicas, "quorums": q.num_quorums,
                            "lighthouse_starts": q.num_lighthouses, "violations": r.violations + q.violations}}


def succeeded(f: dict[str, Any]) -> bool:
    """An emulated job's figures say it succeeded: complete, no unexpected error, replicas and quorum
    history consistent (the exit status of `ftrun emulate`)."""
    return (bool(f["complete"]) and not f["unexpected_errors"] and bool(f["replicas_consistent"])
            and bool(f["quorum_history_consistent"]))


def text(f: dict[str, Any]) -> str:
    """The human-readable report."""
    def s(x: Any, unit: str = " s") -> str:
        return "n/a" if x is None else f"{x:.3f}{unit}"

    lines = [
        f"ftrun emulate {f['profile']}: {f['replicas']} replicas x {f['ranks_per_replica']} ranks = "
        f"{f['ranks']} emulated ranks, {f['steps']} steps; {f['kills']} failure(s) injected"
        + (f" ({'; '.join(f['injected'])})" if f["injected"] else ""),
        "  real for every rank run: the FaultTolerantTrainer (lighthouse quorum, Manager check-in / decision broadcast "
        f"/ 2PC commit vote over {f['replica_comm']} comm, failure detection, rejoin as behind, catch-up fetch "
        "protocol, data ledger and audit, checkpoint writer election, LR intervention)",
        f"  FTAR {f['ftar']}",
        "  modeled: compute (meta-tensor shapes, profile step time), kernels (shape-only), catch-up and "
        "checkpoint bytes (ShapeOnly frames, mock object store), process start and host allocation (mock scheduler)",
        f"  steps committed: {f['steps_done']} of {f['steps']}; per replica {f['steps_committed']}",
        f"  participants per step: {f['participants_per_step']}",
        f"  get_quorum p50 {s(f['get_quorum_p50_ms'], ' ms')}, p99 {s(f['get_quorum_p99_ms'], ' ms')} "
        f"over {f['quorum_rounds']} rounds (last ask -> every rank has the decision; p99 {s(f['get_quorum_no_wait_p99_ms'], ' ms')}"
        f" without the {f['quorum_rounds_waited']} round(s) that waited out the join timeout); leader round trip p50 "
        f"{s(f['leader_quorum_rtt_p50_ms'], ' ms')}; start_step across ranks p50 {s(f['start_step_p50_ms'], ' ms')}"
        f" p99 {s(f['start_step_p99_ms'], ' ms')}",
        f"  step {s(f['step_time_s'])}; stall per failure {s(f['stall_per_failure_s'])} (detected in "
        f"{s(f['detection_s'])}); rejoin {s(f['rejoin_s'])} after restart, stalling the others "
        f"{s(f['rejoin_stall_s'])}",
        f"  effective training time {100 * f['effective_training_time']:.1f}%; where the leaders' time went: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in f["time_split"].items()),
    ]
    if f.get("ranks_mirrored_per_replica"):
        lines.insert(3, f"  ranks folded: {f['folding']}")
    if "audit_batches" in f:
        lines.append(f"  data: {f['audit_summary']}; {f['duplicate_batches']} duplicated, {f['skipped_batches']} "
                     f"skipped; catch-up {f['catchup_bytes'] / 1e6:.1f} MB in {f['catchup_fetches']} fetch(es) from up "
                     f"to {f['catchup_sources']} sources; {f['checkpoints_committed']} checkpoint(s) committed")
    if "wall_s" in f:
        lines.append(f"  modeled {f['modeled_s']:.2f} s in {f['wall_s']:.1f} s wall ({f.get('cpu_s', 0):.1f} s CPU), "
                     f"peak RSS {f['peak_rss_mb']:.0f} MB"
                     f"; {'complete' if f['complete'] else 'INCOMPLETE'}")
    c = f["consistency"]
    lines.append(f"  state: {'identical' if f['replicas_consistent'] else 'INCONSISTENT'} across the "
                 f"{len(c['live_replicas'])} live replicas at step {c['final_step']} (history digest "
                 f"{c['final_digest']}); quorum history {'consistent' if f['quorum_history_consistent'] else 'INCONSISTENT'}"
                 f" ({c['quorums']} quorum ids, {c['lighthouse_starts']} lighthouse start(s))")
    for v in c["violations"][:5]:
        lines.append(f"    ! {v}")
    if f["unexpected_errors"]:
        lines.append(f"  UNEXPECTED ERRORS ({len(f['unexpected_errors'])}): " + "; ".join(f["unexpected_errors"][:3]))
    return "\n".join(lines)
