"""The step's gradients as one preallocated float32 numpy buffer, the unit the cross-replica FTAR reduces.

`gather` copies every trainable parameter's gradient into its slice of the buffer (zeros where a
parameter has no gradient, so every replica sends the same layout); `scatter` copies the reduced buffer
back into the gradients, allocating one where a parameter had none (a replica that healed this step ran
no backward and still applies the step). Every trainable parameter gets a gradient from `scatter`, on
every replica, so optimizers that skip parameters without a gradient skip the same ones everywhere.

A sharded replica (FSDP2) uses the same class: a DTensor parameter contributes its rank's local shard
(of its gradient; FSDP2's reduce-scatter already averaged it over the replica's ranks), so the buffer is
this rank's part of the replica's gradients and FTAR reduces it in the ring of the same rank.

Overlap (ftrun.train.overlap): `arm(on_ready)` makes the next backward copy each parameter's gradient into
its slice as soon as autograd has accumulated it (a post-accumulate-grad hook) and call on_ready(i); the
`gather` after that backward fills only the parameters whose hook did not fire (no gradient: zeros) and
disarms. Threading: one task per instance; the hooks run on autograd's thread (the caller's on CPU).

On a GPU (every parameter on one CUDA device, ftrun.train.device) the buffer is page-locked host memory:
`gather` queues every device-to-host copy and synchronizes once before the buffer is read; a hook's copy
is synchronous (its slice is sent as soon as on_ready returns); `scatter` copies host-to-device
synchronously, so the exchange may write the buffer again at once.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import numpy as np
import torch

from ftrun.train.device import host_buffer, synchronize
from ftrun.train.shard import like, local


class FlatGrads:
    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("FlatGrads needs at least one trainable parameter")
        devices = {local(p).device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"FlatGrads needs every trainable parameter on one device, got "
                             f"{sorted(map(str, devices))}")
        self.device = devices.pop()
        sizes = [local(p).numel() for p in self.params]
        self.buffer = host_buffer(sum(sizes), self.device)  # C-contiguous: what GradientExchange.average takes
        flat = torch.from_numpy(self.buffer)
        offsets = np.cumsum([0] + sizes)
        self._views = [flat[a:b].view(local(p).shape) for p, a, b in zip(self.params, offsets[:-1], offsets[1:])]
        self._hooks: list | None = None  # post-accumulate-grad hook handles, made by the first arm()
        self._sink: Callable[[int], None] | None = None  # armed: called with each parameter's index when copied
        self._fired: list[bool] = []

    @property
    def numels(self) -> list[int]:
        """Each parameter's element count in the buffer (model order)."""
        return [v.numel() for v in self._views]

    def arm(self, on_ready: Callable[[int], None]) -> None:
        """Until the next gather() or disarm(): copy each gradient into the buffer as backward accumulates
        it, then call on_ready(index). A parameter accumulated twice raises (from inside backward)."""
        if self._hooks is None:
            self._hooks = [p.register_post_accumulate_grad_hook(partial(self._on_grad, i))
                           for i, p in enumerate(self.params)]
        self._fired = [False] * len(self.params)
        self._sink = on_ready

    def disarm(self) -> None:
        self._sink = None

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        sink = self._sink
        if sink is None:
            return
        if self._fired[i]:
            raise RuntimeError(f"parameter {i}'s gradient was accumulated twice in one overlapped backward")
        with torch.no_grad():
            self._views[i].copy_(local(p.grad))
        self._fired[i] = True
        sink(i)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def gather(self) -> None:
        """Buffer <- gradients (cast to float32). Armed: only the parameters not copied by their hook,
        each then reported to on_ready; disarms."""
        sink, self._sink = self._sink, None
        filled = []
        with torch.no_grad():
            for i, (p, view) in enumerate(zip(self.params, self._views)):
                if sink is not None and self._fired[i]:
                    continue
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(local(p.grad), non_blocking=True)  # queued on a GPU; a plain copy on CPU
                filled.append(i)
        synchronize(self.device)
        if sink is not None:
            for i in filled:
                sink(i)

    def scatter(self) -> None:
        """Gradients <- buffer (cast to each parameter's dtype)."""
        with torch.no_grad():
            for p, view in zip(self.params, self._views):
                if p.grad is None:  # a DTensor for a DTensor parameter, wrapped from its local shard: no
                    p.grad = like(p, torch.empty_like(local(p)))  # DTensor dispatch (~10 ms per new shape)
                local(p.grad).copy_(view)

    def zero(self) -> None:
        self.buffer.fill(0)
