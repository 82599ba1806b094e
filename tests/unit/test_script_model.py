"""mocks.script (a script's model on meta: FSDP2 dim-0 shards, FLOPs) and mocks.train_api (what a script's
ft.train / job.wrap hand the emulator's session), checked in process with a recording session."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shadow
from mocks.compute import LayoutShapes, ShapeCache
from mocks.config import ModelConfig
from mocks.script import ScriptModel, meta_model, script_shapes, shard_elements, step_flops, to_meta


@pytest.mark.parametrize("shape, world, expected", [
    ((8, 4), 1, 32),          # one rank holds everything
    ((8, 4), 8, 4),           # 8 rows over 8 ranks: one row each
    ((10, 3), 4, 9),          # dim 0 padded to 12: 3 rows of 3
    ((7,), 8, 1),             # fewer rows than ranks: one (padded) row each
    ((), 4, 1),               # a 0-d parameter is a (1,) one
    ((256, 64, 3), 3, 86 * 192),
])
def test_fsdp2_dim0_shard_sizes(shape, world, expected):
    assert shard_elements(shape, world) == expected


def test_shard_of_a_bad_world_size_raises():
    with pytest.raises(ValueError, match="world_size"):
        shard_elements((4,), 0)


FLOPS_MLP_B5 = 2 * 5 * (4 * 6 + 6 * 2) + 2 * 2 * 5 * 6 * 2 + 2 * 5 * 4 * 6  # _mlp on a batch of 5: 840


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def test_the_model_is_built_on_meta_and_sharded_per_rank():
    model = meta_model(_mlp)
    assert all(p.is_meta for p in model.parameters())
    shapes = script_shapes(model, 1e6, ranks_per_replica=4)
    # weights (6, 4) -> 2 x 4, bias (6,) -> 2, weight (2, 6) -> 1 x 6, bias (2,) -> 1
    assert (shapes.num_params, shapes.params_per_rank, shapes.grad_bytes_per_rank) == (44, 17, 68)
    assert shapes.dtype == "float32" and shapes.flops_per_step_per_rank == 1e6


def test_a_large_model_costs_no_memory_on_meta():
    shapes = script_shapes(meta_model(lambda: nn.Linear(65536, 65536, bias=False)), 0.0, ranks_per_replica=8)
    assert shapes.num_params == 65536 ** 2 and shapes.params_per_rank == 65536 ** 2 // 8  # 16 GiB if real


def test_meta_flops_equal_the_real_models():
    torch.manual_seed(0)
    real, batch = _mlp(), torch.randn(5, 4)
    meta = meta_model(_mlp)
    real_flops = step_flops(lambda: real(batch).sum())
    assert real_flops == step_flops(lambda: meta(to_meta(batch)).sum())
    # forward 2 x B x in x out per matmul; backward twice that, less the input gradient the first layer has none of
    assert real_flops == FLOPS_MLP_B5


def test_bad_models_raise():
    with pytest.raises(ValueError, match="torch.nn.Module"):
        meta_model(lambda: "not a model")
    with pytest.raises(ValueError, match="no parameters"):
        script_shapes(nn.ReLU(), 1.0, ranks_per_replica=2)


def test_a_preset_layout_answers_every_shape_lookup():
    preset = script_shapes(meta_model(_mlp), 1.0, ranks_per_replica=2)
    cache = ShapeCache(preset)
    assert cache.get(ModelConfig(), 8) is preset and cache.num_propagations == 1
    assert isinstance(ShapeCache().get(ModelConfig(layers=1, hidden=8, heads=2, vocab=16, seq_len=4), 2), LayoutShapes)


class RecordingSession:
    """The emulator's side of shadow.current(), recording what the script's API hands it."""

    replicas, ranks_per_replica, steps = 3, 4, 7

    def __init__(self) -> None:
        self.runs: list[tuple[ScriptModel, int]] = []

    def run(self, script: ScriptModel, *, steps: int) -> dict:
        self.runs.append((script, steps))
        return {"ranks": 12, "steps_done": steps, "complete": True, "replicas_consistent": True}

    def ok(self) -> bool:
        return True

    def report(self) -> None:
        pass


def test_ft_train_hands_the_session_the_scripts_meta_model(capsys):
    session = RecordingSession()
    with shadow.active(session=session):
        import ftrun.train

        with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=5)) as ft:
            assert ft.max_steps == 7 and ft.spec.num_replicas == 3
            result = ft.train(model_fn=_mlp, optimizer_fn=lambda ps: torch.optim.AdamW(ps),
                              loss_fn=lambda m, b: m(b).sum(), dataset=torch.randn(9, 4))
    (script, steps), = session.runs
    assert steps == 7 and result.ok and result.step == 7 and result.exit_code == 0
    assert script.api == "train" and script.batch_size == 5
    assert (script.shapes.num_params, script.shapes.params_per_rank) == (44, 2 * 4 + 2 + 1 * 6 + 1)
    assert script.shapes.flops_per_step_per_rank == FLOPS_MLP_B5
    assert '"event": "final", "step": 7' in capsys.readouterr().out


def test_the_own_loop_traces_its_first_step_then_the_job_runs():
    session = RecordingSession()
    with shadow.active(session=session):
        import ftrun.train

        with ftrun.train.init_from_env(ftrun.train.FTConfig(batch_size=5)) as job:
            model = _mlp()
            model, opt = job.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
            assert isinstance(opt, torch.optim.Optimizer)  # schedulers take it
            torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
            while job.step < job.max_steps:
                opt.zero_grad()
                model(torch.randn(5, 4)).sum().backward()
                assert opt.step()
    (script, steps), = session.runs
    assert script.api == "wrap" and steps == 7 and job.figures["steps_done"] == 7
    assert script.shapes.flops_per_step_per_rank == FLOPS_MLP_B5


def test_outside_a_session_the_api_says_so():
    with shadow.active():
        import ftrun.train

        with pytest.raises(RuntimeError, match="no shadow session"):
            ftrun.train.init_from_env()
    with pytest.raises(RuntimeError, match="no shadow session"):
        shadow.current()
