"""The `ftrun` entry point.

Each subcommand lives in its own module, imported only when it runs, so `ftrun sim` never pays for torch
and parts of the runtime do not import each other through the CLI. A subcommand module provides
`add_arguments(parser)` and `run(args) -> int`.

Every `bench`, `emulate`, `sim` and `launch` command accepts `--json` and then prints one JSON object with
its figures as the last line of its output (see `emit_json`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import sys
from dataclasses import fields

from ftrun.env.admission import ListenLimits

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "lighthouse": ("ftrun.quorum.cli", "run the lighthouse (quorum) service"),
    "demo": ("ftrun.launch.demo", "real-process demo: lighthouse + 3 replicas x 2 ranks, one SIGKILLed and restarted"),
    "launch": ("ftrun.launch.cli", "supervise a lighthouse and R replicas x K ranks of a training script"),
    "slurm": ("ftrun.launch.slurm", "submit a job to Slurm: one batch job per replica plus the lighthouse"),
    "emulate": ("harness.cli", "emulated dry run of the runtime from a scale profile"),
    "bench": ("ftrun.bench", "benchmarks that print ratios against a baseline measured in the same run"),
    "sim": ("harness.analysis.sim.cli", "availability analytics, SPARe Monte-Carlo and time-to-train simulation"),
    "chaos": ("ftrun.chaos.cli", "real small jobs under seeded random fault schedules, checked for forks and losses"),
    "diagnose": ("ftrun.diagnose.cli", "root cause of a hung or slow job: the collector's current verdict"),
    "calibrate": ("harness.calibrate", "measure this machine and write a calibrated scale profile"),
    "fidelity": ("harness.calibrate.fidelity", "one small job run for real and emulated, figures side by side"),
}


class UsageError(Exception):
    """Bad command-line input (a flag's value, a profile name): `main` prints it and exits 2, no traceback.
    The message names what was wrong."""


def emit_json(figures: dict) -> None:
    """Print `figures` as one JSON object on the last line of the command's output."""
    sys.stdout.flush()
    print(json.dumps(figures, sort_keys=True, default=float), flush=True)


def add_emulation_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, prefix: str = "",
                            ftar_detail_default: str = "the profile's", cpu_charging: str | None = None,
                            cpu_charging_default: str = "the profile's") -> None:
    """The emulator's run flags, one definition for `ftrun emulate` (harness.cli) and `ftrun diagnose bench`
    (ftrun.diagnose.cli): --set, --ftar-detail, --fold-ranks, --ftar-model, --cpu-charging (harness.run's
    JobOptions and the profile's [emulation]). `prefix` starts every help text (the bench's "bench: ");
    `ftar_detail_default` and `cpu_charging_default` say in the help what the command does without the
    flag; `cpu_charging` is the flag's default value (None: the profile's)."""
    p.add_argument("--set", action="append", default=[], metavar="key=value", dest="overrides",
                   help=f"{prefix}override a profile key, e.g. --set train.step_compute_s=2")
    p.add_argument("--ftar-detail", choices=("folded", "full"), default=None,
                   help=f"{prefix}full: run every chunk of every FTAR ring; folded: the rings of one host per replica, "
                        f"the others mirroring them (default: {ftar_detail_default})")
    p.add_argument("--fold-ranks", choices=("auto", "on", "off"), default="auto",
                   help=f"{prefix}with folded rings, run only each replica's lead host and fault targets; the other "
                        "ranks mirror them (with diagnosis: two lead hosts, the others served their reference lead's "
                        "telemetry) (default auto: above 256 ranks per replica)")
    p.add_argument("--ftar-model", choices=("auto", "chunks", "analytic"), default="auto",
                   help=f"{prefix}chunks: all-reduces chunk by chunk; analytic: each ring's all-reduce one modeled "
                        "wait per rank (default auto: analytic above 256 ranks, chunk by chunk where a fault can "
                        "stall a ring silently)")
    p.add_argument("--cpu-charging", choices=("on", "off"), default=cpu_charging,
                   help=f"{prefix}charge real CPU time to emulated hosts (default: {cpu_charging_default})")


def add_listen_arguments(p: argparse.ArgumentParser) -> None:
    """The listener caps flags of a command that runs services (`ftrun lighthouse`, `launch` and its host agents,
    `diagnose --serve`): --max-connections, --max-pending, --max-hello-bytes, one per ListenLimits field
    (ftrun.env.admission), as FTConfig.net_limits sets them for a rank's listeners. `listen_limits` reads them."""
    g = p.add_argument_group("listener caps (every listener this command opens; ftrun.env.admission)")
    helps = {"max_connections": "live connections per listener",
             "max_pending": "connections not past their first message; a new one beyond it closes the oldest",
             "max_hello_bytes": "the largest first message a connection may announce"}
    for f in fields(ListenLimits):
        g.add_argument(_flag(f.name), type=int, default=f.default, metavar="N", dest=f.name,
                       help=f"{helps[f.name]} (default: %(default)s)")


def listen_limits(args: argparse.Namespace) -> ListenLimits:
    """The ListenLimits of `add_listen_arguments`' flags; UsageError naming the flag ListenLimits refused."""
    try:
        return ListenLimits(**{f.name: getattr(args, f.name) for f in fields(ListenLimits)})
    except ValueError as e:
        text = str(e).replace("ListenLimits.", "")
        for f in fields(ListenLimits):
            text = re.sub(rf"\b{f.name}\b", _flag(f.name), text)
        raise UsageError(text) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def setup_logging(level: str = "INFO") -> None:
    """Set up logging once, at the entry point."""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(prog="ftrun", description=__doc__.splitlines()[0])
    top.add_argument("--log-level", default="WARNING")
    top.add_argument("--version", action="version", version=f"%(prog)s {importlib.import_module('ftrun').__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    # Parse only the command name first, then let its own module build the rest of the parser.
    known, _ = top.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    command = known.command
    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"ftrun {command}", description=COMMANDS[command][1])
    parser.add_argument("--log-level", default="WARNING")
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    setup_logging(args.log_level)
    try:
        return int(module.run(args) or 0)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"ftrun {command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
