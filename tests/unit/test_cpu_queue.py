"""The finite-source CPU queue (harness.run.cpu_queue) and where the emulated job takes it (train.shared_cpu_model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from harness.run.cpu_queue import busy_share_and_wait, think_ratio, wait_growth


def test_the_chain_matches_the_closed_forms_of_one_and_two_processes():
    """One process never waits and is busy 1 / (1 + x) of the time; two on one core (machine repairman, p0 : p1 : p2
    = 1 : 2/x : 2/x^2) wait d = p2 / (p1 + p2) = 1 / (1 + x) bursts per burst."""
    for x in (0.1, 1.0, 7.0):
        assert busy_share_and_wait(x, 1, 1.0) == pytest.approx((1 / (1 + x), 0.0))
        p1, p2 = 2 / x, 2 / x ** 2
        u, d = busy_share_and_wait(x, 2, 1.0)
        assert u == pytest.approx((p1 + p2) / 2 / (1 + p1 + p2)) and d == pytest.approx(1 / (1 + x))


def test_no_wait_while_every_process_has_a_core_and_more_as_they_outnumber_them():
    x = 1.0
    assert busy_share_and_wait(x, 2, 2.0)[1] == 0.0 and busy_share_and_wait(x, 3, 3.5)[1] == 0.0
    waits = [busy_share_and_wait(x, n, 1.63)[1] for n in range(2, 9)]
    assert all(a < b for a, b in zip(waits, waits[1:]))
    shares = [busy_share_and_wait(x, n, 1.63)[0] for n in range(2, 9)]
    assert all(a > b for a, b in zip(shares, shares[1:]))  # each gets less of the cores
    assert shares[-1] <= 1.63 / 8 + 1e-9  # never more than the cores


def test_the_think_ratio_gives_back_the_measured_busy_share():
    for u, n, c in ((0.3, 2, 1.63), (0.5, 2, 1.63), (0.35, 4, 1.63), (0.2, 8, 2.0)):
        assert busy_share_and_wait(think_ratio(u, n, c), n, c)[0] == pytest.approx(u, rel=1e-6)
    assert think_ratio(0.99, 2, 1.0) == pytest.approx(1e-9, rel=0.01)  # beyond what 2 on 1 core can be: saturated


def test_the_wait_growth_is_zero_at_the_calibration_point_and_grows_with_the_processes():
    """d(N) - d(N_cal): 0 at the calibration point, negative below it, growing above it, the more so the busier each
    process measured (2 processes on 1.63 cores, a 2 x 1 restep on this machine: u 0.4-0.7); nothing where every process
    keeps a core at both points."""
    assert wait_growth(0.5, 2, 2, 1.63) == 0.0
    x = think_ratio(0.5, 2, 1.63)
    assert wait_growth(0.5, 2, 4, 1.63) == pytest.approx(busy_share_and_wait(x, 4, 1.63)[1]
                                                         - busy_share_and_wait(x, 2, 1.63)[1])
    assert wait_growth(0.5, 2, 1, 1.63) < 0 < wait_growth(0.5, 2, 3, 1.63) < wait_growth(0.5, 2, 4, 1.63)
    assert wait_growth(0.4, 2, 4, 1.63) < wait_growth(0.7, 2, 4, 1.63)
    assert wait_growth(0.5, 2, 3, 3.0) == 0.0


@pytest.mark.parametrize("call, match", [
    (lambda: busy_share_and_wait(1.0, 0, 1.0), "n >= 1"),
    (lambda: busy_share_and_wait(1.0, 2, 0.0), "cores > 0"),
    (lambda: busy_share_and_wait(0.0, 2, 1.0), "think ratio"),
    (lambda: think_ratio(0.0, 2, 1.0), r"busy share must be in \(0, 1\]"),
    (lambda: think_ratio(1.5, 2, 1.0), r"busy share must be in \(0, 1\]"),
])
def test_bad_input_is_refused_naming_it(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def _job(overrides: list[str]):
    from harness.cli import build_profile
    from harness.run import JobOptions
    from harness.run.job import EmulatedJob

    return EmulatedJob(build_profile("ci-small", overrides, steps=4, cpu_charging=False), JobOptions(steps=4))


def _up(job, replicas: int) -> None:
    """`replicas` of the job's replicas alive (what its scaling counts), the others down."""
    job._incarnations = [SimpleNamespace(alive=i < replicas, world_size=job.profile.ranks_per_replica)
                         for i in range(job.profile.replicas)]


def test_the_job_scales_its_2_replica_cpu_waits_by_the_queue_or_by_r_over_2():
    """train.shared_cpu_model: "replicas" (the default) scales the overhead, the compute extra and the skews measured
    with 2 replicas up by R / 2; "queue" adds to each skew half the CPU work per step x the queue's wait growth
    from the measuring run's ranks to the live ones, where the share, its ranks, the CPU per step and the cores are
    measured (else R / 2), and leaves the overhead and compute extra at R / 2; the skews never below their 2-replica
    value, the overhead and compute extra 0 with one replica up."""
    keys = ["replicas=4", "ranks_per_replica=1", "topology.gpus_per_host=1", "ftar.sync_overhead_s=0.01",
            "train.replica_compute_extra_s=0.002", "train.shared_cpu_cores=1.63", "train.rank_cpu_share=0.4",
            "train.rank_cpu_share_ranks=2", "train.rank_start_skew_s=0.003", "train.rank_exchange_skew_s=0.001",
            "train.rank_cpu_step_s=0.006"]
    plain, queued = _job(keys), _job([*keys, "train.shared_cpu_model=queue"])
    for up in (1, 2, 3, 4):
        _up(plain, up)
        _up(queued, up)
        work = up / 2
        grown = 0.006 * wait_growth(0.4, 2, max(up, 2), 1.63)
        assert plain.ftar_overhead_s() == pytest.approx(0.01 * up / 2 if up > 1 else 0.0)
        assert queued.ftar_overhead_s() == pytest.approx(0.01 * work if up > 1 else 0.0)
        assert queued.replica_compute_extra_s() == pytest.approx(0.002 * work if up > 1 else 0.0)
        assert plain._skew_mean(0.003) == pytest.approx(0.003 * max(up, 2) / 2)
        assert queued._skew_mean(0.003) == pytest.approx(0.003 + grown / 2)  # half the step's wait growth each
        assert queued._skew_mean(0.001) == pytest.approx(0.001 + grown / 2)
    unmeasured = _job([*keys[:-1], "train.shared_cpu_model=queue"])
    _up(unmeasured, 4)
    assert unmeasured._skew_mean(0.003) == pytest.approx(0.006)


def test_a_bad_cpu_model_or_share_is_refused_naming_it():
    from ftrun.cli import UsageError
    from harness.cli import build_profile

    with pytest.raises(UsageError, match="shared_cpu_model"):
        build_profile("ci-small", ["train.shared_cpu_model=mm1"], steps=4, cpu_charging=False)
    with pytest.raises(UsageError, match="rank_cpu_share"):
        build_profile("ci-small", ["train.rank_cpu_share=1.5"], steps=4, cpu_charging=False)
    with pytest.raises(UsageError, match="rank_cpu_share_ranks must be a whole number"):  # not rounded to 0 processes
        build_profile("ci-small", ["train.rank_cpu_share_ranks=0.4"], steps=4, cpu_charging=False)


def test_the_queue_never_takes_a_skew_below_its_measured_value_with_fewer_ranks_than_measured():
    """A profile measured on 2 replicas of 2 ranks (4 processes) emulating replicas of 1 rank: the live ranks (2 at 2
    replicas up) are fewer than the measuring run's, where the queue's wait growth is negative. The skew keeps its
    measured value (only what more ranks add is modeled), and its mean never goes below 0, which would draw negative
    late starts and shorten the modeled compute."""
    keys = ["replicas=4", "ranks_per_replica=1", "topology.gpus_per_host=1", "train.shared_cpu_cores=1.63",
            "train.rank_cpu_share=0.35", "train.rank_cpu_share_ranks=4", "train.rank_start_skew_s=0.001",
            "train.rank_exchange_skew_s=0.001", "train.rank_cpu_step_s=0.006", "train.shared_cpu_model=queue"]
    job = _job(keys)
    assert 0.001 + 0.006 * wait_growth(0.35, 4, 2, 1.63) / 2 < 0  # what the queue alone would give at 2 up
    _up(job, 2)
    assert job._skew_mean(0.001) == 0.001
    assert job.start_skew_s(0, 1, 3) > 0
    _up(job, 4)  # 4 live ranks: the measuring run's count, no growth
    assert job._skew_mean(0.001) == pytest.approx(0.001)
