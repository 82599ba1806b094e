"""A torchrun-style script's own process group and FSDP2 sharding, taken over by the job (ftrun.train.shard:
adopt_replica_group, check_sharded; FTJob): the default group the script made from the launcher's environment
is adopted when it is the replica's and left to the script to destroy; a model it sharded is wrapped as it is;
anything else is refused naming what to do. One process here: a one-rank gloo group on a HashStore stands for
the replica's group (the replicas of several ranks are tests/integration/test_launch_torchrun_script.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_own_optimizer import job_for
from ftrun.train.shard import adopt_replica_group, check_sharded, mesh_device_type


@pytest.fixture
def default_group():
    """The script's `dist.init_process_group()`: a one-rank default group."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.nn.Linear(8, 1))


def shard(model: torch.nn.Module, *, root: bool = True) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[1])
    if root:
        fully_shard(model)
    return model


def test_a_default_group_of_another_world_is_refused_naming_what_to_do(default_group):
    assert adopt_replica_group(rank=0, world_size=1, timeout_s=5.0) is None  # the replica's: adopted, no mesh
    with pytest.raises(ValueError, match=r"default process group has rank 0 of 1, but this is rank 1 of a replica "
                                         r"of 2 ranks: make it over the replica's ranks only .*RANK/WORLD_SIZE"):
        adopt_replica_group(rank=1, world_size=2, timeout_s=5.0)


def test_check_sharded_tells_a_model_the_script_sharded_and_refuses_a_partial_or_foreign_one(default_group):
    assert check_sharded(net(), 1) is False  # plain: ftrun shards it (when the replica has several ranks)
    assert check_sharded(shard(net()), 1) is True
    with pytest.raises(ValueError, match=r"parameter '0.weight' is sharded on a mesh of shape \(1,\), but a replica "
                                         r"of 2 ranks shards every parameter on a 1-D mesh of its ranks"):
        check_sharded(shard(net()), 2)
    with pytest.raises(ValueError, match="submodules are sharded with fully_shard but the model itself is not"):
        check_sharded(shard(net(), root=False), 1)


def test_the_job_adopts_the_scripts_group_and_wraps_its_sharded_model(tmp_path, default_group):
    with job_for(tmp_path) as job:
        model = shard(net())
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        with pytest.raises(ValueError, match="already sharded with fully_shard and a shard_fn was given too"):
            job.wrap(model, opt, shard_fn=lambda m, mesh: None)
    with job_for(tmp_path) as job:
        wrapped, ft_opt = job.wrap(model, opt)
        assert wrapped is model  # not sharded again
        while job.step < 2:
            ft_opt.zero_grad()
            wrapped(torch.ones(2, 4)).sum().backward()
            ft_opt.step()
    assert dist.is_initialized()  # the script's group: the script destroys it, not the job


@pytest.mark.parametrize("backend, device", [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"),
                                             ("cuda:nccl", "cuda"), ("cpu:gloo", "cpu"), ("GLOO", "cpu")])
def test_an_adopted_group_s_mesh_is_on_the_device_its_backend_carries(backend, device):
    """A script's NCCL default group gets a CUDA mesh (FSDP2 over it shards CUDA tensors), gloo a host one."""
    assert mesh_device_type(backend) == device
