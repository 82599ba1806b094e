"""Turning telemetry on for one rank: one call from whoever wires the rank (the trainer's wiring, a
launcher worker, the emulator), so the runtime's components only carry a `telemetry` attribute.

    recorder = attach(env.clock, engine=ftar_engine, comm=tree_comm, lighthouse=client)

Each component records through its own one-line hooks while `telemetry` is set; None turns them off.
"""

from __future__ import annotations

from typing import Any

from ftrun.diagnose.telemetry import DEFAULT_CAPACITY, Recorder
from ftrun.env.base import Clock


def attach(clock: Clock, *, engine: Any = None, comm: Any = None, lighthouse: Any = None,
           capacity: int = DEFAULT_CAPACITY) -> Recorder:
    """A new Recorder for this rank, set on every component given (FtarEngine, TreeComm, LighthouseClient).
    Raises TypeError for a component without a `telemetry` hook."""
    recorder = Recorder(clock, capacity)
    for name, part in (("engine", engine), ("comm", comm), ("lighthouse", lighthouse)):
        if part is None:
            continue
        if not hasattr(type(part), "telemetry"):
            raise TypeError(f"attach: {name} {type(part).__name__} has no telemetry hook")
        part.telemetry = recorder
    return recorder
