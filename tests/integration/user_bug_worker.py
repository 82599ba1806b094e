"""A training script with a bug in its loss function on one replica: from --bug-step on, replica
--bug-replica raises a TypeError on every call (tests/integration/test_failing_replica.py)."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ftrun.config import Timeouts
from ftrun.launch.worker_env import WorkerSpec
from ftrun.train.api import FTConfig, init_from_env
from ftrun.train.toy import ToyConfig, lm_loss, make_model, make_tokens


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--bug-replica", default="r1")
    p.add_argument("--bug-step", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--ftar-timeout", type=float, default=2.0)
    args = p.parse_args()
    spec = WorkerSpec.from_environ()
    toy = ToyConfig(seed=0)
    with init_from_env(FTConfig(batch_size=8, timeouts=Timeouts(ftar_timeout_s=args.ftar_timeout))) as ft:
        calls = 0

        def loss_fn(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
            nonlocal calls
            calls += 1
            ft.env.clock.sleep(args.step_time)
            if spec.replica_id == args.bug_replica and calls > args.bug_step:
                return lm_loss(m, batch) + "a user bug"  # TypeError, on every call from here on
            return lm_loss(m, batch)

        result = ft.train(model_fn=lambda: make_model(toy), loss_fn=loss_fn, dataset=make_tokens(toy),
                          steps=lambda: args.steps,
                          optimizer_fn=lambda params: torch.optim.AdamW(params, lr=3e-3))
    return result.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
