"""A mock cluster scheduler: hands out hosts for a failed replica after the profile's allocation delays.

Two requests, as a real scheduler (Slurm, Kubernetes, an internal allocator) would see them:
- `relaunch(hosts)`: the replica's processes died but its hosts are healthy (a SIGKILL, an OOM, a
  software crash): the same hosts come back after `alloc_delay_warm_s` (requeue on the allocation).
- `replace(hosts)`: the hosts themselves are lost: hot spares first (pre-warmed, `alloc_delay_warm_s`),
  then cold spares (idle capacity, `alloc_delay_cold_s`); NoCapacity when neither pool can cover it.
Either way the new processes still need `process_start_s` before they check in; the launcher waits
that out, not the scheduler. Delays wait on the Env's clock of the calling task (virtual in
emulation). Spare pools come from the profile's topology (`harness.topology.Topology.hot_spare_hosts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from mocks.config import SchedulerConfig

__all__ = ["Allocation", "MockScheduler", "NoCapacity"]


class NoCapacity(RuntimeError):
    """No spare pool can supply the hosts asked for."""


@dataclass(frozen=True)
class Allocation:
    hosts: tuple[str, ...]
    kind: str  # "relaunch" (same hosts, warm), "hot" (hot spares, warm), "cold" (cold spares, cold)
    delay_s: float
    reason: str


class MockScheduler:
    """Allocations for one job. Threading: one task at a time (the job's supervisor)."""

    def __init__(self, *, env: Any, config: SchedulerConfig, hot_spares: Sequence[str] = (),
                 cold_spares: Sequence[str] = ()) -> None:
        self.env, self.config = env, config
        self._hot, self._cold = list(hot_spares), list(cold_spares)
        self.history: list[Allocation] = []

    @property
    def free_hot(self) -> int:
        return len(self._hot)

    @property
    def free_cold(self) -> int:
        return len(self._cold)

    def plan_relaunch(self, hosts: Sequence[str]) -> Allocation:
        """What `relaunch` will hand out (pure: no waiting, no state change)."""
        return Allocation(tuple(hosts), "relaunch", self.config.alloc_delay_warm_s,
                          f"{len(hosts)} healthy hosts requeued after the warm delay")

    def plan_replace(self, num_hosts: int) -> Allocation:
        """What `replace` will hand out (pure). Raises NoCapacity."""
        if num_hosts <= len(self._hot):
            return Allocation(tuple(self._hot[:num_hosts]), "hot", self.config.alloc_delay_warm_s,
                              f"{num_hosts} hot spares ({len(self._hot)} free)")
        if num_hosts <= len(self._cold):
            return Allocation(tuple(self._cold[:num_hosts]), "cold", self.config.alloc_delay_cold_s,
                              f"{num_hosts} cold spares ({len(self._hot)} hot spares were too few)")
        raise NoCapacity(f"need {num_hosts} hosts: {len(self._hot)} hot and {len(self._cold)} cold spares free")

    def relaunch(self, hosts: Sequence[str]) -> Allocation:
        """Block for the warm delay, then hand the same hosts back."""
        return self._grant(self.plan_relaunch(hosts))

    def replace(self, num_hosts: int) -> Allocation:
        """Block for the pool's delay, then hand out `num_hosts` spare hosts. Raises NoCapacity."""
        alloc = self.plan_replace(num_hosts)
        pool = self._hot if alloc.kind == "hot" else self._cold
        del pool[:num_hosts]  # taken now, so a concurrent request cannot get the same hosts
        return self._grant(alloc)

    def give_back(self, hosts: Sequence[str], *, hot: bool = False) -> None:
        """Return hosts to a pool (e.g. repaired machines)."""
        (self._hot if hot else self._cold).extend(hosts)

    def _grant(self, alloc: Allocation) -> Allocation:
        self.env.clock.sleep(alloc.delay_s)
        self.history.append(alloc)
        return alloc
