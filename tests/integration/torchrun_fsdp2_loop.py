"""An FSDP2 training loop written torchrun-style, on ftrun's own-loop API: the process group comes from the
launcher's environment (`dist.init_process_group("nccl")` reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT),
the GPU from LOCAL_RANK (`torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`), and the model is sharded
either with `fully_shard(module)` and no mesh (FSDP2 builds its default mesh over the default group:
`--mesh default`) or on a `DeviceMesh("cuda", ranks)` built directly over the replica's ranks
(LOCAL_WORLD_SIZE of them: `--mesh direct`). It checks that the launcher's variables agree with its job.

    ftrun emulate tests/integration/torchrun_fsdp2_loop.py --profile ci-small --script-args "--mesh default"
    ftrun emulate tests/integration/torchrun_fsdp2_loop.py --profile ci-small --script-args "--mesh direct"

tests/integration/test_examples_shadow.py runs both (the shadow loader makes the default group a one-rank
group on the host, and either mesh a one-rank host mesh standing for the replica's ranks: shadow.cuda_dist).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import ftrun.train

DIM, HIDDEN, DEPTH, MICRO = 32, 64, 2, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(DEPTH))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def check_environment(job: ftrun.train.FTJob) -> None:
    """The launcher's variables say the same rank and layout as the job (ftrun launch's names)."""
    spec = job.spec
    want = {"RANK": spec.replica_index * spec.ranks_per_replica + spec.rank, "LOCAL_RANK": spec.rank,
            "WORLD_SIZE": spec.num_replicas * spec.ranks_per_replica, "LOCAL_WORLD_SIZE": spec.ranks_per_replica}
    seen = {name: int(os.environ[name]) for name in want}
    if seen != want:
        raise SystemExit(f"torchrun_fsdp2_loop: the environment says {seen}, the job {want}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--mesh", choices=("default", "direct"), default="default")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=MICRO, device=str(device))) as job:
        check_environment(job)
        steps = job.max_steps or args.steps
        model = Net().to(device)
        if args.mesh == "default":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        else:
            mesh = DeviceMesh(device.type, torch.arange(int(os.environ["LOCAL_WORLD_SIZE"])), mesh_dim_names=("shard",))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = job.wrap(model, opt)
        print(f"torchrun_fsdp2_loop: rank {dist.get_rank()} of {dist.get_world_size()} ({dist.get_backend()}), "
              f"{device}, {args.mesh} mesh", file=sys.stderr)
        g = torch.Generator().manual_seed(1)
        while job.step < steps:
            x = torch.randn(MICRO, DIM, generator=g).to(device, non_blocking=True)
            opt.zero_grad()
            loss = F.mse_loss(model(x), torch.sin(x.sum(dim=1, keepdim=True)))
            loss.backward()
            if opt.step():
                job.log_metrics(loss=loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
