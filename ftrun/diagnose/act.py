"""Acting on a verdict: whether to evict a replica now instead of waiting out the FTAR timeout (pure).

`decide_eviction(now, verdict, first_seen, num_live_replicas, config)`: a hang that names culprit ranks
evicts their replicas once the same verdict has held for `confirm_s` (two analyses apart, so one racy
snapshot cannot evict anyone). Never evicted: a slow rank, host or link whose lag stays under the wait
limit (the step still completes); a candidate pair (sender and receiver cannot be told apart, the
timeout decides); a verdict naming more than `max_fraction` of the live replicas (that is a partition
or a fault on the observer's side, not a culprit). The driver remembers when a verdict was first seen.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    return a is not None and b is not None and (a.kind, a.ranks) == (b.kind, b.ranks)


def decide_eviction(now: float, verdict: Verdict, first_seen: float | None, num_live_replicas: int,
                    config: EvictionConfig = EvictionConfig()) -> Eviction:
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
    return Eviction(verdict.replicas, f"confirmed hang for {now - first_seen:.2f}s: {verdict.reason}")
