"""FSDP2 inside a replica: the replica's process group, sharding a model, local shards, failure reset.

A replica of K > 1 ranks shards its model with `torch.distributed.fsdp.fully_shard` (FSDP2, DTensor
parameters sharded on dim 0) over a gloo group of exactly its K ranks; K = 1 is plain replication and
touches none of this. Every rank's trainable state is its LOCAL shards (`local`): catch-up ships the same
rank's shards between replicas and the cross-replica FTAR reduces rank r's gradient shard in the ring of
rank r of every replica (FSDP2 already averaged it over the replica's K ranks in its reduce-scatter).

The group. FSDP2 and DTensor need torch's default process group (DeviceMesh asks for the global rank),
so `init_replica_group` makes the replica's K ranks the process's default group: one replica rank per
process, as `ftrun launch` starts them. It rendezvouses under a store prefix naming the replica and its
incarnation, so a restarted replica never meets the dead incarnation's keys. Its timeout bounds how long
a rank waits in a collective for a hung peer; a dead peer is seen at once through its closed connection.
A torchrun-style script makes that group itself (`dist.init_process_group()` from the launcher's
environment, which describes the replica's world: ftrun.launch.worker_env); `adopt_replica_group` takes
it over when it is the replica's, and `check_sharded` accepts a model the script already sharded with
fully_shard over it.

torch.distributed.tensor costs about half a second to import: nothing here imports it until a replica
is actually sharded (`is_dtensor` is false while the module is not loaded, since then no tensor can be
a DTensor), so a one-rank replica restarts that much sooner.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

ShardFn = Callable[[torch.nn.Module, Any], None]  # (model, DeviceMesh): shards the model in place


def fsdp_prefix(replica_id: str, incarnation: int) -> str:
    """The store prefix of one incarnation's FSDP group (a restarted replica gets a fresh one)."""
    return f"{replica_id}/{incarnation}/fsdp/"


def init_replica_group(*, store: dist.Store, replica_id: str, incarnation: int, rank: int, world_size: int,
                       timeout_s: float):
    """Make the replica's ranks this process's default (gloo) group; return its 1-D CPU DeviceMesh.

    Raises ValueError for a bad rank/size and RuntimeError when a default group already exists (one
    replica rank per process) or the rendezvous fails within `timeout_s`.
    """
    if world_size < 2:
        raise ValueError(f"a sharded replica needs at least 2 ranks, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a replica of {world_size} ranks")
    if dist.is_initialized():
        raise RuntimeError("this process already has a default process group: one replica rank per process")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.PrefixStore(fsdp_prefix(replica_id, incarnation), store),
                            rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return init_device_mesh("cpu", (world_size,))


def adopt_replica_group(*, rank: int, world_size: int, timeout_s: float):
    """The process's default group (there must be one), made by the script (init_process_group from the
    launcher's environment), as the replica's group: its 1-D DeviceMesh (a CUDA one over an NCCL group;
    None for one rank), with `timeout_s` as its collectives' timeout like a group init_replica_group
    makes. Raises ValueError when it is not this replica's (rank, size)."""
    have = (dist.get_rank(), dist.get_world_size())
    if have != (rank, world_size):
        raise ValueError(
            f"the process's default process group has rank {have[0]} of {have[1]}, but this is rank {rank} of a "
            f"replica of {world_size} ranks: make it over the replica's ranks only (init_process_group() with "
            f"the RANK/WORLD_SIZE the launcher sets), or leave it to ftrun.train.init_from_env (make none)")
    if world_size < 2:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    return init_device_mesh(mesh_device_type(str(dist.get_backend())), (world_size,))


def mesh_device_type(backend: str) -> str:
    """The device type of a mesh over a group of `backend` ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...): a
    script's NCCL group carries CUDA tensors ("cuda"), a gloo one host tensors ("cpu"). Pure."""
    kinds = {part.rpartition(":")[2].strip().lower() for part in backend.split(",")}
    return "cuda" if "nccl" in kinds else "cpu"


def sharded_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that fully_shard made FSDP2 modules (none while FSDP2 is not loaded: then
    nothing can have been sharded)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def check_sharded(model: torch.nn.Module, world_size: int) -> bool:
    """Whether the user already sharded `model` with fully_shard (False: not at all). Raises ValueError when
    it is sharded in part (a unit but not the root) or over other ranks than the replica's `world_size`
    (a 1-D mesh of them), naming what to do."""
    units = sharded_units(model)
    if not units:
        return False
    if model not in units:
        raise ValueError("the model's submodules are sharded with fully_shard but the model itself is not: call "
                         "fully_shard(model) too (after its units), or shard none of it and let ftrun do it")
    for name, param in model.named_parameters():
        mesh = param.device_mesh if is_dtensor(param) else None
        if mesh is None or mesh.ndim != 1 or mesh.size() != world_size:
            where = "not sharded" if mesh is None else f"sharded on a mesh of shape {tuple(mesh.shape)}"
            raise ValueError(f"parameter {name!r} is {where}, but a replica of {world_size} ranks shards every "
                             f"parameter on a 1-D mesh of its ranks: fully_shard over the default process group "
                             f"(no mesh=) or a DeviceMesh of the replica's ranks (cross-replica averaging is "
                             f"ftrun's, not an HSDP mesh's)")
    return True


def close_replica_group() -> None:
    """Tear the default group down (a no-op when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The default sharding units: the members of every nn.ModuleList (a transformer's blocks)."""
    return [m for mod in model.modules() if isinstance(mod, torch.nn.ModuleList) for m in mod]


def shard_model(model: torch.nn.Module, mesh, *, units: Iterable[torch.nn.Module] | None = None,
                reshard_after_forward: bool = True) -> None:
    """fully_shard each unit (default: `block_modules`), then the root, in place (bottom-up, as FSDP2
    requires). Each unit is one all-gather / reduce-scatter; the root takes the remaining parameters."""
    from torch.distributed.fsdp import fully_shard

    for unit in (block_modules(model) if units is None else list(units)):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)


def is_dtensor(t: object) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: the local shard of a DTensor (a view: writing it writes the DTensor),
    `t` itself otherwise. Call under no_grad when writing."""
    return t.to_local() if is_dtensor(t) else t


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` as a tensor of the same kind as `param`: a local shard is wrapped into a DTensor with the
    param's mesh, placements and global shape (no communication); a plain param leaves it as it is."""
    if not is_dtensor(param):
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


def reset_iteration(model: torch.nn.Module) -> None:
    """After a failed step: drop FSDP2's per-iteration state (in-flight all-gathers, reduce-scatter
    buffers, unsharded parameters) and every gradient, so the next forward starts clean. Nothing for a
    plain module beyond zeroing the gradients."""
    reset = getattr(model, "reset_iter_state", None)
    if reset is not None:
        reset()
    model.zero_grad(set_to_none=True)
