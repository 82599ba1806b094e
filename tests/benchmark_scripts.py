"""A script under benchmarks/ loaded as a module, for the tests of its pure parts (benchmarks/ is no package).

    bench = load("catchup_launch")      # benchmarks/catchup_launch.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}_bench", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
