"""Emulator at scale: `ftrun emulate` of a profile at several total rank counts (ranks per replica varied),
one subprocess per point so each point's peak RSS is its own. Prints modeled get_quorum p50/p99, wall and
peak RSS per point, and each against the smallest point measured in the same run (the baseline): how
modeled latency and the emulator's own cost grow with scale.

    PYTHONPATH=. .venv/bin/python benchmarks/emulate_scale.py [--profile meta-98k] [--ranks 1k,8k,32k,98k]
        [--steps 3] [--comm tree|flat] [--kill] [--rss-limit-mb 8192] [--json]

`--kill` injects "kill replica=1 step=1" at every point (steps must be >= 4 to see the rejoin). A point that
passes --rss-limit-mb or --wall-limit-s is stopped and reported as such, and larger points are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.cli import parse_sweep, sweep_layout  # noqa: E402
from harness.profile import load_profile  # noqa: E402


def run_point(args: argparse.Namespace, per_replica: int, racks: int) -> dict:
    cmd = [sys.executable, "-m", "ftrun.cli", "emulate", args.profile, "--steps", str(args.steps), "--json",
           "--no-progress", "--comm", args.comm, "--set", f"ranks_per_replica={per_replica}",
           "--set", f"topology.racks_per_zone={racks}"]
    cmd += ["--inject", "kill replica=1 step=1"] if args.kill else ["--set", "failures.mode=none"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=env)
    ps, peak, started = psutil.Process(proc.pid), 0.0, time.monotonic()
    stopped = None
    while proc.poll() is None:
        try:
            peak = max(peak, ps.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            break
        if peak > args.rss_limit_mb or time.monotonic() - started > args.wall_limit_s:
            stopped = f"stopped at {time.monotonic() - started:.0f} s wall, {peak:.0f} MB RSS"
            proc.kill()
            break
        time.sleep(0.25)
    out = proc.communicate()[0]
    wall = time.monotonic() - started
    if stopped or proc.returncode != 0:
        return {"ranks_per_replica": per_replica, "stopped": stopped or f"exit {proc.returncode}",
                "wall_s": round(wall, 1), "peak_rss_mb": round(peak)}
    f = json.loads(out.strip().splitlines()[-1])
    return {k: f[k] for k in ("ranks", "ranks_per_replica", "get_quorum_p50_ms", "get_quorum_p99_ms",
                              "start_step_p50_ms", "leader_quorum_rtt_p50_ms", "stall_per_failure_s",
                              "rejoin_stall_s", "wall_s", "peak_rss_mb", "complete")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="meta-98k")
    p.add_argument("--ranks", default="1k,8k,32k,98k")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--comm", choices=("tree", "flat"), default="tree")
    p.add_argument("--kill", action="store_true")
    p.add_argument("--rss-limit-mb", type=float, default=8192)
    p.add_argument("--wall-limit-s", type=float, default=900)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    base = load_profile(args.profile)
    t = base.topology
    rows = []
    for total in parse_sweep(f"ranks={args.ranks}"):
        per = sweep_layout(base, total)
        hosts = -(-per // t.gpus_per_host)
        racks = max(t.racks_per_zone, -(-base.replicas * hosts // (t.hosts_per_rack * t.zones_per_building * t.buildings)))
        row = run_point(args, per, racks)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if "stopped" in row:
            break
    done = [r for r in rows if "stopped" not in r]
    if done:
        b = done[0]
        print(f"\n{'ranks':>7} {'q p50 ms':>9} {'q p99 ms':>9} {'x base':>7} {'wall s':>7} {'us/rank-step':>12} {'RSS MB':>7}")
        for r in done:
            per_rank = 1e6 * r["wall_s"] / (r["ranks"] * args.steps)
            print(f"{r['ranks']:>7} {r['get_quorum_p50_ms']:>9.2f} {r['get_quorum_p99_ms']:>9.2f} "
                  f"{r['get_quorum_p50_ms'] / b['get_quorum_p50_ms']:>7.2f} {r['wall_s']:>7.1f} {per_rank:>12.1f} "
                  f"{r['peak_rss_mb']:>7.0f}")
    for r in rows:
        if "stopped" in r:
            print(f"  {r['ranks_per_replica']} ranks per replica: {r['stopped']}")
    if args.json:
        print(json.dumps({"profile": args.profile, "comm": args.comm, "steps": args.steps, "points": rows}))
    return 0 if all("stopped" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
