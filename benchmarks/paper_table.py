"""The FT-HSDP paper's stall table (§6.1) reproduced in the emulator: paper-expected vs emulated side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/paper_table.py [--profile meta-98k] [--ranks-per-replica 8]
        [--check-ranks 32] [--diagnose 2] [--json] [--out benchmarks/results/paper_table.md]

Scenarios, each one emulated job (harness.cli.execute) of the profile scaled down (below):
- silent:      the paper's settings, `cut replica=3 step=3 at=0.5 duration=120` (a host loss mid-step: silence,
               no reset, for 120 s, then the hosts answer again)
- crash:       the same moment as a process crash, `kill replica=3 step=3 at=0.5` (connections reset at once)
- no_warmup:   `kill replica=3 step=3`, train.warmup_before_checkin=false: the restarted replica's first step
- warmup:      the same with the §5 warm-up before check-in (the profile's setting)
- ftrun:       the silent loss again with ftrun's own timeouts (ftrun.config.Timeouts' heartbeat interval and
               timeout, FTAR timeout) instead of the paper's 60 s
The table: stall per failure and its parts (harness.analysis.papertable), the rejoin stall of the restarted
replica (harness.report's rejoin_stall_s), and the effective training time the availability model
(harness.analysis.sim.availability) gives with them at one failure every 18 minutes.

Scaling: the profile keeps its replicas, timing and timeouts; each replica has --ranks-per-replica ranks
instead of 8192, an AI zone holds just the racks they need, and the model shrinks with the rank count so
that each rank's shard (its gradient and optimizer state, hence its FTAR and catch-up bytes) is the
full-scale one. What the rank count still changes is the depth of each replica's check-in / vote tree;
--check-ranks K reruns the silent scenario at K ranks per replica and reports the difference. --diagnose S
reruns it with root-cause diagnosis every S seconds and reports when a verdict names (and would evict) the
lost replica.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ftrun.config import Timeouts  # noqa: E402
from harness.analysis import papertable as pt  # noqa: E402
from harness.cli import execute  # noqa: E402
from harness.profile import load_profile  # noqa: E402
from harness.run import JobOptions, parse_inject, split_faults  # noqa: E402
from mocks.compute import propagate_shapes  # noqa: E402

VICTIM = 3
SCENARIOS: dict[str, tuple[list[str], list[str], int]] = {  # name -> (injects, extra overrides, steps)
    "silent": ([f"cut replica={VICTIM} step=3 at=0.5 duration=120"], [], 8),
    "crash": ([f"kill replica={VICTIM} step=3 at=0.5"], [], 8),
    "no_warmup": ([f"kill replica={VICTIM} step=3"], ["train.warmup_before_checkin=false"], 14),
    "warmup": ([f"kill replica={VICTIM} step=3"], ["train.warmup_before_checkin=true"], 22),
}
SCALED_HIDDEN, SCALED_HEADS = 8192, 64


def ftrun_timeouts() -> list[str]:
    """ftrun's own detection settings (ftrun.config.Timeouts defaults) as profile overrides."""
    d = Timeouts()
    return [f"timeouts.heartbeat_interval_s={d.heartbeat_interval_s}",
            f"timeouts.heartbeat_timeout_s={d.heartbeat_timeout_s}", f"timeouts.ftar_timeout_s={d.ftar_timeout_s}"]


def scaled_overrides(profile_name: str, ranks_per_replica: int) -> tuple[list[str], dict[str, Any]]:
    """Overrides that scale the profile to `ranks_per_replica` ranks per replica with the full-scale per-rank
    shard, and a description of what was scaled."""
    full = load_profile(profile_name)
    if ranks_per_replica < 1 or ranks_per_replica > full.ranks_per_replica:
        raise ValueError(f"--ranks-per-replica must be in 1..{full.ranks_per_replica}, got {ranks_per_replica}")
    target = propagate_shapes(full.model, full.ranks_per_replica).params_per_rank * ranks_per_replica
    one = replace(full.model, layers=1, hidden=SCALED_HIDDEN, heads=SCALED_HEADS, vocab=1)
    block = propagate_shapes(one, 1).num_params - 2 * SCALED_HIDDEN  # one layer's parameters
    layers = max(1, int(0.8 * target // block))
    vocab = max(1, round((target - layers * block) / (2 * SCALED_HIDDEN)))
    model = replace(one, layers=layers, vocab=vocab)
    t = full.topology
    racks = -(-ranks_per_replica // (t.gpus_per_host * t.hosts_per_rack))  # one replica per AI zone, as at full scale
    overrides = [f"ranks_per_replica={ranks_per_replica}", f"topology.racks_per_zone={racks}", f"model.layers={layers}",
                 f"model.hidden={SCALED_HIDDEN}", f"model.heads={SCALED_HEADS}", f"model.vocab={vocab}",
                 "emulation.cpu_charging=false", "failures.mode=none"]
    full_shard = propagate_shapes(full.model, full.ranks_per_replica).grad_bytes_per_rank
    shard = propagate_shapes(model, ranks_per_replica).grad_bytes_per_rank
    what = {"profile": profile_name, "replicas": full.replicas,
            "ranks_per_replica": f"{ranks_per_replica} (full scale {full.ranks_per_replica})",
            "model": f"{layers} layers x hidden {SCALED_HIDDEN}, vocab {vocab} (full scale: {full.model.layers} x "
                     f"{full.model.hidden}, vocab {full.model.vocab})",
            "grad_mib_per_rank": f"{shard / 2**20:.1f} (full scale {full_shard / 2**20:.1f})",
            "topology.racks_per_zone": f"{racks} (full scale {t.racks_per_zone})",
            "cpu_charging": "off (modeled time only: this machine's CPU is not charged)",
            "kept": f"step_compute_s={full.train.step_compute_s}, heartbeat_timeout_s="
                    f"{full.timeouts.heartbeat_timeout_s}, ftar_timeout_s={full.timeouts.ftar_timeout_s}, "
                    f"first_step_extra_s={full.train.first_step_extra_s}, first_batch_s={full.train.first_batch_s}"}
    return overrides, what


def victim_id(replicas: int) -> str:
    """The victim's replica id as the emulated job names it (harness.run.job.EmulatedJob.replica_id)."""
    return f"r{VICTIM:0{len(str(replicas - 1))}d}"


def run(profile_name: str, overrides: list[str], injects: list[str], steps: int,
        diagnose_s: float | None = None) -> tuple[dict, list[dict], float]:
    """(figures, events, wall seconds) of one emulated job (diagnose_s: root-cause diagnosis every that often)."""
    profile = load_profile(profile_name, overrides)
    kills, faults = split_faults([parse_inject(t) for t in injects])
    t0 = time.monotonic()
    figures, job = execute(profile, JobOptions(steps=steps, kills=kills, faults=faults, diagnose=diagnose_s is not None,
                                               diagnose_interval_s=diagnose_s))
    if not figures["complete"] or figures["unexpected_errors"]:
        raise RuntimeError(f"{injects}: the emulated job failed: complete={figures['complete']}, "
                           f"errors={figures['unexpected_errors'][:3]}")
    return figures, job.recorder.events, time.monotonic() - t0


def measure(profile_name: str, ranks_per_replica: int, log: Any = sys.stderr,
            extra_overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run every scenario and build the table (extra_overrides: further profile overrides, a test's smaller job)."""
    base, what = scaled_overrides(profile_name, ranks_per_replica)
    base += list(extra_overrides)
    replicas = load_profile(profile_name, base).replicas
    victim = victim_id(replicas)
    out: dict[str, Any] = {"scaled": what, "scenarios": {}}
    parts: dict[str, pt.FailureParts] = {}
    rejoin: dict[str, float | None] = {}
    plan = {**SCENARIOS, "ftrun": (SCENARIOS["silent"][0], ftrun_timeouts(), SCENARIOS["silent"][2])}
    for name, (injects, extra, steps) in plan.items():
        figures, events, wall = run(profile_name, base + extra, injects, steps)
        keep = {k: figures.get(k) for k in ("step_time_s", "stall_per_failure_s", "detection_s", "rejoin_s",
                                            "rejoin_stall_s", "effective_training_time", "modeled_s")}
        keep.update(inject=injects, overrides=extra, steps=steps, wall_s=round(wall, 1))
        if name in ("silent", "crash", "ftrun"):
            parts[name] = pt.failure_parts(events, victim)
            keep["failure"] = parts[name].as_dict()
        else:
            rejoin[name] = figures["rejoin_stall_s"]
        out["scenarios"][name] = keep
        print(f"  {name}: {json.dumps(keep)}", file=log, flush=True)
    paper_col = pt.run_figures(parts["silent"], rejoin["no_warmup"], rejoin["warmup"], replicas)
    ftrun_col = pt.run_figures(parts["ftrun"], rejoin["no_warmup"], rejoin["warmup"], replicas)
    out["rows"] = pt.table(paper_col, ftrun_col)
    out["crash"] = parts["crash"].as_dict()
    out["availability_paper_inputs"] = round(pt.effective_training_time(80.0, 100.0, replicas), 4)
    return out


def check_ranks(profile_name: str, ranks_per_replica: int) -> dict[str, Any]:
    """The silent scenario at another rank count: its failure parts and wall time."""
    base, _ = scaled_overrides(profile_name, ranks_per_replica)
    injects, _, steps = SCENARIOS["silent"]
    figures, events, wall = run(profile_name, base, injects, steps)
    parts = pt.failure_parts(events, victim_id(load_profile(profile_name).replicas))
    return {"ranks_per_replica": ranks_per_replica, "step_time_s": figures["step_time_s"],
            "failure": parts.as_dict(), "wall_s": round(wall, 1)}


def check_diagnosis(profile_name: str, ranks_per_replica: int, interval_s: float) -> dict[str, Any]:
    """The silent scenario at the paper's timeouts with root-cause diagnosis every `interval_s`: when a verdict
    first names the lost replica and first recommends evicting it, and the stall (nothing in the emulator acts
    on a verdict, so the stall is the timeout's)."""
    base, _ = scaled_overrides(profile_name, ranks_per_replica)
    injects, _, steps = SCENARIOS["silent"]
    figures, events, wall = run(profile_name, base, injects, steps, diagnose_s=interval_s)
    victim = victim_id(load_profile(profile_name).replicas)
    return {"interval_s": interval_s, **pt.diagnosis_times(events, victim, VICTIM),
            "failure": pt.failure_parts(events, victim).as_dict(), "wall_s": round(wall, 1)}


def render(out: dict[str, Any]) -> str:
    lines = ["Scaled: " + "; ".join(f"{k} {v}" for k, v in out["scaled"].items()), "", pt.markdown(out["rows"]), ""]
    c = out["crash"]
    lines.append(f"A process crash at the same moment (kill replica={VICTIM} step=3 at=0.5): stall {c['stall_s']} s "
                 f"(detection {c['detection_s']} s by {c['detected_by']}, rebuild {c['rebuild_s']} s, "
                 f"re-train {c['retrain_s']} s).")
    lines.append(f"Availability model with the paper's own inputs (80 s + 100 s stall): "
                 f"{100 * out['availability_paper_inputs']:.1f}%.")
    for chk in out.get("rank_checks", []):
        f = chk["failure"]
        lines.append(f"At {chk['ranks_per_replica']} ranks per replica the silent loss: stall {f['stall_s']} s "
                     f"(detection {f['detection_s']}, rebuild {f['rebuild_s']}, re-train {f['retrain_s']}), step "
                     f"{chk['step_time_s']} s, wall {chk['wall_s']} s.")
    d = out.get("diagnosis")
    if d:
        lines.append(f"Root-cause diagnosis every {d['interval_s']} s (paper timeouts): a verdict names the lost "
                     f"replica {d['verdict_s']} s after the cut and recommends evicting it at {d['eviction_s']} s; "
                     f"nothing in the emulator evicts on a verdict, so the stall stays {d['failure']['stall_s']} s.")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default="meta-98k")
    p.add_argument("--ranks-per-replica", type=int, default=8)
    p.add_argument("--check-ranks", type=int, action="append", default=[],
                   help="also run the silent loss at this many ranks per replica (repeatable)")
    p.add_argument("--diagnose", type=float, metavar="SECONDS",
                   help="also run the silent loss with root-cause diagnosis every SECONDS")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="write the rendered table (markdown) here")
    args = p.parse_args()
    os.environ.setdefault("FTRUN_LOG_LEVEL", "ERROR")
    import logging

    logging.disable(logging.WARNING)  # the survivors' per-rank abort warnings: thousands of lines
    t0 = time.monotonic()
    out = measure(args.profile, args.ranks_per_replica)
    out["rank_checks"] = [check_ranks(args.profile, k) for k in args.check_ranks]
    if args.diagnose:
        out["diagnosis"] = check_diagnosis(args.profile, args.ranks_per_replica, args.diagnose)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    text = render(out)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(out, sort_keys=True) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
