"""An FSDP2 (HSDP) training loop written for GPUs that lays out its own device mesh, on ftrun's own-loop API:
`init_device_mesh("cuda", (replicas, ranks per replica), mesh_dim_names=("replicate", "shard"))`,
`fully_shard` of every block and then the root on it, a process group of its own made with
`dist.new_group(backend="nccl")` (to average the logged loss), the batch branches on `is_cuda`, is copied on a
side stream and handed to the compute stream with `record_stream`, and `torch.accelerator` names the device.

    ftrun emulate tests/integration/fsdp2_mesh_loop.py --profile ci-small --script-args "--device cuda"

tests/integration/test_examples_shadow.py runs it (the shadow loader answers the mesh at the profile's layout
with a one-rank mesh on the host, shadow.cuda_dist). Under `ftrun launch` a replica's ranks are the
process group, so there a script shards through `job.wrap(..., shard_fn=...)` with the replica's mesh instead.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import ftrun.train

DIM, HIDDEN, DEPTH, MICRO, SAMPLES = 32, 64, 3, 16, 2048


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, HIDDEN)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.GELU())
                                    for _ in range(DEPTH))
        self.out = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def forever(loader: DataLoader):
    while True:
        yield from loader


def train(args: argparse.Namespace, job: ftrun.train.FTJob) -> None:
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != "cuda":
        raise SystemExit(f"fsdp2_mesh_loop: needs a CUDA accelerator, torch.accelerator has {accelerator}")
    device = torch.device("cuda", torch.accelerator.current_device_index())
    mesh = init_device_mesh("cuda", (job.spec.num_replicas, job.spec.ranks_per_replica),
                            mesh_dim_names=("replicate", "shard"))
    with torch.device(device):
        model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = job.wrap(model, opt)
    loss_group = dist.new_group(backend="nccl")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, DIM, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))
    loader = DataLoader(data, batch_size=MICRO, sampler=job.sampler(data), drop_last=True, pin_memory=True)
    copies = torch.cuda.Stream()
    print(f"fsdp2_mesh_loop: {accelerator.type} x {torch.accelerator.device_count()}, mesh "
          f"{dict(zip(mesh.mesh_dim_names, (job.spec.num_replicas, job.spec.ranks_per_replica)))}", file=sys.stderr)
    batches = forever(loader)
    step = job.step
    while step < args.steps:
        with torch.cuda.stream(copies):
            xb, yb = (t if t.is_cuda else t.to(device, non_blocking=True) for t in next(batches))
        torch.cuda.current_stream().wait_stream(copies)
        for t in (xb, yb):
            t.record_stream(torch.cuda.current_stream())
        if not (xb.is_cuda and next(model.parameters()).is_cuda):
            raise SystemExit("fsdp2_mesh_loop: the batch and the model must be on the GPU")
        opt.zero_grad()
        loss = F.mse_loss(model(xb), yb)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        if not opt.step():
            continue
        step = job.step
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=loss_group)
        job.log_metrics(loss=mean.item() / dist.get_world_size(loss_group))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda", help="cuda only: the mesh is a CUDA one")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=MICRO, device=args.device)) as job:
        args.steps = job.max_steps or args.steps
        train(args, job)


if __name__ == "__main__":
    main()
