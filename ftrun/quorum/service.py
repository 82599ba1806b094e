"""The lighthouse service: one event loop around the pure `decide`.

Tasks:
- accept: takes connections and starts a reader per connection.
- reader (one per replica leader): checks the hello and token, then turns every frame into an event.
  A dropped connection becomes a `lost` event at once (failure detection is pushed, not polled); a
  connection silent for heartbeat_timeout_s becomes a `hung` event.
- main: the only task that touches state. It applies events, calls `decide`, hands a formed quorum to
  its participants and persists (quorum_id, participants) atomically, so `kill -9` and a restart keep
  quorum ids monotonic and the job alive.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from ftrun.config import LighthouseConfig
from ftrun.env.base import Connection, Env, EnvTimeout, NetError, NetTimeout, PeerClosed
from ftrun.quorum import protocol
from ftrun.quorum.decide import (Decision, LighthouseState, Member, QuorumRequest, apply, decide, expect_previous,
                                 live_members)
from ftrun.storage import Storage

log = logging.getLogger("ftrun.quorum")
STATE_KEY = "lighthouse_state.json"


class LighthouseStateError(ValueError):
    """The persisted lighthouse state cannot be read."""


@dataclass(frozen=True)
class _Event:
    kind: str  # hello | heard | ask | lost | hung | stop
    replica_id: str = ""
    conn: Connection | None = None
    msg: Any = None


def load_state(storage: Storage | None) -> LighthouseState:
    raw = storage.read(STATE_KEY) if storage else None
    if raw is None:
        return LighthouseState()
    try:
        doc = json.loads(raw)
        quorum_id, participants = doc["quorum_id"], doc["participants"]
        if not isinstance(quorum_id, int) or quorum_id < 0 or not all(isinstance(p, str) for p in participants):
            raise ValueError(f"bad field types in {doc!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise LighthouseStateError(f"lighthouse state {STATE_KEY!r} is unreadable: {e}") from e
    return LighthouseState(quorum_id=quorum_id, prev_participants=tuple(participants))


class Lighthouse:
    """Quorum service for one job. `start()` returns the address replicas connect to."""

    def __init__(
        self, *, env: Env, config: LighthouseConfig, token: str,
        storage: Storage | None = None, bind: str = "127.0.0.1:0",
    ) -> None:
        self.env, self.config, self._token, self._storage, self._bind = env, config, token, storage, bind
        self._events = env.queue()
        self._state = expect_previous(load_state(storage), env.clock.now())
        self._requests: dict[str, QuorumRequest] = {}
        self._conns: dict[str, Connection] = {}
        self._last_decision: Decision | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=10_000)  # changes, for reports and /status
        self.addr = ""
        self._tasks: list = []
        self._pending_view: tuple[str, ...] = ()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> str:
        self._listener = self.env.net.listen(self._bind)
        self.addr = self._listener.addr
        self._tasks = [
            self.env.spawn(self._accept_loop, name="lighthouse-accept"),
            self.env.spawn(self._main_loop, name="lighthouse-main"),
        ]
        log.info("lighthouse at %s, quorum_id=%d", self.addr, self._state.quorum_id)
        return self.addr

    def stop(self) -> None:
        self._events.put(_Event("stop"))
        self._listener.close()
        for t in self._tasks:
            t.join(timeout=5.0)
        for conn in list(self._conns.values()):
            conn.close()

    # -- connection tasks ----------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except (PeerClosed, NetError):
                return
            self.env.spawn(self._reader, conn, name="lighthouse-reader")

    def _reader(self, conn: Connection) -> None:
        timeouts = self.config.timeouts
        try:
            token, replica_id = protocol.parse_hello(conn.recv(timeout=timeouts.connect_timeout_s))
            if not hmac.compare_digest(token.encode(), self._token.encode()):
                raise protocol.BadRequest("wrong job token")
        except (protocol.BadRequest, NetError) as e:
            self._reject(conn, str(e))
            return
        self._events.put(_Event("hello", replica_id, conn))
        while True:
            try:
                msg = conn.recv(timeout=timeouts.heartbeat_timeout_s)
            except NetTimeout:
                self._events.put(_Event("hung", replica_id, conn))
                conn.close()
                return
            except NetError:
                self._events.put(_Event("lost", replica_id, conn))
                return
            kind = msg.get("type")
            if kind in ("heartbeat", "quorum"):
                self._events.put(_Event("heard" if kind == "heartbeat" else "ask", replica_id, conn, msg))
            else:
                self._reply(conn, {"type": "error", "error": f"unknown message type {kind!r}"})

    def _reject(self, conn: Connection, why: str) -> None:
        log.warning("rejecting connection from %s: %s", conn.peer_addr, why)
        self._reply(conn, {"type": "error", "error": why})
        conn.close()

    def _reply(self, conn: Connection, msg: dict) -> None:
        try:
            conn.send(msg, timeout=self.config.timeouts.connect_timeout_s)
        except NetError:
            pass  # its reader sees the loss and reports it

    # -- the one task that owns state ----------------------------------------------------------
    def _main_loop(self) -> None:
        while True:
            try:
                ev = self._events.get(timeout=self._wait_time())
            except EnvTimeout:
                ev = None
            if ev is not None and ev.kind == "stop":
                return
            if ev is not None:
                self._apply_event(ev)
            self._maybe_form()
            self._pending_view = tuple(sorted(self._requests))  # what status() may read concurrently

    def _wait_time(self) -> float:
        hb = self.config.timeouts.heartbeat_timeout_s
        retry = self._last_decision.retry_at if self._last_decision and not self._last_decision.ready else None
        wake = [retry] if retry is not None else []
        wake += [m.last_heard + hb for m in self._state.members.values() if m.connected or m.expected]
        return max(min(wake) - self.env.clock.now(), 0.001) if wake else 1.0

    def _apply_event(self, ev: _Event) -> None:
        now, rid = self.env.clock.now(), ev.replica_id
        if ev.kind == "hello":
            old = self._conns.get(rid)
            if old is not None and old is not ev.conn:
                old.close()  # a restarted replica replaces its previous incarnation
            self._conns[rid] = ev.conn
            self._requests.pop(rid, None)
            self._set_member(Member(rid, now, True))
            self._record("member_joined", replica_id=rid)
            self._reply(ev.conn, {"type": "welcome", "quorum_id": self._state.quorum_id})
            return
        if self._conns.get(rid) is not ev.conn:
            return  # an event from a replaced incarnation
        if ev.kind in ("lost", "hung"):
            self._conns.pop(rid, None)
            self._requests.pop(rid, None)
            self._set_member(Member(rid, now, False))
            self._record("member_lost", replica_id=rid, why=ev.kind)
            log.warning("replica %s %s", rid, "disconnected" if ev.kind == "lost" else "hung (no heartbeat)")
            return
        self._set_member(Member(rid, now, True))
        if ev.kind == "ask":
            self._accept_request(rid, ev.conn, ev.msg, now)

    def _accept_request(self, rid: str, conn: Connection, msg: dict, now: float) -> None:
        try:
            step, commit_failed, last_quorum_id, addrs = protocol.parse_quorum_request(msg)
        except protocol.BadRequest as e:
            self._reply(conn, {"type": "error", "error": str(e)})
            return
        if last_quorum_id > self._state.quorum_id:
            # The replicas have seen a higher id than ours (state lost): adopt it to stay monotonic.
            log.warning("adopting quorum_id %d reported by %s (had %d)", last_quorum_id, rid, self._state.quorum_id)
            self._state = replace(self._state, quorum_id=last_quorum_id)
        self._requests[rid] = QuorumRequest(rid, step, now, commit_failed, addrs)

    def _set_member(self, m: Member) -> None:
        self._state = replace(self._state, members={**self._state.members, m.replica_id: m})

    def _maybe_form(self) -> None:
        if not self._requests:
            return
        d = decide(self.env.clock.now(), self._state, self._requests, self.config)
        if d.reason != (self._last_decision.reason if self._last_decision else None):
            log.info("quorum: %s", d.reason)
        self._last_decision = d
        if not d.ready:
            return
        self._state = apply(self._state, d)
        self._persist()
        self._record("quorum", quorum_id=d.quorum_id, participants=list(d.replica_ids),
                     max_step=d.max_step, behind=list(d.behind), reason=d.reason)
        msg = protocol.encode_decision(d)
        for rid in d.replica_ids:
            self._requests.pop(rid, None)
            self._reply(self._conns[rid], msg)

    def _persist(self) -> None:
        if self._storage is not None:
            doc = {"quorum_id": self._state.quorum_id, "participants": list(self._state.prev_participants)}
            self._storage.write_atomic(STATE_KEY, json.dumps(doc).encode())

    def _record(self, kind: str, **fields: Any) -> None:
        self.history.append({"t": self.env.clock.now(), "event": kind, **fields})

    # -- observation ---------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """A snapshot for the status page; safe to call from another task (reads immutable values)."""
        state, now = self._state, self.env.clock.now()
        last = self._last_decision
        return {
            "addr": self.addr,
            "quorum_id": state.quorum_id,
            "participants": list(state.prev_participants),
            "live": sorted(live_members(now, state, self.config)),
            "members": {m.replica_id: {"connected": m.connected, "heard_s_ago": round(now - m.last_heard, 3)}
                        for m in state.members.values()},
            "pending": list(self._pending_view),
            "last_reason": last.reason if last else None,
            "min_replicas": self.config.min_replicas,
        }
