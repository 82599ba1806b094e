"""Fault plans for the FT-HSDP worker: where a rank process kills itself, how its catch-up server lies. Pure.

Entry points read them from the environment (FTRUN_DIE_AT, FTRUN_CATCHUP_FAULT); entries are separated
by ';', fields by ',':

    FTRUN_DIE_AT="step=5,phase=exchange,replica=r1,incarnation=0;phase=heal,replica=r1,incarnation=1"
        SIGKILL this process the first time it reaches `phase` at a step >= `step` (default 0). Phases:
        quorum (before asking), heal (catch-up fetched, not loaded), backward (inside autograd),
        exchange (inside the FTAR, after a few reduces), before_commit (FTAR done, before the vote),
        after_commit (optimizer stepped, ledger and audit not yet written).
    FTRUN_CATCHUP_FAULT="kind=truncate,then=die,replica=r0,incarnation=0"
        spoil the first `count` (default 1) shard responses of this rank's catch-up server: kind=corrupt
        flips a byte (the client's CRC check catches it), kind=truncate sends half and closes; then=die
        SIGKILLs the process right after (a source dying mid-transfer).
`replica` and `incarnation` restrict an entry to one replica / one incarnation (default: all).
"""

from __future__ import annotations

from dataclasses import dataclass

DIE_PHASES = ("quorum", "heal", "backward", "exchange", "before_commit", "after_commit")
FAULT_KINDS = ("corrupt", "truncate")


@dataclass(frozen=True, kw_only=True)
class DieAt:
    phase: str
    step: int = 0
    replica: str | None = None
    incarnation: int | None = None

    def __post_init__(self) -> None:
        if self.phase not in DIE_PHASES:
            raise ValueError(f"DieAt.phase must be one of {DIE_PHASES}, got {self.phase!r}")
        if self.step < 0 or (self.incarnation is not None and self.incarnation < 0):
            raise ValueError(f"DieAt.step and incarnation must be >= 0, got {self.step}, {self.incarnation}")

    def applies_to(self, replica: str, incarnation: int) -> bool:
        return self.replica in (None, replica) and self.incarnation in (None, incarnation)

    def due(self, phase: str, step: int) -> bool:
        return phase == self.phase and step >= self.step


@dataclass(frozen=True, kw_only=True)
class CatchupFault:
    kind: str
    then_die: bool = False
    count: int = 1
    replica: str | None = None
    incarnation: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"CatchupFault.kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.count < 1:
            raise ValueError(f"CatchupFault.count must be >= 1, got {self.count}")

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
    return tuple(DieAt(phase=f.get("phase", ""), step=int(f.get("step", "0")), replica=f.get("replica"),
                       incarnation=_opt_int(f.get("incarnation")))
                 for f in _entries(text, {"phase", "step", "replica", "incarnation"}))


def parse_catchup_fault(text: str) -> tuple[CatchupFault, ...]:
    """Parse FTRUN_CATCHUP_FAULT (see the module docstring). Raises ValueError naming the bad part."""
    faults = []
    for f in _entries(text, {"kind", "then", "count", "replica", "incarnation"}):
        if f.get("then", "die") != "die":
            raise ValueError(f"CatchupFault then= must be 'die', got {f['then']!r}")
        faults.append(CatchupFault(kind=f.get("kind", ""), then_die="then" in f, count=int(f.get("count", "1")),
                                   replica=f.get("replica"), incarnation=_opt_int(f.get("incarnation"))))
    return tuple(faults)


def plan_for(plans: tuple, replica: str, incarnation: int) -> tuple:
    """The entries of `plans` that apply to this replica's incarnation."""
    return tuple(p for p in plans if p.applies_to(replica, incarnation))
