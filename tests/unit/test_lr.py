"""LR intervention: the pure factor and the optimizer helper."""

from __future__ import annotations

import math

import pytest
import torch

from ftrun.train.lr import BASE_LR_KEY, LRConfig, apply_lr_factor, lr_factor

# (policy, num_healthy, num_total, factor)
FACTOR_CASES = [
    ("none", 3, 12, 1.0),
    ("none", 12, 12, 1.0),
    ("linear", 12, 12, 1.0),
    ("linear", 9, 12, 0.75),
    ("linear", 1, 4, 0.25),
    ("sqrt", 12, 12, 1.0),
    ("sqrt", 9, 12, math.sqrt(0.75)),
    ("sqrt", 1, 4, 0.5),
    ("sqrt", 1, 1, 1.0),
]


@pytest.mark.parametrize(("policy", "healthy", "total", "factor"), FACTOR_CASES)
def test_lr_factor(policy, healthy, total, factor):
    assert lr_factor(policy, num_healthy=healthy, num_total=total) == pytest.approx(factor, rel=0, abs=1e-15)


@pytest.mark.parametrize(("policy", "healthy", "total", "message"), [
    ("cubic", 1, 2, "policy must be one of"),
    ("sqrt", 0, 2, "num_healthy=0"),
    ("sqrt", 3, 2, "num_healthy=3, num_total=2"),
    ("linear", 1, 0, "num_total=0"),
])
def test_lr_factor_rejects_bad_input(policy, healthy, total, message):
    with pytest.raises(ValueError, match=message):
        lr_factor(policy, num_healthy=healthy, num_total=total)


def test_config_defaults_to_sqrt_and_validates():
    assert LRConfig().policy == "sqrt"
    with pytest.raises(ValueError, match="LRConfig.policy"):
        LRConfig(policy="exp")


def optimizer(*lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=1.0)


def test_apply_scales_relative_to_the_stored_base_and_is_idempotent():
    opt = optimizer(0.1, 0.4)
    assert apply_lr_factor(opt, 0.5) == [0.05, 0.2]
    assert apply_lr_factor(opt, 0.5) == [0.05, 0.2]  # same step again: no compounding
    assert [g[BASE_LR_KEY] for g in opt.param_groups] == [0.1, 0.4]
    assert apply_lr_factor(opt, 1.0) == [0.1, 0.4]  # everyone healthy again: back to the base
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.4]


def test_apply_takes_new_base_lrs_from_a_schedule():
    opt = optimizer(0.1)
    apply_lr_factor(opt, 0.5)
    assert apply_lr_factor(opt, 0.5, base_lrs=[0.02]) == [0.01]
    assert opt.param_groups[0][BASE_LR_KEY] == 0.02
    assert apply_lr_factor(opt, 1.0) == [0.02]


def test_apply_keeps_tensor_lrs_in_place():
    param = torch.nn.Parameter(torch.zeros(2))
    lr = torch.tensor(0.2)
    opt = torch.optim.Adam([param], lr=lr)
    apply_lr_factor(opt, 0.5)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.1)


@pytest.mark.parametrize(("factor", "base_lrs", "message"), [
    (0.0, None, "factor must be > 0"),
    (float("nan"), None, "factor must be > 0"),
    (0.5, [0.1, 0.2, 0.3], "3 base LRs for 2 param groups"),
])
def test_apply_rejects_bad_input(factor, base_lrs, message):
    with pytest.raises(ValueError, match=message):
        apply_lr_factor(optimizer(0.1, 0.2), factor, base_lrs=base_lrs)
