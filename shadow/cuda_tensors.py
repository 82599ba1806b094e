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
  the host for "cuda", "cuda:N" for "cuda:N");
- `x.is_cuda` answers, to code outside torch (the script's), whether x was made for a CUDA device: the
  mode notes the storages of the tensors made on a CUDA device= (or under `with torch.device("cuda")`
  or torch.set_default_device("cuda"), a tensor made from no tensor), moved there (Tensor.to / cuda(),
  Module.to / cuda()) or made by an op from such a tensor (a move back with .cpu() / .to("cpu") is a
  copy, as on a GPU host; an in-place op leaves its tensor where it was). A parameter's .grad is noted
  as it is read (autograd makes it without any mode seeing it). torch's own code gets the host's answer
  (False): it handles host tensors. x.device still reports the host.

Some torch names ask for a GPU where no torch function mode sees it; `HostNames` gives the context
stand-ins for them (installed as attributes of torch / torch.Tensor, put back on exit):

- torch.set_default_device(<CUDA device>) sets the host as the default device (torch's default-device
  mode sits below every other mode, so it would fill in "cuda" after this one looked); on exit the
  default device found on entry is set again;
- torch.Generator(device=<CUDA device>) is a host generator (a subclass; isinstance checks against
  torch.Generator still accept every generator);
- Tensor.record_stream(<a torch.cuda shim stream>) records nothing (torch would refuse the shim's stream
  before any mode saw the call; a host tensor's memory is not reused behind a stream's back);
- torch.distributed's process groups and device meshes: shadow.cuda_dist.

torch.accelerator's functions answer, to code outside torch, for the shim's modeled GPUs (a CUDA
accelerator, gpus_per_host devices: shadow.cuda_shim.accelerator_names); torch's own code gets the
real build's answers.

A CUDA device is a torch.device or a string of type cuda ("cuda", "cuda:3"), or an int ordinal passed to
Tensor.to / as device=. With the torch.cuda shim (shadow.cuda_shim: is_available() is True, set_device,
synchronize, streams, events, autocast and GradScaler through torch.cuda.amp), ftrun's device seam
(ftrun.train.device) and a script's own CUDA calls run unchanged. Not covered: a tensor's device reports
the host (x.device.type is "cpu"; is_cuda, above, is the script's answer); a DataLoader's pin-memory
thread (pin_memory=True with workers: the mode covers the entering thread, and on a CUDA build that
thread pins through torch.accelerator).
"""

from __future__ import annotations

import sys
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

from shadow.cuda_shim import Stream as ShimStream, is_torch_frame

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


_MOVES = frozenset((torch.Tensor.to, torch.Tensor.cpu))  # and Tensor.cuda
# The note on a storage made for a CUDA device: an attribute of its Python object, which torch keeps for as
# long as the storage lives once it has attributes (a weak set would lose it with the first wrapper object).
_FOR_GPU = "_shadow_made_for_gpu"
_IS_CUDA = torch.Tensor.is_cuda  # the property's descriptor: `x.is_cuda` reaches the mode as its __get__


class HostTensors(TorchFunctionMode):
    """The torch function mode of the module docstring (thread-local, like every torch function mode:
    it covers the thread that entered it). It notes the storages of the tensors made for a CUDA device
    (`is_cuda`, _FOR_GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self._noted_any = False  # a storage has been noted: ops look at their tensors' storages from then on
        self.default_for_gpu = False  # torch.set_default_device(<CUDA device>) is in effect (HostNames)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if getattr(func, "__self__", None) is _IS_CUDA:
            return self.is_cuda(args[0], caller=sys._getframe(1))
        for_gpu = None  # None: as its tensor arguments (an op on a CUDA tensor makes a CUDA tensor)
        if func is torch.Tensor.cuda:
            return self._noted(self._moved(args[0], args[0].to(_host_of(args[0])), True), True)
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cpu:
            for_gpu = False
        if func is torch.Tensor.to and len(args) > 1 and _names_device(args[1]):
            for_gpu = is_cuda_device(args[1])
            if for_gpu:
                args = (args[0], _host_of(args[0]), *args[2:])
        if kwargs.get("device") is not None:
            for_gpu = is_cuda_device(kwargs["device"])
        if for_gpu:
            if func in _RANDOM_FACTORIES and kwargs.get("generator") is None:
                kwargs["generator"] = torch.cuda._generator_of(kwargs["device"])  # the shim, in the context
            if "device" in kwargs:
                kwargs["device"] = _host_of(args[0] if args else None)
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        out = func(*args, **kwargs)
        if func in _MOVES and for_gpu is not None:
            out = self._moved(args[0], out, for_gpu)
        if args and out is args[0]:
            return out  # in place (x.copy_(y), x.add_(y)): x stays where it is
        if for_gpu is None and (self._noted_any or self.default_for_gpu):
            tensors = list(_tensors(args, kwargs))
            for_gpu = any(self._made_for_gpu(t) for t in tensors) if tensors else self.default_for_gpu
        return self._noted(out, for_gpu)

    def is_cuda(self, tensor: torch.Tensor, *, caller: Any) -> bool:
        """`x.is_cuda`: torch's own code gets the tensor's real answer (it is a host tensor); other code
        (the script's) gets whether it was made for a CUDA device."""
        while caller is not None and caller.f_code.co_name == "__torch_function__":
            caller = caller.f_back  # other torch function modes above this one (torch.device("cuda")'s)
        if is_torch_frame(caller):
            return _IS_CUDA.__get__(tensor)
        return self._made_for_gpu(tensor)

    @staticmethod
    def _made_for_gpu(tensor: torch.Tensor) -> bool:
        return getattr(_storage(tensor), _FOR_GPU, False)

    def _moved(self, tensor: torch.Tensor, out: Any, for_gpu: bool) -> Any:
        """A move between a CUDA device and the host is a copy, as on a GPU host: here torch returns the
        host tensor itself, so it is copied when the move changes what `is_cuda` answers."""
        if out is tensor and not tensor.is_meta and self._made_for_gpu(tensor) != for_gpu:
            return tensor.clone()
        return out

    def _noted(self, out: Any, for_gpu: bool) -> Any:
        if for_gpu:
            for t in _tensors((out,), {}):
                storage = _storage(t)
                if storage is not None and not t.is_meta:
                    setattr(storage, _FOR_GPU, True)
                    self._noted_any = True
        return out


def _names_device(arg: Any) -> bool:
    """Whether Tensor.to's second positional argument is a device (not a dtype or another tensor)."""
    return isinstance(arg, (torch.device, str)) or (isinstance(arg, int) and not isinstance(arg, bool))


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among the arguments, and inside lists and tuples one level down."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _storage(tensor: torch.Tensor) -> Any:
    """The tensor's storage (a DTensor's: its local shard's); None for a tensor without one."""
    if type(tensor) not in _PLAIN:
        to_local = getattr(tensor, "to_local", None)
        if to_local is not None:
            tensor = to_local()
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _HostGeneratorType(type(_REAL_GENERATOR)):  # type: ignore[misc]
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _REAL_GENERATOR)  # torch.Generator, while replaced, accepts every generator


class HostGenerator(_REAL_GENERATOR, metaclass=_HostGeneratorType):  # type: ignore[misc, valid-type]
    """torch.Generator inside the context: one asked for on a CUDA device is a host generator."""

    def __new__(cls, device: Any = "cpu") -> "HostGenerator":
        return super().__new__(cls, device="cpu" if is_cuda_device(device) else device)


class HostNames:
    """The stand-ins of the module docstring for torch.set_default_device, torch.Generator and
    Tensor.record_stream. Make it before entering the context (it notes the default device then), with the
    context's HostTensors mode; `names()` lists (owner, attribute, stand-in); `restore()` on exit sets the
    entry's default device again if the script changed it."""

    def __init__(self, mode: HostTensors) -> None:
        self._mode = mode
        self._set_default = torch.set_default_device
        self._entry_default = torch.get_default_device()
        self._changed = False

    def names(self) -> list[tuple[Any, str, Any]]:
        return [(torch, "set_default_device", self.set_default_device), (torch, "Generator", HostGenerator),
                (torch.Tensor, "record_stream", _record_stream)]

    def set_default_device(self, device: Any) -> None:
        """torch.set_default_device: a CUDA device becomes the host (tensors made from no tensor are
        then made for the GPU, `is_cuda`)."""
        self._changed = True
        self._mode.default_for_gpu = is_cuda_device(device)
        self._set_default("cpu" if is_cuda_device(device) else device)

    def restore(self) -> None:
        if self._changed:
            self._set_default(None if self._entry_default.type == "cpu" else self._entry_default)
            self._changed = False


_REAL_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tensor.record_stream: with the torch.cuda shim's stream, nothing to record (a host tensor's memory
    is not reused behind a stream's back); any other stream goes to torch."""
    if isinstance(stream, ShimStream):
        return None
    return _REAL_RECORD_STREAM(tensor, stream)
