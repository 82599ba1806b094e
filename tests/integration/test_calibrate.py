"""`ftrun calibrate --quick` measures this machine for real and writes a profile that loads, says how and
when each value was measured, and runs under the emulator, which charges the calibrated keys."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from harness.profile import load_profile, profile_value

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(300)
def test_quick_calibration_writes_a_profile_the_emulator_runs(tmp_path):
    out = tmp_path / "here.toml"
    proc = subprocess.run([sys.executable, "-m", "ftrun.cli", "calibrate", "--quick", "--out", str(out), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["out"] == str(out) and figures["quick"] is True
    for name in ("step_s", "tcp_one_way_us", "tcp_gb_s", "unix_one_way_us", "unix_gb_s", "shm_gb_s",
                 "catchup_per_fetch_s", "catchup_ns_per_byte", "ftar_reduce_gb_s", "ftar_copy_gb_s",
                 "zygote_start_s", "crash_detect_s", "peer_reset_s", "storage_write_s"):
        assert figures["figures"][name] > 0, name

    p = load_profile(out)
    assert p.name == "ci-small-calibrated" and p.calibration is not None and p.calibration.quick
    assert p.train.step_compute_s == figures["figures"]["step_s"]
    assert p.scheduler.crash_detect_s == figures["figures"]["crash_detect_s"]
    assert p.ftar.kernel_reduce_gb_s == figures["figures"]["ftar_reduce_gb_s"]
    for v in p.calibration.values:
        assert v.method and v.measured_at == p.calibration.measured_at
        if not v.key.startswith("measured."):
            assert profile_value(p, v.key) == v.value
    assert "measured.unix_gb_s" in {v.key for v in p.calibration.values}

    # The emulator runs it: the supervisor notices the injected kill crash_detect_s after it (not at its
    # next poll), and the restarted replica rejoins.
    from harness.cli import execute
    from harness.profile import apply_overrides
    from harness.run import JobOptions, Kill

    # Enough steps after the kill that the job is still running when the supervisor notices it: both figures
    # were measured, and under load crash detection can take many (~1 ms) steps.
    steps = 4 + math.ceil(3 * p.scheduler.crash_detect_s / p.train.step_compute_s)
    short = apply_overrides(p, [f"train.steps={steps}", "emulation.cpu_charging=false"])
    f, job = execute(short, JobOptions(steps=steps, kills=(Kill(1, at_step=2),)))
    assert f["complete"] and f["replicas_consistent"], f
    events = job.recorder.events
    kill = next(e for e in events if e.get("event") == "kill")
    noticed = next(e for e in events if e.get("event") == "noticed")
    assert noticed["t"] - kill["t"] == pytest.approx(p.scheduler.crash_detect_s, abs=1e-9)
