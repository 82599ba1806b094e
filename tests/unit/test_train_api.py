"""The training API's pure parts: config checks, step targets, the shard helpers on plain tensors, and the
Llama example's model and data pieces (tokenizer, windows, rotary embeddings, causality, corpus cache)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.config import Timeouts
from ftrun.launch.worker_env import WorkerSpec
from ftrun.train.api import FTConfig, FTJob, init_from_env
from ftrun.train.job_config import steps_target as _target
from ftrun.train.shard import block_modules, is_dtensor, like, local, reset_iteration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_example():
    name = "train_llama_tiny_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "train_llama_tiny.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("bad", [dict(batch_size=0), dict(seed=-1), dict(checkpoint=5),
                                 dict(num_threads=0), dict(max_retries=-2),
                                 dict(catchup=dict(max_shard_bytes=100)), dict(catchup=dict(wait_limit_s=-1.0)),
                                 dict(catchup=dict(bind="0.0.0.0:0")),
                                 dict(catchup=dict(timeouts=Timeouts(catchup_stall_s=1.0))),
                                 dict(ftar=dict(num_chunks=0)), dict(ftar=dict(chunk_bytes=1000)),
                                 dict(ftar=dict(timeout_s=3.0))])
def test_config_rejects_bad_values_rather_than_rounding_them(bad):
    from ftrun.config import FtarConfig

    with pytest.raises(ValueError):
        FTConfig(**{k: FtarConfig(**v) if k == "ftar" else CatchupConfig(**v) if k == "catchup" else v
                    for k, v in bad.items()})


def test_config_nests_the_ftar_engines_config_with_the_jobs_ftar_timeout():
    from ftrun.config import FtarConfig, Timeouts

    cfg = FTConfig(timeouts=Timeouts(ftar_timeout_s=4.0), ftar=FtarConfig(chunk_bytes=4096, num_chunks=3))
    assert cfg.ftar == FtarConfig(chunk_bytes=4096, num_chunks=3, timeout_s=4.0)  # what the engine is given
    assert FTConfig(timeouts=Timeouts(ftar_timeout_s=4.0), ftar=FtarConfig(timeout_s=4.0)).ftar.timeout_s == 4.0


def test_config_nests_the_catchup_config_with_the_jobs_timeouts():
    t = Timeouts(ftar_timeout_s=4.0, catchup_stall_s=3.0)
    cfg = FTConfig(timeouts=t, catchup=CatchupConfig(max_shard_bytes=4096))
    assert cfg.catchup == CatchupConfig(max_shard_bytes=4096, timeouts=t)  # what the server and client are given
    assert cfg.catchup.wait_limit == 4.0 and cfg.catchup.stall_s == 3.0  # no wait limit set: the FTAR timeout
    assert FTConfig(timeouts=t, catchup=CatchupConfig(wait_limit_s=0.5)).catchup.wait_limit == 0.5
    with pytest.raises(ValueError, match="FTConfig.catchup.timeouts"):
        FTConfig(timeouts=t, catchup=CatchupConfig(timeouts=Timeouts(catchup_stall_s=1.0)))


def test_step_target():
    assert _target(5, None)() == 5
    assert _target(None, 7)() == 7
    assert _target(lambda: 3, 7)() == 3
    with pytest.raises(ValueError, match="steps"):
        _target(None, None)
    with pytest.raises(ValueError):
        _target(-1, None)


def test_incomplete_launcher_environment_is_refused():
    with pytest.raises(ValueError, match="FTRUN_NUM_REPLICAS"):
        init_from_env(FTConfig(num_threads=None), environ={"FTRUN_REPLICA_ID": "r0"})


def test_a_bad_phase_events_setting_is_refused_naming_it():
    with pytest.raises(ValueError, match="FTRUN_PHASE_EVENTS must be 1"):
        init_from_env(FTConfig(num_threads=None), environ={"FTRUN_PHASE_EVENTS": "yes"})


def test_phase_events_come_before_the_users_phase_hook_and_only_when_asked():
    from types import SimpleNamespace

    from ftrun.train.wiring import _phase_hook

    seen = []
    clock = SimpleNamespace(now=lambda: 7.0, cpu=lambda: 0.25)
    job = SimpleNamespace(config=FTConfig(phase_events=True), env=SimpleNamespace(clock=clock),
                          spec=SimpleNamespace(rank=1), emit=seen.append)
    hook = _phase_hook(job, lambda phase, step: seen.append((phase, step)))
    hook("forward", 3)
    assert seen == [{"event": "phase", "t": 7.0, "cpu": 0.25, "phase": "forward", "step": 3, "rank": 1}, ("forward", 3)]
    user = lambda phase, step: None  # noqa: E731
    assert _phase_hook(SimpleNamespace(config=FTConfig()), user) is user


def test_torchrun_without_replica_settings_is_refused_not_run_alone():
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "x",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(ValueError, match="one torchrun per replica, each with FTRUN_REPLICA_ID"):
        init_from_env(FTConfig(num_threads=None), environ=torchrun)


def test_shard_helpers_leave_plain_tensors_alone():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 2))
    p = model[0].weight
    assert not is_dtensor(p) and local(p) is p
    value = torch.ones(2, 2)
    assert like(p, value) is value
    assert block_modules(model) == list(model[1])
    model[0](torch.ones(1, 2)).sum().backward()
    reset_iteration(model)
    assert all(q.grad is None for q in model.parameters())


def test_byte_tokenizer_and_windows():
    ex = load_example()
    text = "Zoë works at Acme.\n"
    tokens = ex.encode(text)
    assert tokens.max() < 256 and ex.decode(tokens) == text
    w = ex.windows(tokens, 4)
    assert w.shape == (len(tokens) // 5, 5) and w.dtype == torch.int64
    assert w[1].tolist() == tokens[5:10].tolist()
    with pytest.raises(ValueError):
        ex.windows(tokens[:3], 4)


def test_rotary_embedding_depends_on_relative_position_only():
    ex = load_example()
    cos, sin = ex.rope_tables(8, 16, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def rotated(v, pos):
        x = v.expand(1, 1, 16, 8)
        return ex.apply_rope(x, cos, sin)[0, 0, pos]

    assert torch.allclose(rotated(q, 3).norm(), q.norm(), atol=1e-5)
    assert torch.allclose(rotated(q, 5) @ rotated(k, 2), rotated(q, 9) @ rotated(k, 6), atol=1e-5)


def test_llama_is_causal_and_shapes_fit():
    ex = load_example()
    torch.manual_seed(0)
    cfg = ex.LlamaConfig(dim=16, num_layers=2, num_heads=2, ffn_hidden=24, max_seq_len=12)
    model = ex.LlamaTiny(cfg)
    x = torch.randint(0, 256, (2, 12))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % 256
    a, b = model(x), model(y)
    assert a.shape == (2, 12, 256)
    assert torch.equal(a[:, :8], b[:, :8]) and not torch.equal(a[:, 8:], b[:, 8:])
    assert "rope_cos" not in model.state_dict()  # derived buffers are not state
    assert ex.lm_loss(model, torch.randint(0, 256, (2, 13))).ndim == 0
    with pytest.raises(ValueError):
        ex.LlamaConfig(dim=10, num_heads=4)


def test_corpus_is_deterministic_and_cached(tmp_path):
    ex = load_example()
    a = ex.load_tokens(tmp_path, seed=1, num_chars=3000)
    assert len(a) >= 3000 and list(tmp_path.iterdir())
    assert (ex.load_tokens(tmp_path, seed=1, num_chars=3000) == a).all()
    assert ex.make_corpus(1, 3000) == ex.make_corpus(1, 3000) != ex.make_corpus(2, 3000)
