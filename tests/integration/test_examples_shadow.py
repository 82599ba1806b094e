"""Every script in examples/ runs unchanged under the shadow loader (`ftrun emulate SCRIPT --profile
ci-small`): its imports of torch (dynamo and inductor included) see the torch.cuda shim, and it trains
to the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# own_loop_plain.py is the plain-PyTorch "before" of own_loop.py (the port diff): it starts no ftrun job.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if p.name != "own_loop_plain.py")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_under_the_shadow_loader(script, tmp_path):
    out = subprocess.run([sys.executable, "-m", "ftrun.cli", "emulate", str(script), "--profile", "ci-small"],
                         capture_output=True, text=True, timeout=110, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "under the shadow loader" in out.stderr and "torch.cuda shimmed" in out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    final = [e for e in events if e.get("event") == "final"]
    assert final and final[-1]["step"] > 0, out.stdout[-2000:]


def test_there_are_examples():
    assert EXAMPLES
