"""The zygote's preload for a sharded job: the training API's lazily imported wiring and FSDP2's first use
are warm before any fork, and the zygote stays fork-safe (one thread, no default process group).

Runs the preload in a fresh interpreter (as the zygote does): it imports torch and makes, then destroys,
a fake process group, which must not leak into the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ftrun.launch.procs import ZYGOTE_ENV
from ftrun.train.warm import announce, warm_sharding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import json, sys
import torch.distributed as dist
from ftrun.launch import zygote
code, path, failed = zygote.preload("ftrun.train.ft_worker", module=True, sharded=SHARDED)
out = {"threads": zygote.num_threads(), "initialized": dist.is_initialized(), "failed": failed,
       "wiring": "ftrun.train.wiring" in sys.modules, "fsdp_warm": "ftrun.train.warm" in sys.modules}
import torch
from ftrun.train.toy import ToyConfig, make_model
from ftrun.train.warm import shapes_spec, warm_sharding
model = make_model(ToyConfig())
spec = json.loads(json.dumps(shapes_spec(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 2)))  # as read back
if not zygote.cuda_could_start():  # on a GPU host the zygote skips this warm-up (its backward starts CUDA)
    warm_sharding(spec)  # the job's own shapes, as the zygote warms them once a rank announced them
out["after_spec"] = [zygote.num_threads(), dist.is_initialized()]
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from ftrun.train.warm import warm_sharding
try:
    warm_sharding()
except RuntimeError as e:
    out["refused"] = str(e)
dist.destroy_process_group()
print(json.dumps(out))
"""


def probe(sharded: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE.replace("SHARDED", str(sharded))], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, **ZYGOTE_ENV, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(150)
def test_preload_warms_wiring_and_fsdp2_and_stays_fork_safe():
    sharded = True
    out = probe(sharded)
    assert out["threads"] == 1 and not out["initialized"] and out["failed"] == []
    assert out["wiring"]  # imported by FTJob.train on first use: preloaded instead
    assert out["fsdp_warm"] is sharded
    assert "without a default process group" in out["refused"]
    assert out["after_spec"] == [1, False]


GPU_HOST_PROBE = """
import json, sys
import torch
from ftrun.launch import zygote
zygote.cuda_could_start = lambda: True  # as on a machine with an NVIDIA device and a CUDA build of torch
def refuse(*args, **kwargs):
    raise AssertionError("would start CUDA before a fork")
torch.Tensor.backward = refuse
torch.autograd.backward = refuse
torch.optim.Optimizer.step = refuse
torch.optim.AdamW.step = refuse
zygote.preload("ftrun.train.ft_worker", module=True, sharded=True)
print(json.dumps({"threads": zygote.num_threads(), "dynamo": "torch._dynamo" in sys.modules}))
"""


@pytest.mark.timeout(150)
def test_on_a_gpu_host_the_preload_runs_no_backward_or_optimizer_step():
    """Autograd's first backward and an optimizer's first step run cuInit on a GPU host (driver threads, and no
    forked child could use CUDA): the zygote then only imports what the first step would."""
    proc = subprocess.run([sys.executable, "-c", GPU_HOST_PROBE], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **ZYGOTE_ENV, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"threads": 1, "dynamo": True}  # and no refused call (sharded=True: FSDP2's warm-up neither)


def test_a_rank_announces_the_jobs_shapes_to_its_zygote_once(tmp_path):
    spec = {"world": 2, "params": [[[4, 3], "float32", True]], "optimizer": ["torch.optim.adamw", "AdamW", {}]}
    assert not announce(spec, str(tmp_path), environ={})  # not forked by a zygote: nobody to tell
    r, w = os.pipe()
    try:
        env = {"FTRUN_ZYGOTE_WARM_FD": str(w)}
        assert announce(spec, str(tmp_path), environ=env)
        assert not announce(spec, str(tmp_path), environ=env)  # another rank did already
        path = os.read(r, 4096).decode()
        assert path == str(tmp_path / "zygote-warm-2.json") + "\n"
        assert json.loads((tmp_path / "zygote-warm-2.json").read_text()) == spec
        assert sorted(os.listdir(tmp_path)) == ["zygote-warm-2.json"]  # no temp file left
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("bad,message", [
    ({"world": 1}, "'world' must be an integer >= 2, got 1"),
    ({"world": 2, "params": [], "optimizer": ["os", "system", {}]}, "'optimizer' must name a torch.optim class"),
    ({"world": 2, "params": None, "optimizer": ["torch.optim.sgd", "SGD", {}]}, "'params' must be a list"),
])
def test_a_bad_spec_is_refused_before_any_group_exists(bad, message):
    import torch.distributed as dist

    with pytest.raises(ValueError, match=message):
        warm_sharding(bad)
    assert not dist.is_initialized()
