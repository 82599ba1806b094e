"""One report pipeline: a real and an emulated job give their events in one schema to one picture
(ftrun.launch.report_png) and one Perfetto writer (ftrun.launch.trace). Pure, plus one small picture."""

from __future__ import annotations

import pytest

from ftrun.launch.report_png import draw, lanes, losses, smooth
from ftrun.launch.trace import launch_trace
from harness.report_files import launch_schema, title
from harness.run.record import Recorder

EVENTS = [
    {"event": "start", "replica_id": "r0", "incarnation": 0, "t": 10.0},
    {"event": "start", "replica_id": "r1", "incarnation": 0, "t": 10.0},
    *[{"event": "commit", "replica_id": r, "incarnation": 0, "rank": 0, "step": s, "t": 10.0 + s}
      for s in (1, 2) for r in ("r0", "r1")],
    {"event": "kill", "replica_id": "r1", "incarnation": 0, "t": 12.5, "why": "injected"},
    {"event": "restart", "replica_id": "r1", "incarnation": 1, "t": 13.0},
    {"event": "quorum", "replica_id": "r1", "incarnation": 1, "rank": 0, "t": 13.5},
    {"event": "heal", "replica_id": "r1", "incarnation": 1, "rank": 0, "to_step": 3, "t": 13.6},
    *[{"event": "commit", "replica_id": r, "incarnation": i, "rank": 0, "step": 4, "t": 14.0}
      for r, i in (("r0", 0), ("r1", 1))],
    {"event": "fault", "t": 12.0, "fault": "hang host=1 time=2"},
]


def test_lanes_mark_steps_kills_restarts_the_restart_gap_and_caught_up_steps():
    lane = lanes(EVENTS)
    assert lane["replicas"] == ["r0", "r1"] and lane["kills"] == [("r1", 12.5)] and lane["restarts"] == [("r1", 13.0)]
    assert lane["starting"] == [("r1", 13.0, 13.5)] and lane["faults"] == [(12.0, "hang host=1 time=2")]
    assert ("r1", 13.5, 14.0, True) in lane["steps"] and ("r0", 12.0, 14.0, False) in lane["steps"]
    assert lane["commits"] == {0: 2, 1: 2, 3: 2}


def test_losses_come_from_committed_trained_steps_and_metrics_with_the_eval_loss():
    events = [{"event": "step", "t": 1.0, "rank": 0, "committed": True, "loss": 2.0},
              {"event": "step", "t": 2.0, "rank": 0, "committed": True, "loss": 9.0, "healed": True},  # not trained
              {"event": "step", "t": 3.0, "rank": 1, "committed": True, "loss": 9.0},  # not the leader
              {"event": "step", "t": 4.0, "rank": 0, "committed": False, "loss": 9.0},
              {"event": "metrics", "t": 5.0, "rank": 0, "loss": 1.0, "val_loss": 1.5},
              {"event": "metrics", "t": 6.0, "eval_loss": 1.25}]
    assert losses(events) == ([(1.0, 2.0), (5.0, 1.0)], [(5.0, 1.5), (6.0, 1.25)])
    assert smooth([(0, 4.0), (1, 2.0), (2, 0.0)], n=2) == [(0, 4.0), (1, 3.0), (2, 1.0)]


def test_the_emulators_recorder_converts_to_the_launch_schema():
    rec = Recorder()
    rec.event({"event": "start", "t": 0.0, "replica_id": "r1", "incarnation": 0, "step": 0})
    rec.event({"event": "kill", "t": 1.0, "replica_id": "r1", "incarnation": 0, "step": 2})
    rec.event({"event": "start", "t": 2.0, "replica_id": "r1", "incarnation": 1, "step": 2})
    rec.event({"t": 0.1, "event": "lighthouse_quorum", "quorum_id": 1, "max_step": 0, "lighthouse": 0})
    rec.event({"event": "lighthouse_kill", "t": 3.0, "step": 3})
    rec.event({"event": "diagnosis", "t": 4.0, "step": 3, "kind": "hang", "reason": "x", "ranks": ["r1/0"]})
    rec.span("r1", 1, "ftrun::ftar::all_reduce", 2.5, 2.75)
    events, history, diagnosis = launch_schema(rec)
    assert [(e["event"], e.get("why")) for e in events] == [("start", None), ("kill", "injected"), ("restart", None),
                                                            ("lighthouse_kill", None)]
    assert history == [{"t": 0.1, "event": "quorum", "quorum_id": 1, "max_step": 0, "lighthouse": 0}]
    assert diagnosis is not None and diagnosis["verdicts"][0]["kind"] == "hang"
    trace = launch_trace(events, history, diagnosis, rec.spans, clock="modeled")
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"quorum 1 (step 0)", "kill", "restart", "lighthouse_kill", "verdict: hang", "ftrun::ftar::all_reduce",
            "hang: r1/0"} <= names
    span = next(e for e in trace["traceEvents"] if e["name"] == "ftrun::ftar::all_reduce")
    assert span["cat"] == "ftar" and span["dur"] == pytest.approx(0.25e6) and trace["otherData"]["clock"] == "modeled"


def test_one_picture_for_both(tmp_path):
    path = draw(EVENTS + [{"event": "metrics", "t": 10.0 + s, "rank": 0, "loss": 3.0 / s} for s in (1, 2, 3)],
                str(tmp_path / "report.png"), title="a job")
    assert (tmp_path / "report.png").stat().st_size > 10_000 and path.endswith("report.png")
    f = {"profile": "ci-small", "replicas": 4, "ranks_per_replica": 8, "steps": 10, "injected": ["kill replica=1 step=3"],
         "stall_per_failure_s": 0.1, "rejoin_stall_s": 0.2, "effective_training_time": 0.9}
    assert title(f).startswith("ftrun emulate ci-small: 4 replicas x 8 ranks, 10 steps, kill replica=1 step=3")
