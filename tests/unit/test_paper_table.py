"""The paper's stall table (harness.analysis.papertable, benchmarks/paper_table.py): the parts of a failure from
events (table tests), and, emulated at a tiny scale of meta-98k (4 x 4 ranks), the whole table: a silent host
loss's stall includes the 60 s detection while a process crash is seen at once."""

from __future__ import annotations

import io

import pytest

from harness.analysis import papertable as pt
from tests.benchmark_scripts import load


def _ev(event: str, t: float, rid: str | None = None, **kw) -> dict:
    return {"event": event, "t": t, **({"replica_id": rid} if rid else {}), **kw}


def _commits(rid: str, times: list[float]) -> list[dict]:
    return [_ev("commit", t, rid, incarnation=0, step=i + 1) for i, t in enumerate(times)]


SILENT = (_commits("r0", [20, 40, 60, 151, 171]) + _commits("r1", [20, 40, 60, 71])
          + [_ev("fault", 71.0, fault="cut replica=1 step=3 at=0.5"), _ev("lighthouse_member_lost", 131.0, "r1"),
             _ev("abort", 131.0, "r0"), _ev("quorum", 133.0, "r0"), _ev("commit", 60.5, "r2", incarnation=0)])


def test_failure_parts_of_a_silent_loss() -> None:
    p = pt.failure_parts(SILENT, "r1")
    assert (p.detection_s, p.rebuild_s, p.retrain_s) == (60.0, 2.0, 18.0)
    assert p.stall_s == 80.0 and p.detected_by == "abort" and p.verdict_s == 60.0
    assert p.extension_s == pytest.approx(91.0 - 20.0)  # r0's 60 -> 151 interval, minus the median step


@pytest.mark.parametrize("drop, by, detection", [
    ({"abort"}, "lighthouse", 60.0),                            # nothing aborted: the lighthouse's verdict
    ({"abort", "lighthouse_member_lost"}, "lighthouse", 0.0),  # the next quorum simply left it out
])
def test_detection_without_an_abort(drop: set, by: str, detection: float) -> None:
    p = pt.failure_parts([e for e in SILENT if e["event"] not in drop], "r1")
    assert (p.detected_by, p.detection_s) == (by, detection)


@pytest.mark.parametrize("events, message", [
    ([e for e in SILENT if e["event"] != "fault"], "no kill or fault of replica r1"),
    ([e for e in SILENT if e["event"] != "quorum"], "never decided a quorum"),
    ([e for e in SILENT if not (e["event"] == "commit" and e["t"] > 71)], "never committed"),
    (_commits("r0", [20]) + [_ev("kill", 5.0, "r1")], "too few steps"),
])
def test_bad_events_raise(events: list[dict], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        if message == "too few steps":
            pt.normal_step_s(events)
        else:
            pt.failure_parts(events, "r1")


def test_kill_event_is_the_failure_time() -> None:
    events = _commits("r0", [20, 40, 60]) + [_ev("kill", 50.0, "r1"), _ev("quorum", 55.0, "r0")]
    assert pt.failure_time(events, "r1") == 50.0
    assert pt.failure_parts(events, "r1").retrain_s == 5.0


def test_diagnosis_times_after_the_failure() -> None:
    events = SILENT + [_ev("diagnosis", 60.0, replicas=[1], eviction=[1]),  # before the failure: ignored
                       _ev("diagnosis", 85.0, replicas=[1], eviction=[]),
                       _ev("diagnosis", 88.0, replicas=[1], eviction=[1])]
    assert pt.diagnosis_times(events, "r1", 1) == {"verdict_s": 14.0, "eviction_s": 17.0}
    assert pt.diagnosis_times(SILENT, "r1", 1) == {"verdict_s": None, "eviction_s": None}


def test_availability_with_the_papers_inputs_is_80_percent() -> None:
    assert pt.effective_training_time(80.0, 100.0) == pytest.approx((8 + 7 * 11 / 12) / 18, abs=0.005)
    assert pt.effective_training_time(10.0, 0.0) > pt.effective_training_time(80.0, 0.0)


def test_table_has_every_row_and_renders() -> None:
    col = pt.run_figures(pt.failure_parts(SILENT, "r1"), 0.0, 3.0, 12)
    rows = pt.table(col, col)
    assert [r["key"] for r in rows] == [k for k, _, _ in pt.ROWS]
    assert {r["key"]: r["paper"] for r in rows}["stall_s"] == 90.0
    text = pt.markdown(rows)
    assert text.count("\n") == len(rows) + 1 and "| 80.0% |" in text and "80.00 s" in text


def _bench():
    return load("paper_table")


def test_scaling_keeps_the_per_rank_shard() -> None:
    overrides, what = _bench().scaled_overrides("meta-98k", 8)
    assert "ranks_per_replica=8" in overrides and "emulation.cpu_charging=false" in overrides
    scaled, full = what["grad_mib_per_rank"].replace("(full scale ", "").rstrip(")").split()
    assert abs(float(scaled) / float(full) - 1) < 0.01
    with pytest.raises(ValueError, match="--ranks-per-replica"):
        _bench().scaled_overrides("meta-98k", 0)


@pytest.mark.timeout(300)
def test_measure_builds_the_whole_table_from_emulated_runs() -> None:
    """meta-98k at 4 replicas x 4 ranks: every scenario emulated; a silent loss waits out the 60 s timeout,
    a crash at the same moment does not."""
    out = _bench().measure("meta-98k", 4, log=io.StringIO(), extra_overrides=("replicas=4",))
    assert set(out["scenarios"]) == {"silent", "crash", "no_warmup", "warmup", "ftrun"}
    rows = {r["key"]: r for r in out["rows"]}
    assert list(rows) == [k for k, _, _ in pt.ROWS]
    paper, fast = rows["stall_s"]["emulated"], rows["stall_s"]["ftrun_detection"]
    assert paper >= 75.0 and fast <= paper - 40.0  # ftrun's 2 s heartbeat timeout instead of 60 s
    assert rows["detection_s"]["emulated"] >= 55.0 and rows["verdict_s"]["ftrun_detection"] <= 3.0
    ett = rows["effective_training_time"]
    assert 0.0 < ett["emulated"] < ett["ftrun_detection"] <= 1.0
    assert out["scenarios"]["warmup"]["rejoin_s"] > out["scenarios"]["no_warmup"]["rejoin_s"]  # warm-up before check-in
    # the first-step extra not warmed up lands on the joiner's first computing step: the job stalls (here the
    # survivors' 60 s all-reduce wait limit bounds it); warmed up before check-in, it does not
    assert rows["first_step_no_warmup_s"]["emulated"] >= 60.0 and rows["first_step_s"]["emulated"] < 1.0
    silent, crash = out["scenarios"]["silent"]["failure"], out["crash"]
    assert 55.0 <= silent["verdict_s"] <= 61.0 and 55.0 <= silent["detection_s"] <= 61.0  # the 60 s heartbeat timeout
    assert crash["verdict_s"] < 1.0  # connections reset: the lighthouse knows at once
    assert crash["detection_s"] <= 10.5  # the survivors abort as they reach the all-reduce (half a 20 s step)
    for p in (silent, crash):
        assert 19.0 <= p["retrain_s"] <= 21.0  # one 20 s step trained again
    assert silent["stall_s"] - crash["stall_s"] >= 45.0
    assert "ranks_per_replica" in out["scaled"] and "| stall per failure" in _bench().render(out)
