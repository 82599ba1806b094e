"""Soak: an FT-HSDP CPU job that survives N injected replica kills with exactly-once data and identical state.

    python benchmarks/soak.py [--kills 1000] [--replicas 4] [--kill-random-mean 0.8s] [--out DIR] [--json]

Runs `ftrun launch` on ftrun.train.ft_worker (real lighthouse, quorum, HTTP catch-up, FTAR, 2PC, sqrt LR
intervention, audit files) with random (exponential) kills of whole replicas until --kills kills were
injected; then, once every replica is back, the job stops a few steps later through the worker's stop
file. Rank processes fork from the launcher's zygote, so a restart costs ~50 ms of CPU instead of ~3 s
of interpreter and torch start-up. Kills only hit a replica whose loss leaves at least --min-replicas
healthy ones, so the job always keeps a copy of its state.

Prints the launcher's report and the soak's figures: kills injected, steps and replica-steps committed,
duplicate and skipped batches (the exactly-once audit over every replica's audit files), identical-state
checks (param_hash comparisons of replicas committing the same step) and wall time; exits 1 unless
duplicates = skipped = 0, no divergence, and the job completed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(args: argparse.Namespace, out: str) -> list[str]:
    return [sys.executable, "-m", "ftrun.cli", "launch", "--replicas", str(args.replicas),
            "--min-replicas", str(args.min_replicas), "--steps", "10000000", "--max-kills", str(args.kills),
            "--kill-random-mean", args.kill_random_mean, "--restart-delay", args.restart_delay,
            "--stop-file", os.path.join(out, "stop"), "--seed", str(args.seed), "--timeout", args.timeout,
            "--out", out, "--json", "-m", "ftrun.train.ft_worker", "--step-time", str(args.step_time),
            "--stop-file", os.path.join(out, "stop"), "--ftar-timeout", "5"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=1000)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--kill-random-mean", default="0.8s")
    p.add_argument("--restart-delay", default="0.1s")
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", default="3h")
    p.add_argument("--out", default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="ftrun-soak-"))
    os.makedirs(out, exist_ok=True)
    cmd = command(args, out)
    print("soak:", " ".join(cmd), flush=True)
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    wall = time.monotonic() - started
    lines = proc.stdout.strip().splitlines()
    print("\n".join(lines[:-1]))
    try:
        f = json.loads(lines[-1])
    except (IndexError, ValueError):
        print(f"soak: the launcher ended with {proc.returncode} and no figures", file=sys.stderr)
        return 1
    figures = {"kills_injected": f["failures_injected"], "crashes": f["crashes"], "steps": f["steps_reached"],
               "replica_steps_committed": f["steps_committed"], "replica_steps_total": f["steps_total"],
               "step_efficiency": f["step_efficiency"], "theoretical_efficiency": f["theoretical_efficiency"],
               "failed_commits": f["failed_commits"], "events_after_kill": f["events_after_kill"], "duplicate_batches": f["duplicate_batches"],
               "skipped_batches": f["skipped_batches"], "audit_problems": f["audit_problems"],
               "replicas_identical": f["replicas_identical"], "identity_checks": f["identity_checks"],
               "mean_downtime_s": f["mean_downtime_s"], "mean_restart_s": f["mean_restart_s"],
               "final_loss": f["final_loss"], "wall_s": wall, "complete": f["complete"], "out": out}
    ok = (f["complete"] and f["failures_injected"] >= args.kills and f["duplicate_batches"] == 0
          and f["skipped_batches"] == 0 and f["audit_problems"] == 0 and f["replicas_identical"]
          and f["events_after_kill"] == 0)
    print(f"\nsoak {'PASSED' if ok else 'FAILED'}: {figures['kills_injected']} kills injected "
          f"({figures['crashes']} crashes), {figures['steps']} steps, {figures['replica_steps_committed']}/"
          f"{figures['replica_steps_total']} replica-steps committed, {figures['failed_commits']} failed commits; "
          f"duplicate batches {figures['duplicate_batches']}, skipped batches {figures['skipped_batches']}, "
          f"audit problems {figures['audit_problems']}; replicas identical: {figures['replicas_identical']} "
          f"({figures['identity_checks']} param_hash checks); wall {wall:.0f}s")
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
