"""Fault plans for the FT-HSDP worker: where a rank process kills itself, how its catch-up server lies. Pure.

Entry points read them from the environment (FTRUN_DIE_AT, FTRUN_CATCHUP_FAULT); entries are separated
by ';', fields by ',':

    FTRUN_DIE_AT="step=5,phase=exchange,replica=r1,incarnation=0;phase=heal,replica=r1,incarnation=1"
        SIGKILL this process the first time it reaches `phase` at a step >= `step` (default 0). Phases:
        quorum (before asking), heal (catch-up fetched, not loaded), backward (inside autograd),
        exchange (inside the FTAR, after a few reduces), before_commit (FTAR done, before the vote),
        after_commit (optimizer stepped, ledger and audit not yet written).
        `action` (default kill) says what happens there instead: kill (SIGKILL), stop (the process prints
        a {"event": "fault"} line and SIGSTOPs itself; its supervisor sends SIGCONT after `seconds`) or
        slow (sleep `seconds` there, once). Every entry fires at most once per process. With phase=backward,
        `at=F` (0 < F < 1; kill or stop) acts F x this rank's median compute (forward and backward of its
        recent steps) after the step started (its quorum), from a timer, wherever the rank is then (a kill from
        the kernel's timer, on time even while the trainer holds the GIL: ftrun.train.ft_worker.kill_in): a kill
        F x a step into the step, as `ftrun launch --inject "kill ... at=F"` and the emulator mean it (before
        any step of the process was timed, inside the backward).
    FTRUN_CATCHUP_FAULT="kind=truncate,then=die,replica=r0,incarnation=0"
        spoil the first `count` (default 1) shard responses of this rank's catch-up server: kind=corrupt
        flips a byte (the client's CRC check catches it), kind=truncate sends half and closes; then=die
        SIGKILLs the process right after (a source dying mid-transfer); kind=slow (every response, not
        `count`): a throttled source, waiting `delay` seconds before a manifest answer and stretching each
        shard to `factor` x its send time (`ftrun launch --inject "slow fetch ..."` writes it).
`replica` and `incarnation` restrict an entry to one replica / one incarnation (default: all); a DieAt
entry's `rank` to one rank of the replica.
"""

from __future__ import annotations

from dataclasses import dataclass

DIE_PHASES = ("quorum", "heal", "backward", "exchange", "before_commit", "after_commit")
DIE_ACTIONS = ("kill", "stop", "slow")
FAULT_KINDS = ("corrupt", "truncate", "slow")


@dataclass(frozen=True, kw_only=True)
class DieAt:
    phase: str
    step: int = 0
    replica: str | None = None
    incarnation: int | None = None
    rank: int | None = None  # the rank inside the replica (default: every rank)
    action: str = "kill"
    seconds: float = 0.0  # how long a stop or slow action lasts
    at: float = 0.0  # phase=backward: act this fraction of the rank's compute after the step started (0: in backward)

    def __post_init__(self) -> None:
        if self.phase not in DIE_PHASES:
            raise ValueError(f"DieAt.phase must be one of {DIE_PHASES}, got {self.phase!r}")
        if self.step < 0 or (self.incarnation is not None and self.incarnation < 0):
            raise ValueError(f"DieAt.step and incarnation must be >= 0, got {self.step}, {self.incarnation}")
        if self.action not in DIE_ACTIONS:
            raise ValueError(f"DieAt.action must be one of {DIE_ACTIONS}, got {self.action!r}")
        if not 0.0 <= self.seconds <= 3600.0:
            raise ValueError(f"DieAt.seconds must be in [0, 3600], got {self.seconds}")
        if not 0.0 <= self.at < 1.0:
            raise ValueError(f"DieAt.at must be in [0, 1), got {self.at}")
        if self.at and (self.phase != "backward" or self.action == "slow"):
            raise ValueError(f"DieAt.at goes with phase=backward and action kill or stop, got phase={self.phase} "
                             f"action={self.action}")

    def encode(self) -> str:
        """The FTRUN_DIE_AT entry that parses back to this plan."""
        fields = {"phase": self.phase, "step": self.step, "replica": self.replica, "incarnation": self.incarnation,
                  "rank": self.rank}
        if self.action != "kill":
            fields.update(action=self.action, seconds=self.seconds)
        if self.at:
            fields.update(at=self.at)
        return ",".join(f"{k}={v}" for k, v in fields.items() if v is not None)

    def applies_to(self, replica: str, incarnation: int) -> bool:
        return self.replica in (None, replica) and self.incarnation in (None, incarnation)

    def for_rank(self, rank: int) -> bool:
        return self.rank in (None, rank)

    def due(self, phase: str, step: int) -> bool:
        return phase == self.phase and step >= self.step


@dataclass(frozen=True, kw_only=True)
class CatchupFault:
    kind: str
    then_die: bool = False
    count: int = 1
    replica: str | None = None
    incarnation: int | None = None
    factor: float = 1.0  # kind=slow
    delay: float = 0.0  # kind=slow, seconds

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"CatchupFault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.count < 1:
            raise ValueError(f"CatchupFault.count must be >= 1, got {self.count}")
        if not (1.0 <= self.factor <= 1e6 and 0.0 <= self.delay <= 3600.0):
            raise ValueError(f"CatchupFault.factor must be in [1, 1e6] and delay in [0, 3600], got {self.factor}, "
                             f"{self.delay}")

    def encode(self) -> str:
        """The FTRUN_CATCHUP_FAULT entry that parses back to this fault."""
        fields = {"kind": self.kind, "count": self.count, "replica": self.replica, "incarnation": self.incarnation}
        if self.kind == "slow":
            fields.update(factor=self.factor, delay=self.delay)
        return ",".join(f"{k}={v}" for k, v in fields.items() if v is not None) + (",then=die" if self.then_die else "")

    def applies_to(self, replica: str, incarnation: int) -> bool:
        return self.replica in (None, replica) and self.incarnation in (None, incarnation)


def _entries(text: str, allowed: set[str]) -> list[dict[str, str]]:
    out = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        fields = {}
        for part in entry.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in allowed:
                raise ValueError(f"bad field {part!r} in {entry!r}: expected key=value with key in {sorted(allowed)}")
            fields[key] = value
        out.append(fields)
    return out


def _opt_int(value: str | None) -> int | None:
    return None if value is None else int(value)


def parse_die_at(text: str) -> tuple[DieAt, ...]:
    """Parse FTRUN_DIE_AT (see the module docstring). Raises ValueError naming the bad part."""
    plans = []
    for f in _entries(text, {"phase", "step", "replica", "incarnation", "rank", "action", "seconds", "at"}):
        try:
            seconds, at = float(f.get("seconds", "0")), float(f.get("at", "0"))
        except ValueError:
            raise ValueError(f"bad seconds={f.get('seconds')!r} or at={f.get('at')!r}: expected numbers") from None
        plans.append(DieAt(phase=f.get("phase", ""), step=int(f.get("step", "0")), replica=f.get("replica"),
                           incarnation=_opt_int(f.get("incarnation")), rank=_opt_int(f.get("rank")),
                           action=f.get("action", "kill"), seconds=seconds, at=at))
    return tuple(plans)


def parse_catchup_fault(text: str) -> tuple[CatchupFault, ...]:
    """Parse FTRUN_CATCHUP_FAULT (see the module docstring). Raises ValueError naming the bad part."""
    faults = []
    for f in _entries(text, {"kind", "then", "count", "replica", "incarnation", "factor", "delay"}):
        if f.get("then", "die") != "die":
            raise ValueError(f"CatchupFault then= must be 'die', got {f['then']!r}")
        try:
            factor, delay = float(f.get("factor", "1")), float(f.get("delay", "0"))
        except ValueError:
            raise ValueError(f"bad factor= or delay= in {f}: expected numbers") from None
        faults.append(CatchupFault(kind=f.get("kind", ""), then_die="then" in f, count=int(f.get("count", "1")),
                                   replica=f.get("replica"), incarnation=_opt_int(f.get("incarnation")),
                                   factor=factor, delay=delay))
    return tuple(faults)


def plan_for(plans: tuple, replica: str, incarnation: int) -> tuple:
    """The entries of `plans` that apply to this replica's incarnation."""
    return tuple(p for p in plans if p.applies_to(replica, incarnation))
