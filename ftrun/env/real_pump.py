"""Both directions of a ring link driven by one thread: bulk frames to the next rank are queued and
pushed while the caller waits for frames from the previous rank (or for a queued frame to go).

Why: with a sender thread per link, every chunk costs hand-offs between threads (queue, event, the
GIL), and on a busy host each hand-off waits for a CPU. One thread polling both sockets moves bytes
whenever either is ready, sends header and payload in one sendmsg, and receives them in one
recvmsg_into. Frames are the same bulk frames as RealConnection.send_bytes / recv_into, so the other
side may use either.

Errors are those of RealConnection: PeerClosed (peer gone, or a connection closed locally, which
wakes a waiting pump through the connections' eventfds), NetTimeout (the wait passed its deadline;
mid-frame, so both connections are closed), ProtocolError (a frame of another kind or size).
"""

from __future__ import annotations

import select
import time
from collections import deque
from typing import Any

from ftrun.env import wire
from ftrun.env.base import NetTimeout, PeerClosed, ProtocolError

RealConnection = Any  # ftrun.env.real_net.RealConnection, which imports this module (no cycle back)

_RECV_STEP = 1 << 20  # as RealConnection: bounded copies keep a loopback sender moving


class RealPump:
    """Queued bulk sends on `out`, bulk receives from `inc`. Threading: one caller at a time."""

    def __init__(self, out: RealConnection, inc: RealConnection) -> None:
        self._out, self._in = out, inc
        self._queue: deque[list] = deque()  # [header view, payload view], the head partly sent
        self.num_queued = 0  # frames queued so far; a frame's ticket is its number
        self.num_sent = 0  # frames handed whole to the kernel
        self._header = bytearray(wire.HEADER_SIZE)
        self._polls: dict[tuple[bool, bool], select.poll] = {}

    # -- the caller's three operations -------------------------------------------------------------
    def send(self, buf) -> int:
        """Queue one bulk frame of `buf` (not copied: keep it unchanged until sent). Returns its ticket:
        the frame is sent once `num_sent >= ticket`."""
        view = memoryview(buf).cast("B")
        self._queue.append([memoryview(wire.bulk_header(view.nbytes)), view])
        self.num_queued += 1
        return self.num_queued

    def wait_sent(self, ticket: int, timeout: float) -> None:
        """Push queued frames until frame `ticket` is sent."""
        deadline = time.monotonic() + timeout
        while self.num_sent < ticket:
            if not self._push():
                self._wait(deadline, timeout, want_in=False)

    def recv_into(self, buf, timeout: float) -> None:
        """Receive the next bulk frame from `inc`, exactly len(buf) bytes, into buf; queued frames
        keep going out meanwhile."""
        view = memoryview(buf).cast("B")
        header = memoryview(self._header)
        deadline = time.monotonic() + timeout
        got_header = got = 0
        while got < view.nbytes or got_header < wire.HEADER_SIZE:
            moved = self._push()
            try:
                if got_header < wire.HEADER_SIZE:
                    n = self._in._sock.recvmsg_into([header[got_header:], view[:_RECV_STEP]])[0]
                    h = min(n, wire.HEADER_SIZE - got_header)
                    got_header += h
                    if got_header == wire.HEADER_SIZE:
                        self._check_header(view.nbytes)
                    got += n - h  # iovecs fill in order: payload bytes only once the header is whole
                else:
                    n = self._in._sock.recv_into(view[got:got + _RECV_STEP])
                    got += n
            except BlockingIOError:
                n = -1
            except OSError as e:
                self._lost(self._in, "receiving", e)
            if n == 0:
                self._lost(self._in, "receiving", None)
            if n < 0 and not moved:
                self._wait(deadline, timeout, want_in=True)

    def flush(self, timeout: float) -> None:
        """Push every queued frame."""
        self.wait_sent(self.num_queued, timeout)

    # -- internals ---------------------------------------------------------------------------------
    def _check_header(self, want: int) -> None:
        try:
            kind, length = wire.parse_header(self._header)
            wire.expect_kind(kind, wire.KIND_BULK, length, want)
        except ProtocolError:
            self._in.close()
            raise

    def _push(self) -> bool:
        """Send what the socket takes now; True if any byte went."""
        out = self._out
        moved = False
        while self._queue:
            if out._closed:
                raise PeerClosed(f"connection to {out.peer_addr} closed locally")
            frame = self._queue[0]
            try:
                n = out._sock.sendmsg(frame)
            except BlockingIOError:
                return moved
            except OSError as e:
                self._lost(out, "sending", e)
            moved = True
            for i, part in enumerate(frame):
                take = min(n, part.nbytes)
                frame[i] = part[take:]
                n -= take
            if frame[1].nbytes == 0 and frame[0].nbytes == 0:
                self._queue.popleft()
                self.num_sent += 1
        return moved

    def _wait(self, deadline: float, timeout: float, *, want_in: bool) -> None:
        want_out = bool(self._queue)
        for conn in (self._in, self._out):
            if conn._closed:
                raise PeerClosed(f"connection to {conn.peer_addr} closed locally")
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not self._poll(want_in, want_out).poll(remaining * 1000.0):
            self._in.close()
            self._out.close()
            raise NetTimeout(f"ring transfer with {self._in.peer_addr} / {self._out.peer_addr} made no progress "
                             f"within {timeout}s; connections closed")

    def _poll(self, want_in: bool, want_out: bool) -> select.poll:
        key = (want_in, want_out)
        p = self._polls.get(key)
        if p is None:
            p = select.poll()
            if want_in:
                p.register(self._in._sock.fileno(), select.POLLIN | select.POLLPRI)
            if want_out:
                p.register(self._out._sock.fileno(), select.POLLOUT)
            for conn in {id(self._in): self._in, id(self._out): self._out}.values():
                p.register(conn._wake, select.POLLIN)
            self._polls[key] = p
        return p

    @staticmethod
    def _lost(conn: RealConnection, doing: str, error: OSError | None) -> None:
        if conn._closed:
            raise PeerClosed(f"connection to {conn.peer_addr} closed locally")
        conn.close()
        why = f": {error}" if error is not None else ""
        raise PeerClosed(f"connection to {conn.peer_addr} lost while {doing}{why}") from None
