"""Env implementations under the contract suite. Each factory returns a fresh Env (given `net_limits`, its
listeners are capped by them); the emulated engine adds its own factory here."""

from __future__ import annotations

from typing import Callable

from ftrun.env.admission import ListenLimits
from ftrun.env.base import Env
from ftrun.env.real import RealEnv


def _emulated(net_limits: ListenLimits | None = None) -> Env:
    from harness.engine import EmulatedWorld  # imported lazily: the emulator is optional here

    return EmulatedWorld(seed=0, net_limits=net_limits).host_env("host-0")


ENV_FACTORIES: dict[str, Callable[..., Env]] = {"real": RealEnv}
try:
    import harness.engine as _engine  # noqa: F401

    if hasattr(_engine, "EmulatedWorld"):
        ENV_FACTORIES["emulated"] = _emulated
except ImportError:
    pass
