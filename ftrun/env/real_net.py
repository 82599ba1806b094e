"""Real network for RealEnv: framed messages and bulk buffers over TCP or Unix stream sockets.

Addresses are "host:port" (port 0 picks a free port) or "unix:/path". Receives honour a deadline per
frame; a peer that dies surfaces as PeerClosed as soon as the kernel sees the connection drop (FIN or
RST), with no waiting for a timeout.

Bounded memory: a control message's buffer grows with the bytes that arrived (wire.next_alloc), never
to the size a header claims; listeners cap live and pending connections and the size of a pending
connection's first frame (admission.ListenLimits, set per RealNetwork).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, NoReturn

from ftrun.env.admission import Admission, ListenLimits, log_admit
from ftrun.env.base import (CANCEL_CHECK_S, CONNECT_RETRY_S, AcceptFailed, ConnectError, EnvTimeout, Message,
                            NetTimeout, PeerClosed, ProtocolError, connect_cancelled, split_host_port)
from ftrun.env import wire

if TYPE_CHECKING:
    from ftrun.env.real_bulk import BlockingBulk

_SOCK_BUF = 4 * 1024 * 1024
# One recv() copies at most this much: a huge read holds the socket lock while it copies and stalls the
# sender on loopback (measured: 4 MiB reads ran several times slower than 1 MiB ones).
_RECV_STEP = 1 << 20
# accept() errors on an open listener that a later accept can get past (out of descriptors or buffers):
# AcceptFailed, retried; any other error, but those below, means it is gone.
ACCEPT_TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Errors of the one connection accept() took off the backlog (reset while it waited, or a network error
# pending on it, which Linux passes on from accept(2): its man page says to retry as for EAGAIN): that
# connection is lost and accept() goes on to the next, as for a connection reset before it was admitted.
ACCEPT_CONNECTION_LOST = frozenset(getattr(errno, name) for name in (
    "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH", "EOPNOTSUPP",
    "ENETUNREACH") if hasattr(errno, name))


def _parse(addr: str) -> tuple[int, object]:
    if addr.startswith("unix:"):
        return socket.AF_UNIX, addr[len("unix:"):]
    host, port = split_host_port(addr)
    return socket.AF_INET, (host or "127.0.0.1", port)


def _format(family: int, sockaddr: object) -> str:
    if family == socket.AF_UNIX:
        return f"unix:{sockaddr}"
    host, port = sockaddr[:2]  # type: ignore[index]
    return f"{host}:{port}"


def _tune(sock: socket.socket) -> None:
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _set_buffers(sock, _SOCK_BUF)


def _set_buffers(sock: socket.socket, nbytes: int) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


class RealConnection:
    """Non-blocking socket (blocking while held, see ftrun.env.real_bulk) plus one poll object per
    direction, so a sender and a receiver can wait concurrently, each with its own deadline.

    close() from another thread must wake a task blocked in poll(), but Linux wakes no poll on close(),
    and shutdown() of a connection the peer already reset may fail without raising an event. So each
    connection also polls an eventfd that close() signals.
    """

    def __init__(self, sock: socket.socket, *, hello_limit: int | None = None,
                 on_event: Callable[["RealConnection", str], None] | None = None) -> None:
        """hello_limit: the largest first control message accepted (None: wire.MAX_MSG_BYTES); set for
        connections a listener accepted. on_event(conn, "greeted" | "closed"): the listener's bookkeeping."""
        _tune(sock)
        sock.setblocking(False)
        self._sock = sock
        self._hello_limit, self._on_event = hello_limit, on_event
        self._rx: bytearray | None = None  # a control message being received
        self._wait_all = False  # held (ftrun.env.real_bulk): blocking calls; a recv takes the rest of a frame
        self._send_lock = threading.Lock()
        self._header = bytearray(wire.HEADER_SIZE)
        self._closed = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._rpoll = select.poll()
        self._rpoll.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        self._rpoll.register(self._wake, select.POLLIN)
        self._wpoll = select.poll()
        self._wpoll.register(sock.fileno(), select.POLLOUT)
        self._wpoll.register(self._wake, select.POLLIN)
        self.local_addr = _format(sock.family, sock.getsockname())
        self.peer_addr = _format(sock.family, sock.getpeername()) if sock.family == socket.AF_INET else "unix"

    # -- sending -------------------------------------------------------------------------------
    def send(self, msg: Message, timeout: float | None = None) -> None:
        self._send_all((memoryview(wire.encode_msg(msg)),), timeout)

    def send_bytes(self, buf: memoryview | bytes, timeout: float | None = None) -> None:
        view = memoryview(buf).cast("B")
        self._send_all((memoryview(wire.bulk_header(view.nbytes)), view), timeout)

    def _send_all(self, parts: tuple[memoryview, ...], timeout: float | None) -> None:
        """Header and payload go in one sendmsg: with TCP_NODELAY a separate 9-byte header would be a
        packet (and a wake-up of the receiver) of its own."""
        deadline = None if timeout is None else time.monotonic() + timeout
        left = [p for p in parts if p.nbytes]
        with self._send_lock:
            while left:
                self._check_open()
                try:
                    sent = self._sock.sendmsg(left)
                except BlockingIOError:
                    if not self._wait(self._wpoll, deadline):
                        self._send_timed_out(timeout)
                    continue
                except OSError as e:
                    self._lost("sending", e)
                while sent:
                    take = min(sent, left[0].nbytes)
                    left[0] = left[0][take:]
                    sent -= take
                    if not left[0].nbytes:
                        left.pop(0)
                if left and self._wait_all and _past(deadline):  # held: the kernel's timeout ended a part
                    self._send_timed_out(timeout)

    def _send_timed_out(self, timeout: float | None) -> NoReturn:
        self.close()  # part of a frame may be on the wire: the stream is unusable
        raise NetTimeout(f"send to {self.peer_addr} timed out after {timeout}s") from None

    def hold_bulk(self, timeout: float) -> "BlockingBulk":
        """Bulk sends and receives on this connection that block in the kernel (at most `timeout` per
        call) until the holder's `release()` (see ftrun.env.real_bulk); nothing but close() may use the
        connection meanwhile."""
        from ftrun.env.real_bulk import BlockingBulk

        return BlockingBulk(self, timeout)

    def set_buffer_bytes(self, nbytes: int) -> None:
        """Set the socket's send and receive buffers (SO_SNDBUF / SO_RCVBUF; the kernel doubles them)."""
        if nbytes <= 0:
            raise ValueError(f"socket buffer size must be > 0, got {nbytes}")
        self._check_open()
        _set_buffers(self._sock, nbytes)

    # -- receiving -----------------------------------------------------------------------------
    def recv(self, timeout: float | None) -> Message:
        deadline = None if timeout is None else time.monotonic() + timeout
        kind, length = self._read_header(deadline, timeout)
        wire.expect_kind(kind, wire.KIND_MSG, length)
        if self._hello_limit is not None and length > self._hello_limit:
            self.close()
            raise ProtocolError(f"first message from {self.peer_addr} announces {length} bytes, more than the "
                                f"{self._hello_limit} allowed before the handshake; connection closed")
        payload = bytearray(min(length, wire.ALLOC_STEP))
        self._rx = payload
        try:
            self._read_exact([memoryview(payload)], deadline, timeout, started=True)
            while len(payload) < length:  # grow only once what was allocated has arrived
                received = len(payload)
                payload.extend(bytes(wire.next_alloc(received, length)))
                self._read_exact([memoryview(payload)[received:]], deadline, timeout, started=True)
        finally:
            self._rx = None
        self._greeted()
        return wire.decode_msg(payload)

    @property
    def receive_buffer_bytes(self) -> int:
        """Bytes allocated for a control message now being received (0 between messages)."""
        rx = self._rx
        return len(rx) if rx is not None else 0

    def _greeted(self) -> None:
        if self._hello_limit is not None:
            self._hello_limit = None
            if self._on_event is not None:
                self._on_event(self, "greeted")

    def recv_into(self, buf: memoryview, timeout: float | None) -> None:
        view = memoryview(buf).cast("B")
        deadline = None if timeout is None else time.monotonic() + timeout

        def check(kind: int, length: int) -> None:
            try:
                wire.expect_kind(kind, wire.KIND_BULK, length, view.nbytes)
            except Exception:
                self.close()  # the unread (or wrongly read) payload makes the stream unusable
                raise

        # Held, the payload's size is known: header and payload come in with one recvmsg. The header is
        # checked as soon as a call returns with it, so a frame of another size or kind is still a
        # ProtocolError (once the buffers are full or the hold's timeout ends the call).
        self._read_exact([memoryview(self._header), view] if self._wait_all else [memoryview(self._header)],
                         deadline, timeout, started=False, on_header=check)
        if not self._wait_all:
            self._read_exact([view], deadline, timeout, started=True)
        self._greeted()

    def _read_header(self, deadline: float | None, timeout: float | None) -> tuple[int, int]:
        self._read_exact([memoryview(self._header)], deadline, timeout, started=False)
        return self._parse_header()

    def _parse_header(self) -> tuple[int, int]:
        try:
            return wire.parse_header(self._header)
        except Exception:
            self.close()
            raise

    def _read_exact(self, parts: list[memoryview], deadline: float | None, timeout: float | None, started: bool,
                    on_header: Callable[[int, int], None] | None = None) -> None:
        """Fill `parts` in order from the stream: held, all of them with recvmsg(MSG_WAITALL) calls; else
        one recv of at most _RECV_STEP at a time. `on_header(kind, length)`: parts[0] is a frame header,
        parsed and handed over as soon as it is in (before more of the frame is waited for)."""
        got, total = 0, sum(p.nbytes for p in parts)
        while got < total:
            self._check_open()
            try:
                if self._wait_all:
                    n = self._sock.recvmsg_into(parts, 0, socket.MSG_WAITALL)[0]
                else:
                    n = self._sock.recv_into(parts[0][:_RECV_STEP])
            except BlockingIOError:  # nothing yet (held: nothing within the kernel's timeout)
                if not self._wait(self._rpoll, deadline):
                    self._recv_timed_out(timeout, mid_frame=started or got > 0)
                continue
            except OSError as e:
                self._lost("receiving", e)
            if n == 0:
                self._check_open()
                self.close()
                raise PeerClosed(f"peer {self.peer_addr} closed the connection")
            if on_header is not None and got < wire.HEADER_SIZE <= got + n:
                on_header(*self._parse_header())
            got += n
            while parts and n >= parts[0].nbytes:
                n -= parts.pop(0).nbytes
            if n:
                parts[0] = parts[0][n:]
            if got < total and self._wait_all and _past(deadline):  # held: the kernel's timeout ended a part
                self._recv_timed_out(timeout, mid_frame=True)

    def _recv_timed_out(self, timeout: float | None, mid_frame: bool) -> NoReturn:
        if mid_frame:
            self.close()
        raise NetTimeout(f"receive from {self.peer_addr} timed out after {timeout}s"
                         + (" mid-frame; connection closed" if mid_frame else "")) from None

    def _wait(self, poller: select.poll, deadline: float | None) -> bool:
        """Wait until the socket is ready (or hung up); False if the deadline passed first."""
        if deadline is None:
            poller.poll()
            return True
        remaining = deadline - time.monotonic()
        return remaining > 0 and bool(poller.poll(remaining * 1000.0))

    def _check_open(self) -> None:
        if self._closed:
            raise PeerClosed(f"connection to {self.peer_addr} closed locally")

    def _lost(self, doing: str, error: OSError) -> None:
        self._check_open()
        self.close()
        raise PeerClosed(f"connection to {self.peer_addr} lost while {doing}: {error}") from None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._on_event is not None:
            self._on_event(self, "closed")
        os.eventfd_write(self._wake, 1)  # wakes a task polling this connection
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def __del__(self) -> None:
        on_event = getattr(self, "_on_event", None)
        if on_event is not None and not getattr(self, "_closed", True):
            on_event(self, "closed")  # dropped without close(): the listener must not count it
        # The eventfd outlives close(): a task may still be waking up on it. It goes with the object.
        wake = getattr(self, "_wake", None)
        if wake is not None:
            os.close(wake)
            self._wake = None

    @property
    def closed(self) -> bool:
        return self._closed


class RealListener:
    """Accepts connections under `limits` (see ftrun.env.admission): accept() closes the connections the
    caps refuse or evict and keeps waiting, within its timeout, for one it may return."""

    def __init__(self, addr: str, limits: ListenLimits = ListenLimits()) -> None:
        family, sockaddr = _parse(addr)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        if family == socket.AF_INET:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        elif os.path.exists(sockaddr):  # type: ignore[arg-type]
            os.unlink(sockaddr)  # type: ignore[arg-type]
        self._sock.bind(sockaddr)
        self._sock.listen(1024)
        self._closed = False
        self.addr = _format(family, self._sock.getsockname())
        self.limits = limits
        self._admission = Admission(limits)
        self._lock = threading.RLock()  # RLock: a connection's __del__ may report from inside a locked call
        self._conns: weakref.WeakValueDictionary[int, RealConnection] = weakref.WeakValueDictionary()

    def accept(self, timeout: float | None = None) -> RealConnection:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise PeerClosed("listener is closed")
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                self._sock.settimeout(remaining)  # EBADF here too when another thread closes the listener
                sock, _ = self._sock.accept()
            except (socket.timeout, BlockingIOError):  # BlockingIOError: no time was left (timeout 0)
                raise EnvTimeout(f"accept timed out after {timeout}s") from None
            except OSError as e:
                if not self._closed and e.errno in ACCEPT_CONNECTION_LOST:
                    continue
                if self._closed or e.errno not in ACCEPT_TRANSIENT:
                    raise PeerClosed(f"listener {self.addr} closed: {e}") from None
                raise AcceptFailed(f"accept on {self.addr} failed: {e}") from None
            sock.settimeout(None)
            conn = self._admit(sock)
            if conn is not None:
                return conn

    def _admit(self, sock: socket.socket) -> RealConnection | None:
        try:
            conn = RealConnection(sock, hello_limit=self.limits.max_hello_bytes, on_event=self._on_event)
        except OSError as e:
            sock.close()
            if e.errno in ACCEPT_TRANSIENT:  # e.g. no descriptor left for its wake-up eventfd: this one is lost
                raise AcceptFailed(f"accept on {self.addr} failed: {e}") from None
            return None  # the peer reset it before we got to it
        with self._lock:
            decision = self._admission.accepted(id(conn))
            evicted = [self._conns.get(cid) for cid in decision.evict]
            if decision.keep:
                self._conns[id(conn)] = conn
        for old in evicted:
            if old is not None:
                old.close()
        log_admit(self.addr, decision)
        if not decision.keep:
            conn._on_event = None
            conn.close()
            return None
        return conn

    def _on_event(self, conn: RealConnection, event: str) -> None:
        with self._lock:
            if self._conns.get(id(conn)) is not conn and event == "greeted":
                return  # evicted or refused meanwhile
            if event == "greeted":
                self._admission.greeted(id(conn))
            else:
                self._admission.closed(id(conn))
                self._conns.pop(id(conn), None)

    def stats(self) -> dict[str, int]:
        """Accepted connections now live and pending, how many were refused and evicted, and the bytes
        their receive buffers hold for control messages in progress."""
        with self._lock:
            conns = list(self._conns.values())
            adm = self._admission
            out = {"live": adm.num_live, "pending": adm.num_pending, "refused": adm.num_refused,
                   "evicted": adm.num_evicted}
        out["buffered_bytes"] = sum(c.receive_buffer_bytes for c in conns)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept on Linux
        except OSError:
            pass
        self._sock.close()


class RealNetwork:
    """`limits` apply to every listener this network makes."""

    def __init__(self, limits: ListenLimits = ListenLimits()) -> None:
        self.limits = limits

    def listen(self, addr: str) -> RealListener:
        return RealListener(addr, self.limits)

    def connect(self, addr: str, timeout: float, cancelled: Callable[[], bool] | None = None) -> RealConnection:
        family, sockaddr = _parse(addr)
        start = time.monotonic()
        deadline = start + timeout
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            left = max(deadline - time.monotonic(), 1e-3)
            sock.settimeout(left if cancelled is None else min(left, CANCEL_CHECK_S))
            try:
                sock.connect(sockaddr)
                sock.settimeout(None)
                return RealConnection(sock)
            except OSError as e:  # refused, no such socket file, timed out, unreachable
                sock.close()
                if cancelled is not None and cancelled():
                    raise connect_cancelled(addr, time.monotonic() - start) from None
                if time.monotonic() + CONNECT_RETRY_S >= deadline:
                    raise ConnectError(f"cannot connect to {addr} within {timeout}s: {e}") from None
                time.sleep(CONNECT_RETRY_S)  # listener may not be up yet: retry until the deadline
