"""The analysis' data: its input (`Snapshot` of the collected summaries, `Layout` of who each rank is),
its `AnalysisConfig` and its output (`Verdict` and the verdict kinds). Kept apart from the algorithm
modules (analysis, slow, tree) so they share these types without importing one another in a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

# verdict kinds
HANG, CANDIDATES, SLOW_HOST, SLOW_RANK, SLOW_LINK, NO_HANG = (
    "hang", "candidates", "slow_host", "slow_rank", "slow_link", "no_hang")



@dataclass(frozen=True, kw_only=True)
class AnalysisConfig:
    stall_s: float = 1.0  # a running collective that has not moved for this long is blocked
    # ... or for this long when one of its members did not answer the collector (None: stall_s): the
    # silence (a pull unanswered for the collector's pull timeout) is evidence already
    silent_stall_s: float | None = None
    slow_lag_frac: float = 0.10  # a rank whose median entry lag exceeds this fraction of the step is slow
    slow_min_ops: int = 4  # ... over at least this many recent all-reduces
    slow_min_lag_s: float = 0.1  # ... and by at least this much (scheduling noise on short steps is not a fault)
    link_factor: float = 3.0  # a link whose transfers take this multiple of comparable links' median is slow

    @property
    def silent_stall(self) -> float:
        return self.stall_s if self.silent_stall_s is None else min(self.silent_stall_s, self.stall_s)

    def __post_init__(self) -> None:
        if (self.stall_s <= 0 or not 0 < self.slow_lag_frac < 1 or self.slow_min_ops < 2 or self.link_factor <= 1
                or self.slow_min_lag_s < 0 or (self.silent_stall_s is not None and self.silent_stall_s <= 0)):
            raise ValueError(f"AnalysisConfig: need stall_s > 0, 0 < slow_lag_frac < 1, slow_min_ops >= 2, "
                             f"link_factor > 1, slow_min_lag_s >= 0 and silent_stall_s > 0, got {self}")


@dataclass(frozen=True)
class Layout:
    """Who each global rank index is: its replica, its group rank (its FTAR ring), its host, and its
    replica's position in the current quorum's ring (-1: not a participant)."""

    replica: np.ndarray
    group: np.ndarray
    host: np.ndarray
    ring_pos: np.ndarray
    host_names: tuple[str, ...] = ()
    ring_size: int = 0  # the current ring's size when known (positions nobody holds are holes); 0: max ring_pos + 1

    def __post_init__(self) -> None:
        n = len(self.replica)
        if any(len(a) != n for a in (self.group, self.host, self.ring_pos)):
            raise ValueError("Layout: replica, group, host and ring_pos need one entry per rank")

    @cached_property
    def ring_table(self) -> np.ndarray:
        """table[g, pos] = global rank of group rank g in the replica at ring position pos, or -1.
        Computed once per layout (a live job's membership), like `num_groups`."""
        part = np.flatnonzero(self.ring_pos >= 0)
        width = max(int(self.ring_pos.max()) + 1 if part.size else 0, self.ring_size)
        table = np.full((self.num_groups, width), -1, np.int64)
        table[self.group[part], self.ring_pos[part]] = part
        return table

    @cached_property
    def ring_full(self) -> bool:
        """Every ring position of every group is held (no hole in the ring table)."""
        return bool((self.ring_table >= 0).all())

    @cached_property
    def num_groups(self) -> int:
        return int(self.group.max()) + 1 if len(self.group) else 0

    def host_name(self, h: int) -> str:
        return self.host_names[h] if h < len(self.host_names) else f"host{h}"

    def rank_name(self, r: int) -> str:
        return f"rank {int(self.group[r])} of replica {int(self.replica[r])} ({self.host_name(int(self.host[r]))})"


@dataclass(frozen=True)
class Snapshot:
    """What the collector gathered: `summary[r]`/`hist[r]` are valid where `answered[r]`."""

    now: float
    answered: np.ndarray
    summary: np.ndarray
    hist: np.ndarray


@dataclass(frozen=True)
class Verdict:
    kind: str
    reason: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[int, ...] = ()
    replicas: tuple[int, ...] = ()
    collectives: tuple[str, ...] = ()  # the leaves of the collective wait-for graph
    lag_s: float = 0.0  # slow verdicts: the median lag (or extra wire time per all-reduce) of the worst rank
    edges: tuple[tuple[str, str], ...] = field(default=(), compare=False)  # waiter -> waited on (for display)

    @property
    def is_hang(self) -> bool:
        return self.kind in (HANG, CANDIDATES)
