"""The replica leader's side of the lighthouse protocol.

`LighthouseClient.quorum()` asks for the next quorum and blocks until the lighthouse decides. A
heartbeat task keeps the leader alive in the lighthouse's eyes. If the lighthouse goes away (crash,
restart) the client reconnects and asks again until quorum_timeout_s passes.

Who receives: the task that asked reads its reply off the connection itself (one thread wake-up per
request, not two: no reader task hands the reply over; `ftrun bench overhead`). Between requests the
heartbeat task takes the lighthouse's unasked notices (a participant of the current quorum hung) at
each heartbeat, so a notice reaches `on_peer_hung` at most heartbeat_interval_s after it arrives. A
receive lock makes sure only one task reads at a time.
"""

from __future__ import annotations

import logging

from typing import Callable

from ftrun.config import Timeouts
from ftrun.env.base import Connection, Env, EnvTimeout, NetError, NetTimeout, PeerClosed, Task
from ftrun.quorum import protocol
from ftrun.quorum.decide import Decision

log = logging.getLogger("ftrun.quorum")


class QuorumError(Exception):
    """Base of the quorum client's errors."""


class QuorumTimeout(QuorumError):
    """No quorum decision within quorum_timeout_s."""


class LighthouseRejected(QuorumError):
    """The lighthouse refused a message; the text is its reason (wrong token, malformed request...)."""


class JobFinished(QuorumError):
    """The job was reported finished at a later step than this replica's (ftrun.quorum.decide rule 0):
    the replica is stale and exits (status 0) instead of training."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


PeerHungFn = Callable[[str, int], None]  # (replica_id, quorum_id): a participant of that quorum hung


class LighthouseClient:
    """Threading: `quorum` and `report_finished` from one task at a time. The lighthouse's `hung` notices
    go to `on_peer_hung` (called on the heartbeat task, or on the asking one: it must not block), so a
    replica stuck inside an all-reduce with a hung peer hears of it within the lighthouse's heartbeat
    timeout (plus at most one heartbeat interval) instead of its own FTAR timeout."""

    telemetry = None  # this rank's ftrun.diagnose.telemetry.Recorder, when root-cause telemetry is on
    # Whether the whole replica is alive (ftrun.replica.rank_watch); while it says no, no heartbeats go
    # out, so the lighthouse declares the replica hung. None: the leader's own liveness is the replica's.
    healthy: Callable[[], bool] | None = None

    def __init__(self, *, env: Env, addr: str, token: str, replica_id: str, timeouts: Timeouts,
                 on_peer_hung: PeerHungFn | None = None) -> None:
        self.env, self.addr, self.replica_id, self.timeouts = env, addr, replica_id, timeouts
        self.on_peer_hung = on_peer_hung
        self._token = token
        self._conn: Connection | None = None
        self._receiving = env.lock()  # held by the one task reading the connection
        self._tasks: list[Task] = []
        self.last_quorum_id = 0

    def connect(self) -> None:
        """Register with the lighthouse now (it counts this replica as live from here on), rather than at
        the first quorum request. Raises ConnectError or LighthouseRejected."""
        self._connected(self.timeouts.connect_timeout_s)

    def quorum(self, step: int, *, commit_failed: bool = False, own_failures: int = 0, fresh: bool = False,
               data_addrs: tuple[str, ...] = ()) -> Decision:
        """Ask for the quorum of `step`; reconnects across lighthouse restarts until the timeout.
        own_failures: failed commits by this replica's own fault since its last commit (the lighthouse
        may leave a replica that keeps failing out of this quorum: ftrun.quorum.decide rule 7).
        fresh: this incarnation's first quorum, its state resumed from the job's durable state (only
        then may a full restart rewind the job below the highest step handed out: rule 8).
        Raises QuorumTimeout, LighthouseRejected (a refusal, e.g. a step below the job's: the text
        says why)."""
        request = {
            "type": "quorum", "step": step, "commit_failed": commit_failed, "own_failures": own_failures,
            "fresh": fresh, "last_quorum_id": self.last_quorum_id, "data_addrs": list(data_addrs),
        }
        deadline = self.env.clock.now() + self.timeouts.quorum_timeout_s
        if self.telemetry: self.telemetry.quorum_ask(step)
        while True:
            remaining = deadline - self.env.clock.now()
            if remaining <= 0:
                raise QuorumTimeout(f"no quorum for step {step} within {self.timeouts.quorum_timeout_s}s")
            try:
                conn = self._connected(remaining)
                reply = self._ask(conn, request, deadline)
            except (NetTimeout, EnvTimeout):
                continue  # the deadline check above raises QuorumTimeout
            except NetError as e:
                log.warning("lighthouse connection lost (%s); reconnecting", e)
                self._drop()
                self.env.clock.sleep(min(0.05, max(deadline - self.env.clock.now(), 0)))
                continue
            decision = self._decision(reply)
            self.last_quorum_id = decision.quorum_id
            if self.telemetry: self.telemetry.quorum_got(decision.max_step, decision.quorum_id)
            return decision

    def report_finished(self, step: int) -> bool:
        """Tell the lighthouse this replica committed the job's final step (`step` steps), so a stale
        replica asking later is told the job finished (rule 0). Waits for the acknowledgement up to
        connect_timeout_s; False (logged) if it did not come: the job's outcome does not depend on it."""
        timeout = self.timeouts.connect_timeout_s
        try:
            conn = self._connected(timeout)
            reply = self._ask(conn, {"type": "finished", "step": step}, self.env.clock.now() + timeout)
        except (NetError, EnvTimeout, QuorumError) as e:
            log.warning("could not report the job finished at step %d to the lighthouse: %s", step, e)
            return False
        if not reply or reply.get("type") != "finished_ack":
            log.warning("the lighthouse answered %r to the job's finished report", reply)
            return False
        return True

    def _decision(self, reply: dict) -> Decision:
        if reply.get("type") == "job_finished":
            step = reply.get("step")
            raise JobFinished(str(reply.get("error")), step if isinstance(step, int) else -1)
        if reply.get("type") == "error":
            raise LighthouseRejected(str(reply.get("error")))
        if reply.get("type") != "quorum":
            raise LighthouseRejected(f"unexpected reply {reply.get('type')!r} to a quorum request")
        return protocol.decode_decision(reply)

    def _ask(self, conn: Connection, request: dict, deadline: float) -> dict:
        """Send `request` and read its reply on this task (notices that come first go to their callback).
        Raises NetError (NetTimeout at the deadline), EnvTimeout if the receive lock stays busy."""
        if not self._receiving.acquire(timeout=max(deadline - self.env.clock.now(), 0.0)):
            raise EnvTimeout("the lighthouse connection's receive lock stayed busy")
        try:
            self._take_unasked(conn, stale_ok=True)  # a reply that came after an earlier call gave up
            conn.send(request, timeout=max(deadline - self.env.clock.now(), 1e-3))
            while True:
                msg = conn.recv(timeout=max(deadline - self.env.clock.now(), 1e-3))
                if msg.get("type") != "hung":
                    return msg
                self._notice(msg)
        finally:
            self._receiving.release()

    def _take_unasked(self, conn: Connection, *, stale_ok: bool) -> None:
        """Read what has already arrived, without waiting: notices go to their callback, anything else
        is a reply nobody waits for any more (dropped). The caller holds the receive lock."""
        while True:
            try:
                msg = conn.recv(timeout=0)
            except NetTimeout:
                return
            if msg.get("type") == "hung":
                self._notice(msg)
            elif not stale_ok:
                log.warning("dropping the lighthouse's unasked %r message", msg.get("type"))

    def _notice(self, msg: dict) -> None:
        if self.on_peer_hung is None:
            return
        try:
            self.on_peer_hung(str(msg.get("replica_id")), int(msg.get("quorum_id", -1)))
        except Exception as e:  # the notice is an optimisation; the FTAR timeout still holds
            log.warning("handling the lighthouse's notice %s failed: %r", msg, e)

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
        self._tasks = [t for t in self._tasks if t.join(0) is False]  # forget finished ones
        self._tasks.append(self.env.spawn(self._heartbeat_loop, conn, name=f"heartbeat-{self.replica_id}"))
        return conn

    def _heartbeat_loop(self, conn: Connection) -> None:
        """A heartbeat per interval, and the notices that arrived since the last one (unless a request
        is being answered: its task reads them). A connection that is gone ends the loop; the next
        request reconnects."""
        while not conn.closed:
            try:
                if self._replica_healthy():
                    conn.send({"type": "heartbeat"}, timeout=self.timeouts.heartbeat_timeout_s)
                if self._receiving.acquire(timeout=0):
                    try:
                        self._take_unasked(conn, stale_ok=False)
                    finally:
                        self._receiving.release()
            except (NetError, PeerClosed):
                return
            self.env.clock.sleep(self.timeouts.heartbeat_interval_s)

    def _replica_healthy(self) -> bool:
        if self.healthy is None:
            return True
        try:
            return bool(self.healthy())
        except Exception as e:  # the watch is an optimisation: never let it stop the heartbeats
            log.warning("checking the replica's ranks failed: %r", e)
            return True

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def close(self) -> None:
        self._drop()
        for task in self._tasks:
            task.join(timeout=1.0)
        self._tasks = []

