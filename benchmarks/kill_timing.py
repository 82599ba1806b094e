"""How late a real run's mid-step kills (`--inject kill ... at=F`) landed: per kill, the time from the victim rank's
`started` phase event to its `fault` event, less F x that rank's median compute (forward to exchange phase events
over its last ftrun.train.ft_worker.COMPUTE_WINDOW steps: what the rank timed it on).

    python benchmarks/kill_timing.py RUN_DIR [RUN_DIR ...]     # events.jsonl of `ftrun launch` / `ftrun fidelity --out`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import median

from ftrun.train.ft_worker import COMPUTE_WINDOW
from harness.calibrate import phase_spans


def lateness(events: list[dict]) -> list[float]:
    """Seconds each kill came after F x the victim's median compute from its step's start. Pure."""
    events = sorted(events, key=lambda e: e["t"])
    out = []
    for f in (e for e in events if e["event"] == "fault" and e.get("action") == "kill"):
        key = (f["replica_id"], f.get("incarnation", 0), f["rank"])
        mine = [e for e in events if e["event"] == "phase" and e["t"] <= f["t"]
                and (e["replica_id"], e.get("incarnation", 0), e.get("rank")) == key]
        started = [e["t"] for e in mine if e["phase"] == "started" and e["step"] == f["step"]]
        computes = phase_spans(mine, "forward", "exchange")
        if started and computes:
            out.append(f["t"] - started[-1] - _fraction(events, f) * median(computes[-COMPUTE_WINDOW:]))
    return out


def _fraction(events: list[dict], fault: dict) -> float:
    """F of the supervisor's kill event for this fault ("kill replica=R step=S at=F": of the victim's replica, the
    one nearest in time: a self-kill's event carries the fault's time), 0.5 if it names none."""
    kills = [e for e in events if e["event"] == "kill" and e.get("replica_id") == fault["replica_id"]]
    spec = str(min(kills, key=lambda e: abs(e["t"] - fault["t"])).get("fault", "")) if kills else ""
    return float(spec.split("at=")[1].split()[0]) if "at=" in spec else 0.5


def main() -> None:
    for run in sys.argv[1:]:
        with open(Path(run) / "events.jsonl") as f:
            late = sorted(x * 1e3 for x in lateness([json.loads(line) for line in f if line.strip()]))
        if not late:
            print(f"{run}: no timed kill")
            continue
        print(f"{run}: {len(late)} kills, late by median {median(late):.1f} ms, max {late[-1]:.1f} ms")


if __name__ == "__main__":
    main()
