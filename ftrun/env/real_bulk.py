"""Blocking bulk frames on a connection that one user holds for a while (an FTAR ring link during one
all-reduce): the socket is put in blocking mode with SO_SNDTIMEO / SO_RCVTIMEO, so a frame goes out with
one sendmsg (header + payload) and comes in with one recvmsg(MSG_WAITALL) into the header and the
receiver's buffer (the receiver knows the size; the header is checked when the call returns, so a frame of
another size or kind is a ProtocolError); `release` puts the socket back in non-blocking mode.

Why: RealConnection waits in poll() and copies at most 1 MiB per recv, so a chunk costs a return to
Python and two system calls for every piece that arrives (on loopback, every 64 KiB segment). Held, one
call moves the whole chunk while the thread sleeps in the kernel, so the sender's and the receiver's
copies interleave without Python in between; with small socket buffers on same-machine links
(RealConnection.set_buffer_bytes) the bytes are still in cache when the receiver copies them out
(benchmarks/results/ftar_socket.md).

The calls are RealConnection's own send_bytes / recv_into (same frames, errors and deadlines): a call the
kernel's timeout ends with nothing moved falls back to their poll() wait, which ends at the deadline; one
it ends with part of a frame moved is a timeout once the deadline has passed (a peer that trickles bytes
cannot stretch a frame past it).
close() from another task shuts the socket down, which wakes a blocked call at once (PeerClosed).
Nothing but close() may use the connection between `RealConnection.hold_bulk` and `release`.

`hold_socket` / `send_held` / `release_socket` are the same hold on a bare socket (the catch-up server's
shard bodies, sent from a task of their own while its event loop serves other requests).
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

RealConnection = Any  # ftrun.env.real_net.RealConnection, which imports this module (no cycle back)


class BlockingBulk:
    """A hold on `conn`: `send_bytes` and `recv_into` block in the kernel, each call at most `timeout`
    seconds there. Threading: one sender and one receiver at a time; close() of the connection from any
    task."""

    def __init__(self, conn: RealConnection, timeout: float) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self._conn = conn
        conn._check_open()
        try:
            hold_socket(conn._sock, timeout)
        except OSError as e:  # closed by another task meanwhile
            conn._lost("holding it", e)
        conn._wait_all = True
        self.send_bytes, self.recv_into = conn.send_bytes, conn.recv_into

    def release(self) -> None:
        """Back to the connection's non-blocking mode (nothing to do once it is closed)."""
        self._conn._wait_all = False
        if not self._conn.closed:
            release_socket(self._conn._sock)


def hold_socket(sock: socket.socket, timeout: float) -> None:
    """Put `sock` in blocking mode, each send or receive at most `timeout` seconds in the kernel with
    nothing moved (SO_SNDTIMEO / SO_RCVTIMEO). Raises OSError if the socket is closed."""
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    whole = int(timeout)
    micros = max(int((timeout - whole) * 1e6), 0 if whole else 1)  # a zero timeval never times out
    limit = struct.pack("ll", whole, micros)  # struct timeval
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.setblocking(True)


def send_held(sock: socket.socket, data: memoryview, timeout: float) -> None:
    """All of `data` on a socket held by `hold_socket`: a send blocks in the kernel (the GIL released)
    until it has moved what it could. TimeoutError once `timeout` has passed with bytes left (a peer that
    stops reading or trickles cannot stretch it); OSError if the connection fails or is shut down."""
    deadline = time.monotonic() + timeout
    view = memoryview(data).cast("B")
    while view.nbytes:
        try:
            sent = sock.send(view)
        except BlockingIOError:  # the kernel's timeout ended the call with nothing moved
            sent = 0
        view = view[sent:]
        if view.nbytes and time.monotonic() >= deadline:
            raise TimeoutError(f"sent {len(data) - view.nbytes} of {len(data)} bytes in {timeout:g}s")


def release_socket(sock: socket.socket) -> None:
    """Back to non-blocking mode (nothing to do once the socket is closed)."""
    try:
        sock.setblocking(False)
    except OSError:
        pass  # closed meanwhile
