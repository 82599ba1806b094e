"""`ftrun bench NAME ...`: benchmarks that print ratios against a baseline measured in the same run.

Each benchmark lives in the ftrun_bench package (not the runtime: it is loaded by name, never imported by
ftrun/) and provides `add_arguments(parser)` and `run(args)`.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "ftar": ("ftrun_bench.ftar", "FTAR vs torch.distributed gloo all_reduce on loopback"),
    "overhead": ("ftrun_bench.overhead", "FT overhead per step (quorum + commit) with real replicas"),
    "catchup": ("ftrun_bench.catchup", "catch-up state transfer bandwidth per source count"),
    "overlap": ("ftrun_bench.overlap", "training steps with the exchange overlapped with backward vs after it"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module_name)
        try:
            importlib.import_module(module_name).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._module).run(args) or 0)
