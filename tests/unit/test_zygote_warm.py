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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import json, sys
import torch.distributed as dist
from ftrun.launch import zygote
code, path, failed = zygote.preload("ftrun.train.ft_worker", module=True, sharded=SHARDED)
out = {"threads": zygote.num_threads(), "initialized": dist.is_initialized(), "failed": failed,
       "wiring": "ftrun.train.wiring" in sys.modules, "fsdp_warm": "ftrun.train.warm" in sys.modules}
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
