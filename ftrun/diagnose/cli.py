"""`ftrun diagnose`: print the current root-cause verdict of a live job, or run its collector.

  ftrun diagnose --lighthouse HOST:PORT [--json]     ask a live job's lighthouse (its diagnosis monitor)
                                                     for a verdict now (`ftrun launch` writes OUT/lighthouse)
  ftrun diagnose --collector HOST:PORT [--json]      ask a collector for a verdict now
  ftrun diagnose --serve [--bind 127.0.0.1:29511]    run the collector (ranks register with it); its listener
                                                     capped by --max-connections / --max-pending / --max-hello-bytes
  ftrun diagnose bench --profile P --scenarios N --seed S [--fault-free K] [--only K,...] [--json]
                                                     one emulated job, N random fault scenarios one after
                                                     another, each scored against the analysis' verdict
                                                     (harness.diagbench); --only: just those of the N

The job token comes from $FTRUN_TOKEN or --token-file (a file only its owner can read), never argv.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import stat
import sys

from ftrun.cli import add_emulation_arguments, add_listen_arguments, listen_limits
from ftrun.diagnose.collect import Collector, CollectorConfig, DiagnoseError, request
from ftrun.env.real import RealEnv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", nargs="?", choices=("bench",), help="bench: emulated fault scenarios (harness.diagbench)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--lighthouse", help="a live job's lighthouse address (host:port; ftrun launch writes it "
                       "to OUT/lighthouse)")
    where.add_argument("--collector", help="the diagnosis collector's address (host:port)")
    where.add_argument("--serve", action="store_true", help="run the collector until interrupted")
    p.add_argument("--bind", default="127.0.0.1:29511", help="--serve: the collector's address")
    p.add_argument("--interval", type=float, default=2.0, help="--serve: seconds between pulls")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the verdict")
    p.add_argument("--token-file", help="file holding the job token (mode 0600); default: $FTRUN_TOKEN")
    p.add_argument("--json", action="store_true")
    add_listen_arguments(p)  # --serve: the collector's listener
    bench = p.add_argument_group("bench")
    bench.add_argument("--profile", default="ci-small", help="bench: scale profile name or TOML path")
    bench.add_argument("--scenarios", type=int, default=12, help="bench: fault scenarios to run")
    bench.add_argument("--seed", type=int, default=0, help="bench: draws the scenarios (kind, place, phase)")
    bench.add_argument("--only", default=None, metavar="K[,K...]",
                       help="bench: run only these scenarios (0-based indexes) of the --scenarios drawn with --seed, "
                            "each as drawn (to reproduce one cheaply; the job has not run the others before it)")
    bench.add_argument("--fault-free", type=int, default=None,
                       help="bench: fault-free collections for false positives (default: half the scenarios)")
    bench.add_argument("--out", default=None, metavar="DIR", help="bench: write every scenario's result here")
    add_emulation_arguments(
        bench, prefix="bench: ", cpu_charging="off",
        ftar_detail_default="full up to 16K ranks, else the profile's; folded places faults on each replica's first host",
        cpu_charging_default="off: the bench scores verdicts, and charging thousands of ranks' CPU on a few cores "
                             "slows and perturbs virtual time")


def job_token(path: str | None) -> str:
    if path:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SystemExit(f"ftrun diagnose: token file {path} must be readable by its owner only (chmod 600)")
        with open(path) as f:
            return f.read().strip()
    token = os.environ.get("FTRUN_TOKEN")
    if not token:
        raise SystemExit("ftrun diagnose: no job token: set $FTRUN_TOKEN or pass --token-file")
    return token


def run(args: argparse.Namespace) -> int:
    if args.action == "bench":  # the emulator's bench, dispatched by name like ftrun.cli's subcommands
        return importlib.import_module("harness.diagbench").cli_run(args)
    if not (args.lighthouse or args.collector or args.serve):
        from ftrun.cli import UsageError
        raise UsageError("one of --lighthouse, --collector, --serve or the bench action is required")
    limits = listen_limits(args)
    token, env = job_token(args.token_file), RealEnv(net_limits=limits)
    if args.serve:
        return _serve(env, token, args)
    try:
        reply = request(env, args.lighthouse or args.collector, {"type": "verdict", "token": token}, args.timeout)
    except DiagnoseError as e:
        print(f"ftrun diagnose: {e}", file=sys.stderr)
        return 2
    reply.pop("type", None)
    if args.json:
        from ftrun.cli import emit_json
        emit_json(reply)
        return 0
    print(format_verdict(reply))
    return 0


def format_verdict(v: dict) -> str:
    lines = [f"verdict: {v['kind']} ({v.get('num_answered', '?')} of {v.get('num_ranks', '?')} ranks answered)",
             f"  reason: {v['reason']}"]
    if v.get("rank_names"):
        lines.append(f"  ranks: {', '.join(v['rank_names'])}")
    if v.get("silent"):
        lines.append(f"  silent (did not answer): {', '.join(v['silent'])}")
    if v.get("hosts"):
        lines.append(f"  hosts: {', '.join(v['hosts'])}")
    if v.get("collectives"):
        lines.append(f"  blocked in: {', '.join(v['collectives'])}")
    ev = v.get("eviction") or {}
    lines.append(f"  eviction: {ev.get('replicas') or 'none'}: {ev.get('reason', '')}")
    return "\n".join(lines)


def _serve(env: RealEnv, token: str, args: argparse.Namespace) -> int:
    collector = Collector(env=env, token=token, bind=args.bind, config=CollectorConfig())
    addr = collector.start()
    stop = env.event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"diagnosis collector listening on {addr}", flush=True)
    collector.run_every(args.interval, stop)
    collector.stop()
    return 0
