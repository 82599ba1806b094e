"""The Compute seam: one rank's training computation, as the step driver (ftrun.train.trainer) uses it.

    grads                              the flat gradient buffer the cross-replica FTAR averages
    state                              the rank's TrainState (what catch-up ships and loads)
    forward_backward(step, samples, seed) -> loss     this rank's gradient into `grads`
    zero_grads()                       a behind rank contributes zeros
    keep_grads() / restore_grads(k)    reuse a gradient for a retry of the same step on the same state
    scatter()                          the averaged buffer back into the model's gradients
    apply(lr_factor)                   the committed step: optimizer step with the LR intervention
    reset()                            drop the step's gradients and per-iteration state (failed step, heal)

Two implementations behind one contract test (tests/unit/test_compute_contract.py): `TorchCompute`
here (a torch model on CPU/GPU, FSDP2 inside the replica) and the shape-only compute of the emulator
(mocks.compute.ShapeOnlyTrainCompute: meta tensors, the profile's modeled step time). The trainer
never asks which one it has. Threading: one task (the training loop) per instance.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np
import torch

from ftrun.train.device import to_device
from ftrun.train.grads import FlatGrads
from ftrun.train.lr import scaled_lr
from ftrun.train.shard import reset_iteration
from ftrun.train.state import ReplicaState, TrainState

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # (model, batch of samples) -> scalar loss


class Compute(Protocol):
    grads: Any  # numpy float32 array (real) or a shape-only buffer: what GradientExchange.average takes
    state: TrainState

    def forward_backward(self, step: int, samples: Callable[[], np.ndarray], seed: int | None) -> float:
        """Forward and backward of this rank's batch into `grads`; the loss. `samples()` gives the
        batch's dataset indices (a compute that reads no data never asks). `seed`: reseed the RNG
        first (None: leave it alone). Raises what the model raises."""

    def zero_grads(self) -> None:
        """grads <- 0 (a rank behind this step contributes nothing)."""

    def gather(self) -> None:
        """grads <- the gradients a backward outside the compute left in the model (the user's own loop)."""

    def keep_grads(self) -> Any:
        """A copy of `grads` for `restore_grads`."""

    def restore_grads(self, kept: Any) -> None:
        """grads <- a copy from `keep_grads`."""

    def scatter(self) -> None:
        """The model's gradients <- grads (after the exchange averaged it)."""

    def apply(self, lr_factor: float) -> None:
        """The committed step: the optimizer step at `lr_factor` x each group's LR, then gradients dropped."""

    def reset(self) -> None:
        """Drop gradients and per-iteration state (a failed step, or a state just loaded)."""


class TorchCompute:
    """A torch model, its optimizer and loss over an in-memory dataset (whole model, or FSDP2 shards).

    state/grads: default ReplicaState/FlatGrads over the model's (local) tensors.
    device: where the model is (ftrun.train.device; the caller moved it there): each batch is taken from
    the dataset (which stays where it is) and moved there; the gradient buffer is on the host (FlatGrads).
    Raises ValueError if `dataset` has fewer than `min_samples` samples. The user's own loop
    (ftrun.train.own) has no loss_fn or dataset: its backward runs outside, and `gather` collects it.
    """

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_fn: LossFn | None,
                 dataset: torch.Tensor | None, min_samples: int = 0, state: TrainState | None = None,
                 flat: FlatGrads | None = None, device: torch.device = torch.device("cpu")) -> None:
        if dataset is not None and len(dataset) < min_samples:
            raise ValueError(f"dataset has {len(dataset)} samples, the layout {min_samples}")
        self.model, self.optimizer, self.loss_fn, self.dataset = model, optimizer, loss_fn, dataset
        self.device = device
        self.state = state if state is not None else ReplicaState(model=model, optimizer=optimizer)
        self.flat = flat if flat is not None else FlatGrads(model.parameters())
        self.grads = self.flat.buffer
        self._in_step = False  # a forward ran and its step was neither applied nor reset

    def forward_backward(self, step: int, samples: Callable[[], np.ndarray], seed: int | None) -> float:
        if seed is not None:
            torch.manual_seed(seed)
        self.model.zero_grad(set_to_none=True)
        self._in_step = True
        batch = self.dataset[torch.from_numpy(samples())]
        if self.device.type != "cpu":
            batch = to_device(batch, self.device)
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        self.flat.gather()
        return float(loss.detach())

    def zero_grads(self) -> None:
        self.flat.zero()

    def gather(self) -> None:
        self._in_step = True  # the user's forward ran: FSDP2 may hold per-iteration state
        self.flat.gather()

    def keep_grads(self) -> np.ndarray:
        return self.grads.copy()

    def restore_grads(self, kept: np.ndarray) -> None:
        np.copyto(self.grads, kept)

    def scatter(self) -> None:
        self.flat.scatter()

    def apply(self, lr_factor: float) -> None:
        with scaled_lr(self.optimizer, lr_factor):  # composed with the group's LR (a user's schedule), not set
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self._in_step = False

    def reset(self) -> None:
        if self._in_step:  # FSDP2's per-iteration state exists only once a forward ran
            reset_iteration(self.model)
        else:
            self.model.zero_grad(set_to_none=True)
        self._in_step = False
