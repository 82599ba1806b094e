"""The time-to-train profile (`scale_profiles/ttt-default.toml`): typed, validated, overridable.

Sections map to nested keyword-only dataclasses; every bad value raises ValueError naming the field as
`section.key`. Dotted overrides (`--set failures.mtbf_s=300`) are applied to the parsed TOML before
validation. Pure except `load_profile`, which reads the file.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any


def _fail(section: str, key: str, message: str, value: Any) -> None:
    raise ValueError(f"{section}.{key} {message}, got {value!r}")


def _check_numbers(obj: Any, section: str) -> None:
    """Every field must be a finite int/float (not bool) or a tuple of them."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        items = value if isinstance(value, tuple) else (value,)
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                _fail(section, f.name, "must be a finite number", value)


def _positive(obj: Any, section: str, *keys: str) -> None:
    for key in keys:
        if getattr(obj, key) <= 0:
            _fail(section, key, "must be > 0", getattr(obj, key))


def _non_negative(obj: Any, section: str, *keys: str) -> None:
    for key in keys:
        if getattr(obj, key) < 0:
            _fail(section, key, "must be >= 0", getattr(obj, key))


def _integer(obj: Any, section: str, key: str, minimum: int) -> None:
    value = getattr(obj, key)
    if int(value) != value or value < minimum:
        _fail(section, key, f"must be an integer >= {minimum}", value)


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """Group failures: a renewal process with Weibull inter-arrival times of mean `mtbf_s`."""

    mtbf_s: float
    weibull_shape: float
    jitter_frac: float

    def __post_init__(self) -> None:
        _check_numbers(self, "failures")
        _positive(self, "failures", "mtbf_s", "weibull_shape")
        if not 0 <= self.jitter_frac < 1:
            _fail("failures", "jitter_frac", "must be in [0, 1)", self.jitter_frac)


@dataclass(frozen=True, kw_only=True)
class SystemConfig:
    """The data-parallel job SPARe, replication and CKPT-only run on."""

    num_groups: int
    compute_per_stack_s: float
    allreduce_s: float
    global_restart_s: float
    shrink_s: float
    controller_s: float
    checkpoint_save_s: float
    train_horizon_h: float

    def __post_init__(self) -> None:
        _check_numbers(self, "system")
        _integer(self, "system", "num_groups", 2)
        _positive(self, "system", "compute_per_stack_s", "checkpoint_save_s", "train_horizon_h")
        _non_negative(self, "system", "allreduce_s", "global_restart_s", "shrink_s", "controller_s")


@dataclass(frozen=True, kw_only=True)
class FtHsdpConfig:
    """FT-HSDP: replicas that fail and repair independently while the others keep training."""

    num_replicas: int
    min_replicas: int
    stall_per_failure_s: float
    rejoin_stall_s: float
    repair_s: float

    def __post_init__(self) -> None:
        _check_numbers(self, "ft_hsdp")
        _integer(self, "ft_hsdp", "num_replicas", 1)
        _integer(self, "ft_hsdp", "min_replicas", 1)
        if self.min_replicas > self.num_replicas:
            _fail("ft_hsdp", "min_replicas", f"must be <= num_replicas ({self.num_replicas})", self.min_replicas)
        _non_negative(self, "ft_hsdp", "stall_per_failure_s", "rejoin_stall_s")
        _positive(self, "ft_hsdp", "repair_s")
        if self.rejoin_stall_s > self.repair_s:
            _fail("ft_hsdp", "rejoin_stall_s", f"must be <= repair_s ({self.repair_s})", self.rejoin_stall_s)


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """What to run: redundancies, event trails (seeds), Monte-Carlo trials for E[F], a wall-time cap."""

    redundancies: tuple[int, ...]
    num_seeds: int
    mc_trials: int
    max_wall_factor: float

    def __post_init__(self) -> None:
        _check_numbers(self, "sweep")
        if not self.redundancies or any(int(r) != r or r < 1 for r in self.redundancies):
            _fail("sweep", "redundancies", "must be a non-empty list of integers >= 1", self.redundancies)
        _integer(self, "sweep", "num_seeds", 1)
        _integer(self, "sweep", "mc_trials", 1)
        if self.max_wall_factor <= 1:
            _fail("sweep", "max_wall_factor", "must be > 1", self.max_wall_factor)


@dataclass(frozen=True, kw_only=True)
class TttProfile:
    """The whole profile; `seed` picks the event trails (trail i uses seed + i)."""

    failures: FailureConfig
    system: SystemConfig
    ft_hsdp: FtHsdpConfig
    sweep: SweepConfig
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        for r in self.sweep.redundancies:
            if r > self.system.num_groups:
                raise ValueError(f"sweep.redundancies has {r} > system.num_groups ({self.system.num_groups})")


_SECTIONS = {"failures": FailureConfig, "system": SystemConfig, "ft_hsdp": FtHsdpConfig, "sweep": SweepConfig}


def profile_from_dict(data: dict) -> TttProfile:
    """Validate a parsed TOML document into a TttProfile.

    Raises:
        ValueError: a missing or unknown section or key, or a bad value (naming `section.key`).
    """
    unknown = set(data) - set(_SECTIONS) - {"seed"}
    if unknown:
        raise ValueError(f"unknown profile section(s): {sorted(unknown)}")
    built = {}
    for name, cls in _SECTIONS.items():
        section = data.get(name)
        if not isinstance(section, dict):
            raise ValueError(f"profile section [{name}] is missing")
        expected = {f.name for f in fields(cls)}
        unknown_keys, missing = sorted(set(section) - expected), sorted(expected - set(section))
        if unknown_keys:
            raise ValueError(f"{name}.{unknown_keys[0]} is not a known key (expected one of {sorted(expected)})")
        if missing:
            raise ValueError(f"{name}.{missing[0]} is missing")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in section.items()}
        built[name] = cls(**values)
    return TttProfile(**built, seed=data.get("seed", 0))


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of `data` with `section.key=value` overrides applied; values parse as TOML
    (`8`, `0.5`, `[2, 4]`), anything else as a string (then rejected by validation).

    Raises:
        ValueError: an override without `=` or without a `section.` prefix.
    """
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like section.key=value")
        parts = path.strip().split(".")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        if len(parts) == 1 and parts[0] == "seed":
            out["seed"] = value
        elif len(parts) == 2:
            out.setdefault(parts[0], {})[parts[1]] = value
        else:
            raise ValueError(f"override {item!r} must name section.key")
    return out


def load_profile(path: str | Path, overrides: list[str] | None = None) -> TttProfile:
    """Read, override and validate a TOML profile."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    return profile_from_dict(apply_overrides(data, overrides or []))
