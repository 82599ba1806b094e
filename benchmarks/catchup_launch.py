"""How long a joiner's healthy peers wait for its catch-up, in a real `ftrun launch` (issue 15 item 1).

    python benchmarks/catchup_launch.py [--steps 40] [--kill-at 10,25] [--json] [--out DIR]

Three replicas train a 4.2M-parameter MLP (benchmarks/catchup_mlp_worker.py: a 50.4 MB state with the
Adam moments); r1 is SIGKILLed after each --kill-at step, restarted, and catches up from the other two.
From the job's events.jsonl it prints, per rejoin: the joiner's fetch (bytes, seconds, GB/s) and each
healthy replica's measured stall in that step ("catchup_wait" stall_s), against the job's median step
time measured in the same run (commit to commit of r0 over steps without a joiner). The figure is
`max_stall_steps` = the longest stall / the median step: the target is <= 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", default="10,25", help="steps after which r1 is killed, comma separated")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="keep the job's output (events.jsonl, logs) in this new directory")
    args = p.parse_args()
    if args.out:
        out_dir = contextlib.nullcontext(args.out)
    else:
        out_dir = tempfile.TemporaryDirectory(prefix="ftrun-catchup-launch-")
    with out_dir as out:
        cmd = [sys.executable, "-m", "ftrun.cli", "launch", "--replicas", "3", "--steps", str(args.steps),
               "--out", out, "--no-progress", "--timeout", "600s"]
        for step in args.kill_at.split(","):
            cmd += ["--kill-at", f"step={int(step)},replica=r1"]
        cmd += [os.path.join(ROOT, "benchmarks", "catchup_mlp_worker.py"), "--width", str(args.width)]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"ftrun launch exited with {run.returncode}")
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f if line.strip()]
    figures = analyse(events)
    print(f"median step {figures['median_step_s'] * 1e3:.1f} ms (steps without a joiner)")
    for r in figures["rejoins"]:
        print(f"step {r['step']}: fetch {r['num_bytes'] / 1e6:.1f} MB in {r['fetch_s'] * 1e3:.1f} ms "
              f"({r['fetch_gbps']:.2f} GB/s); healthy peers' stall {r['max_stall_s'] * 1e3:.1f} ms "
              f"= {r['stall_steps']:.2f} steps ({', '.join(r['actions'])})")
    print(f"max stall: {figures['max_stall_steps']:.2f} steps")
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    return 0


def analyse(events: list[dict]) -> dict:
    """Per-rejoin fetch and stall figures, and the median step time of steps without a joiner."""
    rank0 = [e for e in events if e.get("rank", 0) == 0]
    joined = {e["step"] for e in rank0 if e.get("event") == "catchup"}
    commits = sorted((e["step"], e["t"]) for e in rank0 if e.get("event") == "commit" and e.get("replica_id") == "r0")
    steps = [t1 - t0 for (s0, t0), (s1, t1) in zip(commits, commits[1:])
             if s1 == s0 + 1 and not ({s0, s1} & joined | {s1 - 1, s1 - 2} & joined)]
    median = statistics.median(steps) if steps else float("nan")
    rejoins = []
    for c in (e for e in rank0 if e.get("event") == "catchup"):
        waits = [e for e in rank0 if e.get("event") == "catchup_wait" and e["step"] == c["step"]]
        stall = max((w["stall_s"] for w in waits), default=0.0)
        rejoins.append({"step": c["step"], "replica": c["replica_id"], "num_bytes": c["num_bytes"],
                        "fetch_s": c["seconds"], "fetch_gbps": c["num_bytes"] / max(c["seconds"], 1e-9) / 1e9,
                        "max_stall_s": stall, "stall_steps": stall / median, "actions": [w["action"] for w in waits]})
    return {"median_step_s": median, "rejoins": rejoins,
            "max_stall_steps": max((r["stall_steps"] for r in rejoins), default=0.0)}


if __name__ == "__main__":
    sys.exit(main())
