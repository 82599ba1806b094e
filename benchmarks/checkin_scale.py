"""Flat vs tree check-in at scale, timed with CPU charging: the paper's 9 s get_quorum (§5) in miniature.

A 2-replica emulated job runs its check-in, decision broadcast and commit vote through the real TreeComm
or through FlatComm (every rank messages the leader), at growing ranks per replica, with CPU charging on
so each message's real handling cost lands on its host's timeline. Prints the modeled get_quorum p50 per
size and the growth over the size range for both; flat grows about linearly, the tree by a level.

The ratios depend on real CPU time, so machine load moves them (a loaded 2-core box once measured flat
x3.8 over 16x the ranks where an idle one gives more): that is why this is a benchmark and not a test.
The exact structural fact (messages the leader handles per collective) is asserted in
tests/unit/test_emulated_checkin.py.

    PYTHONPATH=. .venv/bin/python benchmarks/checkin_scale.py [--sizes 128 512 2048] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.cli import execute  # noqa: E402
from harness.profile import apply_overrides, load_profile  # noqa: E402
from harness.run import JobOptions  # noqa: E402


def quorum_ms(comm: str, ranks_per_replica: int, steps: int) -> float:
    """Median modeled get_quorum of a 2-replica job whose replicas check in and vote through `comm`."""
    profile = apply_overrides(load_profile("meta-98k"), [
        "replicas=2", f"ranks_per_replica={ranks_per_replica}", "model.layers=1", "model.hidden=256",
        "model.heads=4", "model.vocab=1000", f"train.steps={steps}", "failures.mode=none",
        "emulation.cpu_charging=true"])
    figures, _ = execute(profile, JobOptions(steps=steps, comm=comm))  # type: ignore[arg-type]
    if not figures["complete"] or figures["unexpected_errors"]:
        raise RuntimeError(f"{comm} at {ranks_per_replica} ranks did not complete: {figures['unexpected_errors']}")
    return figures["get_quorum_p50_ms"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 512, 2048], help="ranks per replica")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    if len(args.sizes) < 2 or any(n < 2 for n in args.sizes):
        parser.error(f"--sizes needs at least two sizes of >= 2 ranks, got {args.sizes}")
    result: dict = {"sizes": args.sizes}
    for comm in ("flat", "tree"):
        ms = [quorum_ms(comm, n, args.steps) for n in args.sizes]
        result[f"{comm}_get_quorum_p50_ms"] = ms
        result[f"{comm}_growth"] = ms[-1] / ms[0]
        print(f"{comm}: get_quorum p50 {', '.join(f'{m:.2f}' for m in ms)} ms at {args.sizes} ranks per replica "
              f"(x{result[f'{comm}_growth']:.2f} over x{args.sizes[-1] / args.sizes[0]:.0f} ranks)", flush=True)
    result["flat_over_tree_growth"] = result["flat_growth"] / result["tree_growth"]
    print(f"flat grows x{result['flat_over_tree_growth']:.2f} faster than the tree")
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
