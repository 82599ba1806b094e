"""Screenshot of the lighthouse status page during a real incident, for the closing note.

Usage: python benchmarks/status_page.py [--out benchmarks/results/status_page.png] [--json]
Launches `ftrun launch --replicas 3 --ranks-per-replica 2 -m ftrun.train.ft_worker`, waits until every replica
committed, SIGSTOPs rank 1 of r1 (its leader stays alive: only the diagnosis finds it), waits for the monitor's
eviction, then loads the page from OUT/status in headless Chromium with the token from OUT/token (in an
Authorization header, tests/integration/chromium.py) and saves the screenshot; copies the job's report.png
beside it (`_report.png`) once the job ends. Needs chromium (ci/install_chromium.sh). With --json the last line is
one JSON object: the paths, and the seconds from the SIGSTOP to the verdict naming the rank (`named_s`), to its
eviction (`evicted_s`) and to both survivors committing a step in a new quorum (`survivors_commit_s`). The event
log helpers are benchmarks/diagnose_real.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.diagnose_real import ENV, VICTIM, _events, _recommitted, _wait  # noqa: E402
from tests.integration.chromium import find_chromium, load_page  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/status_page.png"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if find_chromium()[0] is None:
        print(find_chromium()[1], file=sys.stderr)
        return 2
    run = Path(tempfile.mkdtemp(prefix="ftrun-status-page-")) / "run"
    cmd = [sys.executable, "-m", "ftrun.cli", "launch", "--out", str(run), "--json", "--no-progress", "--replicas", "3",
           "--ranks-per-replica", "2", "--steps", "60", "--min-replicas", "2", "--timeout", "150s",
           "-m", "ftrun.train.ft_worker", "--step-time", "0.05"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)
    try:
        _wait(run, proc, lambda evs: any(e["event"] == "steady" for e in evs), 120, "steady state")
        victim = next(e["pid"] for e in _events(run) if e["event"] == "ready" and e["replica_id"] == VICTIM[0]
                      and e["rank"] == VICTIM[1] and e["incarnation"] == 0)
        os.kill(victim, signal.SIGSTOP)
        stopped = time.monotonic()
        evict = _wait(run, proc, lambda evs: next((e for e in evs if e["event"] == "evict"), None), 60, "eviction")
        recommit = _wait(run, proc, lambda evs: _recommitted(evs, stopped), 60, "the survivors' commit")
        key = f"{VICTIM[0]}/{VICTIM[1]}"
        named = next(e for e in _events(run) if e["event"] == "verdict" and key in e["ranks"] + e["silent"])
        url, token = (run / "status").read_text().strip(), (run / "token").read_text().strip()
        shot = load_page(url, headers={"Authorization": f"Bearer {token}"}, out_png=args.out)
        proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    report = str(Path(args.out).with_name(Path(args.out).stem + "_report.png"))
    shutil.copy(run / "report.png", report)
    result = {"screenshot": args.out, "report_png": report, "run": str(run), "launch_exit": proc.returncode,
              "named_s": round(named["t"] - stopped, 3), "evicted_s": round(evict["t"] - stopped, 3),
              "survivors_commit_s": round(recommit - stopped, 3),
              "page_bytes": len(shot.dom), "token_in_page": token in shot.dom}
    print(f"status page of a real job with r1/1 SIGSTOPped: {args.out} (report: {report}); named after "
          f"{result['named_s']}s, evicted after {result['evicted_s']}s, survivors committed after "
          f"{result['survivors_commit_s']}s")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
