"""benchmarks/catchup_launch.py's analysis of a job's events: start heals apart from restart rejoins, and
a kill whose restarted replica never caught up is named (the script then exits 1)."""

from __future__ import annotations

import math

import pytest

from tests.benchmark_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("catchup_launch")


def _commits(steps: range, t0: float = 0.0, dt: float = 0.1) -> list[dict]:
    return [{"rank": 0, "event": "commit", "replica_id": "r0", "step": s, "t": t0 + s * dt} for s in steps]


def _catchup(step: int, incarnation: int, seconds: float, t: float) -> list[dict]:
    return [{"rank": 0, "event": "catchup", "replica_id": "r1", "incarnation": incarnation, "step": step,
             "num_bytes": 50_000_000, "seconds": seconds, "t": t},
            {"rank": 0, "event": "catchup_wait", "replica_id": "r0", "step": step, "stall_s": 0.02,
             "action": "join", "t": t}]


def _kill(step: int, incarnation: int, t: float) -> dict:
    return {"event": "kill", "replica_id": "r1", "incarnation": incarnation, "step": step, "t": t}


def test_start_heal_is_apart_from_rejoins(bench):
    events = _commits(range(60)) + _catchup(1, 0, 0.17, 0.1) + [_kill(10, 0, 1.0)] + _catchup(30, 1, 0.04, 3.0) \
        + [_kill(40, 1, 4.0)] + _catchup(55, 2, 0.06, 5.5)
    figures = bench.analyse(events)
    assert [(h["incarnation"], h["fetch_s"]) for h in figures["start_heals"]] == [(0, 0.17)]
    assert [(r["incarnation"], r["step"]) for r in figures["rejoins"]] == [(1, 30), (2, 55)]
    assert figures["median_rejoin_fetch_s"] == pytest.approx(0.05)
    assert figures["median_step_s"] == pytest.approx(0.1)
    assert figures["max_stall_steps"] == pytest.approx(0.2)
    assert [r["step_s"] for r in figures["rejoins"]] == [pytest.approx(0.1)] * 2  # r0's commit before to its own
    assert figures["kills_without_rejoin"] == []


def test_a_kill_without_a_rejoin_is_named(bench):
    # the restarted replica (incarnation 1) is killed again before it joins; the start heal is no rejoin
    events = _commits(range(40)) + _catchup(1, 0, 0.17, 0.1) + [_kill(10, 0, 1.0), _kill(25, 1, 2.5)]
    figures = bench.analyse(events)
    assert figures["rejoins"] == [] and math.isnan(figures["median_rejoin_fetch_s"])
    assert figures["kills_without_rejoin"] == [{"replica": "r1", "incarnation": 0, "step": 10},
                                               {"replica": "r1", "incarnation": 1, "step": 25}]


@pytest.fixture(scope="module")
def baseline():
    return load("catchup_torchft")  # torchft is imported only inside the run, so this needs none


def test_the_torchft_baseline_reports_each_rejoin_under_the_same_keys(baseline):
    steps = [{"event": "step", "replica": 0, "step": s, "t": s * 0.1} for s in range(1, 40)]
    steps[20]["t"] += 0.05  # r0's step 21 took 0.15 s: it waited for the joiner
    for later in steps[21:]:
        later["t"] += 0.05
    heal = {"event": "recv_checkpoint", "replica": 1, "t": 2.02, "seconds": 0.05, "nbytes": 50_000_000, "step": 20}
    figures = baseline.analyse(steps + [heal], kill_times=[(10, 1.0), (30, 3.2)])
    assert figures["kills_without_rejoin"] == [30]  # no transfer after the second kill
    [rejoin] = figures["rejoins"]
    assert rejoin["killed_after_step"] == 10 and rejoin["fetch_s"] == 0.05 and rejoin["gbps"] == pytest.approx(1.0)
    assert rejoin["step_s"] == pytest.approx(0.15)
    assert figures["median_step_s"] == pytest.approx(0.1)
    assert figures["median_rejoin_fetch_s"] == 0.05
    assert figures["max_stall_steps"] == pytest.approx(0.5)
