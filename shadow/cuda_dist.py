"""torch.distributed for a script's process inside `shadow.active`: it is the one rank it traces, on the host.

Under `ftrun emulate SCRIPT.py` the script's process traces one rank's step (mocks.train_api) while the
emulated ranks train shape-only; its process groups and device meshes are that rank's, made on the host.
`HostGroups` gives the context stand-ins (installed as attributes, put back on exit) for:

- torch.distributed.init_process_group and new_group make gloo groups with no bound device: an NCCL backend
  ("nccl", "cpu:gloo,cuda:nccl"), or none given, becomes gloo and a CUDA device_id is dropped (the tensors they
  reduce are host tensors). An init_process_group without a store= is a one-rank group on a HashStore
  instead of a rendezvous: a torchrun-style `init_process_group("nccl")` reading RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT, an init_method, or the script's own rank and world_size; the context destroys
  it on exit if the script did not. `ftrun emulate` sets the launcher's variables for the traced rank as
  `ftrun launch` would
  (mocks.train_api.launcher_environ: RANK 0, LOCAL_RANK 0, WORLD_SIZE the job's ranks, LOCAL_WORLD_SIZE a
  replica's), so torch.cuda.set_device(int(os.environ["LOCAL_RANK"])) selects a modeled GPU;
- torch.distributed(.device_mesh).init_device_mesh("cuda", shape, mesh_dim_names=...) and a DeviceMesh("cuda",
  ranks, mesh_dim_names=...) built directly are a DeviceMesh on the host with the script's dimension names and
  ONE rank in each dimension, over a one-rank gloo group made the default one when there is none (destroyed
  on exit). fully_shard(model, mesh=mesh) shards the model for real over that one rank, so the
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

Not covered: groups that span processes (the script's process is one rank: a default group on the script's
own store= of more than one rank is refused by name). And outside the emulator, a real `ftrun launch`
sets RANK and WORLD_SIZE for the whole job and MASTER_ADDR/PORT to the job's store, so there a torchrun-style
init_process_group from the environment fails (rank 0 cannot listen on the store's port), and a group
across replicas would be the wrong fault domain: under `ftrun launch` the replica's group is ftrun's
(job.wrap shards over it).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch

from shadow.cuda_shim import is_torch_frame
from shadow.cuda_tensors import is_cuda_device


class HostGroups:
    """The stand-ins of the module docstring, for the job's layout (replicas, ranks per replica; None: any
    mesh shape). `names()` lists (owner, attribute, stand-in) and makes this the context's HostGroups,
    through which the stand-ins answer (`_ACTIVE`); `restore()` on exit destroys the one-rank process group
    the context made and ends that. Each torch.distributed method takes the real function and the frame
    that called the stand-in."""

    def __init__(self, *, layout: tuple[int, int] | None = None) -> None:
        self._layout = layout
        self._made_group = False

    def names(self) -> list[tuple[Any, str, Any]]:
        if not torch.distributed.is_available():
            return []
        _ACTIVE[:] = [self]
        return _distributed_names()

    def init_process_group(self, real: Any, caller: Any, *args: Any, **kwargs: Any) -> None:
        """A host backend (`_host_group_arguments`; gloo for none); without a store= a one-rank group on a
        HashStore, not a rendezvous through the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
        or an init_method (torchrun-style `init_process_group("nccl")`, and FSDP2's own call when
        fully_shard finds no default group)."""
        bound = _host_group_arguments(real, args, kwargs)
        if bound.arguments.get("backend") is None:  # torch's default: NCCL too on a CUDA build
            bound.arguments["backend"] = "gloo"
        one_rank = bound.arguments.get("store") is None
        if not one_rank and bound.arguments.get("world_size", -1) not in (-1, 1):
            raise ValueError(f"init_process_group(store=..., world_size={bound.arguments['world_size']}) under the "
                             f"shadow loader: the script's process is one rank and no peer will join; leave "
                             f"store, rank and world_size out (torchrun-style) or give world_size=1")
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
            self.init_process_group(_STAND_INS["init_process_group"][0], None)
        elif dist.get_world_size() != 1:
            raise RuntimeError(f"{idiom} under the shadow loader: the script's process is one rank, but its "
                               f"default process group has {dist.get_world_size()}")
        return kwargs

    def restore(self) -> None:
        if self._made_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._made_group = False
        if _ACTIVE and _ACTIVE[0] is self:
            _ACTIVE.clear()


_ACTIVE: list[HostGroups] = []  # the active context's (none outside one: shadow.active does not nest)


def _dispatching(name: str, real: Any) -> Any:
    """The stand-in for torch.distributed's `name` (the function `real`): the active context's HostGroups
    answers it (its method `name`), and `real` outside a context, so a module imported inside one, which
    keeps the stand-in it bound, calls torch's own afterwards."""
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        groups = _ACTIVE[0] if _ACTIVE else None
        if groups is None:
            return real(*args, **kwargs)
        return getattr(groups, name)(real, sys._getframe(1), *args, **kwargs)

    return functools.update_wrapper(stand_in, real)


if torch.distributed.is_available():
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
    one rank per dimension on the host, as its init_device_mesh is (HostGroups.host_mesh checks the shape of
    `mesh` against the layout); torch's own DeviceMesh constructions go to torch."""
    groups = _ACTIVE[0] if _ACTIVE else None
    if groups is not None and is_cuda_device(device_type) and not is_torch_frame(sys._getframe(1)):
        if mesh is None:
            raise ValueError(f"DeviceMesh({device_type!r}) under the shadow loader: give the mesh of ranks")
        shape = tuple(torch.as_tensor(mesh).shape)
        kwargs = groups.host_mesh(f"DeviceMesh({device_type!r}, <a mesh of shape {shape}>)", shape, kwargs)
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


def _host_backend(backend: Any) -> Any:
    """A process group backend for host tensors: any NCCL part of `backend` becomes gloo."""
    if isinstance(backend, str) and "nccl" in backend.lower():
        return "gloo"
    return backend
