"""Analytic FTAR rings (harness.run.ring_model): the schedule's modeled cost, the board that ends a ring when
every participant has arrived, and jobs whose rings are analytic training and failing as chunk-level ones do."""

from __future__ import annotations

import pytest

from ftrun.ftar.schedule import schedule
from harness import cli
from harness.profile import load_profile
from harness.run import JobOptions, parse_inject, split_faults
from harness.run.ring_model import RingBoard, ring_seconds, step_summary


class _Flag:
    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True


def test_ring_seconds_is_bandwidth_bound_or_kernel_bound_per_step_plus_the_fill():
    sched = schedule(4, 1, 4 * 2 * 1024, elem_size=4, chunk_bytes=1024, num_chunks=2)  # one partition
    steps = len(sched.steps)
    summary = step_summary(sched)
    assert summary[0] == 4 and sum(c for _, _, c in summary[1]) == steps
    assert steps == (2 * 4 - 2) * 2 + 2  # (2N - 2) hops x C chunks, and the last hop's receives
    slow_wire = ring_seconds(summary, rate=1024.0, latency=0.5, kernel_s=lambda nb: 0.0)
    assert slow_wire == pytest.approx(steps * 1.0 + 6 * 0.5)  # 1 s per chunk, 0.5 s per fill hop
    slow_kernel = ring_seconds(summary, rate=1e12, latency=0.0, kernel_s=lambda nb: 2.0)
    reducing = sum(1 for s in sched.steps if type(s.ops[1]).__name__ in ("Reduce", "ReduceCopy"))
    assert reducing == 3 * 2 and slow_kernel == pytest.approx(reducing * 2.0, rel=1e-6)  # N - 1 reduce hops x C
    with pytest.raises(ValueError, match="rate"):
        ring_seconds(summary, rate=0.0, latency=0.0, kernel_s=lambda nb: 0.0)


def test_the_board_ends_a_ring_at_the_last_arrival_plus_the_longest_duration():
    board = RingBoard()
    flags = [_Flag() for _ in range(3)]
    key = (7, ("a", "b", "c"), 1)
    ring = board.arrive(key, 3, 1.0, 0.5, flags[0])
    board.arrive(key, 3, 3.0, 0.25, flags[1])
    assert ring.end is None and not any(f.is_set for f in flags)
    assert board.arrive(key, 3, 2.0, 0.75, flags[2]) is ring
    assert ring.end == pytest.approx(3.75) and all(f.is_set for f in flags) and board.num_rings == 1
    for _ in range(3):
        board.leave(key, ring)
    fresh = board.arrive(key, 3, 5.0, 0.1, _Flag())  # gone once every participant left
    assert fresh is not ring and board.num_rings == 2


def _run(model: str, *inject: str, steps: int = 10) -> dict:
    kills, faults = split_faults([parse_inject(i) for i in inject])
    f, _ = cli.execute(load_profile("ci-small"), JobOptions(steps=steps, kills=kills, faults=faults, ftar_model=model))
    return f


SAME = ("complete", "replicas_consistent", "steps_done", "participants_per_step", "audit_batches",
        "duplicate_batches", "skipped_batches", "catchup_bytes", "unexpected_errors")
CLOSE = ("step_time_s", "stall_per_failure_s", "rejoin_s", "effective_training_time")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inject", ["kill replica=1 step=3", "kill replica=2 step=3 at=ftar",
                                    "kill replica=2 step=3 at=0.5", "kill replica=2 rank=3 time=1.0"])
def test_analytic_rings_train_and_fail_as_chunk_level_rings(inject):
    chunks, analytic = _run("chunks", inject), _run("analytic", inject)
    assert chunks["ftar_model"] == "chunks" and analytic["ftar_model"] == "analytic"
    assert analytic["analytic_all_reduces"] > 0 and chunks["analytic_all_reduces"] == 0
    assert {k: analytic[k] for k in SAME} == {k: chunks[k] for k in SAME}
    for key in CLOSE:
        if chunks[key] is not None:
            assert analytic[key] == pytest.approx(chunks[key], rel=0.05, abs=0.005), key
    if "ftar" in inject or "at=0.5" in inject:  # the ring broke: survivors retrained the step, without a timeout
        assert analytic["stall_per_failure_s"] < analytic["step_time_s"] + 0.1


def test_faults_that_stall_a_ring_silently_keep_chunk_level_rings():
    f = _run("auto", "hang replica=2 step=3 at=0.2 duration=30", steps=8)
    assert f["ftar_model"] == "chunks"  # a hang stalls a ring silently: auto keeps chunk-level rings
    with pytest.raises(ValueError, match="ftar_model=analytic"):
        JobOptions(steps=8, faults=(parse_inject("hang replica=2 step=3 duration=30"),), ftar_model="analytic")
    with pytest.raises(ValueError, match="ftar_model"):
        JobOptions(steps=8, ftar_model="fast")  # type: ignore[arg-type]


def test_auto_is_analytic_only_at_scale():
    from harness.run import EmulatedJob

    assert EmulatedJob(load_profile("ci-small"), JobOptions(steps=1)).ring_board is None
    assert EmulatedJob(load_profile("crusoe-300"), JobOptions(steps=1)).ring_board is not None
