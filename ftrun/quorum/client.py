"""The replica leader's side of the lighthouse protocol.

`LighthouseClient.quorum()` asks for the next quorum and blocks until the lighthouse decides. A
heartbeat task keeps the leader alive in the lighthouse's eyes. If the lighthouse goes away (crash,
restart) the client reconnects and asks again until quorum_timeout_s passes.
"""

from __future__ import annotations

import logging

from ftrun.config import Timeouts
from ftrun.env.base import Connection, Env, NetError, NetTimeout, PeerClosed, Task
from ftrun.quorum import protocol
from ftrun.quorum.decide import Decision

log = logging.getLogger("ftrun.quorum")


class QuorumError(Exception):
    """Base of the quorum client's errors."""


class QuorumTimeout(QuorumError):
    """No quorum decision within quorum_timeout_s."""


class LighthouseRejected(QuorumError):
    """The lighthouse refused a message; the text is its reason (wrong token, malformed request...)."""


class LighthouseClient:
    def __init__(self, *, env: Env, addr: str, token: str, replica_id: str, timeouts: Timeouts) -> None:
        self.env, self.addr, self.replica_id, self.timeouts = env, addr, replica_id, timeouts
        self._token = token
        self._conn: Connection | None = None
        self._heartbeat: Task | None = None
        self.last_quorum_id = 0

    def connect(self) -> None:
        """Register with the lighthouse now (it counts this replica as live from here on), rather than at
        the first quorum request. Raises ConnectError or LighthouseRejected."""
        self._connected(self.timeouts.connect_timeout_s)

    def quorum(self, step: int, *, commit_failed: bool = False, data_addrs: tuple[str, ...] = ()) -> Decision:
        """Ask for the quorum of `step`; reconnects across lighthouse restarts until the timeout."""
        request = {
            "type": "quorum", "step": step, "commit_failed": commit_failed,
            "last_quorum_id": self.last_quorum_id, "data_addrs": list(data_addrs),
        }
        deadline = self.env.clock.now() + self.timeouts.quorum_timeout_s
        while True:
            remaining = deadline - self.env.clock.now()
            if remaining <= 0:
                raise QuorumTimeout(f"no quorum for step {step} within {self.timeouts.quorum_timeout_s}s")
            try:
                conn = self._connected(remaining)
                conn.send(request, timeout=remaining)
                reply = conn.recv(timeout=max(deadline - self.env.clock.now(), 1e-3))
            except NetTimeout:
                continue  # the deadline check above raises QuorumTimeout
            except NetError as e:
                log.warning("lighthouse connection lost (%s); reconnecting", e)
                self._drop()
                self.env.clock.sleep(min(0.05, max(deadline - self.env.clock.now(), 0)))
                continue
            decision = self._decision(reply)
            self.last_quorum_id = decision.quorum_id
            return decision

    def _decision(self, reply: dict) -> Decision:
        if reply.get("type") == "error":
            raise LighthouseRejected(str(reply.get("error")))
        if reply.get("type") != "quorum":
            raise LighthouseRejected(f"unexpected reply {reply.get('type')!r} to a quorum request")
        return protocol.decode_decision(reply)

    def _connected(self, timeout: float) -> Connection:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        conn = self.env.net.connect(self.addr, timeout=min(timeout, self.timeouts.connect_timeout_s))
        conn.send({"type": "hello", "token": self._token, "replica_id": self.replica_id})
        welcome = conn.recv(timeout=min(timeout, self.timeouts.connect_timeout_s))
        if welcome.get("type") != "welcome":
            conn.close()
            raise LighthouseRejected(str(welcome.get("error", welcome)))
        self.last_quorum_id = max(self.last_quorum_id, int(welcome.get("quorum_id", 0)))
        self._conn = conn
        self._heartbeat = self.env.spawn(self._heartbeat_loop, conn, name=f"heartbeat-{self.replica_id}")
        return conn

    def _heartbeat_loop(self, conn: Connection) -> None:
        while not conn.closed:
            try:
                conn.send({"type": "heartbeat"}, timeout=self.timeouts.heartbeat_timeout_s)
            except (NetError, PeerClosed):
                return
            self.env.clock.sleep(self.timeouts.heartbeat_interval_s)

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._drop()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=1.0)
