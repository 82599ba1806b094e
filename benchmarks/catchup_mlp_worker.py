"""A rank of `benchmarks/catchup_launch.py`'s job: a 4.2M-parameter MLP under AdamW (a 50.4 MB catch-up
state: parameters plus both Adam moments), trained with ftrun.train on random regression data."""

from __future__ import annotations

import argparse
import os
import sys

import torch

import ftrun.train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024, help="in/out features; the hidden layer is twice as wide")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    w = args.width
    data = torch.randn(4096, 2 * w, generator=torch.Generator().manual_seed(args.seed))  # inputs and targets

    def model_fn() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(w, 2 * w), torch.nn.ReLU(), torch.nn.Linear(2 * w, w))

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(batch[:, :w]), batch[:, w:])

    config = ftrun.train.FTConfig(batch_size=args.batch_size, seed=args.seed)
    with ftrun.train.init_from_env(config) as ft:
        result = ft.train(model_fn=model_fn, loss_fn=loss_fn, dataset=data,
                          optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True))
    return result.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
