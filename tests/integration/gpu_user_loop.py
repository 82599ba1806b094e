"""A training loop on ftrun written the way a GPU user writes it, with the CUDA idioms such scripts carry:
seeding of the host and every GPU, TF32 matmuls, the device's properties printed, the model built under
`with torch.device(...)`, a generator on the device for the data's noise, pinned batches copied with
non_blocking=True, bf16 autocast, CUDA events timing every step and peak memory statistics.

    ftrun emulate tests/integration/gpu_user_loop.py --profile ci-small --script-args "--device cuda"
    ftrun launch --replicas 2 --steps 50 tests/integration/gpu_user_loop.py --device cuda   # on a GPU host

tests/integration/test_examples_shadow.py runs the first (the shadow loader answers every one of these
idioms on the host: shadow.cuda_shim, shadow.cuda_tensors).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ftrun.train

DIM, HIDDEN, MICRO, SAMPLES = 32, 128, 16, 2048


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def dataset(seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, DIM, generator=g)
    return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def forever(loader: DataLoader):
    while True:
        yield from loader


def train(args: argparse.Namespace, job: ftrun.train.FTJob) -> None:
    cuda = args.device.startswith("cuda")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")  # ftrun chose it
    if cuda:
        props = torch.cuda.get_device_properties(device)
        print(f"gpu_user_loop: {props.name}, {props.total_memory / 2**30:.0f} GiB", file=sys.stderr)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.device(device):
        model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = job.wrap(model, opt)
    data = dataset(seed=1)
    loader = DataLoader(data, batch_size=MICRO, sampler=job.sampler(data), drop_last=True, pin_memory=cuda)
    noise = torch.Generator(device=device).manual_seed(2)
    start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None, None)
    batches = forever(loader)
    step = job.step
    while step < args.steps:
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        x = x + 0.01 * torch.randn(x.shape, generator=noise, device=device)
        if cuda:
            start.record()
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        loss.backward()
        if not opt.step():
            continue
        step = job.step
        metrics = {"loss": loss.item()}
        if cuda:
            end.record()
            end.synchronize()
            metrics.update(step_ms=start.elapsed_time(end),
                           peak_mem_mib=torch.cuda.max_memory_allocated(device) / 2**20)
        job.log_metrics(**metrics)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda", help="cuda (this rank's GPU), cuda:N or cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=MICRO, device=args.device)) as job:
        args.steps = job.max_steps or args.steps
        train(args, job)


if __name__ == "__main__":
    main()
