"""A plain PyTorch training loop: the "before" of examples/own_loop.py (the same loop on ftrun).

    python examples/own_loop_plain.py --steps 100 [--device cuda]

A custom model (an MLP with dropout), AdamW, a warmup + cosine LR schedule (LambdaLR), gradient
clipping, gradient accumulation over 2 micro-batches, a torch Dataset + DataLoader, an EMA of the
weights, eval every EVAL_EVERY steps and JSON metrics on stdout. `diff examples/own_loop_plain.py
examples/own_loop.py` shows the port (tests/unit/test_own_loop_port.py keeps it at most 20 lines).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

MICRO, ACCUM, EVAL_EVERY, WARMUP, DIM = 8, 2, 20, 10, 16


class Regression(Dataset):
    """A synthetic regression task: y = tanh(x @ w) + noise, from a seed."""

    def __init__(self, size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(0))
        self.x = torch.randn(size, DIM, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.05 * torch.randn(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, hidden: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, hidden))
                                    for _ in range(depth))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.out(h)


class EMA:
    """An exponential moving average of the model's parameters."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for n, p in model.named_parameters():
            self.shadow[n].lerp_(p.detach(), 1 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return factor


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    device = next(model.parameters()).device
    losses = [F.mse_loss(model(x.to(device)), y.to(device)).item() for x, y in loader]
    model.train()
    return sum(losses) / len(losses)


def forever(loader: DataLoader):
    while True:
        yield from loader


def train(args: argparse.Namespace) -> None:
    train_set, val_set = Regression(4096, seed=1), Regression(256, seed=2)
    model = Net().to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(WARMUP, args.steps))
    ema = EMA(model, decay=0.9)
    loader = DataLoader(train_set, batch_size=MICRO, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64)
    batches = forever(loader)
    step = 0
    while step < args.steps:
        opt.zero_grad()
        total = 0.0
        for _ in range(ACCUM):
            x, y = (t.to(args.device) for t in next(batches))
            loss = F.mse_loss(model(x), y) / ACCUM
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema.update(model)
        step += 1
        print(json.dumps({"step": step, "loss": total, "lr": sched.get_last_lr()[0]}), flush=True)
        if step % EVAL_EVERY == 0:
            print(json.dumps({"step": step, "val_loss": evaluate(model, val_loader)}), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cpu", help="cpu, cuda (this rank's GPU) or cuda:N")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    torch.manual_seed(0)
    train(parse_args(argv))


if __name__ == "__main__":
    main()
