"""The faults an emulated job can inject (`ftrun emulate --inject "..."` and the profiles' `[failures] events`),
in the one fault grammar of ftrun.faultspec (shared with `ftrun launch --inject`: kill = a crash, hang = stopped
processes, cut = silent hosts). Pure.

    kill replica=R step=S [at=F|ftar] [hosts=relaunch|replace]
    kill replica=R time=T [hosts=relaunch|replace]
        When the job reaches step S (replica R has committed S steps, or the job is past S), plus F x the
        step's compute time (default 0: at the step boundary, before the next quorum; at=0.5 kills
        mid-compute, so the survivors' all-reduce fails and they retrain the step); at=ftar: as replica
        R's leader enters the gradient all-reduce of step S (its peers' first chunks are on their way to
        it); or at virtual second T, every host of replica R dies (its processes are SIGKILLed: connections drop, peers see it at
        once). hosts=relaunch (default): the hosts are healthy and the scheduler relaunches on them after
        the warm delay; hosts=replace: the hosts are lost and the scheduler hands out spares.
    kill lighthouse time=T [down=D]
    kill lighthouse step=S [at=F] [down=D]
        The lighthouse's process dies (its connections drop: leaders see PeerClosed) and a new one starts
        on the same host and address D seconds later (default 0), from the state it persisted
        (quorum_id, last participants). Leaders reconnect on their next quorum request.
    slow host replica=R [rank=K] factor=F [step=S]
        A straggler: the host that runs rank K (default 0) of replica R computes F x slower (F >= 1) from
        step S on (default 0). It stays slow across a relaunch on the same hosts; spares are not slow.
    slow fetch replica=R [factor=F] [delay=D]
        Every catch-up (state fetch) of replica R takes F x its modeled transfer time, plus D seconds (a
        throttled or congested path from the sources); combine with a kill of R to make a behind replica
        whose fetch is slower than a step.
    cut replica=R [rank=K] [time=T | step=S [at=F]] [duration=D]
        A host loss: the hosts of replica R (the host of its rank K) go silent, as a lost machine does: they
        send and answer nothing, nothing is reset, peers see only their timeouts; for D seconds or for good.
    cut building=B time=T duration=D
        From virtual second T for D seconds, the network between building B and every other building is
        cut. The cut is silent, as a fiber cut is for TCP: nothing is refused and no RST is sent; a frame,
        FIN or connection attempt that would cross the cut is held and delivered when the cut heals (TCP
        retransmitting it then), so peers see only their own timeouts fire meanwhile. Hosts the topology
        does not place (the lighthouse, the supervisor) are in building 0.

Scenario faults (root-cause diagnosis: one job runs many, one after another; `ftrun diagnose bench`
injects them as it goes, `--inject` at virtual second T, default 0). A host is a training host's index in
the topology or its name.
    hang replica=R [rank=K] [time=T | step=S [at=F]] [duration=D]
    hang host=H [time=T | step=S [at=F]] [duration=D]
        Every rank of replica R (its rank K; every process of host H) stops, as under SIGSTOP: its tasks
        are frozen in the engine, it sends nothing, its peers wait; until a release (or D seconds), when
        it resumes and sees its timers expired. step=S: once the job has committed step S, plus F x a
        step's compute (as `ftrun launch` times it).
    slow host=H factor=X [time=T] [duration=D]
        Host H computes X x slower (X >= 1) until a release (or D seconds).
    slow link a=H b=H factor=X [time=T] [duration=D]
        Frames between hosts A and B move X x slower (their NIC time is X x longer) until released.
    kill replica=R rank=K [time=T]
        Rank K of replica R: its process crashes (its connections reset); the supervisor notices, as for a replica
        kill, and restarts the replica.
    release [time=T]
        Every hang is released and every scenario slowness restored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Union

from ftrun import faultspec


def _check_trigger(what: str, at_step: int | None, at_s: float | None, at_fraction: float) -> None:
    if (at_step is None) == (at_s is None):
        raise ValueError(f"{what} needs exactly one of step= or time=")
    if (at_step is not None and at_step < 0) or (at_s is not None and not at_s >= 0):
        raise ValueError(f"{what}: step and time must be >= 0")
    if not 0 <= at_fraction < 1:
        raise ValueError(f"{what}: at= must be in [0, 1), got {at_fraction}")
    if at_s is not None and at_fraction:
        raise ValueError(f"{what}: at= goes with step=, not time=")


def _when(at_step: int | None, at_s: float | None, at_fraction: float) -> str:
    return f"step={at_step} at={at_fraction:g}" if at_step is not None else f"time={at_s:g}"


@dataclass(frozen=True)
class Kill:
    replica: int
    at_step: int | None = None
    at_s: float | None = None
    at_fraction: float = 0.0  # of the step's compute time, after the step begins (at_step kills)
    hosts: Literal["relaunch", "replace"] = "relaunch"
    in_ftar: bool = False  # at step at_step, as the replica enters the all-reduce (at=ftar)

    def __post_init__(self) -> None:
        _check_trigger("a kill", self.at_step, self.at_s, self.at_fraction)
        if self.in_ftar and (self.at_step is None or self.at_fraction):
            raise ValueError("at=ftar goes with step= alone")
        if self.replica < 0:
            raise ValueError(f"negative replica in {self}")
        if self.hosts not in ("relaunch", "replace"):
            raise ValueError(f"hosts= must be relaunch or replace, got {self.hosts!r}")

    def describe(self) -> str:
        when = f"step={self.at_step} at=ftar" if self.in_ftar else _when(self.at_step, self.at_s, self.at_fraction)
        return f"kill replica={self.replica} {when} hosts={self.hosts}"


@dataclass(frozen=True)
class KillLighthouse:
    at_step: int | None = None
    at_s: float | None = None
    at_fraction: float = 0.0
    down_s: float = 0.0  # from the kill to the new process listening

    def __post_init__(self) -> None:
        _check_trigger("a lighthouse kill", self.at_step, self.at_s, self.at_fraction)
        if not (self.down_s >= 0 and math.isfinite(self.down_s)):
            raise ValueError(f"down= must be a finite number >= 0, got {self.down_s}")

    def describe(self) -> str:
        return f"kill lighthouse {_when(self.at_step, self.at_s, self.at_fraction)} down={self.down_s:g}"


@dataclass(frozen=True)
class SlowHost:
    replica: int
    factor: float
    rank: int = 0  # the host that runs this rank of the replica
    from_step: int = 0

    def __post_init__(self) -> None:
        if self.replica < 0 or self.rank < 0 or self.from_step < 0:
            raise ValueError(f"negative replica, rank or step in {self}")
        if not (self.factor >= 1 and math.isfinite(self.factor)):
            raise ValueError(f"factor= must be a finite number >= 1, got {self.factor}")

    def describe(self) -> str:
        return f"slow host replica={self.replica} rank={self.rank} factor={self.factor:g} step={self.from_step}"


@dataclass(frozen=True)
class SlowFetch:
    replica: int
    factor: float = 1.0
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.replica < 0:
            raise ValueError(f"negative replica in {self}")
        if not (self.factor >= 1 and math.isfinite(self.factor)) or not (self.delay_s >= 0 and math.isfinite(self.delay_s)):
            raise ValueError(f"factor= must be >= 1 and delay= >= 0, got {self.factor}, {self.delay_s}")
        if self.factor == 1 and self.delay_s == 0:
            raise ValueError("a slow fetch needs factor= > 1 or delay= > 0")

    def describe(self) -> str:
        return f"slow fetch replica={self.replica} factor={self.factor:g} delay={self.delay_s:g}"


@dataclass(frozen=True)
class CutBuilding:
    building: int
    at_s: float
    duration_s: float

    def __post_init__(self) -> None:
        if self.building < 0 or not self.at_s >= 0:
            raise ValueError(f"negative building or time in {self}")
        if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
            raise ValueError(f"duration= must be a finite number > 0, got {self.duration_s}")

    @property
    def end_s(self) -> float:
        return self.at_s + self.duration_s

    def describe(self) -> str:
        return f"cut building={self.building} time={self.at_s:g} duration={self.duration_s:g}"


def _check_scenario(what: str, at_s: float, duration_s: float | None) -> None:
    if not (at_s >= 0 and math.isfinite(at_s)):
        raise ValueError(f"{what}: time= must be a finite number >= 0, got {at_s}")
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise ValueError(f"{what}: duration= must be a finite number > 0, got {duration_s}")


def _tail(at_s: float, duration_s: float | None, at_step: int | None = None, at_fraction: float = 0.0) -> str:
    when = f" step={at_step} at={at_fraction:g}" if at_step is not None else f" time={at_s:g}"
    return when + (f" duration={duration_s:g}" if duration_s is not None else "")


def _check_step_trigger(what: str, at_step: int | None, at_fraction: float) -> None:
    if at_step is not None and at_step < 0:
        raise ValueError(f"{what}: step= must be >= 0, got {at_step}")
    if not 0 <= at_fraction < 1:
        raise ValueError(f"{what}: at= must be in [0, 1), got {at_fraction}")
    if at_step is None and at_fraction:
        raise ValueError(f"{what}: at= goes with step=")


def _place(replica: int | None, rank: int | None) -> str:
    return f"replica={replica}" + (f" rank={rank}" if rank is not None else "")


def _check_factor(what: str, factor: float) -> None:
    if not (factor >= 1 and math.isfinite(factor)):
        raise ValueError(f"{what}: factor= must be a finite number >= 1, got {factor}")


@dataclass(frozen=True)
class Hang:
    """Stopped processes (SIGSTOP): every rank of replica `replica`, its rank `rank`, or every process of host
    `host`."""

    replica: int | None = None
    rank: int | None = None  # in the replica
    host: str | None = None
    at_s: float = 0.0
    duration_s: float | None = None
    at_step: int | None = None  # instead of at_s: once the job has committed this step, plus at_fraction x a step
    at_fraction: float = 0.0

    def __post_init__(self) -> None:
        _check_step_trigger("a hang", self.at_step, self.at_fraction)
        if (self.replica is None) == (self.host is None):
            raise ValueError("a hang needs exactly one of replica= or host=")
        if self.rank is not None and self.replica is None:
            raise ValueError("rank= goes with replica=")
        if (self.replica is not None and self.replica < 0) or (self.rank is not None and self.rank < 0):
            raise ValueError(f"negative replica or rank in {self}")
        _check_scenario("a hang", self.at_s, self.duration_s)

    def describe(self) -> str:
        where = f"host={self.host}" if self.host is not None else _place(self.replica, self.rank)
        return f"hang {where}{_tail(self.at_s, self.duration_s, self.at_step, self.at_fraction)}"


@dataclass(frozen=True)
class HostLoss:
    """Silent hosts (`cut replica=R [rank=K]`): the hosts of replica R (the host of its rank K) stop sending
    and answering, as a host lost to the network is (nothing reset, no heartbeat); for duration_s, or for
    good. Emulated as those hosts' processes frozen: the supervisor cannot tell them from a lost machine."""

    replica: int
    rank: int | None = None
    at_s: float = 0.0
    duration_s: float | None = None
    at_step: int | None = None  # instead of at_s: once the job has committed this step, plus at_fraction x a step
    at_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.replica < 0 or (self.rank is not None and self.rank < 0):
            raise ValueError(f"negative replica or rank in {self}")
        _check_step_trigger("a host loss", self.at_step, self.at_fraction)
        _check_scenario("a host loss", self.at_s, self.duration_s)

    def describe(self) -> str:
        when = _tail(self.at_s, self.duration_s, self.at_step, self.at_fraction)
        return f"cut {_place(self.replica, self.rank)}{when}"


@dataclass(frozen=True)
class SlowHostAt:
    """A straggler host named by its place (scenario form of `slow host`), until released."""

    host: str
    factor: float
    at_s: float = 0.0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        _check_factor("a slow host", self.factor)
        _check_scenario("a slow host", self.at_s, self.duration_s)

    def describe(self) -> str:
        return f"slow host={self.host} factor={self.factor:g}{_tail(self.at_s, self.duration_s)}"


@dataclass(frozen=True)
class SlowLink:
    a: str
    b: str
    factor: float
    at_s: float = 0.0
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"a slow link needs two different hosts, got a=b={self.a}")
        _check_factor("a slow link", self.factor)
        _check_scenario("a slow link", self.at_s, self.duration_s)

    def describe(self) -> str:
        return f"slow link a={self.a} b={self.b} factor={self.factor:g}{_tail(self.at_s, self.duration_s)}"


@dataclass(frozen=True)
class KillRank:
    """One rank's process crashes (`kill replica=R rank=K time=T`)."""

    replica: int
    rank: int
    at_s: float = 0.0

    def __post_init__(self) -> None:
        if self.replica < 0 or self.rank < 0:
            raise ValueError(f"negative replica or rank in {self}")
        _check_scenario("a rank kill", self.at_s, None)

    def describe(self) -> str:
        return f"kill {_place(self.replica, self.rank)} time={self.at_s:g}"


@dataclass(frozen=True)
class Release:
    at_s: float = 0.0

    def __post_init__(self) -> None:
        _check_scenario("a release", self.at_s, None)

    def describe(self) -> str:
        return f"release time={self.at_s:g}"


SCENARIO_FAULTS = (Hang, HostLoss, SlowHostAt, SlowLink, KillRank, Release)
Fault = Union[Kill, KillLighthouse, SlowHost, SlowFetch, CutBuilding, Hang, HostLoss, SlowHostAt, SlowLink, KillRank,
              Release]

ENV = "emulate"
USAGE = faultspec.usage(ENV)


def parse_inject(text: str) -> Fault:
    """Parse one --inject value (the one fault grammar, ftrun.faultspec) into a fault. Raises ValueError naming
    the problem and the forms the emulator injects."""
    try:
        spec = faultspec.parse(text, ENV)
        f, num = spec.fields, spec.num
        step, dur = spec.int("step"), num("duration")
        verb, replica, rank = spec.form.verb, spec.int("replica"), spec.int("rank")
        if spec.key == ("kill", None) and rank is not None:
            if spec.has("step", "at", "hosts"):
                raise ValueError("kill replica=R rank=K takes time= only")
            return KillRank(replica=replica, rank=rank, at_s=num("time", 0.0))
        if spec.key == ("kill", None):
            in_ftar = f.get("at") == "ftar"
            return Kill(replica=replica, at_step=step, at_s=num("time"),
                        at_fraction=0.0 if in_ftar else num("at", 0.0), in_ftar=in_ftar,
                        hosts=f.get("hosts", "relaunch"))
        if spec.key == ("kill", "lighthouse"):
            return KillLighthouse(at_step=step, at_s=num("time"), at_fraction=num("at", 0.0),
                                  down_s=num("down", 0.0))
        if spec.key == ("slow", "host"):
            return SlowHost(replica=replica, rank=rank or 0, factor=num("factor"),
                            from_step=step or 0)
        if spec.key == ("slow", None):
            return SlowHostAt(host=f["host"], factor=num("factor"), at_s=num("time", 0.0), duration_s=dur)
        if spec.key == ("slow", "link"):
            return SlowLink(a=f["a"], b=f["b"], factor=num("factor"), at_s=num("time", 0.0), duration_s=dur)
        if spec.key == ("slow", "fetch"):
            return SlowFetch(replica=replica, factor=num("factor", 1.0), delay_s=num("delay", 0.0))
        if spec.key == ("release", None):
            return Release(at_s=num("time", 0.0))
        if spec.has("step") and spec.has("time"):
            raise ValueError(f"{spec.form.name} takes one of step= or time=")
        when = dict(at_s=num("time", 0.0), at_step=step, at_fraction=num("at", 0.0))
        if verb == "hang":
            faultspec.one_target(spec, "replica", "host")
            return Hang(replica=replica, rank=rank, host=f.get("host"), duration_s=dur, **when)
        # cut
        if faultspec.one_target(spec, "replica", "building") == "building":
            if not spec.has("time") or dur is None or spec.has("step", "at"):
                raise ValueError("cut building=B needs time=T and duration=D")
            return CutBuilding(building=int(f["building"]), at_s=num("time"), duration_s=dur)
        return HostLoss(replica=replica, rank=rank, duration_s=dur, **when)
    except ValueError as e:
        raise ValueError(f"bad --inject {text!r}: {e}; {USAGE}") from None


def resolve_host(host: str, hosts: tuple[str, ...] | list[str]) -> str:
    """A scenario's host place (an index into the training hosts, or a name) as a host name; ValueError if
    the topology has no such host."""
    if host.isdigit():
        if int(host) >= len(hosts):
            raise ValueError(f"host={host}: the job has training hosts 0..{len(hosts) - 1}")
        return hosts[int(host)]
    if host not in hosts:
        raise ValueError(f"host={host}: not a training host of the job")
    return host


def check_faults(faults: tuple[Fault, ...] | list[Fault], *, replicas: int, ranks_per_replica: int,
                 buildings: int, hosts: tuple[str, ...] | list[str] | None = None) -> None:
    """Raise ValueError if a fault names a replica, rank or building the job does not have, or two
    faults of a kind that allows one per replica (slow host, slow fetch) name the same replica."""
    seen: set[tuple[str, int]] = set()
    for fault in faults:
        replica = getattr(fault, "replica", None)
        if replica is not None and not 0 <= replica < replicas:
            raise ValueError(f"{fault.describe()}: the profile has replicas 0..{replicas - 1}")
        if isinstance(fault, SlowHost) and fault.rank >= ranks_per_replica:
            raise ValueError(f"{fault.describe()}: a replica has ranks 0..{ranks_per_replica - 1}")
        if isinstance(fault, CutBuilding) and fault.building >= buildings:
            raise ValueError(f"{fault.describe()}: the topology has buildings 0..{buildings - 1}")
        rank = getattr(fault, "rank", None)
        if isinstance(fault, (Hang, HostLoss, KillRank)) and rank is not None and rank >= ranks_per_replica:
            raise ValueError(f"{fault.describe()}: a replica has ranks 0..{ranks_per_replica - 1}")
        if hosts is not None:
            for place in [getattr(fault, k, None) for k in ("host", "a", "b")]:
                if isinstance(place, str):
                    try:
                        resolve_host(place, hosts)
                    except ValueError as e:
                        raise ValueError(f"{fault.describe()}: {e}") from None
        if isinstance(fault, (SlowHost, SlowFetch)):
            key = (type(fault).__name__, fault.replica)
            if key in seen:
                raise ValueError(f"{fault.describe()}: one {type(fault).__name__} per replica")
            seen.add(key)
