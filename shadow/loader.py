"""The shadow loader: inside `with active(profile):` GPU-targeted modules import as their CPU mocks.

    with shadow.active(profile):
        import ftrun.ftar.cuda_kernels as k     # -> the code of mocks.ftar_kernels, named ftrun.ftar.cuda_kernels
        torch.cuda.is_available()               # -> True (shadow.cuda_shim), device_count() = GPUs per host

How: a meta path finder (first on sys.meta_path) answers for every real module in the registry with a
loader that executes the mock's code in a fresh module object carrying the real name, so the training
code imports and runs unchanged, and the mock module itself is never modified. Real modules imported
before the context are set aside (sys.modules and their parent package's attribute) and put back on
exit; shadow modules are dropped on exit. `torch.cuda` is replaced by a shim object (sys.modules and
the `torch.cuda` attribute) and restored on exit, when torch is installed; with it, tensors asked for on a
CUDA device are made on the host (shadow.cuda_tensors: a torch function mode of the entering thread, and
stand-ins for torch.set_default_device, torch.Generator and Tensor.record_stream, and shadow.cuda_dist's
for torch.distributed's init_process_group, new_group, init_device_mesh and DeviceMesh.__init__, set as
attributes and put back on exit, with the default device found on entry; a CUDA mesh is checked against
the profile's layout), and
torch.accelerator answers for the shim's GPUs to code outside torch (shadow.cuda_shim.accelerator_names).
`environ=` sets variables in os.environ for the block (a launcher's, for the rank a script's process stands
for) and puts them back on exit.

Only one context may be active at a time (the import system is process-wide); nesting raises
RuntimeError. Modules imported inside the context that bound a shadow module by name keep it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from shadow.cuda_shim import accelerator_names, make_cuda_shim
from shadow.registry import Registry, load_registry

_MISSING = object()


class ShadowLoader(importlib.abc.Loader):
    """Executes the mock's code under the real module's name."""

    def __init__(self, real: str, mock: str) -> None:
        self.real, self.mock = real, mock

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__shadow_of__ = self.mock  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        spec = importlib.util.find_spec(self.mock)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            raise ImportError(f"shadow loader: mock {self.mock!r} for {self.real!r} cannot be found", name=self.real)
        code = spec.loader.get_code(self.mock)
        module.__file__ = spec.origin
        exec(code, module.__dict__)


class ShadowFinder(importlib.abc.MetaPathFinder):
    def __init__(self, modules: dict[str, str]) -> None:
        self.modules = dict(modules)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        mock = self.modules.get(fullname)
        if mock is None:
            return None
        return importlib.util.spec_from_loader(fullname, ShadowLoader(fullname, mock), origin=f"shadow:{mock}")


class _Active:
    """What an active context changed, so that exit can undo exactly that."""

    def __init__(self) -> None:
        self.saved_modules: dict[str, Any] = {}
        self.saved_attrs: list[tuple[Any, str, Any]] = []
        self.saved_environ: dict[str, str | None] = {}  # None: it was not set
        self.mode: Any = None  # the torch function mode entered (cuda_tensors.HostTensors)
        self.host_names: Any = None  # cuda_tensors.HostNames, whose restore() puts the default device back
        self.host_groups: Any = None  # cuda_dist.HostGroups, whose restore() destroys the group it made
        self.finder: ShadowFinder | None = None
        self.session: Any = None


_state: dict[str, _Active | None] = {"active": None}  # process-wide by nature: sys.meta_path is


def _gpus_per_host(profile: Any) -> int:
    topo = getattr(profile, "topology", None)
    return int(getattr(topo, "gpus_per_host", 8)) if topo is not None else 8


@contextmanager
def active(profile: Any = None, *, registry: Registry | None = None, cuda_shim: bool = True,
           session: Any = None, environ: Mapping[str, str] | None = None) -> Iterator[Registry]:
    """Install the import hook (and the torch.cuda shim) for the duration of the block.

    Args:
        profile: a harness.profile.Profile (or None); the shim reports its gpus_per_host devices.
        registry: real -> mock table; default mocks/shadow_registry.toml.
        cuda_shim: also replace torch.cuda (when torch is installed).
        session: what the mocks hand their work to inside the block (`current()`), e.g. the emulator's
            runner of a script's training job (mocks.train_api); None: nothing to hand to.
        environ: variables set in os.environ for the block (what a launcher sets for the rank a script's
            process stands for, e.g. RANK and LOCAL_RANK), put back on exit.
    Yields the registry in use. Raises RuntimeError when a context is already active.
    """
    if _state["active"] is not None:
        raise RuntimeError("shadow.active() is already in effect; it does not nest")
    bad = {k: v for k, v in (environ or {}).items() if not (isinstance(k, str) and isinstance(v, str) and k)}
    if bad:
        raise ValueError(f"shadow.active(environ=...): names and values must be strings, got {bad!r}")
    registry = registry if registry is not None else load_registry()
    undo = _Active()
    undo.session = session
    _state["active"] = undo
    try:
        for real in registry.modules:
            _set_aside(undo, real)
        for name, value in (environ or {}).items():
            undo.saved_environ.setdefault(name, os.environ.get(name))
            os.environ[name] = value
        if cuda_shim:
            _install_cuda_shim(undo, profile)
        undo.finder = ShadowFinder(registry.modules)
        sys.meta_path.insert(0, undo.finder)
        importlib.invalidate_caches()
        yield registry
    finally:
        _restore(undo, registry)
        _state["active"] = None


def is_active() -> bool:
    return _state["active"] is not None


def current() -> Any:
    """The session of the active context (`active(session=...)`). Raises RuntimeError outside one or
    when it was given none: a mock that needs the emulator cannot work without it."""
    undo = _state["active"]
    if undo is None or undo.session is None:
        raise RuntimeError("no shadow session: this runs only inside shadow.active(session=...) "
                           "(e.g. `ftrun emulate SCRIPT.py`)")
    return undo.session


def _set_aside(undo: _Active, name: str) -> None:
    """Take an already-imported real module out of sys.modules and off its parent package."""
    undo.saved_modules[name] = sys.modules.pop(name, _MISSING)
    parent_name, _, attr = name.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is not None and hasattr(parent, attr):
        undo.saved_attrs.append((parent, attr, getattr(parent, attr)))
        delattr(parent, attr)


def _install_cuda_shim(undo: _Active, profile: Any) -> None:
    try:
        import torch

        from shadow.cuda_dist import HostGroups
        from shadow.cuda_tensors import HostNames, HostTensors
    except ImportError:
        return  # nothing to shim: code that needs torch.cuda needs torch first
    real = sys.modules.get("torch.cuda")
    shim = make_cuda_shim(device_count=_gpus_per_host(profile), real=real)
    undo.saved_modules["torch.cuda"] = sys.modules.get("torch.cuda", _MISSING)
    undo.saved_attrs.append((torch, "cuda", getattr(torch, "cuda", _MISSING)))
    sys.modules["torch.cuda"] = shim
    torch.cuda = shim  # type: ignore[assignment]
    undo.mode = HostTensors()
    layout = (profile.replicas, profile.ranks_per_replica) if hasattr(profile, "ranks_per_replica") else None
    undo.host_names = HostNames(undo.mode)
    undo.host_groups = HostGroups(layout=layout)
    stand_ins = undo.host_names.names() + undo.host_groups.names()
    stand_ins += [(torch.accelerator, name, fn) for name, fn in accelerator_names(shim, torch.accelerator).items()]
    for owner, attr, stand_in in stand_ins:
        undo.saved_attrs.append((owner, attr, vars(owner).get(attr, _MISSING)))  # _MISSING: inherited (a class's)
        setattr(owner, attr, stand_in)
    undo.mode.__enter__()
    _forget_device_modules(torch)


def _forget_device_modules(torch: Any) -> None:
    """torch.get_device_module caches its answers (functools.cache in torch 2.13): forget them whenever
    torch.cuda changes, or torch.random.fork_rng & co. would keep reaching the torch.cuda of before."""
    cache_clear = getattr(torch.get_device_module, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _restore(undo: _Active, registry: Registry) -> None:
    if undo.mode is not None:
        undo.mode.__exit__(None, None, None)
    if undo.host_names is not None:
        undo.host_names.restore()
    if undo.host_groups is not None:
        undo.host_groups.restore()
    if undo.finder is not None and undo.finder in sys.meta_path:
        sys.meta_path.remove(undo.finder)
    for real in registry.modules:  # drop the shadow modules imported inside the context
        mod = sys.modules.get(real)
        if mod is not None and getattr(mod, "__shadow_of__", None) is not None:
            del sys.modules[real]
            parent_name, _, attr = real.rpartition(".")
            parent = sys.modules.get(parent_name)
            if parent is not None and getattr(parent, attr, None) is mod:
                delattr(parent, attr)
    for name, mod in undo.saved_modules.items():
        if mod is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod
    for obj, attr, value in reversed(undo.saved_attrs):
        if value is _MISSING:
            if hasattr(obj, attr):
                delattr(obj, attr)
        else:
            setattr(obj, attr, value)
    for name, value in undo.saved_environ.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if undo.mode is not None:
        _forget_device_modules(sys.modules["torch"])
    importlib.invalidate_caches()
