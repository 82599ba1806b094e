"""benchmarks/kill_timing.py: how late a mid-step kill landed after F x the victim rank's median compute."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load


@pytest.fixture(scope="module")
def bench():
    return load("kill_timing")


def _phase(phase: str, step: int, t: float, rank: int = 0) -> dict:
    return {"event": "phase", "phase": phase, "step": step, "t": t, "replica_id": "r1", "incarnation": 0, "rank": rank}


def test_a_kill_is_measured_from_its_step_start_against_the_fraction_of_the_ranks_median_compute(bench):
    events = []
    for step, compute in enumerate([0.010, 0.030, 0.020]):  # median 0.020
        t = step * 0.1
        events += [_phase("started", step, t), _phase("forward", step, t + 0.001),
                   _phase("exchange", step, t + 0.001 + compute)]
    events += [_phase("started", 3, 0.3),
               {"event": "kill", "replica_id": "r1", "t": 0.3125, "fault": "kill replica=1 step=2 at=0.5"},
               {"event": "fault", "action": "kill", "replica_id": "r1", "incarnation": 0, "rank": 0, "step": 3,
                "t": 0.3125}]
    assert bench.lateness(events) == [pytest.approx(0.0025)]  # 12.5 ms after the start, F x compute = 10 ms


def test_a_kill_before_any_timed_compute_is_left_out(bench):
    events = [_phase("started", 0, 0.0),
              {"event": "fault", "action": "kill", "replica_id": "r1", "incarnation": 0, "rank": 0, "step": 0, "t": 0.01}]
    assert bench.lateness(events) == []


def test_each_kill_takes_the_fraction_of_its_own_injection(bench):
    events = [{"event": "kill", "replica_id": "r1", "t": 1.0, "fault": "kill replica=1 step=2 at=0.5"},
              {"event": "kill", "replica_id": "r1", "t": 5.0, "fault": "kill replica=1 step=40 at=0.25"}]
    assert bench._fraction(events, {"replica_id": "r1", "t": 5.0}) == 0.25
    assert bench._fraction(events, {"replica_id": "r1", "t": 1.0}) == 0.5
    assert bench._fraction(events, {"replica_id": "r2", "t": 1.0}) == 0.5  # none injected for it
