"""Tensors a script asks to put on a GPU, inside `shadow.active`: they stay on the script process's host.

Under `ftrun emulate SCRIPT.py` the script's own process trains nothing at scale: `ft.train` builds its
model on meta (mocks.script), and its own loop (`job.wrap`) runs its first step for real, on the model
the script built, to count the step's FLOPs (mocks.train_api); the emulated ranks train shape-only. A
script run with `--device cuda` asks torch for CUDA tensors, which this process cannot make (no GPU, or a
CPU build of torch). While the context is active, this torch function mode answers those requests on
the host, so the script runs as its CPU run does:

- a `device=` argument naming a CUDA device (torch.zeros(..., device="cuda"), torch.randn_like(x,
  device=...)) becomes "cpu";
- Tensor.to(<CUDA device>, ...) and Tensor.cuda() move to "cpu", and a meta tensor (a model built on
  meta) stays on meta; Module.to("cuda") and Module.cuda() go through them;
- pin_memory=True becomes False and Tensor.pin_memory() returns the tensor (pinned host memory is host
  memory here).

A CUDA device is a torch.device or a string of type cuda ("cuda", "cuda:3"), or an int ordinal passed to
Tensor.to / as device=. With the torch.cuda shim (shadow.cuda_shim: is_available() is True,
set_device, synchronize, streams), ftrun's device seam (ftrun.train.device) and a script's own CUDA
calls run unchanged. Not covered: `with torch.device("cuda"):` and torch.set_default_device("cuda")
(torch's own default-device mode fills those in after this one has looked).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def is_cuda_device(device: Any) -> bool:
    """Whether `device` names a CUDA device (torch.device, "cuda[:N]", or an int ordinal)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.partition(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _host_of(tensor: Any) -> str:
    return "meta" if isinstance(tensor, torch.Tensor) and tensor.is_meta else "cpu"


class HostTensors(TorchFunctionMode):
    """The torch function mode of the module docstring (thread-local, like every torch function mode:
    it covers the thread that entered it)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(_host_of(args[0]))
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and is_cuda_device(args[1]):
            args = (args[0], _host_of(args[0]), *args[2:])
        if is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _host_of(args[0] if func is torch.Tensor.to else None)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)
