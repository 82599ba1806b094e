"""A small `torch.cuda` stand-in for shape-only runs: GPUs that exist, do nothing and take no time.

What training code commonly asks torch.cuda is answered: is_available / device_count / current_device /
set_device / device(i), synchronize, Stream / Event / stream(s) / current_stream (an event's elapsed_time
is 0 ms: the device does no work), memory statistics (all zero; mem_get_info reports the modeled device
as empty), get_device_properties / get_device_name / get_device_capability / is_bf16_supported (the
modeled H100), is_initialized / init, amp (the real torch.cuda.amp: autocast and GradScaler; the host
tensors a script makes for the GPU are not CUDA tensors, so CUDA autocast leaves their dtype alone),
nvtx (range markers with nothing to record them). The random number state: one host generator per
device stands for its CUDA default generator (`default_generators`), and manual_seed(_all) / seed(_all) /
initial_seed / get_rng_state(_all) / set_rng_state(_all) act on it; shadow.cuda_tensors draws the random
tensors a script asks for on a CUDA device (torch.randn(..., device="cuda")) from it.

Private names (`torch.cuda._...`, used by torch itself, e.g. `_is_in_bad_fork` from torch.manual_seed)
fall through to the real module, and so does any name torch's own modules look up (torch._dynamo's
device tables bind torch.cuda.set_stream & co. at import: they are only called for CUDA tensors, which a
shape-only run never has); any other public name raises AttributeError naming the shim, so a gap in
what training code asks shows up as a clear error instead of a silent wrong answer.

One shim per `shadow.active` context; its state (current device) lives on the shim object.
"""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator

H100_MEMORY_BYTES = 80 * 1024**3  # modeling assumption: the profiles' hosts are 8 x H100 80 GB


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._recorded = False

    def record(self, stream: Any = None) -> None:
        self._recorded = True

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: "Event") -> float:
        """Milliseconds between two events: shape-only work takes no device time here (the emulator
        models durations on its virtual clock instead)."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("both events need enable_timing=True")
        if not (self._recorded and end_event._recorded):
            raise RuntimeError("both events must be recorded before calculating elapsed time")
        return 0.0


class Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device, self.priority = device, priority

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    @property
    def cuda_stream(self) -> int:
        return 0  # the null stream's handle; nothing is ever launched on it


class _Properties(types.SimpleNamespace):
    pass


class _Nvtx:
    """torch.cuda.nvtx: range markers for a profiler; none records them here. Depths are counted as
    NVTX counts them (range_pop with no open range: -1)."""

    def __init__(self) -> None:
        self._depth = 0
        self._next_id = 0

    def range_push(self, msg: str) -> int:
        self._depth += 1
        return self._depth - 1

    def range_pop(self) -> int:
        if self._depth == 0:
            return -1
        self._depth -= 1
        return self._depth

    def range_start(self, msg: str) -> int:
        self._next_id += 1
        return self._next_id

    def range_end(self, range_id: int) -> None:
        pass

    def mark(self, msg: str) -> None:
        pass

    @contextmanager
    def range(self, msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        self.range_push(msg.format(*args, **kwargs))
        try:
            yield
        finally:
            self.range_pop()


class _Generators:
    """The CUDA default generators' host stand-ins, one per device (module docstring). `index(device)`:
    the shim's ordinal of a device (None: the current one)."""

    def __init__(self, device_count: int, index: Callable[[Any], int]) -> None:
        import torch

        self.generators = tuple(torch.Generator() for _ in range(device_count))
        self.index = index

    def names(self) -> dict[str, Any]:
        return dict(default_generators=self.generators, manual_seed=self.manual_seed,
                    manual_seed_all=self.manual_seed_all, seed=self.seed, seed_all=self.seed_all,
                    initial_seed=self.initial_seed, get_rng_state=self.get_rng_state,
                    get_rng_state_all=self.get_rng_state_all, set_rng_state=self.set_rng_state,
                    set_rng_state_all=self.set_rng_state_all)

    def of(self, device: Any = None) -> Any:
        """The generator of a device (None: the current one): shadow.cuda_tensors draws a script's random
        tensors asked for on that device from it (the shim's `_generator_of`)."""
        return self.generators[self.index(device)]

    def manual_seed(self, seed: int) -> None:
        self.of().manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        for g in self.generators:
            g.manual_seed(seed)

    def seed(self) -> None:
        self.of().seed()

    def seed_all(self) -> None:
        self.manual_seed_all(self.generators[0].seed())

    def initial_seed(self) -> int:
        return self.of().initial_seed()

    def get_rng_state(self, device: Any = "cuda") -> Any:
        return self.of(device).get_state()

    def get_rng_state_all(self) -> list[Any]:
        return [g.get_state() for g in self.generators]

    def set_rng_state(self, new_state: Any, device: Any = "cuda") -> None:
        self.of(device).set_state(new_state)

    def set_rng_state_all(self, new_states: Any) -> None:
        for i, new_state in enumerate(new_states):
            self.set_rng_state(new_state, i)


def make_cuda_shim(*, device_count: int, real: Any = None, device_name: str = "Emulated H100 (shape-only)",
                   total_memory: int = H100_MEMORY_BYTES) -> types.ModuleType:
    """A module object to install as `torch.cuda`. `real` is the real torch.cuda (private fallbacks)."""
    if device_count < 1:
        raise ValueError(f"device_count must be >= 1, got {device_count}")
    import torch

    shim = types.ModuleType("torch.cuda", "shadow.cuda_shim: torch.cuda for shape-only emulation")
    state = {"device": 0}
    default_stream = Stream(0)

    def _index(device: Any = None) -> int:
        if device is None:
            return state["device"]
        if not isinstance(device, int):
            device = torch.device(device)
            if device.type != "cuda":
                raise ValueError(f"expected a cuda device, got {device}")
        index = device if isinstance(device, int) else device.index
        if index is None:  # "cuda": the current device
            index = state["device"]
        if not 0 <= index < device_count:
            raise RuntimeError(f"invalid device ordinal {index} (the shim has {device_count} devices)")
        return index

    def set_device(device: Any) -> None:
        state["device"] = _index(device)

    @contextmanager
    def device(dev: Any) -> Iterator[None]:
        saved = state["device"]
        state["device"] = _index(dev)
        try:
            yield
        finally:
            state["device"] = saved

    @contextmanager
    def stream(s: Stream | None) -> Iterator[None]:
        yield

    def get_device_properties(dev: Any = None) -> _Properties:
        _index(dev)
        return _Properties(name=device_name, total_memory=total_memory, multi_processor_count=132,
                           major=9, minor=0, is_integrated=False)

    # A distinct function object per name: torch._dynamo keys its rules by the functions it finds under
    # torch.cuda, and one object under two names with different rules makes it refuse to import.
    def zero() -> Any:  # memory statistics: shape-only tensors allocate nothing
        return lambda device=None: 0

    def nothing() -> Any:
        return lambda *a, **k: None

    generators = _Generators(device_count, _index)
    names = dict(
        is_available=lambda: True, is_initialized=lambda: True, init=nothing(),
        device_count=lambda: device_count, current_device=lambda: state["device"], set_device=set_device,
        device=device, synchronize=lambda device=None: None, Stream=Stream, Event=Event, stream=stream,
        current_stream=lambda device=None: default_stream, default_stream=lambda device=None: default_stream,
        get_device_name=lambda device=None: get_device_properties(device).name,
        get_device_properties=get_device_properties,
        get_device_capability=lambda device=None: (9, 0),
        memory_allocated=zero(), max_memory_allocated=zero(), memory_reserved=zero(), max_memory_reserved=zero(),
        reset_peak_memory_stats=nothing(), empty_cache=nothing(),
        memory_stats=lambda device=None: {"allocated_bytes.all.current": 0, "reserved_bytes.all.current": 0},
        mem_get_info=lambda device=None: (total_memory, total_memory),
        is_bf16_supported=lambda including_emulation=True: True, nvtx=_Nvtx(),
        **generators.names(),
    )
    if real is not None:
        names["amp"] = real.amp  # pure Python over torch.cuda: with the shim installed it asks the shim
    shim.__dict__.update(names)
    shim.__all__ = sorted(names)
    shim._generator_of = generators.of  # for shadow.cuda_tensors only (private: not in __all__)

    def __getattr__(name: str) -> Any:
        if real is not None and (name.startswith("_") or _called_from_torch(1)):
            return getattr(real, name)  # torch's own internals (e.g. _is_in_bad_fork, dynamo's tables)
        raise AttributeError(f"torch.cuda.{name} is not provided by the shadow loader's torch.cuda shim "
                             f"(shadow/cuda_shim.py); add it there if training code needs it")

    shim.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return shim


def _called_from_torch(depth: int = 1) -> bool:
    """Whether the code that called our caller (`depth` 1; 2: its caller, ...) is torch's own, e.g. the
    lookup that reached a module __getattr__."""
    return is_torch_frame(sys._getframe(depth + 1))


def is_torch_frame(frame: Any) -> bool:
    """Whether `frame` runs code of torch's own modules (None: no)."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name == "torch" or name.startswith("torch.")


def accelerator_names(shim: types.ModuleType, real: Any) -> dict[str, Callable[..., Any]]:
    """Stand-ins for torch.accelerator's functions (`real`: the module), as a GPU host answers them for
    the shim's modeled GPUs: a CUDA accelerator, the shim's devices, current device and streams, zero
    memory. Only code outside torch gets these answers: torch's own code (a DataLoader choosing where to
    pin, an optimizer's step) gets the real module's, since the tensors it handles are host tensors. The
    names this torch's torch.accelerator lacks are left out."""
    import torch

    @contextmanager
    def device_index(device: Any) -> Iterator[None]:
        if device is None:
            yield
        else:
            with shim.device(device):
                yield

    answers: dict[str, Callable[..., Any]] = dict(
        is_available=lambda: True, current_accelerator=lambda check_available=False: torch.device("cuda"),
        device_count=shim.device_count, current_device_index=shim.current_device,
        current_device_idx=shim.current_device, set_device_index=shim.set_device, set_device_idx=shim.set_device,
        device_index=device_index, synchronize=shim.synchronize, current_stream=shim.current_stream,
        set_stream=lambda stream: None, empty_cache=shim.empty_cache, memory_allocated=shim.memory_allocated,
        max_memory_allocated=shim.max_memory_allocated, memory_reserved=shim.memory_reserved,
        max_memory_reserved=shim.max_memory_reserved, memory_stats=shim.memory_stats,
        reset_peak_memory_stats=shim.reset_peak_memory_stats, get_memory_info=shim.mem_get_info)
    return {name: _outside_torch(answer, getattr(real, name)) for name, answer in answers.items()
            if hasattr(real, name)}


def _outside_torch(answer: Callable[..., Any], real: Callable[..., Any]) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return (real if _called_from_torch(1) else answer)(*args, **kwargs)

    stand_in.__name__, stand_in.__doc__ = getattr(real, "__name__", "stand_in"), real.__doc__
    return stand_in
