"""`ftrun emulate [PROFILE] [--steps N] [--inject "kill replica=R step=S"] [--set key=value] [--seed S]`.

Runs the dry run of harness.dryrun on the profile (default: ci-small with its scripted replica kill and
rejoin) and prints a report; `--json` prints its figures as one JSON object last.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import defaultdict

import psutil
from tqdm import tqdm

from ftrun.cli import emit_json
from harness.dryrun import DryRun, Kill, scripted_kills
from harness.profile import apply_overrides, load_profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("profile", nargs="?", default="ci-small", help="profile name or TOML path (default ci-small)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--inject", action="append", default=[], metavar='"kill replica=R step=S"')
    p.add_argument("--set", action="append", default=[], metavar="key=value", dest="overrides")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true")


def parse_inject(text: str) -> Kill:
    m = re.fullmatch(r"\s*kill\s+replica=(\d+)\s+step=(\d+)\s*", text)
    if not m:
        raise ValueError(f"bad --inject {text!r}: expected \"kill replica=R step=S\"")
    return Kill(int(m.group(1)), int(m.group(2)))


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps is not None else [])
    profile = apply_overrides(load_profile(args.profile), overrides)
    kills = [parse_inject(t) for t in args.inject] if args.inject else scripted_kills(profile)
    for k in kills:
        if not 0 <= k.replica < profile.replicas:
            raise SystemExit(f"ftrun emulate: --inject names replica {k.replica}, the profile has {profile.replicas}")
    started = time.monotonic()
    with tqdm(total=profile.train.steps, desc=f"emulate {profile.name}", unit="step", file=sys.stderr) as bar:
        dry = DryRun(profile, seed=args.seed, kills=kills, progress=bar)
        log = dry.run()
    figures = report(log, profile=profile, kills=kills, ftar_s=dry._ftar_s, modeled_s=dry.world.now)
    figures.update(wall_s=time.monotonic() - started, peak_rss_mb=psutil.Process().memory_info().rss / 2**20)
    _print(figures, profile)
    if args.json:
        emit_json(figures)
    return 0 if figures["complete"] else 1


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(log: list[dict], *, profile, kills: list[Kill], ftar_s, modeled_s: float) -> dict:
    commits = [e for e in log if e["event"] == "commit"]
    by_step: dict[int, set[str]] = defaultdict(set)
    for e in commits:
        by_step[e["step"] - 1].add(e["replica_id"])
    quorum_ms = [e["seconds"] * 1e3 for e in log if e["event"] == "quorum_time"]
    times = defaultdict(list)
    for e in commits:
        times[(e["replica_id"], e["incarnation"])].append(e["t"])
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    normal = _pct(gaps, 0.5) or 0.0
    stalls, rejoins, rejoin_stalls = [], [], []
    for e in [x for x in log if x["event"] == "kill"]:
        survivors = [ts for (rid, _), ts in times.items() if rid != e["replica_id"]]
        around = [b - a for ts in survivors for a, b in zip(ts, ts[1:]) if a <= e["t"] <= b]
        stalls.append(max(around) - normal if around else 0.0)
    for e in [x for x in log if x["event"] == "restart"]:
        mine = times.get((e["replica_id"], e["incarnation"]), [])
        if mine:
            rejoins.append(mine[0] - e["t"])
            survivors = [ts for (rid, _), ts in times.items() if rid != e["replica_id"]]
            around = [b - a for ts in survivors for a, b in zip(ts, ts[1:]) if a <= mine[0] <= b]
            rejoin_stalls.append(max(around) - normal if around else 0.0)
    steps = profile.train.steps
    replica_steps = sum(len(v) for s, v in by_step.items() if s < steps)
    return {
        "profile": profile.name, "ranks": profile.replicas * profile.ranks_per_replica,
        "replicas": profile.replicas, "steps": steps, "complete": len(by_step) >= steps,
        "steps_committed": {rid: sum(1 for e in commits if e["replica_id"] == rid)
                            for rid in sorted({e["replica_id"] for e in commits})},
        "participants_per_step": [len(by_step[s]) for s in sorted(by_step)],
        "get_quorum_p50_ms": _pct(quorum_ms, 0.5), "get_quorum_p99_ms": _pct(quorum_ms, 0.99),
        "step_time_s": normal, "stall_per_failure_s": max(stalls) if stalls else None,
        "rejoin_s": max(rejoins) if rejoins else None,
        "rejoin_stall_s": max(rejoin_stalls) if rejoin_stalls else None,
        "effective_training_time": replica_steps / (profile.replicas * steps),
        "kills": len([e for e in log if e["event"] == "kill"]), "modeled_s": modeled_s,
        "time_split_s": {"compute": profile.train.step_compute_s, "quorum_p50": (_pct(quorum_ms, 0.5) or 0) / 1e3,
                         "ftar_all_replicas": ftar_s_for(ftar_s, profile.replicas)},
    }


def ftar_s_for(ftar_s, n: int) -> float:
    class _Q:  # the modeled all-reduce needs only the participant count
        num_participants = n

    return ftar_s(_Q())


def _print(f: dict, profile) -> None:
    print(f"\nftrun emulate {f['profile']}: {f['replicas']} replicas x {profile.ranks_per_replica} ranks = "
          f"{f['ranks']} emulated ranks, {f['steps']} steps, {f['kills']} replica kill(s)")
    print("  real for every rank: lighthouse quorum, tree check-in/broadcast/commit vote, failure detection, rejoin;")
    print("  modeled: compute (profile step time), cross-replica all-reduce (folded ring formula), catch-up transfer")
    print(f"  participants per step: {f['participants_per_step']}")
    print(f"  steps committed per replica: {f['steps_committed']}")
    print(f"  get_quorum p50 {f['get_quorum_p50_ms']:.2f} ms, p99 {f['get_quorum_p99_ms']:.2f} ms (modeled)")
    print(f"  step time {f['step_time_s']:.3f} s; stall per failure {_s(f['stall_per_failure_s'])}; "
          f"rejoin {_s(f['rejoin_s'])} after restart, stalling the others {_s(f['rejoin_stall_s'])}")
    print(f"  effective training time {100 * f['effective_training_time']:.1f}% of replica-steps; "
          f"where a step's time goes: {f['time_split_s']}")
    print(f"  modeled {f['modeled_s']:.2f} s in {f['wall_s']:.1f} s wall, peak RSS {f['peak_rss_mb']:.0f} MB; "
          f"{'complete' if f['complete'] else 'INCOMPLETE'}")


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} s"
