"""The replica leader's side of the lighthouse protocol.

`LighthouseClient.quorum()` asks for the next quorum and blocks until the lighthouse decides. A
heartbeat task keeps the leader alive in the lighthouse's eyes. If the lighthouse goes away (crash,
restart) the client reconnects and asks again until quorum_timeout_s passes.

Who receives: the task that asked reads its reply off the connection itself (one thread wake-up per
request, not two: no reader task hands the reply over; `ftrun bench overhead`). Between requests the
heartbeat task takes the lighthouse's unasked notices (a participant of the current quorum hung) at
each heartbeat, so a notice reaches `on_peer_hung` at most heartbeat_interval_s after it arrives. A
receive lock makes sure only one task reads at a time.

Ask-ahead (ftrun.replica.ask_ahead): `ask()` sends a quorum request and returns at once; `collect()`
later reads its reply (a reply the heartbeat task reads first is kept for it, not dropped), `discard()`
forgets it. One request is outstanding at a time: `quorum()` and `report_finished()` discard a pending
early request first. Discarding drops the connection: the reconnect's hello makes the lighthouse forget
the pending request, and no late reply to it can be taken for the next request's.
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
        self._pending: dict | None = None  # the early request (ask) whose reply nobody collected yet
        self._ahead_reply: dict | None = None  # its reply, when the heartbeat task read it first

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
        self.discard()
        request = self._request(step, commit_failed, own_failures, fresh, data_addrs)
        if self.telemetry: self.telemetry.quorum_ask(step)
        return self._quorum(request)

    def _request(self, step: int, commit_failed: bool, own_failures: int, fresh: bool,
                 data_addrs: tuple[str, ...]) -> dict:
        return {"type": "quorum", "step": step, "commit_failed": commit_failed, "own_failures": own_failures,
                "fresh": fresh, "last_quorum_id": self.last_quorum_id, "data_addrs": list(data_addrs)}

    def _quorum(self, request: dict) -> Decision:
        step = request["step"]
        deadline = self.env.clock.now() + self.timeouts.quorum_timeout_s
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
            return self._decided(reply)

    def _decided(self, reply: dict) -> Decision:
        decision = self._decision(reply)
        self.last_quorum_id = decision.quorum_id
        if self.telemetry: self.telemetry.quorum_got(decision.max_step, decision.quorum_id)
        return decision

    # -- ask-ahead: the request now, its reply later (ftrun.replica.ask_ahead) --------------------
    @property
    def asked_ahead(self) -> bool:
        """A request sent by `ask` waits to be collected or discarded."""
        return self._pending is not None

    def ask(self, step: int, *, commit_failed: bool = False, own_failures: int = 0, fresh: bool = False,
            data_addrs: tuple[str, ...] = ()) -> bool:
        """Send the quorum request `quorum()` would send, without waiting for the decision: `collect()`
        reads it. Best effort: False (logged) when it could not be sent (nothing pends; the next
        `quorum()` asks again). Raises RuntimeError while an earlier early request pends."""
        if self._pending is not None:
            raise RuntimeError("an early quorum request is pending: collect or discard it first")
        request = self._request(step, commit_failed, own_failures, fresh, data_addrs)
        timeout = self.timeouts.connect_timeout_s
        if not self._receiving.acquire(timeout=timeout):
            log.warning("could not ask ahead for step %d: the receive lock stayed busy", step)
            return False
        try:
            conn = self._connected(timeout)
            self._take_unasked(conn, stale_ok=True)
            conn.send(request, timeout=timeout)
            self._pending, self._ahead_reply = request, None
        except (NetError, QuorumError) as e:
            log.warning("could not ask ahead for step %d (%s); start_step will ask", step, e)
            self._drop()  # the lighthouse may hold the request: the reconnect's hello clears it
            return False
        finally:
            self._receiving.release()
        return True

    def collect(self) -> Decision:
        """The decision for the request `ask` sent, waiting up to quorum_timeout_s from now. A lost
        connection asks again (as `quorum()` does). Raises QuorumTimeout, LighthouseRejected, JobFinished,
        RuntimeError when nothing pends."""
        request = self._pending
        if request is None:
            raise RuntimeError("no early quorum request to collect")
        # Root-cause telemetry: the ask is timed from here, where the step starts waiting for the
        # decision (a leader that asked at its commit and is computing is not waiting in a quorum).
        if self.telemetry: self.telemetry.quorum_ask(request["step"])
        deadline = self.env.clock.now() + self.timeouts.quorum_timeout_s
        try:
            reply = self._read_ahead_reply(deadline)
        except (NetTimeout, EnvTimeout):
            self.discard()
            raise QuorumTimeout(f"no quorum for step {request['step']} within {self.timeouts.quorum_timeout_s}s")
        except NetError as e:
            log.warning("lighthouse connection lost (%s) before the early request's reply; asking again", e)
            self.discard()
            return self._quorum({**request, "last_quorum_id": self.last_quorum_id})
        self._pending = self._ahead_reply = None
        return self._decided(reply)

    def _read_ahead_reply(self, deadline: float) -> dict:
        if not self._receiving.acquire(timeout=max(deadline - self.env.clock.now(), 0.0)):
            raise EnvTimeout("the lighthouse connection's receive lock stayed busy")
        try:
            if self._ahead_reply is not None:
                return self._ahead_reply
            conn = self._conn
            if conn is None or conn.closed:
                raise PeerClosed("the lighthouse connection closed")
            return self._reply(conn, deadline)
        finally:
            self._receiving.release()

    def discard(self) -> None:
        """Forget the early request, if one pends: drop the connection, so the lighthouse forgets the
        request when the next one says hello, and no late reply to it is read as another's."""
        if self._pending is None:
            return
        self._pending = self._ahead_reply = None
        self._drop()

    def report_finished(self, step: int) -> bool:
        """Tell the lighthouse this replica committed the job's final step (`step` steps), so a stale
        replica asking later is told the job finished (rule 0). Waits for the acknowledgement up to
        connect_timeout_s; False (logged) if it did not come: the job's outcome does not depend on it."""
        self.discard()
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
            return self._reply(conn, deadline)
        finally:
            self._receiving.release()

    def _reply(self, conn: Connection, deadline: float) -> dict:
        """The next message that is not a notice (notices go to their callback). The caller holds the
        receive lock. Raises NetError (NetTimeout at the deadline)."""
        while True:
            msg = conn.recv(timeout=max(deadline - self.env.clock.now(), 1e-3))
            if msg.get("type") != "hung":
                return msg
            self._notice(msg)

    def _take_unasked(self, conn: Connection, *, stale_ok: bool) -> None:
        """Read what has already arrived, without waiting: notices go to their callback, anything else
        is a reply nobody waits for any more (dropped), except the early request's reply, kept for
        `collect`. The caller holds the receive lock."""
        while True:
            try:
                msg = conn.recv(timeout=0)
            except NetTimeout:
                return
            if msg.get("type") == "hung":
                self._notice(msg)
            elif self._pending is not None and self._ahead_reply is None:
                self._ahead_reply = msg  # the early request's reply: kept for collect()
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

