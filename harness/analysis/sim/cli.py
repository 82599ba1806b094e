"""`ftrun sim`: availability analytics, SPARe Monte-Carlo and the time-to-train simulation.

    ftrun sim availability [--report report.json] [flags]     effective training time, sync vs FT-HSDP
    ftrun sim spare-mc [--n N ...] [--r R ...] [--trials T]    failures to wipe-out and stack depth
    ftrun sim ttt [--profile toml] [--set k=v] [--plot png]   time-to-train per scheme and redundancy

With --json each prints one JSON object as its last line: availability {"sync", "ft_hsdp", ...};
spare-mc {"n", "r", "mean_failures", "closed_form", "mean_stack", ...} for one cell, or
{"cells": [...], ...} for a grid; ttt {"ckpt_only", "ft_hsdp", "rep", "spare", "best"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ftrun.cli import emit_json

DEFAULT_PROFILE = Path(__file__).resolve().parents[3] / "scale_profiles" / "ttt-default.toml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", required=True, metavar="SIM_COMMAND")
    a = sub.add_parser("availability", help="effective training time: synchronous recovery vs FT-HSDP")
    a.add_argument("--failure-interval-min", type=float, default=18.0, help="mean time between failures")
    a.add_argument("--sync-stall-min", type=float, default=10.0, help="stall per failure, synchronous recovery")
    a.add_argument("--stall-per-failure-s", type=float, default=80.0, help="FT-HSDP stall when a replica fails")
    a.add_argument("--rejoin-stall-s", type=float, default=100.0, help="FT-HSDP stall when it rejoins")
    a.add_argument("--replicas", type=int, default=12, help="FT-HSDP replicas")
    a.add_argument("--repair-min", type=float, default=10.0, help="failure to the replica training again")
    a.add_argument("--report", metavar="JSON", help="emulator report; its keys (failure_interval_s, sync_stall_s, "
                   "stall_per_failure_s, rejoin_stall_s, num_replicas, repair_s) override these flags")
    m = sub.add_parser("spare-mc", help="SPARe Monte-Carlo: failures to first wipe-out, stack depth")
    m.add_argument("--n", type=int, nargs="+", default=[200, 600, 1000], help="group counts N")
    m.add_argument("--r", type=int, nargs="+", default=list(range(2, 13)), help="redundancies r")
    m.add_argument("--trials", type=int, default=10000, help="trials for E[F]")
    m.add_argument("--stack-trials", type=int, default=50, help="trials for the mean stack depth")
    m.add_argument("--controller-trials", type=int, default=0,
                   help="trials run failure by failure through the controller (patch rate)")
    m.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("ttt", help="time-to-train simulation: CKPT-only, Rep, SPARe, FT-HSDP")
    t.add_argument("--profile", default=str(DEFAULT_PROFILE), help="TOML profile")
    t.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a value")
    t.add_argument("--plot", metavar="PNG", help="write a plot of TTT and availability against r")
    for p in (a, m, t):
        p.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def run(args: argparse.Namespace) -> int:
    handlers = {"availability": _availability, "spare-mc": _spare_mc, "ttt": _ttt}
    try:
        return handlers[args.sim_command](args)
    except (ValueError, OSError) as err:
        print(f"ftrun sim {args.sim_command}: error: {err}", file=sys.stderr)
        return 2


def _availability(args: argparse.Namespace) -> int:
    from harness.analysis.sim.availability import (
        REPORT_KEYS,
        AvailabilityInputs,
        ft_hsdp_effective_training_time,
        inputs_from_report,
        repairs_overlap,
        sync_effective_training_time,
    )

    flags = AvailabilityInputs(
        failure_interval_s=args.failure_interval_min * 60.0, sync_stall_s=args.sync_stall_min * 60.0,
        stall_per_failure_s=args.stall_per_failure_s, rejoin_stall_s=args.rejoin_stall_s,
        num_replicas=args.replicas, repair_s=args.repair_min * 60.0)
    inputs, source = flags, {}
    if args.report:
        with open(args.report) as fh:
            try:
                report = json.load(fh)
            except json.JSONDecodeError as err:
                raise ValueError(f"{args.report} is not JSON: {err}") from None
        inputs, source = inputs_from_report(report, flags)
    sync, ft = sync_effective_training_time(inputs), ft_hsdp_effective_training_time(inputs)
    degraded = max(0.0, inputs.repair_s - inputs.ft_stall_s)
    at = f"{degraded:g} s at {inputs.num_replicas - 1}/{inputs.num_replicas}"
    values = {k: getattr(inputs, k) for k in REPORT_KEYS}
    print(f"Effective training time, one failure every {inputs.failure_interval_s / 60:g} min")
    print(f"{'scheme':<22} {'stall/failure':>14} {'degraded':>18} {'effective':>10}")
    print(f"{'synchronous recovery':<22} {inputs.sync_stall_s:>12g} s {'-':>18} {sync:>10.0%}")
    print(f"{'FT-HSDP':<22} {inputs.ft_stall_s:>12g} s {at:>18} {ft:>10.0%}")
    print("inputs: " + ", ".join(f"{k}={v:g}" + (f" ({source[k]})" if source else "") for k, v in values.items()))
    if repairs_overlap(inputs):
        print("note: repairs outlast the failure interval and overlap; the FT-HSDP figure is then pessimistic")
    if args.json:
        emit_json({"sync": sync, "ft_hsdp": ft, "ft_stall_s": inputs.ft_stall_s, "inputs": values, "sources": source,
                   "repairs_overlap": repairs_overlap(inputs)})
    return 0


def _spare_mc(args: argparse.Namespace) -> int:
    from harness.analysis.spare.montecarlo import MonteCarloConfig, run_monte_carlo

    cells = []
    print(f"{'N':>5} {'r':>3} {'trials':>6} {'E[F] MC':>9} {'Thm 4.1':>9} {'err':>7} {'+1/2':>9} {'err':>7} "
          f"{'stack':>6}" + (f" {'patch':>6}" if args.controller_trials else ""))
    for n in args.n:
        for r in args.r:
            res = run_monte_carlo(MonteCarloConfig(
                num_groups=n, redundancy=r, num_trials=args.trials, num_stack_trials=args.stack_trials,
                num_controller_trials=args.controller_trials, seed=args.seed)).as_dict()
            cells.append(res)
            stack = f"{res['mean_stack']:.3f}" if res["mean_stack"] is not None else "-"
            print(f"{n:>5} {r:>3} {res['trials']:>6} {res['mean_failures']:>9.2f} {res['closed_form']:>9.2f} "
                  f"{res['rel_err']:>+7.2%} {res['finite_closed_form']:>9.2f} {res['rel_err_finite']:>+7.2%} "
                  f"{stack:>6}" + (f" {res['patch_rate']:>6.3f}" if args.controller_trials else ""), flush=True)
    if args.json:
        if len(cells) == 1:
            emit_json(cells[0])
        else:
            emit_json({"cells": cells, "max_abs_rel_err": max(abs(c["rel_err"]) for c in cells),
                       "max_abs_rel_err_finite": max(abs(c["rel_err_finite"]) for c in cells)})
    return 0


def _ttt(args: argparse.Namespace) -> int:
    from harness.analysis.sim.profile import load_profile
    from harness.analysis.sim.sweep import format_sweep, run_sweep

    profile = load_profile(args.profile, args.set)
    result = run_sweep(profile)
    print(format_sweep(result, profile))
    if args.plot:
        from harness.analysis.sim.plot import plot_sweep

        plot_sweep(result, args.plot, title=f"{Path(args.profile).name} {' '.join(args.set)}".strip())
        print(f"plot: {args.plot}")
    if args.json:
        emit_json({**result.as_dict(), "profile": args.profile, "overrides": args.set})
    return 0
