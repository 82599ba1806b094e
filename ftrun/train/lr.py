"""Learning-rate intervention (paper §6.2): scale the LR by the share of replicas that trained the step.

A step trains the batches of its healthy replicas only (the participants that are not behind:
`len(ftrun.data.loader_state.contributors(q.participants, q.step))`), so its effective batch is
num_healthy/num_total of the full one, num_total being the job's configured replicas. Policies:
    none    factor 1
    linear  factor num_healthy / num_total
    sqrt    factor sqrt(num_healthy / num_total)   (default: keeps the LR proportional to the gradient
            noise's standard deviation; the paper found it flattens the loss after failures best)

`lr_factor` is pure. `scaled_lr` is how the trainer applies it: a multiplier composed with whatever
LR the group holds (the user's scheduler's), for the optimizer step only, and restored after it, so a
torch scheduler (which reads and writes group["lr"]) is never overridden. `apply_lr_factor` sets each param group's LR to base * factor, where the base is
remembered in the group under BASE_LR_KEY the first time (so it is saved with the optimizer state and
restored with it), and calling it twice with the same factor changes nothing. With an LR schedule,
pass the schedule's LRs for the step as `base_lrs` (torch's chainable schedulers read group["lr"], which
this helper overwrites, so compute the schedule from the step instead).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

POLICIES = ("none", "linear", "sqrt")
BASE_LR_KEY = "ftrun_base_lr"


@dataclass(frozen=True, kw_only=True)
class LRConfig:
    policy: str = "sqrt"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"LRConfig.policy must be one of {POLICIES}, got {self.policy!r}")


def lr_factor(policy: str, *, num_healthy: int, num_total: int) -> float:
    """The factor for a step trained by `num_healthy` of the job's `num_total` replicas."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if num_total < 1 or not 1 <= num_healthy <= num_total:
        raise ValueError(f"need 1 <= num_healthy <= num_total, got num_healthy={num_healthy}, num_total={num_total}")
    if policy == "none" or num_healthy == num_total:
        return 1.0
    share = num_healthy / num_total
    return share if policy == "linear" else math.sqrt(share)


def apply_lr_factor(optimizer: torch.optim.Optimizer, factor: float, *,
                    base_lrs: Sequence[float] | None = None) -> list[float]:
    """Set every param group's LR to its base LR times `factor`; returns the new LRs.

    base_lrs: new base LRs (one per group), e.g. from a schedule; without them each group keeps the
    base stored on the first call (its LR at that time).
    """
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    groups = optimizer.param_groups
    if base_lrs is not None and len(base_lrs) != len(groups):
        raise ValueError(f"{len(base_lrs)} base LRs for {len(groups)} param groups")
    lrs = []
    for i, group in enumerate(groups):
        if base_lrs is not None:
            group[BASE_LR_KEY] = float(base_lrs[i])
        elif group.get(BASE_LR_KEY) is None:
            group[BASE_LR_KEY] = float(group["lr"])
        lr = group[BASE_LR_KEY] * factor
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # tensor LRs (capturable/fused optimizers) stay the same tensor
        else:
            group["lr"] = lr
        lrs.append(lr)
    return lrs


@contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[list[float]]:
    """Inside the block every param group's LR is its current LR times `factor`; after it (even on an
    exception) the group's LR is exactly what it was. Yields the scaled LRs."""
    if not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    groups = optimizer.param_groups
    saved = [float(g["lr"]) for g in groups]
    if factor == 1.0:
        yield saved
        return
    try:
        for group, lr in zip(groups, saved):
            _set_lr(group, lr * factor)
        yield [lr * factor for lr in saved]
    finally:
        for group, lr in zip(groups, saved):
            _set_lr(group, lr)


def _set_lr(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)  # tensor LRs (capturable/fused optimizers) stay the same tensor
    else:
        group["lr"] = lr
