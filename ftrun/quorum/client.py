"""The replica leader's side of the lighthouse protocol.

`LighthouseClient.quorum()` asks for the next quorum and blocks until the lighthouse decides. A
heartbeat task keeps the leader alive in the lighthouse's eyes; a reader task takes the lighthouse's
replies and its notices that a participant of the current quorum hung. If the lighthouse goes away (crash,
restart) the client reconnects and asks again until quorum_timeout_s passes.
"""

from __future__ import annotations

import logging

from typing import Callable

from ftrun.config import Timeouts
from ftrun.env.base import Connection, Env, EnvTimeout, NetError, NetTimeout, PeerClosed, Queue, Task
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
    """Threading: `quorum` from one task at a time. A reader task per connection routes the lighthouse's
    replies to `quorum` and its `hung` notices to `on_peer_hung` (called on the reader task: it must
    not block), so a replica stuck inside an all-reduce with a hung peer hears of it within the
    lighthouse's heartbeat timeout instead of its own FTAR timeout."""

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
        self._replies: Queue | None = None
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
                conn, replies = self._connected(remaining)
                _drain(replies)  # a reply that came after an earlier call gave up
                conn.send(request, timeout=remaining)
                reply = replies.get(timeout=max(deadline - self.env.clock.now(), 1e-3))
                if reply is None:
                    raise PeerClosed("the lighthouse closed the connection")
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
            conn, replies = self._connected(timeout)
            _drain(replies)
            conn.send({"type": "finished", "step": step}, timeout=timeout)
            reply = replies.get(timeout=timeout)
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

    def _connected(self, timeout: float) -> tuple[Connection, Queue]:
        if self._conn is not None and not self._conn.closed and self._replies is not None:
            return self._conn, self._replies
        conn = self.env.net.connect(self.addr, timeout=min(timeout, self.timeouts.connect_timeout_s))
        conn.send({"type": "hello", "token": self._token, "replica_id": self.replica_id})
        welcome = conn.recv(timeout=min(timeout, self.timeouts.connect_timeout_s))
        if welcome.get("type") != "welcome":
            conn.close()
            raise LighthouseRejected(str(welcome.get("error", welcome)))
        self.last_quorum_id = max(self.last_quorum_id, int(welcome.get("quorum_id", 0)))
        self._conn, self._replies = conn, self.env.queue()
        self._tasks = [t for t in self._tasks if t.join(0) is False]  # forget finished ones
        self._tasks += [self.env.spawn(self._heartbeat_loop, conn, name=f"heartbeat-{self.replica_id}"),
                        self.env.spawn(self._read_loop, conn, self._replies, name=f"lighthouse-{self.replica_id}")]
        return conn, self._replies

    def _read_loop(self, conn: Connection, replies: Queue) -> None:
        """Replies to `replies`; None once the connection is gone. Notices go to their callback."""
        while True:
            try:
                msg = conn.recv(timeout=self.timeouts.heartbeat_timeout_s)
            except NetTimeout:
                continue  # the lighthouse speaks only to answer or to warn; silence is fine
            except NetError:
                replies.put(None)
                return
            if msg.get("type") != "hung":
                replies.put(msg)
            elif self.on_peer_hung is not None:
                try:
                    self.on_peer_hung(str(msg.get("replica_id")), int(msg.get("quorum_id", -1)))
                except Exception as e:  # the notice is an optimisation; the FTAR timeout still holds
                    log.warning("handling the lighthouse's notice %s failed: %r", msg, e)

    def _heartbeat_loop(self, conn: Connection) -> None:
        while not conn.closed:
            try:
                if self._replica_healthy():
                    conn.send({"type": "heartbeat"}, timeout=self.timeouts.heartbeat_timeout_s)
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
        self._conn, self._replies = None, None

    def close(self) -> None:
        self._drop()
        for task in self._tasks:
            task.join(timeout=1.0)
        self._tasks = []


def _drain(queue: Queue) -> None:
    while queue.qsize():
        queue.get(timeout=0)
