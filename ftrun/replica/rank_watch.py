"""Intra-replica rank liveness: the leader's watch over the other ranks of its replica.

A rank frozen (SIGSTOP) or wedged while its leader still runs would go unnoticed: the leader keeps
heartbeating, so the lighthouse keeps the replica, and the peers' ranks wait in their rings through the
frozen rank for the FTAR timeout. The leader therefore pings every other rank of its replica over that
rank's FTAR listener (ftrun.ftar.ring.ping_request; the rank's greeter task answers) and stops
heartbeating to the lighthouse while a rank has not answered for `timeout_s` (the lighthouse's
heartbeat timeout): the lighthouse then declares the replica hung and tells its peers, which abort on
every rank (ftrun.train.exchange). A rank that answers again makes the replica healthy again; one whose
connection closed (it died) keeps it unhealthy: the replica's own collectives fail on it anyway.

`RankStatus` is the pure part (what the answers so far say); `RankWatch` drives one task per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ftrun.env.base import Env, NetError, NetTimeout
from ftrun.ftar.ring import ping_request

log = logging.getLogger("ftrun.replica")


@dataclass
class RankStatus:
    """Per rank address: "ok", "late" (a ping unanswered for timeout_s) or "gone" (connection lost). Pure."""

    states: dict[str, str] = field(default_factory=dict)

    def answered(self, addr: str) -> None:
        if self.states.get(addr) != "gone":
            self.states[addr] = "ok"

    def late(self, addr: str) -> None:
        if self.states.get(addr) != "gone":
            self.states[addr] = "late"

    def gone(self, addr: str) -> None:
        self.states[addr] = "gone"

    def unhealthy(self) -> list[str]:
        return sorted(a for a, s in self.states.items() if s != "ok")


class RankWatch:
    """Started lazily by `healthy(addrs)` once the leader knows its ranks' FTAR addresses (after the
    check-in); `own` is the leader's own address (not pinged). Threading: `healthy` from any task."""

    def __init__(self, *, env: Env, token: str, own: str, interval_s: float, timeout_s: float) -> None:
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"RankWatch needs 0 < interval_s < timeout_s, got {interval_s}, {timeout_s}")
        self.env, self._token, self._own = env, token, own
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.status = RankStatus()
        self._started = False
        self._closed = False
        self._conns: list = []
        self._tasks: list = []

    def healthy(self, addrs: tuple[str, ...] = ()) -> bool:
        """False while some rank of the replica does not answer; starts the watch on the first call with
        addresses."""
        if not self._started and addrs and not self._closed:
            self._started = True
            for addr in addrs:
                if addr and addr != self._own:
                    self.status.answered(addr)  # until shown otherwise
                    self._tasks.append(self.env.spawn(self._watch, addr, name="rank-watch"))
        bad = self.status.unhealthy()
        return not bad

    def _watch(self, addr: str) -> None:
        try:
            conn = self.env.net.connect(addr, timeout=self.timeout_s)
        except NetError:
            self._mark_gone(addr, "unreachable")
            return
        self._conns.append(conn)
        n = 0
        try:
            while not self._closed:
                n += 1
                conn.send(ping_request(self._token, n), timeout=self.timeout_s)
                while True:
                    try:
                        reply = conn.recv(timeout=self.timeout_s)
                    except NetTimeout:
                        if self.status.states.get(addr) == "ok":
                            log.warning("rank at %s has not answered for %.1fs: the replica stops heartbeating",
                                        addr, self.timeout_s)
                        self.status.late(addr)
                        continue
                    if reply.get("pong") == n:
                        break
                self.status.answered(addr)
                self.env.clock.sleep(self.interval_s)
        except NetError:
            if not self._closed:
                self._mark_gone(addr, "closed its connection")

    def _mark_gone(self, addr: str, why: str) -> None:
        log.warning("rank at %s %s: the replica stops heartbeating", addr, why)
        self.status.gone(addr)

    def close(self) -> None:
        self._closed = True
        for conn in list(self._conns):
            conn.close()
        for task in self._tasks:
            task.join(timeout=1.0)
