"""The shadow registry: which GPU-targeted module each CPU mock stands in for. Data, not code.

Read from mocks/shadow_registry.toml:

    [modules]   real module name -> mock module name (active entries)
    [planned]   the same, for real modules that do not exist yet (documentation; never installed)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = Path(__file__).resolve().parents[1] / "mocks" / "shadow_registry.toml"


@dataclass(frozen=True)
class Registry:
    modules: dict[str, str]  # real -> mock
    planned: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for real, mock in {**self.modules, **self.planned}.items():
            if not _is_dotted(real) or not _is_dotted(mock):
                raise ValueError(f"registry entry {real!r} = {mock!r}: both sides must be dotted module names")
            if real == mock:
                raise ValueError(f"registry entry {real!r} maps a module to itself")
        both = sorted(self.modules.keys() & self.planned.keys())
        if both:
            raise ValueError(f"{both[0]!r} is both active and planned")


def _is_dotted(name: object) -> bool:
    return isinstance(name, str) and bool(name) and all(p.isidentifier() for p in name.split("."))


def load_registry(path: str | Path = DEFAULT_PATH) -> Registry:
    """Raises FileNotFoundError, ValueError (bad TOML, unknown table, malformed entry)."""
    with open(path, "rb") as f:
        try:
            doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from e
    unknown = sorted(set(doc) - {"modules", "planned"})
    if unknown:
        raise ValueError(f"{path}: unknown table {unknown[0]!r} (known: modules, planned)")
    return Registry(modules=dict(doc.get("modules", {})), planned=dict(doc.get("planned", {})))
