"""Emulate the real runs of one `ftrun fidelity --restep --json --out DIR` run again with two models: "before"
(the run's own inputs: its restep figures, its write, its teardown, its skews, its start offsets: what it emulated) and "after" (the same
with the changes named on the command line). Same real runs, same restep figures: a clean A/B of the model.

    python benchmarks/fidelity_ab.py DIR FIDELITY_STDOUT [--figure NAME=VALUE ...] [--drop NAME ...]
        [--real-write | --sampled-write] [--teardown run|real|restep] [--skews run|real|restep] [--set KEY=VALUE ...]
        [--speed-from-real] [--seeds N] [--save OUT.json]

FIDELITY_STDOUT: the file the run's stdout went to (its last line is the --json object).
--figure NAME=VALUE: a measured figure replaced in both restep snapshots (e.g. cpu_cores_effective=2.0, measured
  again with the current probe): the keys are derived from it again (train.shared_cpu_cores too).
--drop NAME: a figure left out of both restep snapshots (its keys derived as without it, e.g. script_start_skew_s;
  script_exchange_skew_s: no late wake from the all-reduce, whatever --skews says).
--real-write: the loader_state write from the real runs' own writer (their phase events,
  `harness.calibrate.fidelity.real_write`) instead of the write the run emulated with.
--sampled-write: the write the run sampled in its own process while the real runs ran (`write_sampled_s`).
--set KEY=VALUE: a profile override of the "after" model (e.g. storage.lighthouse_persists=true).
--teardown: the killed rank's teardown the run emulated with ("run", the default), the real runs' own kills' (their
  trace.json, `harness.calibrate.fidelity.real_teardown`) or the restep's mean ("restep", as runs before the real one).
--speed-from-real: the restep's CPU work (`harness.calibrate.fidelity.CPU_WORK_KEYS`) scaled by the real runs' CPU per
  rank-step over the resteps' (`real_cpu_speed`; `mean_values` with that scale): the model at the speed the machine ran the real
  runs at, apart from its drift between the resteps and them.
--seeds N: emulate each model N times (seeds 0..N-1) and pool the runs as `ftrun fidelity --emulated-seeds` does
  (default: its default).
--skews: the ranks' late starts and wakes from the all-reduce the run emulated with ("run"), the real runs' own
  (their events, `harness.calibrate.fidelity.real_skews`; "real-unscaled": divided by the R / 2 the emulator
  scales them by with R replicas up, as they were measured with R up) or the restep's means ("restep").
"""

from __future__ import annotations

import argparse
import json
import os

from harness.calibrate import fidelity as fd
from harness.calibrate.measure import Figure
from harness.calibrate.provenance import profile_keys

KEYS = (*fd.SCRIPT_KEYS, "train.shared_cpu_cores")


def script_keys(figures: dict[str, float], replace: dict[str, float], drop: set[str] = frozenset()) -> dict[str, float]:
    k = profile_keys({n: Figure(n, v, "", "", 1) for n, v in {**figures, **replace}.items() if n not in drop})
    return {key: k[key][0] for key in KEYS if key in k}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("stdout_path")
    p.add_argument("--figure", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--drop", action="append", default=[], metavar="NAME")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--real-write", action="store_true")
    w.add_argument("--sampled-write", action="store_true")
    p.add_argument("--teardown", choices=("run", "real", "restep"), default="run")
    p.add_argument("--skews", choices=("run", "real", "real-unscaled", "restep"), default="run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--speed-from-real", action="store_true")
    p.add_argument("--seeds", type=int, default=fd.EMULATED_SEEDS)
    p.add_argument("--save", default=None)
    a = p.parse_args()
    replace = {}
    for item in a.figure:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--figure {item!r}: expected NAME=VALUE")
        replace[name] = float(value)
    with open(a.stdout_path) as f:
        doc = json.loads(f.read().strip().splitlines()[-1])
    q = argparse.ArgumentParser()
    fd.add_arguments(q)
    kills = doc.get("kills", 4)
    # the run's kill spacing (runs before its `kill_step_interval` key ran --steps = 15 + kills x interval)
    interval = doc.get("kill_step_interval") or (doc["steps"] - 15) // kills
    args = q.parse_args(["--replicas", str(doc["replicas"]), "--ranks-per-replica", str(doc["ranks_per_replica"]),
                         "--steps", str(doc["steps"]), "--kills", str(kills), "--kill-step-interval", str(interval)])
    real_evs, traces = [], []
    for d in sorted(x for x in os.listdir(a.out_dir) if x.startswith("real")):
        with open(os.path.join(a.out_dir, d, "events.jsonl")) as f:
            real_evs.append([json.loads(line) for line in f if line.strip()])
        traces.append(fd.read_trace(os.path.join(a.out_dir, d)))
    real, each = fd.repeated(real_evs, num_replicas=args.replicas)
    starts = [] if doc["first_start_s"] is None else [f"scheduler.first_start_s={doc['first_start_s']!r}"]
    out = {"real": real, "real_stall_phases": fd.runs_stall_phases(real_evs),
           "replace": replace, "drop": a.drop, "real_write": a.real_write, "sampled_write": a.sampled_write,
           "teardown": a.teardown, "skews": a.skews, "set": a.set, "speed_from_real": a.speed_from_real}
    for model in ("before", "after"):
        changes, drop = (replace, set(a.drop)) if model == "after" else ({}, set())
        before, after = (script_keys(doc["restep_figures"][when], changes, drop) for when in ("before", "after"))
        overrides = fd.mean_overrides(before, after)
        if changes or drop:  # keys outside SCRIPT_KEYS that the replaced figures set; 0 for those a dropped one set
            overrides += fd.mean_overrides(before, after, tuple(k for k in KEYS if k not in fd.SCRIPT_KEYS))
            full = script_keys(doc["restep_figures"]["before"], {})
            overrides += [f"{k}=0.0" for k in KEYS if k in full and k not in before]
        if model == "after" and a.speed_from_real:
            speed = fd.real_cpu_speed(real_evs, args.replicas, before, after)
            if speed is None:
                raise SystemExit("--speed-from-real: the real runs' events have no CPU per step (phase events' cpu)")
            out["cpu_per_rank_step_s"] = {"real": speed[0], "restep": speed[1]}
            print(f"speed: the real runs' CPU per rank-step {speed[0] * 1e3:.3f} ms, the resteps' {speed[1] * 1e3:.3f} ms")
            for key, value in fd.mean_values(before, after, fd.CPU_WORK_KEYS, speed[0] / speed[1]).items():
                overrides = fd.with_override(overrides, key, value)
        write = doc["write_during_real_s"]
        if model == "after" and a.real_write:
            write = fd.real_write(real_evs, None).value
        elif model == "after" and a.sampled_write:
            write = doc["write_sampled_s"]
        overrides = fd.with_override(overrides, fd.WRITE_KEY, write)
        # the run's own (None / empty: it emulated with the restep's means; skews_during_real_s: runs of 47a0c94)
        teardown, skews = doc.get("teardown_during_real_s"), dict(doc.get("skews_during_real_s") or {})
        if model == "after" and a.teardown != "run":
            t = fd.real_teardown(traces) if a.teardown == "real" else None
            teardown = None if t is None else t.value
        if model == "after" and a.skews != "run":
            # real-unscaled: the real runs' own, divided by the R / 2 the emulator scales them by with R replicas up
            # (they were measured with R up, not 2)
            scale = args.replicas / 2 if a.skews == "real-unscaled" else 1.0
            skews = ({key: f.value / scale for key, f in fd.real_skews(real_evs, args.ranks_per_replica).items()}
                     if a.skews.startswith("real") else {})
        overrides = fd.with_override(overrides, fd.TEARDOWN_KEY, teardown)
        if "script_exchange_skew_s" in drop:  # no late wake from the all-reduce at all (as before that key)
            skews["train.rank_exchange_skew_s"] = 0.0
        for key, value in skews.items():
            overrides = fd.with_override(overrides, key, value)
        runs = fd.emulated_runs(args, doc["profile"], [*overrides, *starts, *(a.set if model == "after" else ())],
                                a.seeds)
        evs, heals = [ev for _, ev, _ in runs], [h for _, _, h in runs]
        emulated, _ = fd.repeated(evs, num_replicas=args.replicas, catchups=heals)
        table = fd.side_by_side(real, emulated, fd.noise(each))
        out[model] = {"complete": all(f.get("complete") for f, _, _ in runs), "overrides": overrides, "table": table,
                      "stall_phases": fd.runs_stall_phases(evs),
                      "phases": fd.runs_phases(evs)}
        print(f"{model}: max |ln| {table['max_abs_log_ratio']:.3f}; "
              + "  ".join(f"{r['name']} {r['ratio']:.2f}" for r in table["metrics"] if r["ratio"] is not None))
        print("  stall phases, ms, real / emulated: " + "; ".join(
            f"{c} {fd._ms(out['real_stall_phases'][c])} / {fd._ms(out[model]['stall_phases'][c])}"
            for c in fd.STALL_COLUMNS))
    if a.save:
        with open(a.save, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
