"""Turning telemetry on for one rank: one call from whoever wires the rank (the trainer's wiring, a
launcher worker, the emulator), so the runtime's components only carry a `telemetry` attribute.

    recorder = attach(env.clock, engine=ftar_engine, comm=tree_comm, lighthouse=client)

Each component records through its own one-line hooks while `telemetry` is set; None turns them off.
`serve_rank` does the same for a real rank process and also serves its telemetry to the job's
diagnosis collector (ftrun.diagnose.monitor, beside the lighthouse) and registers there.
"""

from __future__ import annotations

from typing import Any, Callable

from ftrun.diagnose.collect import RankInfo, TelemetryServer
from ftrun.diagnose.telemetry import DEFAULT_CAPACITY, Recorder
from ftrun.env.base import Clock, Env


def attach(clock: Clock, *, engine: Any = None, comm: Any = None, lighthouse: Any = None, trainer: Any = None,
           capacity: int = DEFAULT_CAPACITY) -> Recorder:
    """A new Recorder for this rank, set on every component given (FtarEngine, TreeComm or GlooComm,
    LighthouseClient, FaultTolerantTrainer). Raises TypeError for a component without a `telemetry` hook."""
    recorder = Recorder(clock, capacity)
    for name, part in (("engine", engine), ("comm", comm), ("lighthouse", lighthouse), ("trainer", trainer)):
        if part is None:
            continue
        if not hasattr(type(part), "telemetry"):
            raise TypeError(f"attach: {name} {type(part).__name__} has no telemetry hook")
        part.telemetry = recorder
    return recorder


def serve_rank(env: Env, *, token: str, info: RankInfo, collector: str, bind: str = "127.0.0.1:0",
               engine: Any = None, comm: Any = None, lighthouse: Any = None, trainer: Any = None,
               advertise: Callable[[str], str] | None = None,
               register_timeout_s: float = 5.0) -> tuple[Recorder, TelemetryServer]:
    """Attach a Recorder to the rank's components (a comm without a hook, e.g. LocalComm, is skipped),
    serve it on `bind` and register with the collector at `collector` in the background
    (TelemetryServer.register_in_background): the rank goes on at once, even while a collector's listener
    turns registrations away in a burst, and one that fails is logged, not raised: diagnosis must never stop
    or hold up training. Until the registration lands the collector does not know the rank (its verdicts
    leave it out); nothing on the rank waits for it. `advertise` maps the bound address to the one the
    collector should use (a wildcard bind). The caller stops the server, which cancels a registration in flight."""
    if comm is not None and not hasattr(type(comm), "telemetry"):
        comm = None
    recorder = attach(env.clock, engine=engine, comm=comm, lighthouse=lighthouse, trainer=trainer)
    server = TelemetryServer(env=env, token=token, ranks={info: recorder}, bind=bind)
    server.start()
    if advertise is not None:
        server.addr = advertise(server.addr)
    server.register_in_background(collector, timeout=register_timeout_s)
    return recorder, server
