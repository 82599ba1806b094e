"""The FT-HSDP paper's own stall table (seeds/ft-hsdp-paper.txt §4.1, §5, §6.1), computed from an emulated
job's events and set beside what the paper expects. Pure: events in, figures out (benchmarks/paper_table.py
runs the emulated scenarios).

What the paper expects (§6.1, after its two fixes):
- stall per failure ~1.5 min: the 60 s timeout that detects the failure, a few seconds to rebuild FTAR,
  ~20 s to re-train the failed step;
- a restarted replica's first step: ~100 s of whole-job stall (less than the ~200 s first step of Fig. 2,
  thanks to the §5 warm-up before check-in);
- effective training time ~80% at one failure every 18 minutes (12 replicas, 10 min repair).

Parts of one failure at time t_f of replica v, from the survivors' events (replicas other than v):
- detection_s: t_f -> the first survivor error or abort (its all-reduce gives up on v), or, when the
  failure fell between steps and nothing aborted, the lighthouse's verdict on v;
- rebuild_s: that moment -> the survivors' next quorum decision (the membership without v, the ring rebuilt);
- retrain_s: that quorum -> the survivors' next commit (the failed step trained again);
- stall_s = detection + rebuild + retrain: the failure until the job trains past the failed step again
  (the paper's "detect and handle the failure and re-train the failed step");
- verdict_s: t_f -> the lighthouse marking v lost (a crash: at once; a silent loss: its heartbeat timeout);
  detection can be later than the verdict when the survivors are still computing (they abort as they enter
  the all-reduce);
- extension_s: the longest survivor commit-to-commit interval that contains t_f, minus a normal step
  (harness.report's "stall per failure": work lost beyond one normal step).
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Any

from harness.analysis.sim.availability import AvailabilityInputs, ft_hsdp_effective_training_time

PAPER = {  # seeds/ft-hsdp-paper.txt
    "detection_s": 60.0,        # §4.1 / §6.1: "60-second timeout to detect the failure"
    "rebuild_s": 5.0,           # §6.1: "a few seconds to re-build FTAR"
    "retrain_s": 20.0,          # §6.1: "about 20 seconds to re-train a step"
    "stall_s": 90.0,            # §6.1: "the stall time should be around 1.5 minutes"
    "first_step_no_warmup_s": 200.0,  # §6.1 / Fig. 2: "the about 200-second first-step time"
    "first_step_s": 100.0,      # §6.1: "rejoining introduces about 100 seconds of stalling"
    "effective_training_time": 0.80,  # §6.1: (8 + 7 x 11/12) / 18
}
FAILURE_INTERVAL_S = 18 * 60.0  # §3 / §6.1: a failure every 18 minutes at 100K GPUs
REPAIR_S = 10 * 60.0            # §6.1: "fully repairing a replica still takes 10 minutes"


@dataclass(frozen=True)
class FailureParts:
    detection_s: float
    rebuild_s: float
    retrain_s: float
    extension_s: float | None
    detected_by: str  # "abort" (a survivor's all-reduce gave up) or "lighthouse"
    verdict_s: float | None  # t_f -> the lighthouse marking the replica lost (None: it never did)

    @property
    def stall_s(self) -> float:
        return self.detection_s + self.rebuild_s + self.retrain_s

    def as_dict(self) -> dict[str, Any]:
        return {"stall_s": round(self.stall_s, 3), "detection_s": round(self.detection_s, 3),
                "rebuild_s": round(self.rebuild_s, 3), "retrain_s": round(self.retrain_s, 3),
                "extension_s": None if self.extension_s is None else round(self.extension_s, 3),
                "detected_by": self.detected_by,
                "verdict_s": None if self.verdict_s is None else round(self.verdict_s, 3)}


def _survivor(e: dict, victim: str) -> bool:
    return e.get("replica_id") not in (None, victim)


def normal_step_s(events: list[dict]) -> float:
    """Median commit-to-commit interval of one replica incarnation (ValueError when none)."""
    by_inc: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e["event"] == "commit":
            by_inc.setdefault((e["replica_id"], e.get("incarnation", 0)), []).append(e["t"])
    gaps = [b - a for ts in by_inc.values() for a, b in zip(ts, ts[1:])]
    if not gaps:
        raise ValueError("no two consecutive commits of one replica: the job trained too few steps")
    return median(gaps)


def extension_s(events: list[dict], t: float, victim: str) -> float | None:
    """The longest survivor commit-to-commit interval containing t, minus a normal step (None if none)."""
    by_inc: dict[tuple[str, int], list[float]] = {}
    for e in events:
        if e["event"] == "commit" and _survivor(e, victim):
            by_inc.setdefault((e["replica_id"], e.get("incarnation", 0)), []).append(e["t"])
    around = [b - a for ts in by_inc.values() for a, b in zip(ts, ts[1:]) if a <= t <= b]
    return max(around) - normal_step_s(events) if around else None


def failure_time(events: list[dict], victim: str) -> float:
    """When replica `victim` failed: its injected kill, or the fault event that names it (a cut or hang)."""
    for e in events:
        if e["event"] == "kill" and e.get("replica_id") == victim:
            return e["t"]
        number = victim.lstrip("r")
        if e["event"] == "fault" and f"replica={int(number)}" in e.get("fault", "").split() \
                and not e["fault"].startswith("release"):
            return e["t"]
    raise ValueError(f"no kill or fault of replica {victim} among the events")


def failure_parts(events: list[dict], victim: str) -> FailureParts:
    """Detection, rebuild and retrain of the failure of `victim` (see the module doc). ValueError when the
    survivors never trained past it."""
    t_f = failure_time(events, victim)
    after = sorted((e for e in events if e["t"] >= t_f), key=lambda e: e["t"])
    aborts = [e["t"] for e in after if e["event"] in ("abort", "error") and _survivor(e, victim)]
    verdict = [e["t"] for e in after if e["event"] == "lighthouse_member_lost"
               and e.get("replica_id") == victim]
    if aborts:
        t_d, by = aborts[0], "abort"
    elif verdict:
        t_d, by = verdict[0], "lighthouse"
    else:
        t_d, by = t_f, "lighthouse"  # nothing waited on it: the next quorum simply left it out
    quorums = [e["t"] for e in after if e["event"] == "quorum" and _survivor(e, victim) and e["t"] >= t_d]
    if not quorums:
        raise ValueError(f"the survivors of {victim}'s failure never decided a quorum after it")
    commits = [e["t"] for e in after if e["event"] == "commit" and _survivor(e, victim) and e["t"] >= quorums[0]]
    if not commits:
        raise ValueError(f"the survivors of {victim}'s failure never committed after it")
    return FailureParts(detection_s=t_d - t_f, rebuild_s=quorums[0] - t_d, retrain_s=commits[0] - quorums[0],
                        extension_s=extension_s(events, t_f, victim), detected_by=by,
                        verdict_s=verdict[0] - t_f if verdict else None)


def diagnosis_times(events: list[dict], victim: str, replica: int) -> dict[str, float | None]:
    """After the failure of `victim` (replica index `replica`): seconds until the first root-cause verdict that
    names it, and until the first that recommends evicting it (None: none did)."""
    t_f = failure_time(events, victim)
    verdicts = [e for e in events if e["event"] == "diagnosis" and e["t"] >= t_f]
    named = [e["t"] - t_f for e in verdicts if replica in e.get("replicas", ())]
    evict = [e["t"] - t_f for e in verdicts if replica in e.get("eviction", ())]
    return {"verdict_s": round(named[0], 3) if named else None, "eviction_s": round(evict[0], 3) if evict else None}


def effective_training_time(stall_per_failure_s: float, rejoin_stall_s: float, num_replicas: int = 12) -> float:
    """ETT from harness.analysis.sim.availability at the paper's failure interval and repair time."""
    return ft_hsdp_effective_training_time(AvailabilityInputs(
        failure_interval_s=FAILURE_INTERVAL_S, repair_s=REPAIR_S, num_replicas=num_replicas,
        stall_per_failure_s=stall_per_failure_s, rejoin_stall_s=rejoin_stall_s))


ROWS = (  # (key, label, paper key)
    ("stall_s", "stall per failure (failure -> failed step re-trained)", "stall_s"),
    ("detection_s", "  detection", "detection_s"),
    ("rebuild_s", "  rebuild (abort -> next quorum, FTAR ring)", "rebuild_s"),
    ("retrain_s", "  re-train the step", "retrain_s"),
    ("verdict_s", "  (lighthouse marks the replica lost)", None),
    ("extension_s", "  work lost beyond one step (report's stall_per_failure_s)", None),
    ("first_step_no_warmup_s", "restarted replica's first step, no warm-up (rejoin stall)", "first_step_no_warmup_s"),
    ("first_step_s", "restarted replica's first step, warm-up before check-in", "first_step_s"),
    ("effective_training_time", "effective training time at 1 failure / 18 min", "effective_training_time"),
    ("effective_training_time_paper_rejoin", "  the same with the paper's 100 s rejoin stall",
     "effective_training_time"),
)


def table(paper_run: dict[str, Any], ftrun_run: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows {key, label, paper, emulated, ftrun_detection}: the paper's settings and ftrun's faster detection.
    Each run dict holds the keys of ROWS (None where not measured)."""
    rows = []
    for key, label, pkey in ROWS:
        rows.append({"key": key, "label": label, "paper": PAPER.get(pkey) if pkey else None,
                     "emulated": paper_run.get(key), "ftrun_detection": ftrun_run.get(key)})
    return rows


def run_figures(parts: FailureParts, rejoin_no_warmup_s: float | None, rejoin_warmup_s: float | None,
                num_replicas: int) -> dict[str, Any]:
    """One column of the table: a failure's parts, the two rejoin stalls, and the ETT they give."""
    out = parts.as_dict()
    out["first_step_no_warmup_s"] = None if rejoin_no_warmup_s is None else round(rejoin_no_warmup_s, 3)
    out["first_step_s"] = None if rejoin_warmup_s is None else round(rejoin_warmup_s, 3)
    ett = effective_training_time(parts.stall_s, rejoin_warmup_s or 0.0, num_replicas)
    out["effective_training_time"] = round(ett, 4)
    paper_rejoin = effective_training_time(parts.stall_s, PAPER["first_step_s"], num_replicas)
    out["effective_training_time_paper_rejoin"] = round(paper_rejoin, 4)
    return out


def _cell(value: Any, key: str) -> str:
    if value is None:
        return "-"
    if key.startswith("effective_training_time"):
        return f"{100 * value:.1f}%"
    return f"{value:.2f} s" if isinstance(value, float) else str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| figure | paper expects | emulated, paper settings | emulated, ftrun detection |",
             "| --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['label'].strip()} | {_cell(r['paper'], r['key'])} | {_cell(r['emulated'], r['key'])} "
                     f"| {_cell(r['ftrun_detection'], r['key'])} |")
    return "\n".join(lines)
