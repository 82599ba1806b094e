"""Which accepted connections a listener keeps: pure bookkeeping, no I/O (the real listener drives it).

A connection is *pending* from accept until its first complete frame (the service's hello, where the
job token is checked) and *live* until it is closed. Limits:
- at most `max_pending` pending connections: a new one evicts the oldest pending one, so idle or
  half-sent connections cannot lock out a peer that completes its hello in a round trip;
- at most `max_connections` live connections: at the cap a new one evicts the oldest pending one if
  there is one, else it is refused (every live connection has spoken, so keep them);
- a pending connection's first frame may claim at most `max_hello_bytes` (checked by the connection).
Why evict rather than refuse at the pending cap: refusing would let whoever holds `max_pending` silent
connections lock every real peer out until those time out; evicting the oldest means a flood has to open
`max_pending` connections within a real peer's hello round trip to crowd it out.
A run of accepts that the caps answer by closing a connection (a burst) is reported twice: when it begins
and, with how many it closed, when an accept next fits under the caps (`Admit.log`), never once per connection.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable

_log = logging.getLogger("ftrun.env")


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
    log: str = ""  # what the owner should log now ("" nothing): a burst of closing by the caps began or ended


class Admission:
    """Live and pending connection ids of one listener. Not thread-safe: the owner serializes calls."""

    def __init__(self, limits: ListenLimits) -> None:
        self.limits = limits
        self._pending: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self._live: set[Hashable] = set()
        self.num_refused = 0
        self.num_evicted = 0
        self._burst = 0  # connections the caps closed since the burst began (0: none is going on)

    @property
    def num_live(self) -> int:
        return len(self._live)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def accepted(self, cid: Hashable) -> Admit:
        """A new connection `cid` was accepted: keep it or not, which pending ones to evict, what to log."""
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
            return Admit(False, tuple(evict), f"{len(self._live)} connections, all past their hello: at the cap",
                         self._closing_by_caps("refusing new connections: all "
                                               f"{self.limits.max_connections} live ones are past their hello"))
        self._live.add(cid)
        self._pending[cid] = None
        if evict:
            return Admit(True, tuple(evict), "evicted the oldest pending connection", self._closing_by_caps(
                f"{self.limits.max_pending} connections have not sent their first message: closing the oldest "
                "of them for each new one"))
        ended, self._burst = self._burst, 0
        return Admit(True, (), "under the caps", f"under the caps again; {ended} connections were closed by "
                     "them meanwhile" if ended else "")

    def _closing_by_caps(self, what: str) -> str:
        """Counts one connection closed by the caps; what to log: `what` if a burst begins with it."""
        self._burst += 1
        return what if self._burst == 1 else ""

    def greeted(self, cid: Hashable) -> None:
        """`cid` completed its first frame: no longer pending."""
        self._pending.pop(cid, None)

    def closed(self, cid: Hashable) -> None:
        """`cid` was closed (either side); idempotent."""
        self._pending.pop(cid, None)
        self._live.discard(cid)


def log_admit(addr: str, decision: Admit) -> None:
    """Log what `decision` says to (Admit.log) for listener `addr`: a warning as a burst of closing by the caps
    begins, a line at INFO once it ended. Both Envs' listeners call it."""
    if decision.log:
        closing = decision.evict or not decision.keep
        _log.log(logging.WARNING if closing else logging.INFO, "listener %s: %s", addr, decision.log)
