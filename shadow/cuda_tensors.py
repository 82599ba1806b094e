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
stand-ins for them (installed as attributes of torch / torch.distributed / torch.Tensor, put back on exit):

- torch.set_default_device(<CUDA device>) sets the host as the default device (torch's default-device
  mode sits below every other mode, so it would fill in "cuda" after this one looked); on exit the
  default device found on entry is set again;
- torch.Generator(device=<CUDA device>) is a host generator (a subclass; isinstance checks against
  torch.Generator still accept every generator);
- Tensor.record_stream(<a torch.cuda shim stream>) records nothing (torch would refuse the shim's stream
  before any mode saw the call; a host tensor's memory is not reused behind a stream's back);
- torch.distributed.init_process_group and new_group make gloo groups with no bound device: an NCCL backend
  ("nccl", "cpu:gloo,cuda:nccl"), or none given, becomes gloo and a CUDA device_id is dropped (the tensors they
  reduce are host tensors). An init_process_group without a store= is a one-rank group on a HashStore
  instead of a rendezvous: a torchrun-style `init_process_group("nccl")` reading RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT, an init_method, or the script's own rank and world_size; the context destroys
  it on exit if the script did not. The script's process is the one rank it traces (rank 0, world size 1);
  `ftrun emulate` sets the launcher's variables for that rank as `ftrun launch` would
  (mocks.train_api.launcher_environ: RANK 0, LOCAL_RANK 0, WORLD_SIZE the job's ranks, LOCAL_WORLD_SIZE a
  replica's), so torch.cuda.set_device(int(os.environ["LOCAL_RANK"])) selects a modeled GPU;
- torch.distributed(.device_mesh).init_device_mesh("cuda", shape, mesh_dim_names=...) and a DeviceMesh("cuda",
  ranks, mesh_dim_names=...) built directly are a DeviceMesh on the host with the script's dimension names and
  ONE rank in each dimension, over a one-rank gloo group made the default one when there is none (destroyed
  on exit). The script's process is rank 0 of the emulated job and traces one rank's step
  (mocks.train_api): fully_shard(model, mesh=mesh) shards its model for real over that one rank, so the
  traced step runs FSDP2's (or, 2-D, HSDP's) hooks on the rank's whole micro-batch, while the emulated ranks
  shard the model over the profile's layout (mocks.script). The shape (of the ranks, for a DeviceMesh) must
  be that layout (`check_mesh_shape`): (ranks per replica,), or (replicas, ranks per replica) for
  ("replicate", "shard"), where FTAR across the replicas is the replicate dimension; other shapes, 3-D
  meshes (tensor / pipeline parallel) and backend_override fail naming the idiom. mesh.size(), the groups'
  sizes and dist.get_world_size() are 1: a script that sizes its batch or its mesh by them traces a batch
  larger than its ranks' or is refused (use job.spec.ranks_per_replica or LOCAL_WORLD_SIZE, as a script
  on ftrun does);
- fully_shard(model) without a mesh=: FSDP2 makes the default group if there is none (the one-rank group
  above) and asks init_device_mesh for a mesh of the build's accelerator over it; asked by torch's own code
  (`is_torch_frame`), a CUDA mesh is the host mesh of that shape (one rank), so the model is sharded as on an
  explicit mesh. The stand-ins replace the real functions under every name a loaded torch.distributed module
  binds them by (FSDP2's default-mesh module included once loaded; one loaded inside the context binds the
  stand-in itself), so the context imports no FSDP2 (about a second) on entry; a stand-in a module keeps
  after the context calls torch's own function.

torch.accelerator's functions answer, to code outside torch, for the shim's modeled GPUs (a CUDA
accelerator, gpus_per_host devices: shadow.cuda_shim.accelerator_names); torch's own code gets the
real build's answers.

A CUDA device is a torch.device or a string of type cuda ("cuda", "cuda:3"), or an int ordinal passed to
Tensor.to / as device=. With the torch.cuda shim (shadow.cuda_shim: is_available() is True, set_device,
synchronize, streams, events, autocast and GradScaler through torch.cuda.amp), ftrun's device seam
(ftrun.train.device) and a script's own CUDA calls run unchanged. Not covered: a tensor's device reports
the host (x.device.type is "cpu"; is_cuda, above, is the script's answer); a DataLoader's pin-memory
thread (pin_memory=True with workers: the mode covers the entering thread, and on a CUDA build that
thread pins through torch.accelerator); a script whose torch.distributed groups span processes (the
script's process is one rank: a group made on its own store= of more than one rank waits for peers that
never come). Outside the emulator: a real `ftrun launch` sets RANK and WORLD_SIZE for the whole job and
MASTER_ADDR/PORT to its own store, so there a torchrun-style init_process_group from the environment fails
(rank 0 cannot listen on the store's port) and a group across replicas would be the wrong fault domain;
under `ftrun launch` the replica's group is ftrun's (job.wrap shards over it).
"""

from __future__ import annotations

import functools
import inspect
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


def _host_backend(backend: Any) -> Any:
    """A process group backend for host tensors: any NCCL part of `backend` becomes gloo."""
    if isinstance(backend, str) and "nccl" in backend.lower():
        return "gloo"
    return backend


class HostNames:
    """The stand-ins of the module docstring for torch.set_default_device, torch.Generator,
    Tensor.record_stream and torch.distributed's init_process_group, new_group, init_device_mesh and
    DeviceMesh. Make it before entering the context (it notes the default device then), with the context's
    HostTensors mode and the job's layout (replicas, ranks per replica; None: any mesh shape). `names()`
    lists (owner, attribute, stand-in) and makes this the context's HostNames, through which the
    torch.distributed stand-ins answer (`_ACTIVE`); `restore()` on exit sets the entry's default device
    again if the script changed it, destroys the one-rank process group the context made and ends that."""

    def __init__(self, mode: HostTensors, *, layout: tuple[int, int] | None = None) -> None:
        self._mode, self._layout = mode, layout
        self._set_default = torch.set_default_device
        self._entry_default = torch.get_default_device()
        self._changed = False
        self._made_group = False

    def names(self) -> list[tuple[Any, str, Any]]:
        out: list[tuple[Any, str, Any]] = [(torch, "set_default_device", self.set_default_device),
                                           (torch, "Generator", HostGenerator),
                                           (torch.Tensor, "record_stream", _record_stream)]
        if _DISTRIBUTED:
            _ACTIVE[:] = [self]
            out += _distributed_names()
        return out

    def set_default_device(self, device: Any) -> None:
        """torch.set_default_device: a CUDA device becomes the host (tensors made from no tensor are
        then made for the GPU, `is_cuda`)."""
        self._changed = True
        self._mode.default_for_gpu = is_cuda_device(device)
        self._set_default("cpu" if is_cuda_device(device) else device)

    # -- torch.distributed (each takes the real function and the frame that called the stand-in) -----------
    def init_process_group(self, real: Any, caller: Any, *args: Any, **kwargs: Any) -> None:
        """A host backend (`_host_group_arguments`; gloo for none); without a store= it is a one-rank group on a HashStore,
        not a rendezvous through the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT) or an
        init_method: the script's process is the one rank it traces (torchrun-style
        `init_process_group("nccl")`, and FSDP2's own call when fully_shard finds no default group)."""
        bound = _host_group_arguments(real, args, kwargs)
        if bound.arguments.get("backend") is None:  # torch's default: NCCL too on a CUDA build
            bound.arguments["backend"] = "gloo"
        one_rank = bound.arguments.get("store") is None
        if one_rank:
            for name in ("init_method", "rank", "world_size"):
                bound.arguments.pop(name, None)
            bound.arguments.update(store=torch.distributed.HashStore(), rank=0, world_size=1)
        real(*bound.args, **bound.kwargs)
        self._made_group = self._made_group or one_rank

    def new_group(self, real: Any, caller: Any, *args: Any, **kwargs: Any) -> Any:
        bound = _host_group_arguments(real, args, kwargs)
        return real(*bound.args, **bound.kwargs)

    def init_device_mesh(self, real: Any, caller: Any, device_type: str, mesh_shape: tuple[int, ...], *,
                         mesh_dim_names: Any = None, **kwargs: Any) -> Any:
        """A CUDA mesh the script asks for is one rank per dimension on the host (`host_mesh`); one torch's
        own code asks for (FSDP2's default mesh, over the default group: fully_shard without mesh=) is the
        host mesh of that shape."""
        shape = tuple(mesh_shape)
        if is_cuda_device(device_type):
            if not is_torch_frame(caller):
                kwargs = self.host_mesh(f"init_device_mesh({device_type!r}, {shape})", shape, kwargs)
                shape = (1,) * len(shape)
            device_type = "cpu"
        return real(device_type, shape, mesh_dim_names=mesh_dim_names, **kwargs)

    def host_mesh(self, idiom: str, shape: tuple[int, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """What a CUDA mesh of `shape` the script asks for (`idiom`) needs before torch makes it one rank per
        dimension on the host: its shape checked against the layout (`check_mesh_shape`), no backend_override,
        and a one-rank default group (made if there is none). Returns the mesh's other keyword arguments."""
        check_mesh_shape(shape, self._layout, idiom)
        if kwargs.get("backend_override"):
            raise ValueError(f"{idiom} with backend_override under the shadow loader: the mesh's groups are gloo "
                             f"groups on the host; leave backend_override out")
        kwargs = {k: v for k, v in kwargs.items() if k != "backend_override"}
        dist = torch.distributed
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._made_group = True
        elif dist.get_world_size() != 1:
            raise RuntimeError(f"{idiom} under the shadow loader: the script's process is one rank, but its "
                               f"default process group has {dist.get_world_size()}")
        return kwargs

    def restore(self) -> None:
        if self._changed:
            self._set_default(None if self._entry_default.type == "cpu" else self._entry_default)
            self._changed = False
        if self._made_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._made_group = False
        if _ACTIVE and _ACTIVE[0] is self:
            _ACTIVE.clear()


_ACTIVE: list[HostNames] = []  # the active context's HostNames (none outside one: shadow.active does not nest)
_DISTRIBUTED = torch.distributed.is_available()


def _dispatching(name: str, real: Any) -> Any:
    """The stand-in for torch.distributed's `name` (the function `real`): the active context's HostNames
    answers it (its method `name`), and `real` outside a context, so a module imported inside one, which
    keeps the stand-in it bound, calls torch's own afterwards."""
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        names = _ACTIVE[0] if _ACTIVE else None
        if names is None:
            return real(*args, **kwargs)
        return getattr(names, name)(real, sys._getframe(1), *args, **kwargs)

    return functools.update_wrapper(stand_in, real)


if _DISTRIBUTED:
    import torch.distributed.device_mesh as _device_mesh

    _STAND_INS = {name: (real, _dispatching(name, real)) for name, real in (
        ("init_process_group", torch.distributed.init_process_group), ("new_group", torch.distributed.new_group),
        ("init_device_mesh", _device_mesh.init_device_mesh))}
    _REAL_MESH_INIT = _device_mesh.DeviceMesh.__init__


def _distributed_names() -> list[tuple[Any, str, Any]]:
    """The torch.distributed stand-ins, under every name a loaded torch.distributed module binds the real
    function by (torch.distributed, its distributed_c10d and device_mesh, and once loaded e.g.
    torch.distributed.tensor and FSDP2's default-mesh module), so that fully_shard without mesh= reaches
    them without this importing FSDP2 (about a second) for every context; a module loaded inside the
    context binds the stand-in itself. And DeviceMesh.__init__."""
    out = []
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "torch.distributed" or name.startswith("torch.distributed.")):
            bound = vars(module)
            out += [(module, attr, stand_in) for attr, (real, stand_in) in _STAND_INS.items()
                    if bound.get(attr) is real]
    out.append((_device_mesh.DeviceMesh, "__init__", _device_mesh_init))
    return out


def _device_mesh_init(mesh_self: Any, device_type: str, mesh: Any = None, *args: Any, **kwargs: Any) -> None:
    """DeviceMesh.__init__ inside the context: the script's `DeviceMesh(<CUDA device>, mesh)` is a mesh of
    one rank per dimension on the host, as its init_device_mesh is (HostNames.host_mesh checks the shape of
    `mesh` against the layout); torch's own DeviceMesh constructions go to torch."""
    names = _ACTIVE[0] if _ACTIVE else None
    if names is not None and is_cuda_device(device_type) and not is_torch_frame(sys._getframe(1)):
        if mesh is None:
            raise ValueError(f"DeviceMesh({device_type!r}) under the shadow loader: give the mesh of ranks")
        shape = tuple(torch.as_tensor(mesh).shape)
        kwargs = names.host_mesh(f"DeviceMesh({device_type!r}, <a mesh of shape {shape}>)", shape, kwargs)
        device_type, mesh = "cpu", torch.zeros((1,) * len(shape), dtype=torch.int)
    _REAL_MESH_INIT(mesh_self, device_type, mesh, *args, **kwargs)


def check_mesh_shape(shape: tuple[int, ...], layout: tuple[int, int] | None, idiom: str) -> None:
    """A CUDA mesh's shape against the emulated job's layout (replicas, ranks per replica): a 1-D mesh
    is a replica's ranks (FSDP2 shards over them), a 2-D one (replicate, shard) is the replicas by a
    replica's ranks (HSDP: FTAR replicates across the replicas). `idiom`: how the script asked for it.
    Raises ValueError naming the idiom and the shape to use."""
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise ValueError(f"{idiom}: every mesh dimension must be an int >= 1")
    if len(shape) not in (1, 2):
        raise ValueError(f"{idiom} under the shadow loader: the emulator models data parallelism only, a 1-D "
                         f"mesh (ranks per replica,) or a 2-D one (replicas, ranks per replica); a mesh of "
                         f"{len(shape)} dimensions (tensor, pipeline or context parallel) is not emulated")
    if layout is None:
        return
    replicas, ranks = layout
    want = (ranks,) if len(shape) == 1 else (replicas, ranks)
    if shape != want:
        one = (" (dist.get_world_size() is 1 in the script's process: it traces one rank)"
               if shape == (1,) * len(shape) else "")
        raise ValueError(f"{idiom} under the shadow loader: the profile's job is {replicas} replicas of {ranks} "
                         f"ranks, and its emulated ranks shard the model over a replica's {ranks} ranks; use "
                         f"{want} (job.spec.ranks_per_replica" + (")" if len(shape) == 1 else
                         ", with job.spec.num_replicas first)") + one)


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _host_group_arguments(real: Any, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """The arguments of a call of `real` (init_process_group or new_group) with any NCCL part of its backend
    made gloo and a CUDA device_id dropped: the group reduces host tensors."""
    signature = _SIGNATURES.get(real) or _SIGNATURES.setdefault(real, inspect.signature(real))
    bound = signature.bind(*args, **kwargs)
    if "backend" in bound.arguments:
        bound.arguments["backend"] = _host_backend(bound.arguments["backend"])
    if is_cuda_device(bound.arguments.get("device_id")):
        bound.arguments["device_id"] = None
    return bound


_REAL_RECORD_STREAM = torch.Tensor.record_stream


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tensor.record_stream: with the torch.cuda shim's stream, nothing to record (a host tensor's memory
    is not reused behind a stream's back); any other stream goes to torch."""
    if isinstance(stream, ShimStream):
        return None
    return _REAL_RECORD_STREAM(tensor, stream)
