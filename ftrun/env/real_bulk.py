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
"""

from __future__ import annotations

import socket
import struct
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
        whole = int(timeout)
        micros = max(int((timeout - whole) * 1e6), 0 if whole else 1)  # a zero timeval never times out
        limit = struct.pack("ll", whole, micros)  # struct timeval
        try:
            conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
            conn._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
            conn._sock.setblocking(True)
        except OSError as e:  # closed by another task meanwhile
            conn._lost("holding it", e)
        conn._wait_all = True
        self.send_bytes, self.recv_into = conn.send_bytes, conn.recv_into

    def release(self) -> None:
        """Back to the connection's non-blocking mode (nothing to do once it is closed)."""
        self._conn._wait_all = False
        if self._conn.closed:
            return
        try:
            self._conn._sock.setblocking(False)
        except OSError:
            pass  # closed by another task meanwhile
