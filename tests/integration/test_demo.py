"""`ftrun demo` end to end: real processes, a SIGKILLed replica, pushed detection, rejoin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from ftrun.config import Timeouts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_detects_the_kill_at_once_and_the_replica_rejoins():
    out = subprocess.run(
        [sys.executable, "-m", "ftrun.cli", "demo", "--json", "--after-rejoin", "3", "--kill-step", "5",
         "--timeout", "90"],
        capture_output=True, text=True, timeout=110, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["complete"]
    # a killed replica's connection loss is pushed, not waited for (a heartbeat timeout would say "hung");
    # how fast is measured by benchmarks/detection.py: a wall-clock bound here would break under load
    assert figures["detected_by"] == "lost", figures
    assert figures["survivor_max_gap_s"] < Timeouts().ftar_timeout_s  # no survivor waited out a timeout
    assert figures["healed_from_to"][0] == 0 and figures["healed_from_to"][1] >= 5  # the job was past the kill step
    assert len(figures["quorum_ids"]) >= 3  # start, after the kill, after the rejoin
    # the restart claimed prepared spares (the demo's default), and the job stayed consistent: every rank's
    # parameters after each commit equal across replicas, the restarted replica's included
    assert figures["rejoin_prepared"] == [True, True], figures
    assert figures["replicas_consistent"] and figures["rejoined_steps_compared"] >= 2, figures
    assert "committed by" in out.stdout and "report" in out.stdout
