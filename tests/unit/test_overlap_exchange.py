"""The overlapped exchange's driver (ftrun.train.overlap) over a recording stand-in for GradientExchange,
and FlatGrads' hooks: which slices are reduced, in which order, and how errors and cancels end a step."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from ftrun.env.real import RealEnv
from ftrun.ftar.ring import RecoverableError
from ftrun.replica.manager import StepQuorum
from ftrun.train.grads import FlatGrads
from ftrun.train.overlap import OverlapExchange
from ftrun_bench.overlap import (BATCH_STEP, LOOPBACK_BATCH, MAX_BATCH, auto_batch, check_args, exchange_estimate_s,
                                 sized_batch, summarize)

pytestmark = pytest.mark.timeout(30)

Q = StepQuorum(quorum_id=7, step=3, participants=(), replica_index=0, healed=False, reason="test")


class Engine:
    def __init__(self) -> None:
        self.aborted: list[int] = []

    def abort(self, epoch: int) -> bool:
        self.aborted.append(epoch)
        return True


class Exchange:
    """Records prepare/reduce calls; reduce doubles the slice (so a test sees what was reduced)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.engine, self.calls, self.fail_at, self.forgot = Engine(), [], fail_at, 0

    def prepare(self, q, *, setup_timeout_s=None) -> None:
        self.calls.append(("prepare", q.quorum_id))

    def reduce(self, q, grads, *, dtype=None) -> None:
        if self.fail_at == len(self.calls) - 1:
            raise RecoverableError("peer died")
        self.calls.append(("reduce", grads.size))
        grads *= 2

    def forget_ring(self) -> None:
        self.forgot += 1


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))  # 12, 4, 8, 2


def backward(m: torch.nn.Module) -> None:
    m.zero_grad(set_to_none=True)
    m(torch.ones(5, 3)).square().sum().backward()


def test_buckets_are_reduced_in_backward_order_and_the_buffer_ends_as_the_serial_gather_would():
    m, ex = model(), Exchange()
    flat = FlatGrads(m.parameters())
    ov = OverlapExchange(env=RealEnv(), exchange=ex, flat=flat, bucket_bytes=40)  # (2 + 8) (4 + 12) elements
    assert [b.params for b in ov.plan] == [(3, 2), (1, 0)]
    ov.start(Q)
    backward(m)
    flat.gather()
    ov.finish()
    assert ex.calls == [("prepare", 7), ("reduce", 10), ("reduce", 16)]
    reference = FlatGrads(m.parameters())
    reference.gather()  # the same gradients, gathered after backward
    np.testing.assert_array_equal(flat.buffer, 2 * reference.buffer)
    assert not ov.active


def test_a_parameter_without_gradient_is_zero_and_its_bucket_still_goes():
    m, ex = model(), Exchange()
    flat = FlatGrads(m.parameters())
    ov = OverlapExchange(env=RealEnv(), exchange=ex, flat=flat, bucket_bytes=1)  # one bucket per parameter
    ov.start(Q)
    m.zero_grad(set_to_none=True)
    m[0](torch.ones(5, 3)).sum().backward()  # the second layer gets no gradient
    flat.gather()
    ov.finish()
    assert [c for c in ex.calls if c[0] == "reduce"] == [("reduce", 2), ("reduce", 8), ("reduce", 4), ("reduce", 12)]
    assert not flat.buffer[16:].any()


def test_an_exchange_error_is_raised_by_finish_and_the_ring_forgotten():
    m, ex = model(), Exchange(fail_at=1)
    flat = FlatGrads(m.parameters())
    ov = OverlapExchange(env=RealEnv(), exchange=ex, flat=flat, bucket_bytes=1)
    ov.start(Q)
    backward(m)
    flat.gather()
    with pytest.raises(RecoverableError, match="peer died"):
        ov.finish()
    assert ex.forgot == 1 and not ov.active


def test_cancel_gives_the_ring_up_and_disarms_the_hooks():
    m, ex = model(), Exchange()
    flat = FlatGrads(m.parameters())
    ov = OverlapExchange(env=RealEnv(), exchange=ex, flat=flat, bucket_bytes=1 << 20)  # one bucket
    ov.start(Q)
    m.zero_grad(set_to_none=True)
    m[0](torch.ones(5, 3)).sum().backward()  # half a backward: the bucket is not complete; the step "fails"
    ov.cancel()
    assert ex.engine.aborted == [7] and ex.forgot == 1 and not ov.active
    assert [c[0] for c in ex.calls] == ["prepare"]
    ov.cancel()  # a no-op now
    backward(m)  # disarmed: the hooks copy nothing
    flat.zero()
    backward(m)
    assert not flat.buffer.any()
    with pytest.raises(RuntimeError, match="without start"):
        ov.finish()


def test_start_twice_without_finish_is_refused():
    m, ex = model(), Exchange()
    ov = OverlapExchange(env=RealEnv(), exchange=ex, flat=FlatGrads(m.parameters()), bucket_bytes=1)
    ov.start(Q)
    with pytest.raises(RuntimeError, match="neither finished nor cancelled"):
        ov.start(Q)
    ov.cancel()


def test_bad_bucket_size_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        OverlapExchange(env=RealEnv(), exchange=Exchange(), flat=FlatGrads(model().parameters()), bucket_bytes=0)


def test_ftconfig_validates_the_bucket_size():
    from ftrun.train import FTConfig

    assert FTConfig(overlap_bucket_bytes=None).overlap_bucket_bytes is None
    assert FTConfig(overlap_bucket_bytes=1 << 20).overlap_bucket_bytes == 1 << 20
    for bad in (0, -1, 1.5, True, "1M"):
        with pytest.raises(ValueError, match="overlap_bucket_bytes"):
            FTConfig(overlap_bucket_bytes=bad)


def bench_args(**over) -> argparse.Namespace:
    base = dict(replicas=2, width=8, layers=2, batch=4, steps=2, blocks=1, bucket_kb=1, chunk_kb=4, chunks=2,
                netns_rate=0.0)
    return argparse.Namespace(**{**base, **over})


def test_bench_arguments_are_checked():
    assert check_args(bench_args()) is None
    assert "--replicas" in check_args(bench_args(replicas=1))
    assert "--bucket-kb" in check_args(bench_args(bucket_kb=0))
    assert "--netns-rate" in check_args(bench_args(netns_rate=-1))
    assert check_args(bench_args(batch=None)) is None  # sized in the run
    assert "--batch" in check_args(bench_args(batch=0))


def test_bench_exchange_estimate_is_the_ring_volume_over_the_rate():
    # 2 replicas: each sends the whole gradient once (half in reduce-scatter, half in all-gather)
    assert exchange_estimate_s(8_000_000, 2, 500.0) == pytest.approx(8e6 * 8 / 500e6)
    # 4 replicas: 2 x 3/4 of it
    assert exchange_estimate_s(8_000_000, 4, 500.0) == pytest.approx(1.5 * 8e6 * 8 / 500e6)


def test_bench_auto_batch_matches_compute_to_the_exchange():
    assert auto_batch(1e-4, 0.1) == 1024  # 1000 samples, to a multiple of 64
    assert auto_batch(1e-4, 0.0001) == BATCH_STEP  # at least one step
    assert auto_batch(1e-6, 10.0) == MAX_BATCH
    with pytest.raises(ValueError):
        auto_batch(0.0, 0.1)


def test_bench_batch_is_sized_only_over_capped_links_and_when_not_given():
    assert sized_batch(bench_args(batch=96, netns_rate=500.0)) == (96, False)
    assert sized_batch(bench_args(batch=None, netns_rate=0.0)) == (LOOPBACK_BATCH, False)
    batch, auto = sized_batch(bench_args(batch=None, netns_rate=500.0, width=64, layers=2))
    assert auto and batch % BATCH_STEP == 0 and BATCH_STEP <= batch <= MAX_BATCH


def test_bench_summary_is_medians_per_mode():
    rows = [{"mode": "serial", "step_s": s, "exchange_s": e, "compute_s": 0.1} for s, e in ((1.0, 0.4), (2.0, 0.5),
                                                                                            (1.2, 0.6))]
    rows += [{"mode": "overlap", "step_s": s, "exchange_s": 0.1, "compute_s": 0.1} for s in (0.9, 0.6)]
    out = summarize(rows)
    assert out["step_s_serial"] == 1.2 and out["step_s_overlap"] == 0.75 and out["ratio"] == 0.75 / 1.2
    assert out["exchange_fraction"] == 0.5 / 1.2
    with pytest.raises(ValueError):
        summarize(rows[:3])
