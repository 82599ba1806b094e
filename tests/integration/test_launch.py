"""`ftrun launch` end to end: real replica processes, an injected kill, a restart, the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_launch_kills_restarts_and_reports(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "ftrun.cli", "launch", "--replicas", "3", "--ranks-per-replica", "1", "--steps", "100",
         "--kill-at", "step=8,replica=r1", "--min-replicas", "2", "--out", str(tmp_path), "--timeout", "90s",
         "--json", "-m", "ftrun.launch.demo_worker", "--step-time", "0.1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    f = json.loads(out.stdout.strip().splitlines()[-1])
    assert f["complete"] and f["steps_reached"] >= 100
    assert f["kills"] == 1 and f["restarts"] == 1
    assert 0 < f["step_efficiency"] <= 1
    assert os.path.getsize(tmp_path / "report.png") > 10_000
    events = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    kill = next(e for e in events if e["event"] == "kill")
    assert kill["replica_id"] == "r1" and kill["step"] >= 8
    assert any(e["event"] == "commit" and e["replica_id"] == "r1" and e["incarnation"] == 1 for e in events), \
        "the restarted replica rejoined and committed"
