"""The training API standalone: `init_from_env` without a launcher runs a one-replica, one-rank job with
an in-process lighthouse (threads over loopback), prints the event lines, writes the audit, and
`train` runs once."""

from __future__ import annotations

import json

import pytest
import torch

from ftrun.data.audit import audit, read_log
from ftrun.data.loader_state import LoaderState
from ftrun.train import FTConfig, Hooks, init_from_env
from ftrun.train.toy import ToyConfig, lm_loss, make_model, make_tokens

pytestmark = pytest.mark.timeout(60)

TOY = ToyConfig(vocab=16, seq_len=8, d_model=8, hidden=16, num_samples=256, seed=3)


def test_standalone_job_trains_and_reports(tmp_path, capsys):
    seen = []
    config = FTConfig(batch_size=4, run_dir=str(tmp_path), num_threads=None)
    with init_from_env(config, environ={}) as ft:
        assert (ft.replica_id, ft.rank, ft.mesh) == ("r0", 0, None)
        result = ft.train(model_fn=lambda: make_model(TOY), loss_fn=lm_loss, dataset=make_tokens(TOY), steps=5,
                          optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2),
                          hooks=Hooks(on_step=seen.append))
        with pytest.raises(RuntimeError, match="once"):
            ft.train(model_fn=lambda: make_model(TOY), loss_fn=lm_loss, dataset=make_tokens(TOY), steps=5,
                     optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2))
    assert result.ok and result.exit_code == 0 and result.step == 5
    assert [r.step for r in seen] == list(range(5)) and all(r.committed and r.loss > 0 for r in seen)
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "ready" and kinds[-1] == "final" and kinds.count("commit") == 5 and kinds.count("step") == 5
    assert events[-1]["param_hash"] == result.param_hash
    records, problems = read_log((tmp_path / "audit-r0-0.jsonl").read_bytes())
    report = audit(records, final=LoaderState.from_dict(result.loader_state))
    assert not problems and report.ok and report.num_steps == 5


def test_model_fn_must_return_a_module(tmp_path):
    with init_from_env(FTConfig(run_dir=str(tmp_path), num_threads=None, events=False), environ={}) as ft:
        with pytest.raises(ValueError, match="nn.Module"):
            ft.train(model_fn=lambda: None, loss_fn=lm_loss, dataset=make_tokens(TOY), steps=1,
                     optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1))


def test_same_seed_same_model_in_every_replica(tmp_path):
    """model_fn runs under the job's seed, so even an unseeded model_fn builds the same weights."""
    hashes = []
    for _ in range(2):
        with init_from_env(FTConfig(run_dir=str(tmp_path), num_threads=None, events=False), environ={}) as ft:
            result = ft.train(model_fn=lambda: torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 16)),
                              loss_fn=lm_loss, dataset=make_tokens(TOY), steps=0,
                              optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1))
            hashes.append(result.param_hash)
    assert hashes[0] == hashes[1]
