"""Where a rank trains (FTConfig.device) and the few CUDA calls the real trainer makes.

    check_device_name(name)                                   "cpu", "cuda" or "cuda:N"; else ValueError
    resolve_device(name, slot=, device_count=)                pure: the torch.device a rank trains on
    rank_device(name, slot)                                   the same with this host's GPUs; selects it
    host_buffer(numel, device)                                float32 zeros, page-locked for a GPU
    synchronize(device)                                       wait for the device's queued work (none on CPU)
    to_device(batch, device)                                  a batch's tensors (nested in tuples, lists, dicts) moved

"cuda" is the rank's GPU: cuda:{slot % device_count}, the slot being the rank's place among the ranks
started on its host (WorkerSpec.device_slot: FTRUN_HOST_SLOT from `ftrun launch`, which counts every
replica it places on the host, so replicas sharing a host spread over its GPUs; torchrun's LOCAL_RANK;
else the rank inside its replica). "cuda:N" names the GPU. The model, its
optimizer state and the batches live there; the cross-replica FTAR still reduces a host buffer
(ftrun.train.grads: device-to-host after backward, host-to-device before the optimizer step).

torch.cuda is reached as an attribute of torch, never imported (tests/unit/test_import_lint.py): under
the emulator the shadow loader's torch.cuda shim answers it.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"cpu|cuda(:(0|[1-9][0-9]*))?")


def check_device_name(name: object) -> str:
    """`name` if it is "cpu", "cuda" or "cuda:N"; else ValueError naming it."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"FTConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    return name


def resolve_device(name: str, *, slot: int, device_count: int) -> torch.device:
    """The device a rank trains on. slot: the rank's host slot (module docstring); device_count: the CUDA
    GPUs this process sees (0: none).
    Raises ValueError for a bad name, a CUDA device without a GPU, or a GPU index out of range."""
    check_device_name(name)
    if name == "cpu":
        return torch.device("cpu")
    if device_count < 1:
        raise ValueError(f"FTConfig.device={name!r} but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
    if name == "cuda":
        if slot < 0:
            raise ValueError(f"FTConfig.device='cuda': host slot {slot} must be >= 0")
        return torch.device("cuda", slot % device_count)
    index = int(name.split(":")[1])
    if index >= device_count:
        raise ValueError(f"FTConfig.device={name!r} but torch sees {device_count} CUDA GPU(s) "
                         f"(cuda:0..cuda:{device_count - 1})")
    return torch.device("cuda", index)


def rank_device(name: str, *, slot: int) -> torch.device:
    """resolve_device with the GPUs this process sees; a CUDA device becomes the current one."""
    count = torch.cuda.device_count() if name != "cpu" and torch.cuda.is_available() else 0
    device = resolve_device(name, slot=slot, device_count=count)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def host_buffer(numel: int, device: torch.device) -> np.ndarray:
    """A C-contiguous float32 numpy array of zeros; page-locked (pinned) when `device` is a GPU, so its
    copies to and from the device are DMA transfers. On the host its pages are touched here (when the
    trainer is built, before the replica checks in), not on the first step's critical path: a joiner's
    first zero_grads of a 17 MB buffer took 34 ms of page faults at load ~1 on 2 cores."""
    if device.type == "cpu":
        buffer = np.empty(numel, np.float32)
        buffer.fill(0)
        return buffer
    return torch.zeros(numel, dtype=torch.float32, pin_memory=True).numpy()


def synchronize(device: torch.device) -> None:
    """Wait until the device has run everything queued on it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (nested in tuples, lists and dicts) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        items = [to_device(b, device) for b in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)  # a namedtuple too
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch
