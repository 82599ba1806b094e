"""`ftrun bench ftar` on loopback, as a user runs it: one JSON object last, with the same-run gloo baseline and
the CPU seconds each spends per all-reduce (a figure a busy machine does not skew)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
@pytest.mark.slow  # two torch processes and a gloo group: minutes on a loaded 2-core machine
def test_bench_ftar_reports_wall_and_cpu_ratios_against_gloo():
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "bench", "ftar", "--transport", "socket", "--procs", "2",
                           "--sizes", "64K,256K", "--iters", "2", "--json"], capture_output=True, text=True,
                          timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["results"]
    assert [(r["procs"], r["size_mb"]) for r in rows] == [(2, 0.0625), (2, 0.25)]
    for r in rows:
        assert r["ftar_cpu_s"] > 0 and r["gloo_cpu_s"] > 0
        assert r["cpu_ratio"] == r["gloo_cpu_s"] / r["ftar_cpu_s"]
        assert r["ratio"] == r["gloo_s"] / r["ftar_s"]
        assert r["median_ratio"] == r["gloo_median_s"] / r["ftar_median_s"] and r["ftar_median_s"] >= r["ftar_s"]
    assert out["min_ratio"] == min(r["ratio"] for r in rows)
    assert out["min_cpu_ratio"] == min(r["cpu_ratio"] for r in rows)
    assert out["transport"] == "socket" and out["hosts"] == 1
