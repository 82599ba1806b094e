"""Real network for RealEnv: framed messages and bulk buffers over TCP or Unix stream sockets.

Addresses are "host:port" (port 0 picks a free port) or "unix:/path". Receives honour a deadline per
frame; a peer that dies surfaces as PeerClosed as soon as the kernel sees the connection drop (FIN or
RST), with no waiting for a timeout.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time

from ftrun.env.base import ConnectError, EnvTimeout, Message, NetTimeout, PeerClosed
from ftrun.env import wire

_SOCK_BUF = 4 * 1024 * 1024
# One recv() copies at most this much: a huge read holds the socket lock while it copies and stalls the
# sender on loopback (measured: 4 MiB reads ran several times slower than 1 MiB ones).
_RECV_STEP = 1 << 20


def _parse(addr: str) -> tuple[int, object]:
    if addr.startswith("unix:"):
        return socket.AF_UNIX, addr[len("unix:"):]
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} is not 'host:port' or 'unix:/path'")
    return socket.AF_INET, (host or "127.0.0.1", int(port))


def _format(family: int, sockaddr: object) -> str:
    if family == socket.AF_UNIX:
        return f"unix:{sockaddr}"
    host, port = sockaddr[:2]  # type: ignore[index]
    return f"{host}:{port}"


def _tune(sock: socket.socket) -> None:
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


class RealConnection:
    """Non-blocking socket plus one poll object per direction, so a sender and a receiver can wait
    concurrently, each with its own deadline.

    close() from another thread must wake a task blocked in poll(), but Linux wakes no poll on close(),
    and shutdown() of a connection the peer already reset may fail without raising an event. So each
    connection also polls an eventfd that close() signals.
    """

    def __init__(self, sock: socket.socket) -> None:
        _tune(sock)
        sock.setblocking(False)
        self._sock = sock
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
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._send_lock:
            for part in parts:
                sent = 0
                while sent < part.nbytes:
                    self._check_open()
                    try:
                        sent += self._sock.send(part[sent:])
                        continue
                    except BlockingIOError:
                        pass
                    except OSError as e:
                        self._lost("sending", e)
                    if not self._wait(self._wpoll, deadline):
                        self.close()  # part of a frame may be on the wire: the stream is unusable
                        raise NetTimeout(f"send to {self.peer_addr} timed out after {timeout}s")

    # -- receiving -----------------------------------------------------------------------------
    def recv(self, timeout: float | None) -> Message:
        deadline = None if timeout is None else time.monotonic() + timeout
        kind, length = self._read_header(deadline, timeout)
        wire.expect_kind(kind, wire.KIND_MSG, length)
        payload = bytearray(length)
        self._read_exact(memoryview(payload), deadline, timeout, started=True)
        return wire.decode_msg(payload)

    def recv_into(self, buf: memoryview, timeout: float | None) -> None:
        view = memoryview(buf).cast("B")
        deadline = None if timeout is None else time.monotonic() + timeout
        kind, length = self._read_header(deadline, timeout)
        try:
            wire.expect_kind(kind, wire.KIND_BULK, length, view.nbytes)
        except Exception:
            self.close()  # the unread payload makes the stream unusable
            raise
        self._read_exact(view, deadline, timeout, started=True)

    def _read_header(self, deadline: float | None, timeout: float | None) -> tuple[int, int]:
        self._read_exact(memoryview(self._header), deadline, timeout, started=False)
        try:
            return wire.parse_header(self._header)
        except Exception:
            self.close()
            raise

    def _read_exact(self, view: memoryview, deadline: float | None, timeout: float | None, started: bool) -> None:
        got = 0
        while got < view.nbytes:
            self._check_open()
            try:
                n = self._sock.recv_into(view[got:got + _RECV_STEP])
            except BlockingIOError:
                if not self._wait(self._rpoll, deadline):
                    mid_frame = started or got > 0
                    if mid_frame:
                        self.close()
                    raise NetTimeout(f"receive from {self.peer_addr} timed out after {timeout}s"
                                     + (" mid-frame; connection closed" if mid_frame else "")) from None
                continue
            except OSError as e:
                self._lost("receiving", e)
            if n == 0:
                self._check_open()
                self.close()
                raise PeerClosed(f"peer {self.peer_addr} closed the connection")
            got += n

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
        os.eventfd_write(self._wake, 1)  # wakes a task polling this connection
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def __del__(self) -> None:
        # The eventfd outlives close(): a task may still be waking up on it. It goes with the object.
        wake = getattr(self, "_wake", None)
        if wake is not None:
            os.close(wake)
            self._wake = None

    @property
    def closed(self) -> bool:
        return self._closed


class RealListener:
    def __init__(self, addr: str) -> None:
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

    def accept(self, timeout: float | None = None) -> RealConnection:
        if self._closed:
            raise PeerClosed("listener is closed")
        self._sock.settimeout(timeout)
        try:
            sock, _ = self._sock.accept()
        except socket.timeout:
            raise EnvTimeout(f"accept timed out after {timeout}s") from None
        except OSError as e:
            raise PeerClosed(f"listener {self.addr} closed: {e}") from None
        sock.settimeout(None)
        return RealConnection(sock)

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
    def listen(self, addr: str) -> RealListener:
        return RealListener(addr)

    def connect(self, addr: str, timeout: float) -> RealConnection:
        family, sockaddr = _parse(addr)
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                sock.connect(sockaddr)
                sock.settimeout(None)
                return RealConnection(sock)
            except (ConnectionRefusedError, FileNotFoundError, socket.timeout, OSError) as e:
                sock.close()
                if time.monotonic() + 0.02 >= deadline:
                    raise ConnectError(f"cannot connect to {addr} within {timeout}s: {e}") from None
                time.sleep(0.02)  # listener may not be up yet: retry until the deadline
