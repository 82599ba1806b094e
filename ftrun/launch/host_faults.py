"""Host faults for `ftrun launch --netns-hosts`: when to break what. Pure (no clock, no processes).

Three kinds, drawn with a seeded generator each time a fault is due (`--kill-every`, or exponential
intervals with `--kill-random-mean`):
- `replica_kill`: SIGKILL one replica's ranks (as without namespaces);
- `host_kill`: SIGKILL every process on one host (all its replicas at once);
- `host_cut`: take one host's link down for `cut_s` seconds, then back up; its processes live on,
  unreachable, and heal (or crash and restart) when the link returns.
As KillPlan does, a fault is only chosen when the replicas it takes out leave at least `min_up` healthy
replicas (committed since their last start, not cut off); a due fault without a candidate waits. The
lighthouse's host is never faulted (the job would lose its quorum service, which ftrun does not
replicate). The kind is drawn first, among the kinds that have a candidate, then the target.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ftrun.launch.faults import check_fault_timing, next_fault_at

KINDS = ("replica_kill", "host_kill", "host_cut")


@dataclass(frozen=True)
class Fault:
    kind: str  # one of KINDS
    host: int  # the host it hits (a replica_kill: the victim's host)
    replicas: tuple[str, ...]  # the replicas it takes out


def parse_kinds(text: str) -> tuple[str, ...]:
    """'replica_kill,host_cut' -> the kinds; ValueError naming a bad one."""
    kinds = tuple(k.strip().replace("-", "_") for k in text.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise ValueError(f"bad fault kind(s) {', '.join(bad) or repr(text)}: choose from {', '.join(KINDS)}")
    return tuple(dict.fromkeys(kinds))


@dataclass
class HostFaultPlan:
    placement: dict[str, int]  # replica -> host
    protected_hosts: frozenset[int] = frozenset()  # never faulted (the lighthouse's)
    every_s: float | None = None
    random_mean_s: float | None = None
    kinds: tuple[str, ...] = KINDS
    min_up: int = 1
    seed: int = 0
    num_timed_kills: int = 0  # faults made (the name KillPlan's readers use)
    pending: list = field(default_factory=list)  # at-step kills: none here (the name KillPlan's readers use)

    def __post_init__(self) -> None:
        check_fault_timing("HostFaultPlan", self.every_s, self.random_mean_s)
        parse_kinds(",".join(self.kinds))
        self._rng = random.Random(self.seed)
        self._next_at: float | None = None

    def start(self, now: float) -> None:
        self._next_at = self._after(now)

    def _after(self, now: float) -> float | None:
        return next_fault_at(now, self.every_s, self.random_mean_s, self._rng)

    def candidates(self, up: list[str], healthy: list[str]) -> dict[str, list[Fault]]:
        """Per kind, the faults that would leave at least min_up healthy replicas."""
        healthy_set, up_set = set(healthy), set(up)
        out: dict[str, list[Fault]] = {k: [] for k in self.kinds}
        if "replica_kill" in out:
            out["replica_kill"] = [Fault("replica_kill", self.placement[r], (r,)) for r in sorted(up_set)
                                   if self.placement[r] not in self.protected_hosts
                                   and len(healthy_set - {r}) >= self.min_up]
        for host in sorted(set(self.placement.values()) - set(self.protected_hosts)):
            on_host = tuple(sorted(r for r, h in self.placement.items() if h == host))
            if not set(on_host) & up_set or len(healthy_set - set(on_host)) < self.min_up:
                continue
            for kind in ("host_kill", "host_cut"):
                if kind in out:
                    out[kind].append(Fault(kind, host, on_host))
        return {k: v for k, v in out.items() if v}

    def due(self, now: float, up: list[str], healthy: list[str]) -> Fault | None:
        """The fault to inject now, if one is due and has a candidate (else it waits)."""
        if self._next_at is None or now < self._next_at:
            return None
        options = self.candidates(up, healthy)
        if not options:
            return None
        kind = self._rng.choice(sorted(options))
        fault = self._rng.choice(options[kind])
        self._next_at = self._after(now)
        self.num_timed_kills += 1
        return fault

    @property
    def next_at(self) -> float | None:
        return self._next_at


def place_replicas(num_replicas: int, num_hosts: int) -> tuple[int, dict[str, int]]:
    """(the lighthouse's host, replica -> host): the lighthouse on host 0, replicas round-robin on the
    others (all on host 0 when there is only one host)."""
    if num_hosts < 1:
        raise ValueError(f"--netns-hosts must be >= 1, got {num_hosts}")
    if num_hosts == 1:
        return 0, {f"r{i}": 0 for i in range(num_replicas)}
    return 0, {f"r{i}": 1 + i % (num_hosts - 1) for i in range(num_replicas)}
