"""`ftrun bench overlap` as a user runs it: both modes trained in the same run, one JSON object last with the
ratio, the exchange's share of the serial step and the batch it ran (given, the loopback default, or sized
over capped namespace links)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--width", "64", "--layers", "2", "--steps", "2", "--blocks", "1", "--bucket-kb", "4", "--chunk-kb", "4"]


def bench(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "bench", "overlap", *SMALL, *args, "--json"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_bench_overlap_on_loopback_trains_both_modes_to_the_same_parameters():
    out = bench("--netns-rate", "0")
    assert out["identical"] is True and out["replicas"] == 2 and out["steps"] == 2
    assert out["batch"] == 384 and out["batch_auto"] is False and out["shaping"] == "none (loopback)"
    assert out["ratio"] == out["step_s_overlap"] / out["step_s_serial"]
    assert out["exchange_fraction"] == out["exchange_s_serial"] / out["step_s_serial"]


@pytest.mark.timeout(300)
@pytest.mark.netns
def test_bench_overlap_sizes_its_batch_over_capped_links(need_namespaces):
    out = bench("--netns-rate", "200")
    assert out["batch_auto"] is True and out["batch"] % 64 == 0 and out["identical"] is True
    assert "200" in out["shaping"]
    fixed = bench("--netns-rate", "200", "--batch", "32")
    assert fixed["batch"] == 32 and fixed["batch_auto"] is False
