"""Acting on a verdict: whether to evict a replica now instead of waiting out the FTAR timeout (pure).

`decide_eviction(now, verdict, first_seen, num_live_replicas, config)`: a hang that names culprit ranks
evicts their replicas once the same verdict has held for `confirm_s` (two analyses apart, so one racy
snapshot cannot evict anyone). Never evicted: a slow rank, host or link whose lag stays under the wait
limit (the step still completes); a candidate pair (sender and receiver cannot be told apart, the
timeout decides); a verdict naming more than `max_fraction` of the live replicas (that is a partition
or a fault on the observer's side, not a culprit). The driver remembers when a verdict was first seen.

`silent_culprits`: on real processes the driver also says which ranks did not answer the collector
(stopped, wedged or dead processes). The silent culprits are the verdict's ranks that did not answer,
and the silent ranks of a replica whose named culprit answers: that one is alive and waits inside its
replica (an FSDP or gloo collective the telemetry does not see into) on its silent rank. Only their
replicas are evicted once confirmed: a culprit that answers, with no silent rank beside it, is alive,
maybe only slow, and its replica is evicted only when the hang outlasts the wait limit (the FTAR timeout
would cut it off then anyway), so a slow-but-alive replica is never evicted early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ftrun.diagnose.model import CANDIDATES, HANG, NO_HANG, Verdict


@dataclass(frozen=True, kw_only=True)
class EvictionConfig:
    confirm_s: float = 1.0
    wait_limit_s: float = 10.0  # the FTAR timeout: a slower rank is cut off by it anyway
    max_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.confirm_s < 0 or self.wait_limit_s <= 0 or not 0 < self.max_fraction < 1:
            raise ValueError(f"EvictionConfig: need confirm_s >= 0, wait_limit_s > 0 and 0 < max_fraction < 1, "
                             f"got {self}")


@dataclass(frozen=True)
class Eviction:
    replicas: tuple[int, ...]  # to evict now (empty: none)
    reason: str
    retry_at: float | None = None  # look again then (a hang waiting for confirmation)


def same_culprits(a: Verdict | None, b: Verdict | None) -> bool:
    """The same hang seen twice: same kind and the same culprit replicas (a hang's culprit ranks inside
    its replica change as its peers give up; its replicas do not). A verdict naming another replica too
    (an innocent rank behind the hung one, for one racy pull) is another culprit set."""
    return a is not None and b is not None and a.kind == b.kind and \
        (a.ranks == b.ranks or (bool(a.replicas) and a.replicas == b.replicas))


@dataclass(frozen=True)
class Sighting:
    """A verdict as the driver last saw it: its silent culprits and since when the same hang is seen."""
    verdict: Verdict
    silent: tuple[int, ...]
    first_seen: float


def sight(prev: Sighting | None, verdict: Verdict, silent: tuple[int, ...], now: float) -> Sighting:
    """This pull's sighting: the confirmation clock (`first_seen`) carries over only when the previous
    pull named the same culprits (`same_culprits`) with the same silent ranks; a culprit set that changed
    between two pulls starts confirmation again, so no eviction ever rests on a verdict seen once."""
    same = prev is not None and same_culprits(prev.verdict, verdict) and prev.silent == silent
    return Sighting(verdict, silent, prev.first_seen if same else now)


def silent_culprits(verdict: Verdict, answered: Sequence[bool], replica_of: Sequence[int]) -> tuple[int, ...]:
    """The silent culprits (see the module docstring); `answered[r]` and `replica_of[r]` per rank."""
    alive_in = {int(replica_of[r]) for r in verdict.ranks if answered[r]}
    beside = (r for r in range(len(answered)) if not answered[r] and int(replica_of[r]) in alive_in)
    return tuple(sorted({r for r in verdict.ranks if not answered[r]} | set(beside)))


def decide_eviction(now: float, verdict: Verdict, first_seen: float | None, num_live_replicas: int,
                    config: EvictionConfig = EvictionConfig(), *, silent: tuple[int, ...] | None = None,
                    replica_of: Sequence[int] | None = None) -> Eviction:
    """`silent` (with `replica_of[r]`, each rank's replica): the culprits that did not answer; None when
    the driver cannot tell (every culprit counts as silent)."""
    if num_live_replicas < 1:
        raise ValueError(f"num_live_replicas must be >= 1, got {num_live_replicas}")
    if verdict.kind == NO_HANG:
        return Eviction((), "no hang")
    if verdict.kind == CANDIDATES:
        return Eviction((), f"candidates only (ranks {list(verdict.ranks)[:4]}): cannot tell sender from receiver; "
                            f"the FTAR timeout decides")
    if verdict.kind != HANG:
        if verdict.lag_s < config.wait_limit_s:
            return Eviction((), f"{verdict.kind}: slow but alive, lag {verdict.lag_s:.2f}s under the wait limit "
                                f"{config.wait_limit_s:g}s; never evicted")
        return Eviction(verdict.replicas, f"{verdict.kind}: lag {verdict.lag_s:.2f}s beyond the wait limit "
                                          f"{config.wait_limit_s:g}s")
    if not verdict.replicas:
        return Eviction((), "hang without a culprit replica")
    if len(verdict.replicas) > config.max_fraction * num_live_replicas:
        return Eviction((), f"hang names {len(verdict.replicas)} of {num_live_replicas} live replicas: a partition "
                            f"or the observer's fault, not a culprit; not evicting")
    if first_seen is None or now - first_seen < config.confirm_s:
        since = now if first_seen is None else first_seen
        return Eviction((), f"hang in replicas {list(verdict.replicas)}: confirming until {since + config.confirm_s:g}",
                        retry_at=since + config.confirm_s)
    if silent is not None and replica_of is not None and now - first_seen < config.wait_limit_s:
        quiet = tuple(sorted({int(replica_of[r]) for r in silent}))
        if not quiet:
            return Eviction((), f"hang culprits answer the collector (alive, maybe slow): not evicted before the "
                                f"wait limit {config.wait_limit_s:g}s", retry_at=first_seen + config.wait_limit_s)
        return Eviction(quiet, f"confirmed hang for {now - first_seen:.2f}s, culprit silent: {verdict.reason}")
    return Eviction(verdict.replicas, f"confirmed hang for {now - first_seen:.2f}s: {verdict.reason}")
