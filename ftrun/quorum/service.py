"""The lighthouse service: one event loop around the pure `decide`.

Tasks:
- accept: takes connections and starts a reader per connection.
- reader (one per replica leader): checks the hello and token, then turns every frame into an event and
  handles it itself, under the state lock: it applies the event, calls `decide`, hands a formed quorum
  to its participants and persists (quorum_id, participants, max_step) atomically, so `kill -9` and a
  restart keep quorum ids monotonic, never hand out a lower step, and keep the job alive. A dropped
  connection becomes a `lost` event at once (failure detection is pushed, not polled); a connection
  silent for heartbeat_timeout_s becomes a `hung` event; a hung one, or a lost one that was healing
  (behind) in the current quorum, is a `hung` notice to the other participants of that quorum (a peer
  waiting for it gives up at once). Handling an
  event on the task that read it, rather than handing it to another task, saves one thread wake-up per
  request on the step's critical path (`ftrun bench overhead`).
- main: the timer. It decides again when a deadline passes (a member's heartbeat timeout, a round's
  join timeout) and handles the events other tasks queue (evict, stop). Every change of state happens
  under the one lock, so the tasks see one sequence of events as before.

Nothing a replica sends can stop the lighthouse: requests are range-checked at decode time
(ftrun.quorum.protocol), a decision too large for one frame is refused to the requester with the largest
address list, and an unexpected error while applying one event is answered to that replica only. If an
error escapes anyway (deciding, handing out), `failed` says why, `status()` raises (the status page stops answering 200) and
every connection is closed, so replicas see the loss and `ftrun lighthouse` exits non-zero.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from ftrun.config import LighthouseConfig
from ftrun.env import wire
from ftrun.env.base import (Connection, Env, EnvTimeout, NetError, NetTimeout, ProtocolError,
                            serve_connections)
from ftrun.net import WarnLimiter, require_token, token_matches
from ftrun.quorum import protocol
from ftrun.quorum.decide import (Decision, LighthouseState, Member, QuorumRequest, apply, decide, evict,
                                 expect_previous, finish, live_members)
from ftrun.storage import Storage

log = logging.getLogger("ftrun.quorum")
STATE_KEY = "lighthouse_state.json"
ACCEPT_FAIL_AFTER_S = 5.0  # a lighthouse whose accepts keep failing this long is marked failed
REJECT_WARN_EVERY_S = 10.0  # at most one warning per this long for connections refused at their hello


class LighthouseStateError(ValueError):
    """The persisted lighthouse state cannot be read."""


class LighthouseDown(RuntimeError):
    """The lighthouse died (an error while changing its state); `status()` raises this instead of answering."""


@dataclass(frozen=True)
class _Event:
    kind: str  # hello | heard | ask | finished | lost | hung | evict | stop | kick
    replica_id: str = ""
    conn: Connection | None = None
    msg: Any = None


def load_state(storage: Storage | None) -> LighthouseState:
    """The persisted state, checked as strictly as a request. Raises LighthouseStateError naming the
    bad field: a state that could not be handed out again must stop the start, not the service later."""
    raw = storage.read(STATE_KEY) if storage else None
    if raw is None:
        return LighthouseState()
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
        quorum_id, max_step = (_persisted_counter(doc, name) for name in ("quorum_id", "max_step"))
        participants = doc["participants"]
        if not isinstance(participants, list):
            raise ValueError(f"'participants' must be a list, got {type(participants).__name__}")
        participants = [protocol.check_replica_id(p) for p in participants]
        finished_step = None if doc.get("finished_step") is None else _persisted_counter(doc, "finished_step")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise LighthouseStateError(f"lighthouse state {STATE_KEY!r} is unreadable: {e}") from e
    return LighthouseState(quorum_id=quorum_id, prev_participants=tuple(participants), max_step=max_step,
                           finished_step=finished_step)


def _persisted_counter(doc: dict, name: str) -> int:
    value = doc.get(name, 0) if name == "max_step" else doc[name]  # max_step: absent in older states
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= protocol.MAX_COUNTER:
        raise ValueError(f"{name!r} must be an integer in [0, {protocol.MAX_COUNTER}], got {value!r:.80}")
    return value


class Lighthouse:
    """Quorum service for one job. `start()` returns the address replicas connect to."""

    def __init__(
        self, *, env: Env, config: LighthouseConfig, token: str,
        storage: Storage | None = None, bind: str = "127.0.0.1:0",
    ) -> None:
        self.env, self.config, self._storage, self._bind = env, config, storage, bind
        self._token = require_token(token, "Lighthouse")
        self._events = env.queue()  # for the main task: evict, stop, and kicks when a deadline moved earlier
        self._lock = env.lock()  # held while the state changes: by a reader handling its event, or by main
        self._reject_warns, self._reject_lock = WarnLimiter(REJECT_WARN_EVERY_S), env.lock()
        self._wake_at: float | None = None  # when the main task plans to decide again (None: not planned)
        self._state = expect_previous(load_state(storage), env.clock.now())
        self._requests: dict[str, QuorumRequest] = {}
        self._conns: dict[str, Connection] = {}
        self._greeting: set[Connection] = set()  # accepted, hello not read yet: stop() closes these too
        self._last_decision: Decision | None = None
        self._behind: frozenset[str] = frozenset()  # the current quorum's participants that heal first
        self.history: deque[dict[str, Any]] = deque(maxlen=10_000)  # changes, for reports and /status
        self.addr = ""
        self._tasks: list = []
        self._pending_view: tuple[str, ...] = ()
        self.failed: str | None = None  # why the lighthouse died (None while it runs)
        self._stopping = False
        self.diagnosis: Any = None  # () -> the diagnosis verdict dict (ftrun.diagnose.monitor), when one runs
        self.diagnosis_report: Any = None  # () -> the monitor's report without a pull (the status page)
        self._asks_view: dict[str, int] = {}  # replica -> the step it asks a quorum for
        self._oldest_ask: float | None = None  # when the oldest pending quorum request was made

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> str:
        self._listener = self.env.net.listen(self._bind)
        self.addr = self._listener.addr
        self._tasks = [
            serve_connections(self.env, self._listener, self._reader, name="lighthouse-accept",
                              conn_name="lighthouse-reader", on_accept=self._accepted,
                              give_up_after_s=ACCEPT_FAIL_AFTER_S, on_end=self._accept_ended),
            self.env.spawn(self._main_loop, name="lighthouse-main"),
        ]
        log.info("lighthouse at %s, quorum_id=%d", self.addr, self._state.quorum_id)
        return self.addr

    def stop(self) -> None:
        self._stopping = True
        self._events.put(_Event("stop"))
        self._listener.close()
        for t in self._tasks:
            t.join(timeout=5.0)
        for conn in list(self._conns.values()) + list(self._greeting):
            conn.close()

    # -- connection tasks ----------------------------------------------------------------------
    def _accepted(self, conn: Connection) -> None:
        """A connection just accepted (serve_connections' `on_accept`): kept where stop() closes it until its
        hello is read, or closed now if stop() already ran (its loop over the connections missed it)."""
        self._greeting.add(conn)
        if self._stopping:
            conn.close()

    def _accept_ended(self, why: str) -> None:
        """The accept task ended (serve_connections' `on_end`): by stop(), or on its own, when accepts kept
        failing (e.g. EMFILE, out of descriptors) for ACCEPT_FAIL_AFTER_S or the listener is gone. Then the
        lighthouse is marked failed rather than deaf while /status still answered."""
        if self._stopping or self.failed is not None:
            return
        self.failed = f"accepting connections failed: {why}"
        log.critical("lighthouse: %s", self.failed)

    def evict(self, replica_ids: tuple[str, ...], why: str) -> None:
        """Evict replicas the diagnosis names (decide rule 9); safe from any task."""
        self._events.put(_Event("evict", ",".join(replica_ids), msg=why))

    def _reader(self, conn: Connection) -> None:
        timeouts = self.config.timeouts
        try:
            first = conn.recv(timeout=timeouts.connect_timeout_s)
            if isinstance(first, dict) and first.get("type") == "verdict":  # `ftrun diagnose --lighthouse`
                self._answer_verdict(conn, first)
                return
            token, replica_id = protocol.parse_hello(first)
            if not token_matches(token, self._token):
                raise protocol.BadRequest("wrong job token")
        except (protocol.BadRequest, ProtocolError) as e:
            self._reject(conn, str(e))
            return
        except NetError as e:  # silent, gone, or closed by the listener's caps: nothing said, nothing to answer;
            # not a warning each, or a flood of idle connections floods the log (the listener logs its bursts)
            log.debug("connection from %s closed before its hello: %s", conn.peer_addr, e)
            conn.close()
            return
        finally:
            self._greeting.discard(conn)  # from here on a replica's connection, in _conns once its hello is handled
        self._handle(_Event("hello", replica_id, conn))
        while True:
            try:
                msg = conn.recv(timeout=timeouts.heartbeat_timeout_s)
            except NetTimeout:
                self._handle(_Event("hung", replica_id, conn))
                conn.close()
                return
            except NetError:
                self._handle(_Event("lost", replica_id, conn))
                return
            kind = msg.get("type")
            if kind in ("heartbeat", "quorum", "finished"):
                self._handle(_Event({"heartbeat": "heard", "quorum": "ask"}.get(kind, kind), replica_id, conn, msg))
            else:
                self._reply(conn, {"type": "error", "error": f"unknown message type {kind!r}"})

    def _answer_verdict(self, conn: Connection, msg: dict) -> None:
        token = msg.get("token")
        if not token_matches(token, self._token):
            self._reject(conn, "wrong job token")
            return
        try:
            reply = {"type": "verdict", **self.diagnosis()} if self.diagnosis is not None else \
                {"type": "error", "error": "no diagnosis runs beside this lighthouse (ftrun launch --no-diagnose?)"}
        except Exception as e:  # a failed analysis is answered, never fatal to the lighthouse
            reply = {"type": "error", "error": f"diagnosis failed: {e!r}"}
        self._reply(conn, reply)
        conn.close()

    def _reject(self, conn: Connection, why: str) -> None:
        """Answer `why` and close. Logged as a warning at most once per REJECT_WARN_EVERY_S (the next one
        counts those left out), so a flood of bad hellos does not flood the log."""
        with self._reject_lock:
            suppressed = self._reject_warns.allow(self.env.clock.now())
        if suppressed is None:
            log.debug("rejecting connection from %s: %s", conn.peer_addr, why)
        else:
            more = f" ({suppressed} more since the last such warning)" if suppressed else ""
            log.warning("rejecting connection from %s: %s%s", conn.peer_addr, why, more)
        self._reply(conn, {"type": "error", "error": why})
        conn.close()

    def _reply(self, conn: Connection, msg: dict) -> None:
        try:
            conn.send(msg, timeout=self.config.timeouts.connect_timeout_s)
        except NetError:
            pass  # its reader sees the loss and reports it

    # -- state changes: one at a time, under the lock ---------------------------------------------
    def _main_loop(self) -> None:
        """The timer: decides again at the next deadline, and handles the events queued for it."""
        try:
            while True:
                with self._lock:
                    wait = self._wait_time()
                    self._wake_at = self.env.clock.now() + wait
                try:
                    ev = self._events.get(timeout=wait)
                except EnvTimeout:
                    ev = None
                if ev is not None and ev.kind == "stop":
                    return
                if ev is None or ev.kind != "kick":
                    self._handle(ev)
        except BaseException as e:
            self._die(e)
            raise

    def _handle(self, ev: _Event | None) -> None:
        """Apply one event (None: a deadline passed) and decide; called by the task that has the event.
        A bug reached by one replica's input is answered to that replica; any other error kills the
        lighthouse, never silently (status() raises, replicas see every connection close)."""
        with self._lock:
            if self.failed is not None or self._stopping:
                return
            try:
                if ev is not None:
                    try:
                        self._apply_event(ev)
                    except Exception as e:  # a bug reached by one replica's input: answer it, keep serving
                        log.error("lighthouse: event %s from %r failed: %r", ev.kind, ev.replica_id, e, exc_info=True)
                        self._requests.pop(ev.replica_id, None)
                        if ev.conn is not None:
                            self._reply(ev.conn, {"type": "error", "error": f"lighthouse could not handle it: {e!r}"})
                self._maybe_form()
                self._pending_view = tuple(sorted(self._requests))  # what status() may read concurrently
                self._asks_view = {r: q.step for r, q in self._requests.items()}
                self._oldest_ask = min((q.asked_at for q in self._requests.values()), default=None)
                kick = self._wake_at is not None and self.env.clock.now() + self._wait_time() < self._wake_at
            except Exception as e:
                self._die(e)
                return
        if kick:  # a deadline moved earlier than the main task's plan (e.g. a round's join timeout)
            self._events.put(_Event("kick"))

    def _die(self, e: BaseException) -> None:
        if self.failed is not None:
            return
        self.failed = f"{type(e).__name__}: {e}"
        log.critical("lighthouse died: %s", self.failed, exc_info=True)
        self._listener.close()
        for conn in list(self._conns.values()):
            conn.close()

    def _wait_time(self) -> float:
        hb = self.config.timeouts.heartbeat_timeout_s
        retry = self._last_decision.retry_at if self._last_decision and not self._last_decision.ready else None
        wake = [retry] if retry is not None else []
        wake += [m.last_heard + hb for m in self._state.members.values() if m.connected or m.expected]
        return max(min(wake) - self.env.clock.now(), 0.001) if wake else 1.0

    def _apply_event(self, ev: _Event) -> None:
        now, rid = self.env.clock.now(), ev.replica_id
        if ev.kind == "evict":
            self._state, hit = evict(now, self._state, tuple(rid.split(",")))
            for r in hit:
                self._requests.pop(r, None)
                conn = self._conns.pop(r, None)
                if conn is not None:
                    conn.close()
                self._record("member_evicted", replica_id=r, why=ev.msg)
                log.warning("replica %s evicted: %s", r, ev.msg)
                self._notify_hung(r)  # whoever waits for it (in a ring, or to connect one) gives up now
            return
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
            if ev.kind == "hung" or (rid in self._behind and self._state.finished_step is None):
                self._notify_hung(rid)  # a dead joiner too: see _notify_hung
            return
        self._set_member(Member(rid, now, True))
        if ev.kind == "ask":
            self._accept_request(rid, ev.conn, ev.msg, now)
        elif ev.kind == "finished":
            self._finished(rid, ev.conn, ev.msg)

    def _finished(self, rid: str, conn: Connection, msg: dict) -> None:
        """Rule 0: persist that the job finished at this step, then acknowledge (the replica exits)."""
        try:
            step = protocol.parse_finished(msg)
        except protocol.BadRequest as e:
            self._reply(conn, {"type": "error", "error": str(e)})
            return
        if self._state.finished_step is None or step > self._state.finished_step:
            self._state = finish(self._state, step)
            self._persist()
            self._record("job_finished", replica_id=rid, step=step)
            log.info("replica %s reports the job finished at step %d", rid, step)
        self._reply(conn, {"type": "finished_ack", "step": self._state.finished_step})

    def _notify_hung(self, rid: str) -> None:
        """Tell the other participants of the current quorum that `rid` hung, or died while it healed:
        whoever waits for it gives up now, not after its FTAR timeout (or the catch-up wait limit). A dead
        replica's ring peers see its connections close at once (and a diagnosis sees them wait on it), but
        only once the ring is built: a joiner killed while it heals (behind in the quorum, not yet in the
        ring) has no connection to close, and its peers waited the whole wait limit for it (a 10 s stall in
        benchmarks/catchup_launch.py). Not after the job finished: a replica then leaves cleanly."""
        state = self._state
        if rid not in state.prev_participants:
            return
        notice = {"type": "hung", "replica_id": rid, "quorum_id": state.quorum_id}
        for other in state.prev_participants:
            if other != rid and other in self._conns:
                self._reply(self._conns[other], notice)

    def _accept_request(self, rid: str, conn: Connection, msg: dict, now: float) -> None:
        try:
            step, commit_failed, last_quorum_id, addrs, own_failures, fresh = protocol.parse_quorum_request(msg)
        except protocol.BadRequest as e:
            self._reply(conn, {"type": "error", "error": str(e)})
            return
        if last_quorum_id > self._state.quorum_id:
            # The replicas have seen a higher id than ours (state lost): adopt it to stay monotonic.
            log.warning("adopting quorum_id %d reported by %s (had %d)", last_quorum_id, rid, self._state.quorum_id)
            self._state = replace(self._state, quorum_id=last_quorum_id)
        self._requests[rid] = QuorumRequest(rid, step, now, commit_failed, addrs, own_failures, fresh)

    def _set_member(self, m: Member) -> None:
        self._state = replace(self._state, members={**self._state.members, m.replica_id: m})

    def _maybe_form(self) -> None:
        while self._requests:
            d = decide(self.env.clock.now(), self._state, self._requests, self.config)
            if d.reason != (self._last_decision.reason if self._last_decision else None):
                (log.warning if d.refused else log.info)("quorum: %s", d.reason)
            self._last_decision = d
            if d.finished:
                self._tell_finished(d.finished, d.reason)
                continue
            if d.refused:
                self._refuse(d.refused, d.reason)
                continue
            if not d.ready:
                return
            msg = protocol.encode_decision(d)
            try:
                wire.encode_msg(msg)
            except ValueError as e:  # too large for one frame: refuse the largest contribution, decide again
                rid = max(d.participants, key=lambda p: sum(map(len, p.data_addrs))).replica_id
                self._refuse((rid,), f"refused: the decision would not fit one message ({e}); "
                                     f"{rid}'s address list is the largest")
                continue
            self._hand_out(d, msg)
            return

    def _hand_out(self, d: Decision, msg: dict) -> None:
        self._state = apply(self._state, d)
        self._behind = frozenset(d.behind)
        self._persist()
        self._record("quorum", quorum_id=d.quorum_id, participants=list(d.replica_ids), max_step=d.max_step,
                     behind=list(d.behind), left_out=list(d.left_out), reason=d.reason, rewind=d.rewind)
        for rid in d.left_out:  # it sits this quorum out only: it joins the next one (decide rule 7)
            self._requests[rid] = replace(self._requests[rid], own_failures=0)
        for rid in d.replica_ids:
            self._requests.pop(rid, None)
            self._reply(self._conns[rid], msg)

    def _refuse(self, replica_ids: tuple[str, ...], why: str) -> None:
        for rid in replica_ids:
            self._requests.pop(rid, None)
            self._record("refused", replica_id=rid, reason=why)
            if rid in self._conns:
                self._reply(self._conns[rid], {"type": "error", "error": why})

    def _tell_finished(self, replica_ids: tuple[str, ...], why: str) -> None:
        for rid in replica_ids:
            self._requests.pop(rid, None)
            self._record("told_finished", replica_id=rid)
            if rid in self._conns:
                self._reply(self._conns[rid], {"type": "job_finished", "step": self._state.finished_step,
                                               "error": why})

    def _persist(self) -> None:
        if self._storage is None:
            return
        doc = {"quorum_id": self._state.quorum_id, "participants": list(self._state.prev_participants),
               "max_step": self._state.max_step, "finished_step": self._state.finished_step}
        try:
            self._storage.write_atomic(STATE_KEY, json.dumps(doc).encode())
        except Exception as e:  # keep serving from memory; a restart would lose only this decision
            log.error("lighthouse: persisting its state failed: %r", e)

    def _record(self, kind: str, **fields: Any) -> None:
        self.history.append({"t": self.env.clock.now(), "event": kind, **fields})

    # -- observation ---------------------------------------------------------------------------
    def waiting_since(self) -> float | None:
        """When the oldest quorum request still pending was made (None: none pends): a round the
        lighthouse holds for a replica that has not asked (the diagnosis pulls at once). Any task."""
        return self._oldest_ask

    def status(self) -> dict[str, Any]:
        """A snapshot for the status page; safe to call from another task (reads immutable values).
        Raises LighthouseDown once the lighthouse has died."""
        if self.failed is not None:
            raise LighthouseDown(f"lighthouse died: {self.failed}")
        state, now = self._state, self.env.clock.now()
        last = self._last_decision
        return {
            "addr": self.addr,
            "quorum_id": state.quorum_id,
            "max_step": state.max_step,
            "finished_step": state.finished_step,
            "participants": list(state.prev_participants),
            "live": sorted(live_members(now, state, self.config)),
            "members": {m.replica_id: {"connected": m.connected, "heard_s_ago": round(now - m.last_heard, 3),
                                       "expected": m.expected} for m in state.members.values()},
            "pending": list(self._pending_view),
            "asks": dict(self._asks_view),
            "last_reason": last.reason if last else None,
            "min_replicas": self.config.min_replicas,
        }
