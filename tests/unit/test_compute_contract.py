"""The Compute seam's contract (ftrun.train.compute), run against every implementation: the real torch
compute and the emulator's shape-only compute. The trainer relies on exactly these behaviours."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftrun.env.real import RealEnv
from ftrun.train.compute import Compute, TorchCompute
from harness.profile import ModelConfig
from mocks.compute import ShapeCache, ShapeOnlyTrainCompute

pytestmark = pytest.mark.timeout(30)


def _torch() -> TorchCompute:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randn(16, 5)

    def loss_fn(m, batch):
        return ((m(batch[:, :4]).squeeze(-1) - batch[:, 4]) ** 2).mean()

    return TorchCompute(model=model, optimizer=opt, loss_fn=loss_fn, dataset=data, min_samples=16)


def _shape_only() -> ShapeOnlyTrainCompute:
    model = ModelConfig(layers=1, hidden=16, heads=2, vocab=64, seq_len=8, dtype="fp32")
    return ShapeOnlyTrainCompute(env=RealEnv(), model=model, ranks_per_replica=2, cache=ShapeCache(), step_time_s=0.0)


IMPLS = {"torch": _torch, "shape_only": _shape_only}


@pytest.fixture(params=sorted(IMPLS))
def compute(request) -> Compute:
    return IMPLS[request.param]()


def _nbytes(buf) -> int:
    return int(buf.nbytes)


def test_a_step_fills_a_fixed_size_gradient_buffer_and_returns_a_float_loss(compute):
    size = _nbytes(compute.grads)
    assert size > 0
    loss = compute.forward_backward(0, lambda: np.arange(4), seed=1)
    assert isinstance(loss, float) and np.isfinite(loss)
    assert _nbytes(compute.grads) == size  # the exchange all-reduces the same buffer every step


def test_the_same_seed_and_batch_give_the_same_loss(compute):
    a = compute.forward_backward(3, lambda: np.arange(4), seed=7)
    b = compute.forward_backward(3, lambda: np.arange(4), seed=7)
    assert a == b


def test_kept_gradients_restore_into_the_buffer(compute):
    compute.forward_backward(0, lambda: np.arange(4), seed=1)
    kept = compute.keep_grads()
    compute.zero_grads()
    compute.restore_grads(kept)
    if isinstance(compute.grads, np.ndarray):
        assert np.array_equal(compute.grads, kept) and np.any(kept != 0)


def test_zeroed_gradients_are_zero(compute):
    compute.forward_backward(0, lambda: np.arange(4), seed=1)
    compute.zero_grads()
    if isinstance(compute.grads, np.ndarray):
        assert not np.any(compute.grads)


def test_state_round_trips_and_refuses_a_state_that_does_not_fit(compute):
    tensors, meta = compute.state.tensors(), compute.state.metadata()
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    compute.state.load(tensors, meta)  # a peer's state of the same layout loads
    name = sorted(tensors)[0]
    wrong = {**tensors, name: torch.empty(tensors[name].numel() + 1, dtype=tensors[name].dtype,
                                          device=tensors[name].device)}
    with pytest.raises((ValueError, RuntimeError)):
        compute.state.load(wrong, meta)


def test_apply_takes_a_positive_lr_factor_and_refuses_others(compute):
    compute.forward_backward(0, lambda: np.arange(4), seed=1)
    compute.scatter()
    compute.apply(0.5)
    compute.reset()
    with pytest.raises(ValueError):
        compute.apply(0.0)


def test_apply_changes_the_torch_model():
    c = _torch()
    before = [p.detach().clone() for p in c.model.parameters()]
    c.forward_backward(0, lambda: np.arange(4), seed=1)
    c.scatter()
    c.apply(1.0)
    assert any(not torch.equal(a, p) for a, p in zip(before, c.model.parameters()))
    assert all(p.grad is None for p in c.model.parameters())  # dropped after the step
