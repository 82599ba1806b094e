"""One keep-alive HTTP/1.1 client connection whose response bodies land straight in caller buffers.

An asyncio BufferedProtocol: the event loop `recv_into`s the socket directly into the buffer that
`get_buffer` hands out. While a response head is awaited that is a small head buffer; once the head
parses, the caller's `pick_body(head)` names the body's buffer (for a shard: its slice of the
destination tensor), and the rest of the body is received into it with no copy. The CRC32 of the body is
computed as bytes arrive, while they are still in cache.

Requests may be pipelined: `send` writes a request while earlier ones are still being answered, and
the responses are taken in order (each into its own `pick_body` buffer), so the server starts the next
body as soon as it has sent the previous one — no round trip between them. `get` is `send` plus `wait`.

Failures: the connection closing mid-response raises ConnectionLost (with how much of that response
arrived; requests queued behind it get ConnectionLost with got=0); nothing arriving for `stall_s` raises
SourceStalled; a malformed response raises CatchupPeerError. After any of them the connection is closed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ftrun.catchup.checksum import crc32
from ftrun.catchup.errors import CatchupPeerError
from ftrun.catchup.wire import HEAD_END, MAX_HEAD_BYTES, ResponseHead, encode_get, parse_head

PickBody = Callable[[ResponseHead], memoryview]
# One receive copies at most this much of a body, as ftrun.env.real_net's bulk receives do: a larger
# read holds the socket while it copies (stalling a loopback sender), and the CRC32 of a 1 MiB piece
# runs on bytes still in cache (50 MiB from 2 sources, load ~7 on 2 cores: median 0.94 GB/s in two runs
# against 0.62-0.76 with reads up to the whole remaining body).
RECV_STEP = 1 << 20


class ConnectionLost(CatchupPeerError):
    """The connection closed before the response was complete (e.g. a short body)."""

    def __init__(self, message: str, *, got: int) -> None:
        super().__init__(message)
        self.got = got  # response bytes (head and body) that arrived


class SourceStalled(CatchupPeerError):
    """Nothing arrived for longer than the stall limit."""


@dataclass(frozen=True)
class Response:
    head: ResponseHead
    body: memoryview
    crc32: int


@dataclass(frozen=True)
class _Request:
    future: asyncio.Future
    pick_body: PickBody


class HttpConnection(asyncio.BufferedProtocol):
    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self._token = host, port, token
        self._head = bytearray(MAX_HEAD_BYTES)
        self._head_len = 0
        self._state = "idle"  # idle | head | body | closing | closed
        self._transport: asyncio.Transport | None = None
        self._queue: deque[_Request] = deque()  # requests sent, not answered yet; the first is being received
        self._response_head: ResponseHead | None = None
        self._body = memoryview(b"")
        self._pos = self._crc = 0
        self.received = 0  # bytes received on this connection (the stall watchdog watches it)
        self._request_start = 0

    @classmethod
    async def open(cls, host: str, port: int, token: str, timeout: float) -> "HttpConnection":
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(loop.create_connection(lambda: cls(host, port, token), host, port), timeout)
        return conn

    @property
    def usable(self) -> bool:
        """Idle: no request outstanding."""
        return self._state == "idle"

    @property
    def open_for_requests(self) -> bool:
        """A request may be sent now (pipelined behind outstanding ones if any)."""
        return self._state in ("idle", "head", "body")

    def send(self, path: str, pick_body: PickBody) -> asyncio.Future:
        """Send GET `path`; the future gets its Response once every earlier response is done."""
        if not self.open_for_requests:
            raise ConnectionLost(f"connection to {self.host}:{self.port} is {self._state}", got=0)
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(future, pick_body))
        if self._state == "idle":
            self._state, self._head_len, self._request_start = "head", 0, self.received
        self._transport.write(encode_get(self.host, self.port, path, self._token))
        return future

    async def get(self, path: str, pick_body: PickBody, *, head_wait_s: float, stall_s: float) -> Response:
        """GET `path`; the body goes into `pick_body(head)`. Raises ConnectionLost, SourceStalled,
        CatchupPeerError."""
        return await self.wait(self.send(path, pick_body), head_wait_s=head_wait_s, stall_s=stall_s)

    async def wait(self, future: asyncio.Future, *, head_wait_s: float, stall_s: float) -> Response:
        """The response of a request `send` made; SourceStalled if the connection goes quiet for
        stall_s (plus head_wait_s while a head is awaited: the server long-polls before answering)."""
        loop = asyncio.get_running_loop()
        seen, quiet_since = self.received, loop.time()
        while True:
            allowed = stall_s + (head_wait_s if self._state == "head" else 0.0)
            await asyncio.wait({future}, timeout=max(quiet_since + allowed - loop.time(), 0.001))
            if future.done():
                return future.result()
            if self.received != seen:
                seen, quiet_since = self.received, loop.time()
            elif loop.time() - quiet_since >= allowed:
                self.close()  # cancels `future`
                raise SourceStalled(f"{self.host}:{self.port} sent nothing for {allowed:g}s")

    def close(self) -> None:
        """Abort the connection; requests in progress are cancelled."""
        self._state = "closed"
        while self._queue:
            future = self._queue.popleft().future
            if not future.done():
                future.cancel()
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.BufferedProtocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == "body":
            return self._body[self._pos:self._pos + RECV_STEP]
        return memoryview(self._head)[self._head_len:]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        try:
            if self._state == "body":
                self._take_body(nbytes)
            elif self._state == "head":
                self._head_len += nbytes
                self._take_heads(max(0, self._head_len - nbytes - 3))
            else:
                raise CatchupPeerError(f"{self.host}:{self.port} sent {nbytes} bytes outside of a response")
        except CatchupPeerError as e:
            self._fail(e)
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        got, state = self._got(), self._state
        self._state = "closed"
        if state in ("head", "body"):
            self._fail(ConnectionLost(f"{self.host}:{self.port} closed the connection after {got} bytes "
                                      f"of the response" + (f" ({exc})" if exc else ""), got=got))

    # -- internals -----------------------------------------------------------------------------
    def _got(self) -> int:
        return self.received - self._request_start

    def _take_heads(self, scan_from: int) -> None:
        """Parse the head in the head buffer, if complete; bytes after it start its body and, once that
        is whole, the next response (a pipelined one) — so one receive may end several responses."""
        while self._state == "head":
            end = self._head.find(HEAD_END, scan_from, self._head_len)
            if end < 0:
                if self._head_len == MAX_HEAD_BYTES:
                    raise CatchupPeerError(f"response head from {self.host}:{self.port} exceeds "
                                           f"{MAX_HEAD_BYTES} bytes")
                return
            end += len(HEAD_END)
            head = parse_head(bytes(self._head[:end]))
            body = self._queue[0].pick_body(head)
            if body.nbytes != head.content_length:
                raise CatchupPeerError(f"body buffer of {body.nbytes} bytes for a {head.content_length}-byte body")
            take = min(self._head_len - end, body.nbytes)
            self._response_head, self._body, self._pos, self._crc = head, body, 0, 0
            self._state = "body"
            body[:take] = self._head[end:end + take]
            rest = self._head[end + take:self._head_len]
            self._take_body(take)
            scan_from = 0
            if rest:
                if self._state != "head":
                    raise CatchupPeerError(f"{self.host}:{self.port} sent more bytes than its Content-Length")
                self._head[:len(rest)] = rest
                self._head_len, self._request_start = len(rest), self.received - len(rest)

    def _take_body(self, nbytes: int) -> None:
        pos = self._pos
        self._crc = crc32(self._body[pos:pos + nbytes], self._crc)
        self._pos = pos + nbytes
        if self._pos < self._body.nbytes:
            return
        request = self._queue.popleft()
        if not self._response_head.keep_alive:
            self._state = "closing"
        elif self._queue:
            self._state, self._head_len, self._request_start = "head", 0, self.received
        else:
            self._state = "idle"
        if not request.future.done():
            request.future.set_result(Response(self._response_head, self._body, self._crc))
        if self._state == "closing":
            self._fail(ConnectionLost(f"{self.host}:{self.port} closed the connection before answering", got=0))
            self._transport.close()

    def _fail(self, error: Exception) -> None:
        """The first outstanding request gets `error`; the ones behind it were never answered."""
        first = True
        while self._queue:
            future = self._queue.popleft().future
            if not future.done():
                future.set_exception(error if first else ConnectionLost(
                    f"{self.host}:{self.port}: an earlier response on the connection failed", got=0))
            first = False
