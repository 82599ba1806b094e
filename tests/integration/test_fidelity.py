"""`ftrun fidelity`: the same small job with a mid-step kill, a restart and a slow fetch, run for real
(`ftrun launch`) and emulated with a calibrated profile; every figure both runs have agrees within 2x (the
issue's 0.85-1.15 is a benchmark figure: `ftrun fidelity --json`). Minutes of real processes: `slow`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_fidelity_3x1_within_a_factor_of_two(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "fidelity", "--replicas", "3", "--steps", "50",
                           "--out", str(tmp_path), "--json"], cwd=ROOT, capture_output=True, text=True, timeout=1400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads(proc.stdout.strip().splitlines()[-1])
    assert table["real_complete"] and table["emulated_complete"]
    rows = {r["name"]: r for r in table["metrics"]}
    for name in ("step_s", "get_quorum_s", "catchup_s", "rejoin_stall_s", "effective_training_time"):
        assert rows[name]["ratio"] is not None, rows[name]
    assert table["max_abs_log_ratio"] <= math.log(2.0), table["metrics"]
