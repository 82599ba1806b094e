"""Bulk frames on a connection that one user holds for a while (an FTAR ring link during one all-reduce),
waiting inside the kernel: the socket is put in blocking mode with SO_SNDTIMEO / SO_RCVTIMEO as the
deadline, a frame goes out with one sendmsg (header + payload) and comes in with two
recv_into(MSG_WAITALL) calls (header, then payload); `release` puts the socket back in non-blocking mode.

Why: RealConnection waits in poll() and copies at most 1 MiB per recv, so a chunk costs a return to
Python and two system calls for every piece that arrives (on loopback, every 64 KiB segment). Here one
call moves the whole chunk while the thread sleeps in the kernel, so the sender's and the receiver's
copies interleave without Python in between; with small socket buffers on same-machine links
(RealConnection.set_buffer_bytes) the bytes are still in cache when the receiver copies them out.

Frames are the same bulk frames as RealConnection.send_bytes / recv_into, so the other side may use
either. Errors are those of RealConnection: PeerClosed (the peer died or closed; or close() from another
task, which shuts the socket down and so wakes a blocked send or receive at once), NetTimeout (the
deadline passed; mid-frame, so the connection is closed), ProtocolError (a frame of another kind or
size; the connection is closed).

Nothing but close() may use the connection between `RealConnection.hold_bulk` and `release`.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from ftrun.env import wire
from ftrun.env.base import NetTimeout, PeerClosed, ProtocolError

RealConnection = Any  # ftrun.env.real_net.RealConnection, which imports this module (no cycle back)


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class BlockingBulk:
    """Blocking bulk sends and receives on `conn`, each call bounded by `timeout` seconds (the
    `timeout` argument of the calls, when given, overrides it). Threading: one sender and one receiver
    at a time; close() of the connection from any task."""

    def __init__(self, conn: RealConnection, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._conn, self._timeout = conn, timeout
        self._header = bytearray(wire.HEADER_SIZE)
        self._armed = {socket.SO_SNDTIMEO: 0.0, socket.SO_RCVTIMEO: 0.0}
        conn._check_open()
        try:
            self._arm(socket.SO_SNDTIMEO, timeout)
            self._arm(socket.SO_RCVTIMEO, timeout)
            conn._sock.setblocking(True)
        except OSError as e:  # closed by another task meanwhile
            conn._lost("holding it", e)

    def _arm(self, option: int, remaining: float) -> None:
        """Bound the next blocked call (SO_SNDTIMEO or SO_RCVTIMEO) by the time left to its deadline. A
        call that returns with part of a frame comes back here, so the deadline is checked; the limit is
        only lowered (or raised) once it is 5% off, one setsockopt per frame at most in the usual case."""
        armed = self._armed[option]
        if remaining > armed or remaining < 0.95 * armed:
            self._conn._sock.setsockopt(socket.SOL_SOCKET, option, _timeval(max(remaining, 1e-3)))
            self._armed[option] = remaining

    def send_bytes(self, buf, timeout: float | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        view = memoryview(buf).cast("B")
        left = [memoryview(wire.bulk_header(view.nbytes)), view]
        deadline = time.monotonic() + timeout
        conn = self._conn
        while left:
            conn._check_open()
            self._arm(socket.SO_SNDTIMEO, deadline - time.monotonic())
            try:
                sent = conn._sock.sendmsg(left)
            except BlockingIOError:  # the kernel's timeout passed with nothing sent
                sent = 0
            except OSError as e:
                conn._lost("sending", e)
            while sent:
                take = min(sent, left[0].nbytes)
                left[0] = left[0][take:]
                sent -= take
                if not left[0].nbytes:
                    left.pop(0)
            if left and time.monotonic() >= deadline:
                conn.close()  # part of a frame may be on the wire: the stream is unusable
                raise NetTimeout(f"send to {conn.peer_addr} timed out after {timeout}s; connection closed")

    def recv_into(self, buf, timeout: float | None = None) -> None:
        """The next frame, which must be a bulk frame of exactly len(buf) bytes, into buf."""
        timeout = self._timeout if timeout is None else timeout
        view = memoryview(buf).cast("B")
        deadline = time.monotonic() + timeout
        self._read(memoryview(self._header), deadline, timeout, started=False)
        try:
            kind, length = wire.parse_header(self._header)
            wire.expect_kind(kind, wire.KIND_BULK, length, view.nbytes)
        except ProtocolError:
            self._conn.close()  # the unread payload makes the stream unusable
            raise
        self._read(view, deadline, timeout, started=True)

    def _read(self, view: memoryview, deadline: float, timeout: float, *, started: bool) -> None:
        conn, got = self._conn, 0
        while got < view.nbytes:
            conn._check_open()
            self._arm(socket.SO_RCVTIMEO, deadline - time.monotonic())
            try:
                n = conn._sock.recv_into(view[got:], view.nbytes - got, socket.MSG_WAITALL)
            except BlockingIOError:  # the kernel's timeout passed with nothing received
                n = -1
            except OSError as e:
                conn._lost("receiving", e)
            if n == 0:
                conn._check_open()  # closed here: PeerClosed "closed locally"
                conn.close()
                raise PeerClosed(f"peer {conn.peer_addr} closed the connection")
            got += max(n, 0)
            if got < view.nbytes and time.monotonic() >= deadline:
                mid_frame = started or got > 0
                if mid_frame:
                    conn.close()
                raise NetTimeout(f"receive from {conn.peer_addr} timed out after {timeout}s"
                                 + (" mid-frame; connection closed" if mid_frame else ""))

    def release(self) -> None:
        """Back to the connection's non-blocking mode (nothing to do once it is closed)."""
        if self._conn.closed:
            return
        try:
            self._conn._sock.setblocking(False)
        except OSError:
            pass  # closed by another task meanwhile
