"""One keep-alive HTTP/1.1 client connection whose response bodies land straight in caller buffers.

An asyncio BufferedProtocol: the event loop `recv_into`s the socket directly into the buffer that
`get_buffer` hands out. While a response head is awaited that is a small head buffer; once the head
parses, the caller's `pick_body(head)` names the body's buffer (for a shard: its slice of the
destination tensor), and the rest of the body is received into it with no copy. The CRC32 of the body is
computed as bytes arrive, while they are still in cache. One request at a time per connection.

Failures: the connection closing mid-response raises ConnectionLost (with how much arrived); nothing
arriving for `stall_s` raises SourceStalled; a malformed response raises CatchupPeerError. After any of
them the connection is closed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from ftrun.catchup.checksum import crc32
from ftrun.catchup.errors import CatchupPeerError
from ftrun.catchup.wire import HEAD_END, MAX_HEAD_BYTES, ResponseHead, encode_get, parse_head

PickBody = Callable[[ResponseHead], memoryview]


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


class HttpConnection(asyncio.BufferedProtocol):
    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port, self._token = host, port, token
        self._head = bytearray(MAX_HEAD_BYTES)
        self._head_len = 0
        self._state = "idle"  # idle | head | body | closed
        self._transport: asyncio.Transport | None = None
        self._future: asyncio.Future | None = None
        self._pick_body: PickBody | None = None
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
        return self._state == "idle"

    async def get(self, path: str, pick_body: PickBody, *, head_wait_s: float, stall_s: float) -> Response:
        """GET `path`; the body goes into `pick_body(head)`. Raises ConnectionLost, SourceStalled,
        CatchupPeerError."""
        if self._state != "idle":
            raise ConnectionLost(f"connection to {self.host}:{self.port} is {self._state}", got=0)
        self._future = asyncio.get_running_loop().create_future()
        self._pick_body, self._state, self._head_len = pick_body, "head", 0
        self._request_start = self.received
        self._transport.write(encode_get(self.host, self.port, path, self._token))
        return await self._watch(self._future, head_wait_s, stall_s)

    async def _watch(self, future: asyncio.Future, head_wait_s: float, stall_s: float) -> Response:
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
        """Abort the connection; a request in progress is cancelled."""
        self._state = "closed"
        if self._future is not None and not self._future.done():
            self._future.cancel()
        if self._transport is not None:
            self._transport.abort()

    # -- asyncio.BufferedProtocol --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._state == "body":
            return self._body[self._pos:]
        return memoryview(self._head)[self._head_len:]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        try:
            if self._state == "body":
                self._take_body(nbytes)
            elif self._state == "head":
                self._take_head(nbytes)
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

    def _take_head(self, nbytes: int) -> None:
        self._head_len += nbytes
        end = self._head.find(HEAD_END, max(0, self._head_len - nbytes - 3), self._head_len)
        if end < 0:
            if self._head_len == MAX_HEAD_BYTES:
                raise CatchupPeerError(f"response head from {self.host}:{self.port} exceeds {MAX_HEAD_BYTES} bytes")
            return
        end += len(HEAD_END)
        head = parse_head(bytes(self._head[:end]))
        body = self._pick_body(head)
        if body.nbytes != head.content_length:
            raise CatchupPeerError(f"body buffer of {body.nbytes} bytes for a {head.content_length}-byte body")
        extra = self._head_len - end
        if extra > body.nbytes:
            raise CatchupPeerError(f"{self.host}:{self.port} sent more bytes than its Content-Length")
        self._response_head, self._body, self._pos, self._crc = head, body, 0, 0
        self._state = "body"
        body[:extra] = self._head[end:self._head_len]
        self._take_body(extra)

    def _take_body(self, nbytes: int) -> None:
        pos = self._pos
        self._crc = crc32(self._body[pos:pos + nbytes], self._crc)
        self._pos = pos + nbytes
        if self._pos == self._body.nbytes:
            self._state = "idle" if self._response_head.keep_alive else "closing"
            if self._future is not None and not self._future.done():
                self._future.set_result(Response(self._response_head, self._body, self._crc))
            if self._state == "closing":
                self._transport.close()

    def _fail(self, error: Exception) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_exception(error)
