"""How long a joiner's healthy peers wait for its catch-up, in a real `ftrun launch` (issue 15 item 1).

    python benchmarks/catchup_launch.py [--steps 130] [--kill-at 10,50,90] [--json] [--out DIR]

Three replicas train a 4.2M-parameter MLP (benchmarks/catchup_mlp_worker.py: a 50.4 MB state with the
Adam moments); r1 is SIGKILLed after each --kill-at step, restarted, and catches up from the other two.
From the job's events.jsonl it prints, per rejoin: the joiner's fetch (bytes, seconds, GB/s) and each
healthy replica's measured stall in that step ("catchup_wait" stall_s) and the step's length (r0's
commit before it to its commit), against the job's median step time measured in the same run (commit
to commit of r0 over steps without a joiner). The figure is
`max_stall_steps` = the longest stall / the median step: the target is <= 1.

The start heal (r1 starting after the others took their first step: it heals at step 1 as incarnation
0) is a different figure from a restart's rejoin and is reported apart. Each kill must be followed by
its restarted replica's catch-up: a restart takes ~1.7 s to be ready (0.5 s before the launcher
restarts it, ~1.2 s from the fork server to `ready`), so kills closer than that in steps (~85 ms a
step for two replicas on 2 cores) kill the restarted replica before it ever joins. The default kills
are 40 steps apart; a kill without a rejoin after it makes the script exit 1 naming it.

It measures the tree it lives in: the launcher and the workers import this tree's ftrun (PYTHONPATH
starts with it). To compare two trees, run each tree's own copy of the script.
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
    p.add_argument("--steps", type=int, default=130)
    p.add_argument("--kill-at", default="10,50,90",
                   help="steps after which r1 is killed, comma separated (far enough apart for it to rejoin)")
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
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"ftrun launch exited with {run.returncode}")
        with open(os.path.join(out, "events.jsonl")) as f:
            events = [json.loads(line) for line in f if line.strip()]
    figures = analyse(events)
    print(f"median step {figures['median_step_s'] * 1e3:.1f} ms (steps without a joiner)")
    for title, key in (("start heal", "start_heals"), ("rejoin", "rejoins")):
        for r in figures[key]:
            print(f"{title} of {r['replica']} (incarnation {r['incarnation']}) at step {r['step']}: fetch "
                  f"{r['num_bytes'] / 1e6:.1f} MB in {r['fetch_s'] * 1e3:.1f} ms ({r['fetch_gbps']:.2f} GB/s); "
                  f"healthy peers' stall {r['max_stall_s'] * 1e3:.1f} ms = {r['stall_steps']:.2f} steps "
                  f"({', '.join(r['actions'])}); the step took {r['step_s'] * 1e3:.1f} ms")
    if figures["rejoins"]:
        print(f"rejoins: median fetch {figures['median_rejoin_fetch_s'] * 1e3:.1f} ms; "
              f"max stall {figures['max_stall_steps']:.2f} steps")
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    for kill in figures["kills_without_rejoin"]:
        print(f"FAILED: the kill of {kill['replica']} (incarnation {kill['incarnation']}) at step {kill['step']} "
              f"has no rejoin catch-up after it (killed again first, or the job ended): space the kills "
              f"further apart or run more --steps", file=sys.stderr)
    return 1 if figures["kills_without_rejoin"] else 0


def analyse(events: list[dict]) -> dict:
    """Per-catch-up fetch and stall figures (the start heals of incarnation 0 apart from the rejoins of
    restarted replicas), the median step time of steps without a joiner, and the kills whose restarted
    replica never caught up."""
    rank0 = [e for e in events if e.get("rank", 0) == 0]
    joined = {e["step"] for e in rank0 if e.get("event") == "catchup"}
    commits = sorted((e["step"], e["t"]) for e in rank0 if e.get("event") == "commit" and e.get("replica_id") == "r0")
    steps = [t1 - t0 for (s0, t0), (s1, t1) in zip(commits, commits[1:])
             if s1 == s0 + 1 and not ({s0, s1} & joined | {s1 - 1, s1 - 2} & joined)]
    median = statistics.median(steps) if steps else float("nan")
    committed = dict(commits)
    catchups = []
    for c in (e for e in rank0 if e.get("event") == "catchup"):
        waits = [e for e in rank0 if e.get("event") == "catchup_wait" and e["step"] == c["step"]]
        stall = max((w["stall_s"] for w in waits), default=0.0)
        step_s = committed[c["step"]] - committed[c["step"] - 1] \
            if c["step"] in committed and c["step"] - 1 in committed else float("nan")
        catchups.append({"step": c["step"], "replica": c["replica_id"], "incarnation": c.get("incarnation", 0),
                         "num_bytes": c["num_bytes"], "fetch_s": c["seconds"],
                         "fetch_gbps": c["num_bytes"] / max(c["seconds"], 1e-9) / 1e9, "max_stall_s": stall,
                         "stall_steps": stall / median, "actions": [w["action"] for w in waits],
                         "step_s": step_s})
    rejoins = [c for c in catchups if c["incarnation"] > 0]
    caught_up = {(c["replica"], c["incarnation"]) for c in rejoins}
    kills = [{"replica": e["replica_id"], "incarnation": e["incarnation"], "step": e.get("step")}
             for e in sorted(events, key=lambda e: e["t"]) if e.get("event") == "kill"]
    return {"median_step_s": median, "start_heals": [c for c in catchups if c["incarnation"] == 0],
            "rejoins": rejoins,
            "median_rejoin_fetch_s": statistics.median(r["fetch_s"] for r in rejoins) if rejoins else float("nan"),
            "max_stall_steps": max((r["stall_steps"] for r in rejoins), default=0.0),
            "kills_without_rejoin": [k for k in kills if (k["replica"], k["incarnation"] + 1) not in caught_up]}


if __name__ == "__main__":
    sys.exit(main())
