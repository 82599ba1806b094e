"""`ftrun launch --inject SPEC`: faults injected into a real job, in the one fault grammar (ftrun.faultspec,
shared with `ftrun emulate --inject` and the profiles' events; tests/unit/test_launch_inject.py checks that the
forms both accept parse to the same fault). Forms a real job cannot inject (kill lighthouse, slow host, slow
link, release, host=, building=) are rejected by name. Pure: parsing and the plan of what is due.

    kill replica=R step=S [at=F]
    kill replica=R time=T
        A process crash: every rank of replica rR is SIGKILLed (its connections reset at once) at its own
        commit of step S (the time its rank 0 reported; at=0, the step boundary) or, with at=F > 0, F x the
        job's median quorum-to-commit time after its quorum for the next step (mid-step: the survivors'
        all-reduce of that step fails); as in the emulator, a replica that is past S without having committed
        S itself (it was down) is hit F x a step after the supervisor sees it; or T seconds after every
        replica has joined. The supervisor restarts it after --restart-delay, as any crash.
    hang replica=R [rank=K] step=S|time=T [at=F] [duration=D]
        A hang: the process stops (SIGSTOP): rank K of the replica, or every rank without rank=. Nothing is
        reset; peers wait until their own timeouts (or the diagnosis monitor) find it. SIGCONT after D
        seconds (default 0: never; the job's detection evicts the replica and it restarts).
    cut replica=R step=S|time=T [at=F] [duration=D]
        A host loss: silence until a heartbeat or timeout says so. With --netns-hosts the replica's host is
        cut off the network for D seconds (its processes live on, unreachable); on one machine every rank
        process of the replica stops (SIGSTOP): its TCP peers see no reset, the lighthouse no heartbeat.
    slow fetch replica=R [factor=F] [delay=D]
        Replica R's state fetches are slow: while R catches up (from its start until its first commit),
        every catch-up source serves slowly (the HTTP server waits D seconds before sending shard 0, once per
        fetch, and stretches each shard's transfer to F x its send time). Needs a script that reads the fault
        file (FTRUN_FAULT_FILE; ftrun.train.ft_worker does).

Kills and hangs fire once each; a due fault whose replica is down waits until it is back. Where the script
reads the fault file (FTRUN_FAULT_FILE), a mid-step kill (at=F > 0) is carried out by the rank itself: the
file's die_at (phase=backward with at=F, ftrun.train.inject) makes it SIGKILL itself F x its own median compute
after its quorum for the step after S (the emulator's F x the modeled compute), which the supervisor's event
poll cannot time within a short step; the supervisor records it as the injected kill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ftrun import faultspec

ENV = "launch"
USAGE = faultspec.usage(ENV)


@dataclass(frozen=True)
class Injected:
    """One fault of a real job. kind: crash | hang | host_loss | slow_fetch."""

    kind: Literal["crash", "hang", "host_loss", "slow_fetch"]
    replica: int
    at_step: int | None = None
    at_s: float | None = None
    at_fraction: float = 0.0  # of the median step, after step at_step is committed
    rank: int | None = None  # hang: one rank of the replica (None: every rank)
    duration_s: float = 0.0  # hang, host_loss: how long (0: for good)
    factor: float = 1.0  # slow_fetch
    delay_s: float = 0.0  # slow_fetch

    def __post_init__(self) -> None:
        if self.replica < 0 or (self.rank is not None and self.rank < 0):
            raise ValueError(f"negative replica or rank in {self}")
        if self.kind == "slow_fetch":
            if not (1 <= self.factor < math.inf) or not (0 <= self.delay_s < math.inf):
                raise ValueError(f"factor= must be >= 1 and delay= >= 0, got {self.factor}, {self.delay_s}")
            if self.factor == 1 and self.delay_s == 0:
                raise ValueError("a slow fetch needs factor= > 1 or delay= > 0")
            return
        if (self.at_step is None) == (self.at_s is None):
            raise ValueError(f"a {self.kind} needs exactly one of step= or time=")
        if (self.at_step is not None and self.at_step < 0) or (self.at_s is not None and not self.at_s >= 0):
            raise ValueError("step and time must be >= 0")
        if not 0 <= self.at_fraction < 1:
            raise ValueError(f"at= must be in [0, 1), got {self.at_fraction}")
        if self.at_s is not None and self.at_fraction:
            raise ValueError("at= goes with step=, not time=")
        if not (0 <= self.duration_s < math.inf):
            raise ValueError(f"duration= must be a finite number >= 0, got {self.duration_s}")

    @property
    def replica_id(self) -> str:
        return f"r{self.replica}"

    def describe(self) -> str:
        if self.kind == "slow_fetch":
            return f"slow fetch replica={self.replica} factor={self.factor:g} delay={self.delay_s:g}"
        verb = {"crash": "kill", "hang": "hang", "host_loss": "cut"}[self.kind]
        when = f"step={self.at_step} at={self.at_fraction:g}" if self.at_step is not None else f"time={self.at_s:g}"
        rank = f" rank={self.rank}" if self.rank is not None else ""
        extra = f" duration={self.duration_s:g}" if self.kind != "crash" else ""
        return f"{verb} replica={self.replica}{rank} {when}{extra}"


def parse(text: str) -> Injected:
    """One --inject value (the one fault grammar, ftrun.faultspec). Raises ValueError naming the problem and
    the forms `ftrun launch` injects."""
    try:
        spec = faultspec.parse(text, ENV)
        replica = spec.int("replica")
        if spec.key == ("slow", "fetch"):
            return Injected("slow_fetch", replica, factor=spec.num("factor", 1.0), delay_s=spec.num("delay", 0.0))
        verb = spec.form.verb
        faultspec.refuse(spec, ENV, "host", why="a real job names replicas, not hosts: hang replica=R [rank=K]")
        faultspec.refuse(spec, ENV, "building", why="a real job has no buildings: cut replica=R")
        faultspec.refuse(spec, ENV, "hosts", why="the supervisor restarts a replica on its own host")
        faultspec.refuse(spec, ENV, "at=ftar", why="use at=F, a fraction of the step")
        if replica is None:
            raise ValueError(f"{spec.form.name} needs replica=")
        if verb == "kill":
            faultspec.refuse(spec, ENV, "rank", why="a crash kills every rank of the replica")
        if verb == "cut":
            faultspec.refuse(spec, ENV, "rank", why="a host loss cuts the replica's host")
        kind = {"kill": "crash", "hang": "hang", "cut": "host_loss"}[verb]
        return Injected(kind, replica, at_step=spec.int("step"), at_s=spec.num("time"),
                        at_fraction=spec.num("at", 0.0), rank=spec.int("rank"), duration_s=spec.num("duration", 0.0))
    except ValueError as e:
        raise ValueError(f"bad --inject {text!r}: {e}; {USAGE}") from None


def check(faults: list[Injected], *, replicas: int, ranks_per_replica: int) -> None:
    """Raise ValueError if a fault names a replica or rank the job does not have, or a replica has two slow
    fetches."""
    slow: set[int] = set()
    for f in faults:
        if f.replica >= replicas:
            raise ValueError(f"--inject {f.describe()!r}: the job has replicas 0..{replicas - 1}")
        if f.rank is not None and f.rank >= ranks_per_replica:
            raise ValueError(f"--inject {f.describe()!r}: a replica has ranks 0..{ranks_per_replica - 1}")
        if f.kind == "slow_fetch":
            if f.replica in slow:
                raise ValueError(f"--inject {f.describe()!r}: one slow fetch per replica")
            slow.add(f.replica)


@dataclass(frozen=True)
class Action:
    """What the supervisor does now: stop / resume processes, kill a replica, or set the sources' slow fault."""

    what: Literal["crash", "stop", "resume", "cut", "uncut"]
    fault: Injected


class InjectPlan:
    """The timed faults of a job (crash, hang, host loss) and when each is due; slow fetches are state
    (`slow_fetch_for(catching_up)`), not events. `due(...)` hands out each action once."""

    def __init__(self, faults: list[Injected], *, self_kill: bool = False) -> None:
        """self_kill: the script kills itself for a mid-step crash (the fault file's die_at, inside its backward:
        precise where the supervisor's timer is a poll late); the timer then fires only as a backstop, a step
        after the planned time."""
        self.self_kill = self_kill
        self.slow = [f for f in faults if f.kind == "slow_fetch"]
        self._pending = [f for f in faults if f.kind != "slow_fetch"]
        self._armed: dict[Injected, float] = {}  # step reached: fires at this time
        self._resume: list[tuple[float, Injected]] = []
        self._start: float | None = None
        self.fired: list[Injected] = []

    def start(self, now: float) -> None:
        """Every replica has joined: time= faults count from now."""
        if self._start is None:
            self._start = now

    @property
    def pending(self) -> list[Injected]:
        return list(self._pending)

    def due(self, now: float, max_step: int, step_s: float | None, up: set[str], host_cuts: bool,
            committed: dict[str, tuple[int, float]] | None = None,
            started: dict[str, tuple[int, float]] | None = None) -> list[Action]:
        """The actions due now. max_step: the job's highest committed step; step_s: its median compute time
        (quorum to commit) so far (None: not known yet, counted as 0); up: replicas whose processes run;
        host_cuts: a host loss is a network cut (namespaces) rather than stopped processes; committed / started:
        replica -> (step, time) of its running incarnation's latest commit / quorum."""
        committed, started = committed or {}, started or {}
        out: list[Action] = []
        for at, f in list(self._resume):
            if now >= at:
                self._resume.remove((at, f))
                out.append(Action("uncut" if f.kind == "host_loss" and host_cuts else "resume", f))
        for f in list(self._pending):
            if f.at_step is not None:
                own = (started if f.at_fraction else committed).get(f.replica_id)
                late = (1.0 + (step_s or 0.0)) if self.in_process(f) else 0.0  # a backstop only
                if f not in self._armed and own is not None and own[0] >= f.at_step:
                    self._armed[f] = own[1] + f.at_fraction * (step_s or 0.0) + late
                elif f not in self._armed and max_step > f.at_step:
                    self._armed[f] = now + f.at_fraction * (step_s or 0.0) + late
                ready = f in self._armed and now >= self._armed[f]
            else:
                ready = self._start is not None and now >= self._start + (f.at_s or 0.0)
            if not ready or f.replica_id not in up:
                continue
            self._pending.remove(f)
            self.fired.append(f)
            if f.kind == "crash":
                out.append(Action("crash", f))
                continue
            out.append(Action("cut" if f.kind == "host_loss" and host_cuts else "stop", f))
            if f.duration_s > 0:
                self._resume.append((now + f.duration_s, f))
        return out

    def in_process(self, f: Injected) -> bool:
        """Whether the script carries out this crash itself (a mid-step kill, with self_kill)."""
        return self.self_kill and f.kind == "crash" and f.at_step is not None and f.at_fraction > 0

    def self_kills(self) -> list[Injected]:
        """The pending crashes the script carries out itself."""
        return [f for f in self._pending if self.in_process(f)]

    def self_killed(self, replica_id: str) -> Injected | None:
        """The script of `replica_id` killed itself as planned: that crash has fired (returned), once."""
        f = next((f for f in self.self_kills() if f.replica_id == replica_id), None)
        if f is not None:
            self._pending.remove(f)
            self.fired.append(f)
        return f

    def next_at(self) -> float | None:
        """The earliest time an armed fault or a resume is due (the supervisor wakes up for it)."""
        times = [t for f, t in self._armed.items() if f in self._pending] + [t for t, _ in self._resume]
        return min(times, default=None)

    def slow_fetch_for(self, catching_up: set[str]) -> Injected | None:
        """The slow-fetch fault the sources apply now: the first of a replica that is catching up."""
        return next((f for f in self.slow if f.replica_id in catching_up), None)
