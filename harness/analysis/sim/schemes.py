"""Fault-tolerance schemes as the time-to-train simulation sees them: what a failure costs, and how fast
the job trains meanwhile.

Each scheme answers `on_failure()` (a group or replica just failed: is this a wipe-out that forces a
global restart and a rollback to the last checkpoint, and how long does the whole job stall otherwise?),
`on_rejoin()` (FT-HSDP only), `reset()` (after a global restart every group is healthy again) and
`rate()` (useful training per wall second while computing, relative to plain data parallelism, whose step
is one stack of compute plus the all-reduce). All times are seconds, before jitter (the simulator adds it).

No clock and no I/O; randomness comes from the Generator passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.analysis.sim.profile import FtHsdpConfig, SystemConfig
from harness.analysis.spare.controller import decide
from harness.analysis.spare.layout import SpareLayout, block_replication_hosts


@dataclass(frozen=True, kw_only=True)
class FailureEffect:
    """wipe_out: global restart + rollback. stall_s: whole-job stall otherwise. repair_s: FT-HSDP only,
    the failed replica rejoins (through `on_rejoin`) after this long."""

    wipe_out: bool
    stall_s: float = 0.0
    repair_s: float | None = None


class CkptOnly:
    """Plain data parallelism with checkpoints: every failure is a global restart."""

    name = "ckpt_only"

    def __init__(self, system: SystemConfig, rng: np.random.Generator) -> None:
        self.redundancy = 1

    def reset(self) -> None:
        pass

    def on_failure(self) -> FailureEffect:
        return FailureEffect(wipe_out=True)

    def on_rejoin(self) -> float:
        return 0.0

    def depth(self) -> float:
        return 1.0

    def rate(self) -> float:
        return 1.0


class _GroupScheme:
    """Shared by replication and SPARe: N groups fail one by one until a type loses its last host; each
    masked failure costs a failed all-reduce (half of one, SPARe paper §5.1) plus a communicator shrink."""

    def __init__(self, system: SystemConfig, redundancy: int, rng: np.random.Generator) -> None:
        self.system = system
        self.redundancy = redundancy
        self.rng = rng
        self.alive = np.ones(system.num_groups, dtype=bool)

    def reset(self) -> None:
        self.alive[:] = True

    def _fail_random_group(self) -> int:
        group = int(self.rng.choice(np.flatnonzero(self.alive)))
        self.alive[group] = False
        return group

    def _masked_stall(self) -> float:
        return self.system.allreduce_s / 2.0 + self.system.shrink_s

    def on_rejoin(self) -> float:
        return 0.0

    def rate(self) -> float:
        step = self.system.compute_per_stack_s + self.system.allreduce_s
        return step / (self.depth() * self.system.compute_per_stack_s + self.system.allreduce_s)

    def depth(self) -> float:
        raise NotImplementedError


class Replication(_GroupScheme):
    """Traditional replication of degree r: blocks of r groups share r types, each group computes all r
    every step; a block losing all its groups is a wipe-out."""

    name = "rep"

    def __init__(self, system: SystemConfig, redundancy: int, rng: np.random.Generator) -> None:
        super().__init__(system, redundancy, rng)
        self.hosts = block_replication_hosts(system.num_groups, redundancy)

    def on_failure(self) -> FailureEffect:
        group = self._fail_random_group()
        # Only the failed group's block can have just lost its last member.
        if not self.alive[self.hosts[group]].any():
            return FailureEffect(wipe_out=True)
        return FailureEffect(wipe_out=False, stall_s=self._masked_stall())

    def depth(self) -> float:
        return float(self.redundancy)


class Spare(_GroupScheme):
    """SPARe: cyclic Golomb placement, all-reduce after `depth` stacks, the controller after each failure.
    A failure whose committed stacks no longer cover every type (controller phase 0 fails) also needs a
    patch compute of one stack for the step it broke."""

    name = "spare"

    def __init__(self, system: SystemConfig, redundancy: int, rng: np.random.Generator) -> None:
        super().__init__(system, redundancy, rng)
        self.layout = SpareLayout(num_groups=system.num_groups, redundancy=redundancy)
        self.hosts = self.layout.hosts
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.stacks = self.layout.initial_stacks()
        self._depth = 1
        self.num_patches = 0

    def on_failure(self) -> FailureEffect:
        self._fail_random_group()
        decision = decide(self.layout, self.stacks, self.alive, self._depth)
        if decision.wipe_out:
            return FailureEffect(wipe_out=True)
        self.stacks, self._depth = decision.stacks, decision.depth
        stall = self._masked_stall() + self.system.controller_s
        if decision.phase != 0:
            self.num_patches += 1
            stall += self.system.compute_per_stack_s
        return FailureEffect(wipe_out=False, stall_s=stall)

    def depth(self) -> float:
        return float(self._depth)


class FtHsdp:
    """FT-HSDP: R replicas; a failure stalls the job briefly, the replica repairs while the others train
    at alive/R throughput, and its rejoin stalls the job once more. Fewer than min_replicas alive is a
    wipe-out."""

    name = "ft_hsdp"

    def __init__(self, config: FtHsdpConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.redundancy = 1
        self.alive = config.num_replicas

    def reset(self) -> None:
        self.alive = self.config.num_replicas

    def on_failure(self) -> FailureEffect:
        self.alive -= 1
        if self.alive < self.config.min_replicas:
            return FailureEffect(wipe_out=True)
        # The repair's last rejoin_stall_s is the rejoin stall itself, so the replica is back at repair_s.
        return FailureEffect(wipe_out=False, stall_s=self.config.stall_per_failure_s,
                             repair_s=self.config.repair_s - self.config.rejoin_stall_s)

    def on_rejoin(self) -> float:
        self.alive = min(self.alive + 1, self.config.num_replicas)
        return self.config.rejoin_stall_s

    def depth(self) -> float:
        return 1.0

    def rate(self) -> float:
        return self.alive / self.config.num_replicas
