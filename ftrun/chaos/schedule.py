"""Seeded random fault schedules for `ftrun chaos`. Pure: no clock, no processes, no I/O.

A schedule is a small job (R replicas x K ranks, S steps) and a list of faults, each tied to the step at
which the driver arms it. Schedule `index` of run `seed` depends on (seed, index) only, so
`ftrun chaos --seed S --seed-of I` replays exactly the schedule a long run reported.

Fault kinds:
- kill, stop, slow: one rank of a replica SIGKILLs itself, SIGSTOPs itself (resumed after `seconds`)
  or stalls `seconds`, in a phase of the step: quorum, compute (inside autograd), all-reduce (inside
  the FTAR), commit (before the vote or after the optimizer step) or catch-up (the driver first
  SIGKILLs the replica; its next incarnation acts while healing). They go through the worker's one fault
  grammar (ftrun.train.inject.DieAt), phases named as there.
- lighthouse: the lighthouse is stopped (every connection dropped) and restarted `seconds` later on the
  same address from its state dir.
- joiner: the replica does not start with the others; it arrives once the job reaches `step`.
- corrupt: one byte of a loader_state slot (slot `rank`) is flipped at `step`.
- partition: the replica's host (a network namespace) loses its link for `seconds`, then gets it back.
  Drawn only with `partitions=True` (the driver has namespace hosts); without it every draw is as before.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from ftrun.train.inject import DIE_PHASES

PROCESS_KINDS = ("kill", "stop", "slow")
KINDS = PROCESS_KINDS + ("lighthouse", "joiner", "corrupt", "partition")
WEIGHTS = (4, 3, 2, 1, 1, 1)  # of KINDS without partition
PARTITION_WEIGHT = 3
# the phase names -> the worker's (ftrun.train.inject)
PHASES = {"quorum": ("quorum",), "compute": ("backward",), "all-reduce": ("exchange",),
          "commit": ("before_commit", "after_commit"), "catch-up": ("heal",)}
MAX_FAULTS = 3


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # armed once the job has committed step - 1 (steps counted from 0)
    replica: str | None = None  # process faults, joiner and partition
    rank: int = 0  # process faults: the rank; corrupt: the loader_state slot
    phase: str | None = None  # process faults: a phase of ftrun.train.inject.DIE_PHASES
    seconds: float = 0.0  # stop, slow: how long; lighthouse: how long it is down; partition: how long cut

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Fault.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind in PROCESS_KINDS and (self.phase not in DIE_PHASES or self.replica is None):
            raise ValueError(f"a {self.kind} fault needs a replica and a phase of {DIE_PHASES}, got {self}")
        if self.kind == "partition" and self.replica is None:
            raise ValueError(f"a partition fault needs a replica, got {self}")
        if self.step < 0 or self.rank < 0 or self.seconds < 0:
            raise ValueError(f"Fault step, rank and seconds must be >= 0, got {self}")

    def describe(self) -> str:
        if self.kind in PROCESS_KINDS:
            dur = f" {self.seconds:.2f}s" if self.kind != "kill" else ""
            return f"{self.kind} {self.replica}.{self.rank}@{self.step}/{self.phase}{dur}"
        if self.kind == "lighthouse":
            return f"lighthouse@{self.step} down {self.seconds:.2f}s"
        if self.kind == "joiner":
            return f"joiner {self.replica}@{self.step}"
        if self.kind == "partition":
            return f"partition {self.replica}@{self.step} cut {self.seconds:.2f}s"
        return f"corrupt loader_state slot-{self.rank}@{self.step}"


@dataclass(frozen=True)
class Schedule:
    seed: int
    index: int
    replicas: int
    ranks_per_replica: int
    steps: int
    faults: tuple[Fault, ...] = field(default=())

    @property
    def min_replicas(self) -> int:
        """The lighthouse's quorum floor: a majority."""
        return self.replicas // 2 + 1

    @property
    def joiner(self) -> Fault | None:
        return next((f for f in self.faults if f.kind == "joiner"), None)

    def describe(self) -> str:
        return "; ".join(f.describe() for f in self.faults) or "no faults"

    def as_json(self) -> dict:
        return {"seed": self.seed, "index": self.index, "replicas": self.replicas,
                "ranks_per_replica": self.ranks_per_replica, "steps": self.steps,
                "faults": [asdict(f) for f in self.faults], "describe": self.describe()}


def check_shape(replicas: int, ranks_per_replica: int, steps: int) -> None:
    """Raise ValueError naming the flag when a job shape cannot host a schedule."""
    if not 2 <= replicas <= 8:
        raise ValueError(f"--replicas must be in [2, 8], got {replicas}")
    if not 1 <= ranks_per_replica <= 4:
        raise ValueError(f"--ranks-per-replica must be in [1, 4], got {ranks_per_replica}")
    if not 6 <= steps <= 10_000:
        raise ValueError(f"--steps must be in [6, 10000], got {steps}")


def generate(seed: int, index: int, *, replicas: int = 3, ranks_per_replica: int = 1, steps: int = 12,
             partitions: bool = False) -> Schedule:
    """Schedule `index` of run `seed`: 1 to MAX_FAULTS faults at steps in [1, steps - 4], leaving the
    last steps for the job to recover and finish. `partitions`: also draw partition faults (the draws
    of a run without them are unchanged)."""
    check_shape(replicas, ranks_per_replica, steps)
    if index < 0:
        raise ValueError(f"schedule index must be >= 0, got {index}")
    rng = random.Random(f"ftrun-chaos:{seed}:{index}")
    ids = [f"r{i}" for i in range(replicas)]
    last = steps - 4
    faults: list[Fault] = []
    for _ in range(rng.randint(1, MAX_FAULTS)):
        if partitions:
            kind = rng.choices(KINDS, weights=WEIGHTS + (PARTITION_WEIGHT,))[0]
        else:
            kind = rng.choices(KINDS[:len(WEIGHTS)], weights=WEIGHTS)[0]
        step = rng.randint(1, last)
        if kind in PROCESS_KINDS:
            phase = rng.choice(PHASES[rng.choice(sorted(PHASES))])
            seconds = {"kill": 0.0, "stop": rng.uniform(0.5, 3.0), "slow": rng.uniform(0.2, 1.5)}[kind]
            faults.append(Fault(kind, step, rng.choice(ids), rng.randrange(ranks_per_replica), phase,
                                round(seconds, 2)))
        elif kind == "lighthouse":
            faults.append(Fault(kind, step, seconds=round(rng.uniform(0.1, 1.5), 2)))
        elif kind == "joiner":
            if any(f.kind == "joiner" for f in faults):
                continue
            faults.append(Fault(kind, rng.randint(1, last), ids[-1]))
        elif kind == "partition":
            faults.append(Fault(kind, step, rng.choice(ids), seconds=round(rng.uniform(0.5, 3.0), 2)))
        else:
            faults.append(Fault(kind, step, rank=rng.randrange(2)))
    faults.sort(key=lambda f: (f.step, KINDS.index(f.kind)))
    return Schedule(seed, index, replicas, ranks_per_replica, steps, tuple(faults))
