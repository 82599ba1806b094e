"""The step's gradients as one preallocated float32 numpy buffer, the unit the cross-replica FTAR reduces.

`gather` copies every trainable parameter's gradient into its slice of the buffer (zeros where a
parameter has no gradient, so every replica sends the same layout); `scatter` copies the reduced buffer
back into the gradients, allocating one where a parameter had none (a replica that healed this step ran
no backward and still applies the step). Every trainable parameter gets a gradient from `scatter`, on
every replica, so optimizers that skip parameters without a gradient skip the same ones everywhere.

A sharded replica (FSDP2) uses the same class: a DTensor parameter contributes its rank's local shard
(of its gradient; FSDP2's reduce-scatter already averaged it over the replica's ranks), so the buffer is
this rank's part of the replica's gradients and FTAR reduces it in the ring of the same rank.
Threading: one task per instance.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

from ftrun.train.shard import local


class FlatGrads:
    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("FlatGrads needs at least one trainable parameter")
        sizes = [local(p).numel() for p in self.params]
        self.buffer = np.zeros(sum(sizes), np.float32)  # C-contiguous: what GradientExchange.average takes
        flat = torch.from_numpy(self.buffer)
        offsets = np.cumsum([0] + sizes)
        self._views = [flat[a:b].view(local(p).shape) for p, a, b in zip(self.params, offsets[:-1], offsets[1:])]

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def gather(self) -> None:
        """Buffer <- gradients (cast to float32)."""
        with torch.no_grad():
            for p, view in zip(self.params, self._views):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(local(p.grad))

    def scatter(self) -> None:
        """Gradients <- buffer (cast to each parameter's dtype)."""
        with torch.no_grad():
            for p, view in zip(self.params, self._views):
                if p.grad is None:
                    p.grad = torch.empty_like(p)  # a DTensor for a DTensor parameter
                local(p.grad).copy_(view)

    def zero(self) -> None:
        self.buffer.fill(0)
