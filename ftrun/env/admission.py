"""Which accepted connections a listener keeps: pure bookkeeping, no I/O (the real listener drives it).

A connection is *pending* from accept until its first complete frame (the service's hello, where the
job token is checked) and *live* until it is closed. Limits:
- at most `max_pending` pending connections: a new one evicts the oldest pending one, so idle or
  half-sent connections cannot lock out a peer that completes its hello in a round trip;
- at most `max_connections` live connections: at the cap a new one evicts the oldest pending one if
  there is one, else it is refused (every live connection has spoken, so keep them);
- a pending connection's first frame may claim at most `max_hello_bytes` (checked by the connection).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable


@dataclass(frozen=True, kw_only=True)
class ListenLimits:
    max_connections: int = 1024  # live accepted connections per listener
    max_pending: int = 64  # accepted connections that have not completed their first frame
    max_hello_bytes: int = 64 << 10  # largest first frame a pending connection may announce

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_pending", "max_hello_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ListenLimits.{name} must be a positive int, got {value!r}")
        if self.max_pending > self.max_connections:
            raise ValueError(f"ListenLimits.max_pending ({self.max_pending}) must not exceed "
                             f"max_connections ({self.max_connections})")


@dataclass(frozen=True)
class Admit:
    keep: bool  # False: close the new connection at once
    evict: tuple  # ids of older pending connections to close
    reason: str


class Admission:
    """Live and pending connection ids of one listener. Not thread-safe: the owner serializes calls."""

    def __init__(self, limits: ListenLimits) -> None:
        self.limits = limits
        self._pending: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self._live: set[Hashable] = set()
        self.num_refused = 0
        self.num_evicted = 0

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def accepted(self, cid: Hashable) -> Admit:
        """A new connection `cid` was accepted: keep it or not, and which pending ones to evict."""
        evict: list[Hashable] = []
        full_pending = len(self._pending) >= self.limits.max_pending
        full_live = len(self._live) >= self.limits.max_connections
        if (full_pending or full_live) and self._pending:
            oldest = next(iter(self._pending))
            self.closed(oldest)
            evict.append(oldest)
            self.num_evicted += 1
        if len(self._live) >= self.limits.max_connections:
            self.num_refused += 1
            return Admit(False, tuple(evict), f"{len(self._live)} connections, all past their hello: at the cap")
        self._live.add(cid)
        self._pending[cid] = None
        reason = "evicted the oldest pending connection" if evict else "under the caps"
        return Admit(True, tuple(evict), reason)

    def greeted(self, cid: Hashable) -> None:
        """`cid` completed its first frame: no longer pending."""
        self._pending.pop(cid, None)

    def closed(self, cid: Hashable) -> None:
        """`cid` was closed (either side); idempotent."""
        self._pending.pop(cid, None)
        self._live.discard(cid)
