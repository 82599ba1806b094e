"""Tensors a script asks to put on a GPU, inside `shadow.active`: they stay on the script process's host.

Under `ftrun emulate SCRIPT.py` the script's own process trains nothing at scale: `ft.train` builds its
model on meta (mocks.script), and its own loop (`job.wrap`) runs its first step for real, on the model
the script built, to count the step's FLOPs (mocks.train_api); the emulated ranks train shape-only. A
script run with `--device cuda` asks torch for CUDA tensors, which this process cannot make (no GPU, or a
CPU build of torch). While the context is active, this torch function mode answers those requests on
the host, so the script runs as its CPU run does:

- a `device=` argument naming a CUDA device (torch.zeros(..., device="cuda"), torch.randn_like(x,
  device=...)) becomes "cpu", or "meta" when the call's first argument is a meta tensor
  (meta.new_zeros(..., device="cuda"), torch.zeros_like(meta, device="cuda"): a model built on meta
  stays on meta);
- Tensor.to(<CUDA device>, ...) and Tensor.cuda() move to "cpu", and a meta tensor stays on meta;
  Module.to("cuda") and Module.cuda() go through them; non_blocking=True copies are plain host copies;
- a random factory asked for on a CUDA device (torch.rand / randn / randint / randperm / normal with
  device="cuda" and no generator=) draws from that device's generator in the torch.cuda shim (seeded
  by torch.cuda.manual_seed(_all) and torch.manual_seed), so the host's own random stream moves as
  it would on a GPU host (random ops on tensors already made, dropout included, use the host's);
- pin_memory=True becomes False and Tensor.pin_memory() returns the tensor (pinned host memory is host
  memory here);
- `with torch.device("cuda"):` works as it is: torch pushes that default-device mode above this one,
  so it fills in device="cuda" and this mode then sees it (torch.get_default_device() inside reports
  the host for "cuda", "cuda:N" for "cuda:N").

Three torch names ask for a GPU where no torch function mode sees it; `HostNames` gives the context
stand-ins for them (installed as attributes of torch / torch.distributed, put back on exit):

- torch.set_default_device(<CUDA device>) sets the host as the default device (torch's default-device
  mode sits below every other mode, so it would fill in "cuda" after this one looked); on exit the
  default device found on entry is set again;
- torch.Generator(device=<CUDA device>) is a host generator (a subclass; isinstance checks against
  torch.Generator still accept every generator);
- torch.distributed.init_process_group("nccl", device_id=<CUDA device>) makes a gloo group with no
  bound device (the tensors it reduces are host tensors; "cpu:gloo,cuda:nccl" also becomes "gloo").

A CUDA device is a torch.device or a string of type cuda ("cuda", "cuda:3"), or an int ordinal passed to
Tensor.to / as device=. With the torch.cuda shim (shadow.cuda_shim: is_available() is True, set_device,
synchronize, streams, events, autocast and GradScaler through torch.cuda.amp), ftrun's device seam
(ftrun.train.device) and a script's own CUDA calls run unchanged. Not covered: a tensor's device reports
the host (`x.is_cuda` is False); torch.accelerator (it answers for the real build: no accelerator on a
CPU one); Tensor.record_stream(torch.cuda.Stream) (torch parses the stream before any mode sees the
call); a DataLoader's pin-memory thread (pin_memory=True with workers: the mode covers the entering
thread, and on a CUDA build that thread pins through torch.accelerator);
torch.distributed.init_device_mesh("cuda", ...) and new_group(backend="nccl").
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_REAL_GENERATOR = torch.Generator  # captured at import, before any context replaces the name


def is_cuda_device(device: Any) -> bool:
    """Whether `device` names a CUDA device (torch.device, "cuda[:N]", or an int ordinal)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.partition(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _host_of(tensor: Any) -> str:
    return "meta" if isinstance(tensor, torch.Tensor) and tensor.is_meta else "cpu"


# The random factories that take device= and generator=: asked for on a CUDA device, they draw from that
# device's generator (the torch.cuda shim's host stand-in), as on a GPU they draw from its CUDA generator.
_RANDOM_FACTORIES = frozenset((torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal))


def _cuda_generator(device: Any) -> torch.Generator:
    cuda = torch.cuda  # the shim while the context is active
    index = device if isinstance(device, int) else torch.device(device).index
    index = cuda.current_device() if index is None else index
    if not 0 <= index < len(cuda.default_generators):
        raise RuntimeError(f"invalid device ordinal {index} (the shim has {len(cuda.default_generators)} devices)")
    return cuda.default_generators[index]


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
            if func in _RANDOM_FACTORIES and kwargs.get("generator") is None:
                kwargs["generator"] = _cuda_generator(kwargs["device"])
            kwargs["device"] = _host_of(args[0] if args else None)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _HostGeneratorType(type(_REAL_GENERATOR)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_GENERATOR)  # torch.Generator, while replaced, accepts every generator


class HostGenerator(_REAL_GENERATOR, metaclass=_HostGeneratorType):  # type: ignore[misc, valid-type]
    """torch.Generator inside the context: one asked for on a CUDA device is a host generator."""

    def __new__(cls, device: Any = "cpu") -> "HostGenerator":
        return super().__new__(cls, device="cpu" if is_cuda_device(device) else device)


def _host_backend(backend: Any) -> Any:
    """A process group backend for host tensors: any NCCL part of `backend` becomes gloo."""
    if isinstance(backend, str) and "nccl" in backend.lower():
        return "gloo"
    return backend


class HostNames:
    """The stand-ins of the module docstring for torch.set_default_device, torch.Generator and
    torch.distributed.init_process_group. Make it before entering the context (it notes the default
    device then); `names()` lists (owner, attribute, stand-in); `restore()` on exit sets the entry's
    default device again if the script changed it."""

    def __init__(self) -> None:
        self._set_default = torch.set_default_device
        self._entry_default = torch.get_default_device()
        self._changed = False

    def names(self) -> list[tuple[Any, str, Any]]:
        out: list[tuple[Any, str, Any]] = [(torch, "set_default_device", self.set_default_device),
                                           (torch, "Generator", HostGenerator)]
        if torch.distributed.is_available():
            real_init = torch.distributed.init_process_group
            signature = inspect.signature(real_init)

            def init_process_group(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(*args, **kwargs)
                if "backend" in bound.arguments:
                    bound.arguments["backend"] = _host_backend(bound.arguments["backend"])
                if is_cuda_device(bound.arguments.get("device_id")):
                    bound.arguments["device_id"] = None
                return real_init(*bound.args, **bound.kwargs)

            init_process_group.__doc__ = real_init.__doc__
            out.append((torch.distributed, "init_process_group", init_process_group))
        return out

    def set_default_device(self, device: Any) -> None:
        """torch.set_default_device: a CUDA device becomes the host."""
        self._changed = True
        self._set_default("cpu" if is_cuda_device(device) else device)

    def restore(self) -> None:
        if self._changed:
            self._set_default(None if self._entry_default.type == "cpu" else self._entry_default)
            self._changed = False
