"""The emulated network: in-memory listeners and connections whose frames arrive when the link model
says (harness.engine.linkmodel). Same surface and errors as ftrun.env.real_net.

Addresses: `listen("127.0.0.1:0")` on host "host-0" returns "host-0:1" (ports from 1; "localhost",
"127.0.0.1", "0.0.0.0" and the host's own name mean this host); "unix:/path" is per host.
Control messages are msgpack-encoded by the sender (same checks and exceptions as wire.encode_msg)
and decoded by the receiver with wire.decode_msg, so a bad message fails where it would for real and
each side pays its own CPU for it. Bulk frames carry a snapshot of the sender's bytes, copied into the
receiver's buffer, or a ShapeOnly(nbytes) (size and timing only, no bytes).

Close: the other side sees PeerClosed once the FIN arrives (one latency, after frames already in
flight). A killed host closes all its connections; a *silently* killed host sends nothing, drops what
arrives and ignores connection attempts, so peers only notice through timeouts.
Sending blocks only while the host's NIC backlog exceeds the send buffer (NetworkConfig.send_buffer_kib).

Building cuts (`fabric.cuts`, (building, start, end) triples): silent, as a fiber cut is for TCP. A frame,
FIN or SYN that leaves during a cut on a route with exactly one end in the cut building is held and
arrives one latency after the cut ends (TCP retransmitting it then); nothing is refused or reset, so
peers notice the cut only through their own timeouts.
"""

from __future__ import annotations

import errno
from typing import Any, Callable

import msgpack

from ftrun.env import wire
from ftrun.env.admission import Admission, ListenLimits, log_admit
from ftrun.env.base import (CANCEL_CHECK_S, CONNECT_RETRY_S, ConnectError, EnvTimeout, Message, NetTimeout,
                            PeerClosed, ProtocolError, connect_cancelled, split_host_port)
from harness.engine.core import Scheduler
from harness.engine.linkmodel import LinkModel, Route, Timeline
from mocks.shapes import ShapeOnly

_LOCAL_NAMES = frozenset({"", "127.0.0.1", "localhost", "0.0.0.0", "::1"})
_REFUSED = object()
_FIRST_EPHEMERAL = 40000
_NEVER = float("inf")
_MSG, _BULK, _HEADER = wire.KIND_MSG, wire.KIND_BULK, wire.HEADER_SIZE
decode_msg = wire.decode_msg


def parse_addr(addr: str) -> tuple[str | None, int | str]:
    """(host name or None for "this host", port or "unix:/path"). ValueError for a malformed address."""
    if addr.startswith("unix:"):
        return None, addr
    host, port = split_host_port(addr)
    return (None if host in _LOCAL_NAMES else host), port


class NetHost:
    """A host's network state: NIC timelines, listeners, open connection ends."""

    __slots__ = ("name", "nic", "listeners", "conns", "next_port", "next_ephemeral", "silent")

    def __init__(self, name: str) -> None:
        self.name = name
        self.nic = (Timeline(), Timeline())  # (tx, rx)
        self.listeners: dict[int | str, EmuListener] = {}
        self.conns: dict[EmuConnection, None] = {}
        self.next_port = 1
        self.next_ephemeral = _FIRST_EPHEMERAL
        self.silent = False


class Fabric:
    """All hosts' network state plus the link model; one per world."""

    def __init__(self, sched: Scheduler, model: LinkModel, host_of: Any) -> None:
        self.sched = sched
        self.model = model
        self.transmit = model.transmit
        self._host_of = host_of  # name -> core Host (created on first use)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._routes: dict[tuple[str, str], Route] = {}
        self.num_frames = 0
        self.num_bytes = 0
        self.cuts: list[tuple[int, float, float]] = []  # (building, start, end): see the module docstring
        self.crash_fin_delay_s = 0.0  # a crashed host's FINs leave this long after the crash (OS teardown)
        self.listen_limits: ListenLimits | None = None  # caps on each listener's connections (None: none), as
        # ftrun.env.admission says; a connection counts as past its first message once that frame is read
        self.link_factor: dict[tuple[str, str], float] = {}  # (src, dst) host names -> slowdown (slow_link)
        self._base_rate: dict[tuple[str, str], float] = {}

    def held_until(self, route: Route, t: float) -> float:
        """When something leaving at t on `route` can cross: t, or the end of the cut that holds it."""
        b = route.buildings
        if b is not None:
            for building, start, end in self.cuts:
                if start <= t < end and building in b:
                    t = end
        return t

    def net_host(self, name: str) -> NetHost:
        return self._host_of(name).net

    def route(self, src: NetHost, dst: NetHost) -> Route:
        key = (src.name, dst.name)
        r = self._routes.get(key)
        if r is None:
            r = self._routes[key] = self.model.route(src.name, dst.name, src.nic, dst.nic)
            self._base_rate[key] = r.host_rate
            if key in self.link_factor:
                r.host_rate = r.host_rate / self.link_factor[key]
        return r

    def slow_link(self, a: str, b: str, factor: float) -> None:
        """Frames between hosts a and b (both ways) take `factor` x their NIC time (1: restored). Routes
        already in use change at once; their connections keep them."""
        if not factor >= 1:
            raise ValueError(f"a link slowdown needs factor >= 1, got {factor}")
        for key in ((a, b), (b, a)):
            if factor == 1:
                self.link_factor.pop(key, None)
            else:
                self.link_factor[key] = factor
            r = self._routes.get(key)
            if r is not None:
                r.host_rate = self._base_rate[key] / factor

    def encode(self, msg: Message) -> bytes:
        """msgpack payload with wire.encode_msg's checks (a cached Packer is ~2x faster than packb)."""
        if not isinstance(msg, dict):
            raise TypeError(f"a control message must be a dict, not {type(msg).__name__}")
        data = self._packer.pack(msg)
        if len(data) > wire.MAX_MSG_BYTES:
            raise ValueError(f"control message of {len(data)} bytes exceeds {wire.MAX_MSG_BYTES}")
        return data

    def kill_owner(self, host: NetHost, proc: Any) -> None:
        """Close the listeners and connections of the host that process `proc` opened or accepted."""
        for listener in [ln for ln in host.listeners.values() if ln.owner is proc]:
            listener.close()
        for conn in [c for c in host.conns if c.owner is proc]:
            conn._shutdown(send_fin=True, fin_delay_s=self.crash_fin_delay_s)

    def kill_host(self, host: NetHost, silent: bool) -> None:
        """Close every listener and connection of the host (with FINs unless silent)."""
        if silent:
            host.silent = True
        for listener in list(host.listeners.values()):
            listener.close()
        for conn in list(host.conns):
            conn._shutdown(send_fin=not silent, fin_delay_s=self.crash_fin_delay_s)


class EmuNetwork:
    """`env.net` of one emulated host."""

    __slots__ = ("_fab", "_host")

    def __init__(self, fabric: Fabric, host: NetHost) -> None:
        self._fab = fabric
        self._host = host

    def listen(self, addr: str) -> "EmuListener":
        host_name, key = parse_addr(addr)
        host = self._host
        if host_name is not None and host_name != host.name:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {addr!r} from host {host.name}")
        if key == 0:
            while host.next_port in host.listeners:
                host.next_port += 1
            key = host.next_port
            host.next_port += 1
        elif key in host.listeners:
            raise OSError(errno.EADDRINUSE, f"address {addr!r} already in use on {host.name}")
        listener = EmuListener(self._fab, host, key)
        cur = self._fab.sched.current
        listener.owner = cur.proc if cur is not None else None
        host.listeners[key] = listener
        return listener

    def connect(self, addr: str, timeout: float, cancelled: Callable[[], bool] | None = None) -> "EmuConnection":
        host_name, key = parse_addr(addr)
        src = self._host
        dst = src if host_name is None or host_name == src.name else self._fab.net_host(host_name)
        sched = self._fab.sched
        start = sched.vnow()
        deadline = start + timeout
        while True:
            left = deadline - sched.vnow()
            got = self._attempt(src, dst, key, left if cancelled is None else min(left, CANCEL_CHECK_S))
            if isinstance(got, EmuConnection):
                cur = sched.current
                got.owner = cur.proc if cur is not None else None
                return got
            if cancelled is not None and cancelled():
                raise connect_cancelled(addr, sched.vnow() - start)
            if sched.vnow() + CONNECT_RETRY_S >= deadline:  # an attempt without a cap on it waits to the deadline
                raise ConnectError(f"cannot connect to {addr} within {timeout}s: "
                                   + ("refused" if got is _REFUSED else "no answer"))
            sched.wait(None, CONNECT_RETRY_S, "connect retry")

    def _attempt(self, src: NetHost, dst: NetHost, key: int | str, timeout: float) -> Any:
        """One SYN: the connection, _REFUSED, or TIMEOUT (no answer from a silent host)."""
        fab, sched = self._fab, self._fab.sched
        waiters: list = []
        route = fab.route(src, dst)
        depart = fab.held_until(route, sched.vnow()) if fab.cuts else sched.vnow()
        sched.call_at(depart + route.latency, _on_syn, (fab, src, dst, key), waiters)
        return sched.wait(waiters, max(timeout, 0.0), f"connect to {dst.name}:{key}")


def _on_syn(args: tuple, waiters: list) -> None:
    """At the listener's host: accept into the backlog and answer SYN-ACK, or answer RST."""
    fab, src, dst, key = args
    if dst.silent:
        return  # a dead machine does not answer: the client times out
    listener = dst.listeners.get(key)
    back = fab.route(dst, src)
    answer_at = (fab.held_until(back, fab.sched.now) if fab.cuts else fab.sched.now) + back.latency
    if listener is None or listener._closed:
        fab.sched.call_at(answer_at, _on_answer, (fab, waiters), _REFUSED)
        return
    client, server = EmuConnection.pair(fab, src, dst, listener.addr)
    listener._enqueue(server)
    fab.sched.call_at(answer_at, _on_answer, (fab, waiters), client)


def _on_answer(ctx: tuple, answer: Any) -> None:
    fab, waiters = ctx
    if not fab.sched.wake_first(waiters, answer) and isinstance(answer, EmuConnection):
        answer._shutdown(send_fin=True)  # the client gave up meanwhile: drop the half-open connection


class EmuListener:
    __slots__ = ("_fab", "_host", "_key", "addr", "_backlog", "_waiters", "_closed", "owner", "_admission")

    def __init__(self, fab: Fabric, host: NetHost, key: int | str) -> None:
        self._fab, self._host, self._key = fab, host, key
        self.addr = key if isinstance(key, str) else f"{host.name}:{key}"
        self._backlog: list[EmuConnection] = []
        self._waiters: list = []
        self._closed = False
        self.owner: Any = None  # the process (root task) that listens
        limits = fab.listen_limits
        self._admission = None if limits is None else Admission(limits)

    def _enqueue(self, conn: "EmuConnection") -> None:
        self._backlog.append(conn)
        if self._waiters:
            self._fab.sched.wake_first(self._waiters, None)

    def accept(self, timeout: float | None = None) -> "EmuConnection":
        sched = self._fab.sched
        deadline = None if timeout is None else sched.vnow() + timeout
        while True:
            if self._closed:
                raise PeerClosed(f"listener {self.addr} is closed")
            if self._backlog:
                conn = self._backlog.pop(0)
                cur = sched.current
                conn.owner = cur.proc if cur is not None else self.owner
                if self._admission is None or self._admit(conn):
                    return conn
                continue
            remaining = None if deadline is None else deadline - sched.vnow()
            if remaining is not None and remaining <= 0:
                raise EnvTimeout(f"accept timed out after {timeout}s")
            sched.wait(self._waiters, remaining, self)  # woken by a connection, a close or the deadline

    def _admit(self, conn: "EmuConnection") -> bool:
        """Under the listener's caps: closes the connections they evict, and `conn` if they refuse it."""
        decision = self._admission.accepted(conn)
        for old in decision.evict:
            old.close()
        log_admit(self.addr, decision)
        if not decision.keep:
            conn.close()
            return False
        conn._admission, conn._greeting = self._admission, True
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._host.listeners.get(self._key) is self:
            del self._host.listeners[self._key]
        for conn in self._backlog:  # never accepted: the clients see the connection reset
            conn._shutdown(send_fin=True)
        self._backlog.clear()
        waiters, self._waiters = self._waiters, []
        for task, token in waiters:
            self._fab.sched.wake(task, token, None)

    def __repr__(self) -> str:
        return f"<listener {self.addr}{' closed' if self._closed else ''}>"


class EmuConnection:
    """One end of an emulated connection.

    Frames go straight into the peer's `_inbox` as (arrival, kind, payload) when sent and become
    readable at `arrival`; no event is scheduled unless the receiver is blocked waiting for one,
    which halves the event traffic of fan-in patterns. The peer's FIN is the time `_fin_at`.
    """

    __slots__ = ("_fab", "_host", "_peer", "_route", "local_addr", "peer_addr", "_inbox", "_rx", "_watch",
                 "_closed", "_fin_at", "_last_arrival", "owner", "_admission", "_greeting", "__weakref__")

    def __init__(self, fab: Fabric, host: NetHost, local_addr: str, peer_addr: str) -> None:
        self._fab, self._host = fab, host
        self._peer: EmuConnection = self
        self._route: Route | None = None
        self.local_addr, self.peer_addr = local_addr, peer_addr
        self._inbox: list = []
        self._rx: list = []  # the receiver blocked on this end, if any
        self._watch: list = []  # tasks blocked in wait_closed (they read nothing)
        self._closed = False
        self._fin_at = _NEVER
        self._last_arrival = 0.0
        self.owner: Any = None  # the process (root task) that connected or accepted it, if known
        self._admission: Admission | None = None  # its listener's bookkeeping, for an accepted one under caps
        self._greeting = False  # accepted under caps, and no frame read from it yet
        host.conns[self] = None

    @classmethod
    def pair(cls, fab: Fabric, client_host: NetHost, server_host: NetHost, server_addr: str) -> tuple:
        port = client_host.next_ephemeral
        client_host.next_ephemeral += 1
        client = cls(fab, client_host, f"{client_host.name}:{port}", server_addr)
        server = cls(fab, server_host, server_addr, client.local_addr)
        client._peer, server._peer = server, client
        client._route = fab.route(client_host, server_host)
        server._route = fab.route(server_host, client_host)
        return client, server

    # -- sending -----------------------------------------------------------------------------------
    def send(self, msg: Message, timeout: float | None = None) -> None:
        self._check_sendable()
        data = self._fab.encode(msg)
        self._transmit(_MSG, data, len(data) + _HEADER, timeout)

    def send_bytes(self, buf: Any, timeout: float | None = None) -> None:
        self._check_sendable()
        if isinstance(buf, ShapeOnly) or type(buf) is bytes:
            payload = buf  # immutable: no snapshot needed
        else:
            payload = bytes(memoryview(buf).cast("B"))  # the sender may reuse its buffer at once
        self._transmit(_BULK, payload, len(payload) + _HEADER, timeout)

    def _check_sendable(self) -> None:
        if self._closed:
            raise PeerClosed(f"connection to {self.peer_addr} closed locally")
        if self._fin_at != _NEVER and self._fin_at <= self._fab.sched.vnow():
            raise PeerClosed(f"peer {self.peer_addr} closed the connection")

    def _transmit(self, kind: int, payload: Any, nbytes: int, timeout: float | None) -> None:
        fab = self._fab
        sched = fab.sched
        depart = sched.vnow()
        route = self._route
        sent, arrival = fab.transmit(route, depart, nbytes)
        if fab.cuts:
            held = fab.held_until(route, depart)
            if held > depart and arrival < held + route.latency:
                arrival = held + route.latency
        if arrival < self._last_arrival:
            arrival = self._last_arrival  # one byte stream: frames arrive in order
        self._last_arrival = arrival
        peer = self._peer
        if not peer._closed:
            inbox = peer._inbox
            inbox.append((arrival, kind, payload))
            if peer._rx and len(inbox) == 1:  # the receiver waits for exactly this frame
                sched.call_at(arrival, _wake_rx, peer)
        fab.num_frames += 1
        fab.num_bytes += nbytes
        backlog_wait = sent - route.sndbuf_s - depart
        if backlog_wait > 0:  # the NIC queue holds more than a socket buffer: block like a full socket
            if timeout is not None and backlog_wait > timeout:
                sched.wait(None, timeout, self)
                self._shutdown(send_fin=True)  # part of the frame is on the wire: the stream is unusable
                raise NetTimeout(f"send to {self.peer_addr} timed out after {timeout}s")
            sched.wait(None, backlog_wait, self)

    # -- receiving ---------------------------------------------------------------------------------
    def recv(self, timeout: float | None) -> Message:
        _, kind, payload = self._next_frame(timeout)
        if kind != _MSG:
            self._shutdown(send_fin=True)  # the receiver cannot resync on this stream
            raise ProtocolError(f"expected a control message, got a bulk frame of {len(payload)} bytes")
        return decode_msg(payload)

    def recv_into(self, buf: Any, timeout: float | None) -> None:
        _, kind, payload = self._next_frame(timeout)
        shape_only = isinstance(buf, ShapeOnly)
        view = None if shape_only else memoryview(buf).cast("B")
        want = buf.nbytes if shape_only else view.nbytes
        if kind != _BULK or len(payload) != want:
            self._shutdown(send_fin=True)
            what = "bulk frame" if kind == _BULK else "control message"
            raise ProtocolError(f"expected a bulk frame of {want} bytes, got a {what} of {len(payload)} bytes")
        if view is not None and not isinstance(payload, ShapeOnly):
            view[:] = payload

    def _next_frame(self, timeout: float | None) -> tuple:
        """The next frame that has arrived, waiting for one; PeerClosed / NetTimeout otherwise."""
        sched = self._fab.sched
        inbox = self._inbox
        if inbox and inbox[0][0] <= sched.now and not self._closed:
            return self._take()  # the common case: arrived before this slice began, no clock read
        now = sched.vnow()
        deadline = _NEVER if timeout is None else now + timeout
        while True:
            if self._closed:
                raise PeerClosed(f"connection to {self.peer_addr} closed locally")
            if inbox:
                wake_at = inbox[0][0]
                if wake_at <= now:
                    return self._take()
            elif self._fin_at <= now:
                raise PeerClosed(f"peer {self.peer_addr} closed the connection")
            else:
                wake_at = self._fin_at  # _NEVER until a FIN is on its way; a send wakes us then
            if deadline <= now:
                raise NetTimeout(f"receive from {self.peer_addr} timed out after {timeout}s")
            if wake_at < deadline:
                sched.call_at(wake_at, _wake_rx, self)
            sched.wait(self._rx, None if deadline == _NEVER else deadline - now, self, deadline)
            now = sched.now  # just resumed: the slice has barely begun; look again

    def _take(self) -> tuple:
        """The first frame of the inbox, read: the connection is past its first message under its listener's
        caps, as a real one is once that message is read (a frame sent before the accept counts too)."""
        if self._greeting:
            self._greeting = False
            self._admission.greeted(self)
        return self._inbox.pop(0)

    # -- closing -----------------------------------------------------------------------------------
    def wait_closed(self, timeout: float | None = None) -> None:
        """Block until this end is closed (locally, or by a kill) or the peer's FIN has arrived, without
        reading a frame: frames stay for recv / recv_into, so a watcher may sit beside a reader. Raises
        PeerClosed saying which side closed; NetTimeout after `timeout` seconds with both sides open."""
        sched = self._fab.sched
        now = sched.vnow()
        deadline = _NEVER if timeout is None else now + timeout
        while True:
            if self._closed:
                raise PeerClosed(f"connection to {self.peer_addr} closed locally")
            if self._fin_at <= now:
                raise PeerClosed(f"peer {self.peer_addr} closed the connection")
            if deadline <= now:
                raise NetTimeout(f"connection to {self.peer_addr} still open after {timeout}s")
            if self._fin_at < deadline:
                sched.call_at(self._fin_at, _wake_watch, self)
            sched.wait(self._watch, None if deadline == _NEVER else deadline - now, self, deadline)
            now = sched.now

    def close(self) -> None:
        self._shutdown(send_fin=True)

    def _shutdown(self, send_fin: bool, fin_delay_s: float = 0.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.clear()
        self._host.conns.pop(self, None)
        if self._admission is not None:
            self._admission.closed(self)
            self._admission = None
        sched = self._fab.sched
        waiters, self._rx = self._rx + self._watch, []
        self._watch = []
        for task, token in waiters:
            sched.wake(task, token, None)
        peer = self._peer
        if send_fin and not self._host.silent and not peer._closed:
            now = self._fab.held_until(self._route, sched.vnow()) if self._fab.cuts else sched.vnow()
            fin_at = max(now + fin_delay_s + self._route.latency, self._last_arrival)  # after frames in flight
            if fin_at < peer._fin_at:
                peer._fin_at = fin_at
                if peer._rx and not peer._inbox:
                    sched.call_at(fin_at, _wake_rx, peer)
                if peer._watch:
                    sched.call_at(fin_at, _wake_watch, peer)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<connection {self.local_addr} -> {self.peer_addr}{' closed' if self._closed else ''}>"


def _wake_rx(conn: EmuConnection, _unused: Any = None) -> None:
    """A frame or FIN reached a blocked receiver (possibly a stale wake: the receiver re-checks)."""
    if conn._rx:
        conn._fab.sched.wake_first(conn._rx, None)


def _wake_watch(conn: EmuConnection, _unused: Any = None) -> None:
    """A FIN reached the tasks in wait_closed (possibly a stale wake: each re-checks)."""
    waiters, conn._watch = conn._watch, []
    for task, token in waiters:
        conn._fab.sched.wake(task, token, None)
