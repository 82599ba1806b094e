"""Emulate the real runs of one `ftrun fidelity --restep --json --out DIR` run again with two models: "before"
(the phase figures of the restep's script runs dropped, so the keys are derived as they were before them, and
network.replica_collective_pass_s / train.replica_compute_extra_s 0) and "after" (every figure: what the run
itself emulated). Same real runs, same restep figures, same write and start offsets: a clean A/B of the model.

    python benchmarks/fidelity_ab.py DIR FIDELITY_STDOUT [OUT.json]

FIDELITY_STDOUT: the file the run's stdout went to (its last line is the --json object).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from harness.calibrate import fidelity as fd
from harness.calibrate.measure import Figure
from harness.calibrate.provenance import profile_keys

PHASE_FIGURES = {f"script_{what}{runs}_s" for what in ("commit_vote", "compute", "decision_broadcast")
                 for runs in ("", "_2_replicas")}
NEW_KEYS = ("network.replica_collective_pass_s", "train.replica_compute_extra_s")


def script_keys(figures: dict[str, float], drop: set[str]) -> dict[str, float]:
    k = profile_keys({n: Figure(n, v, "", "", 1) for n, v in figures.items() if n not in drop})
    return {key: k[key][0] for key in fd.SCRIPT_KEYS if key in k}


def main(out_dir: str, stdout_path: str, save: str | None) -> None:
    with open(stdout_path) as f:
        doc = json.loads(f.read().strip().splitlines()[-1])
    p = argparse.ArgumentParser()
    fd.add_arguments(p)
    args = p.parse_args(["--replicas", str(doc["replicas"]), "--ranks-per-replica", str(doc["ranks_per_replica"]),
                         "--steps", str(doc["steps"])])
    real_evs = []
    for d in sorted(x for x in os.listdir(out_dir) if x.startswith("real")):
        with open(os.path.join(out_dir, d, "events.jsonl")) as f:
            real_evs.append([json.loads(line) for line in f if line.strip()])
    real, each = fd.repeated(real_evs, num_replicas=args.replicas)
    starts = [] if doc["first_start_s"] is None else [f"scheduler.first_start_s={doc['first_start_s']!r}"]
    out = {"real": real, "real_stall_phases": fd.stall_phase_medians([r for ev in real_evs for r in fd.stall_phases(ev)])}
    for model, drop in (("before", PHASE_FIGURES), ("after", set())):
        before, after = (script_keys(doc["restep_figures"][when], drop) for when in ("before", "after"))
        overrides = fd.with_override(fd.mean_overrides(before, after), fd.WRITE_KEY, doc["write_during_real_s"])
        if drop:
            overrides = [o for o in overrides if o.split("=", 1)[0] not in NEW_KEYS] + [f"{k}=0.0" for k in NEW_KEYS]
        f, ev, heals = fd._emulated(args, doc["profile"], [*overrides, *starts])
        table = fd.side_by_side(real, fd.metrics(ev, num_replicas=args.replicas, catchup_s=heals), fd.noise(each))
        out[model] = {"complete": f.get("complete"), "overrides": overrides, "table": table,
                      "stall_phases": fd.stall_phase_medians(fd.stall_phases(ev))}
        print(f"{model}: max |ln| {table['max_abs_log_ratio']:.3f}; "
              + "  ".join(f"{r['name']} {r['ratio']:.2f}" for r in table["metrics"] if r["ratio"] is not None))
        print("  stall phases, ms, real / emulated: " + "; ".join(
            f"{c} {fd._ms(out['real_stall_phases'][c])} / {fd._ms(out[model]['stall_phases'][c])}"
            for c in fd.STALL_COLUMNS))
    if save:
        with open(save, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:3], sys.argv[3] if len(sys.argv) > 3 else None)
