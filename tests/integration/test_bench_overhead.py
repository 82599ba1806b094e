"""`ftrun bench overhead` runs end to end and prints its figures (no timing is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.slow  # real replica processes: about a minute on 2 cores
@pytest.mark.timeout(150)
def test_bench_overhead_smoke():
    out = subprocess.run([sys.executable, "-m", "ftrun.cli", "bench", "overhead", "--replicas", "2", "--steps", "30",
                          "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    f = json.loads(out.stdout.strip().splitlines()[-1])
    assert (f["replicas"], f["steps"]) == (2, 30)
    assert f["overhead_ms"] > 0 and f["round_trip_ms"] > 0 and f["process_round_trip_ms"] > 0
    assert f["ratio_to_round_trip"] == pytest.approx(f["overhead_ms"] / f["round_trip_ms"])
    assert f["lighthouse_wakeups_per_step"] > 0 and f["replica_wakeups_per_step"] > 0
    assert f["lighthouse_cpu_us_per_step"] > 0 and f["replica_cpu_us_per_step"] > 0
    # sync (no ask-ahead) and ask-ahead in the same run
    assert f["compute_ms"] == 2.0 and f["sync_overhead_ms"] > 0 and f["sync_median_step_ms"] > 0
    assert f["median_ratio_to_round_trip"] == pytest.approx(f["median_step_ms"] / f["round_trip_ms"])
    assert f["sync_ratio_to_round_trip"] == pytest.approx(f["sync_overhead_ms"] / f["round_trip_ms"])
    assert f["hidden_ms"] == pytest.approx(f["sync_overhead_ms"] - f["overhead_ms"])
    assert f["async_to_sync"] == pytest.approx(f["overhead_ms"] / f["sync_overhead_ms"])


@pytest.mark.timeout(90)
@pytest.mark.parametrize("flag,value,what", [("--steps", "0", "--steps must be >= 1"),
                                              ("--compute-ms", "-1", "--compute-ms must be within 0..10000")])
def test_bench_overhead_refuses_bad_input(flag, value, what):
    out = subprocess.run([sys.executable, "-m", "ftrun.cli", "bench", "overhead", flag, value], capture_output=True,
                         text=True, cwd=ROOT, timeout=80, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode != 0 and what in out.stderr
