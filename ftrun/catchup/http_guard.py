"""Bounds for ftrun's aiohttp servers (catch-up state server, lighthouse status page).

What a client without the token, or a broken one, can cost a server:
- **Idle and header-read time**: aiohttp's own `keepalive_timeout` closes a connection that has not sent a
  complete request head within that many seconds of connecting or of its last response (its timer starts
  at `connection_made` and bytes of a partial head do not reset it), so it bounds both. Head sizes use
  aiohttp's `max_line_size` / `max_field_size` / `max_headers`.
- **Connections**: aiohttp has no cap, so `GuardedSite` accepts through `ConnectionGuard`. At the cap a
  new connection evicts the least recently active connection that is not serving a request (a real
  client sends its request at once, so a flood of idle sockets cannot starve it); with every connection
  busy the new one gets a 503 and is closed.
- **Logs**: a malformed request (bad HTTP, bad token encoding, a bad number in the path) is answered
  4xx and logged once at WARNING, one line, no traceback, at most once per `warn_every_s` (the
  suppressed count goes into the next line). A handler bug still logs its traceback at ERROR.

`admit` and `WarnLimiter` (ftrun.net) are the pure decisions; the rest drives aiohttp.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from ftrun.net import WarnLimiter

MAX_PATH_INT_DIGITS = 19  # a step or shard index in a path: at most 19 ASCII digits (fits an int64)


@dataclass(frozen=True, kw_only=True)
class HttpLimits:
    """idle_timeout_s: aiohttp keepalive_timeout (idle and header-read). max_connections: open connections
    per server. backlog: the listen backlog, which is also how many connections asyncio accepts at once
    before any is admitted or refused, so a server needs about max_connections + backlog descriptors.
    max_line_size / max_field_size / max_headers: request head limits (aiohttp's).
    warn_every_s: at most one malformed-request WARNING per that many seconds per server."""

    idle_timeout_s: float = 30.0
    max_connections: int = 256
    backlog: int = 128
    max_line_size: int = 4096
    max_field_size: int = 4096
    max_headers: int = 32
    warn_every_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("idle_timeout_s", "warn_every_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"HttpLimits.{name} must be a number > 0, got {value!r}")
        for name in ("max_connections", "backlog", "max_line_size", "max_field_size", "max_headers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"HttpLimits.{name} must be an int >= 1, got {value!r}")

    def handler_kwargs(self) -> dict[str, Any]:
        """aiohttp RequestHandler settings (also accepted by web.AppRunner)."""
        return {"keepalive_timeout": float(self.idle_timeout_s), "max_line_size": self.max_line_size,
                "max_field_size": self.max_field_size, "max_headers": self.max_headers}


# -- pure decisions --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    admit: bool
    evict: Hashable | None  # the connection to close first, if any
    reason: str


def admit(*, num_open: int, idle_lru: Sequence[Hashable], cap: int) -> Admission:
    """Whether a new connection may join `num_open` open ones under `cap`.

    idle_lru: the open connections not serving a request, least recently active first.
    """
    if num_open < cap:
        return Admission(True, None, f"{num_open} of {cap} connections open")
    if idle_lru:
        return Admission(True, idle_lru[0], f"at the cap of {cap}: evicting the least recently active idle one")
    return Admission(False, None, f"at the cap of {cap} and every connection is serving a request")


# -- aiohttp driver --------------------------------------------------------------------------------
class MalformedLog(logging.LoggerAdapter):
    """The `logger` given to aiohttp's RequestHandler: its "Error handling request" tracebacks for
    malformed HTTP become one rate-limited WARNING line; anything else keeps its traceback."""

    def __init__(self, logger: logging.Logger, guard: "ConnectionGuard") -> None:
        super().__init__(logger, {})
        self._guard = guard

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        if not self._malformed(exc_info):
            self.logger.error(msg, *args, exc_info=exc_info, **kwargs)

    def debug(self, msg: Any, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        if not self._malformed(exc_info):
            self.logger.debug(msg, *args, exc_info=exc_info, **kwargs)

    def _malformed(self, exc_info: Any) -> bool:
        if isinstance(exc_info, HttpProcessingError):
            self._guard.warn(f"malformed HTTP request: {type(exc_info).__name__}: {exc_info.message}")
            return True
        return False


class _Refused(asyncio.Protocol):
    """A connection over the cap: answered 503 at once, its request read and dropped, closed when the
    client closes or within a second (closing with its request unread would reset the connection
    before the client read the 503)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        transport.write_eof()
        asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # close


class ConnectionGuard:
    """Tracks a server's connections (open order, activity, busy) and admits new ones (see `admit`).

    Use: a `GuardedSite` for the listener, `guard.middleware` first among the app's middlewares, and
    `guard.runner_kwargs()` for the AppRunner. Lives on the server's event loop; not thread-safe.
    """

    def __init__(self, limits: HttpLimits, log: logging.Logger, *, name: str) -> None:
        self.limits, self.log, self.name = limits, log, name
        self._open: OrderedDict[RequestHandler, None] = OrderedDict()  # least recently active first
        self._busy: dict[RequestHandler, int] = {}
        self._doomed: dict[RequestHandler, bool] = {}
        self._limiter = WarnLimiter(limits.warn_every_s)
        self.num_evicted = self.num_refused = 0
        self._server: web.Server | None = None

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def num_busy(self) -> int:
        """Connections serving a request now."""
        return len(self._busy)

    def runner_kwargs(self) -> dict[str, Any]:
        return {**self.limits.handler_kwargs(), "logger": MalformedLog(self.log, self),
                "access_log": None}

    def warn(self, message: str) -> None:
        """Log a client's misbehaviour: one WARNING line, rate-limited."""
        suppressed = self._limiter.allow(asyncio.get_running_loop().time())
        if suppressed is not None:
            more = f" ({suppressed} more since the last such warning)" if suppressed else ""
            self.log.warning("%s: %s%s", self.name, " ".join(message.split())[:300], more)  # one line

    def reply(self, status: int, message: str, **fields: Any) -> web.Response:
        """A 4xx answer to a malformed request, logged through `warn`."""
        self.warn(f"{status} {message}")
        return web.json_response({"error": message, **fields}, status=status)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        proto = request.protocol
        self._busy[proto] = self._busy.get(proto, 0) + 1
        try:
            return await handler(request)
        finally:
            left = self._busy.pop(proto, 1) - 1  # absent: the connection was lost meanwhile
            if left > 0:
                self._busy[proto] = left
            if proto in self._open:
                self._open.move_to_end(proto)

    # -- protocol factory ------------------------------------------------------------------------
    def factory(self, server: web.Server):
        loop = asyncio.get_running_loop()
        kwargs = self.runner_kwargs()
        guard = self

        class _Tracked(RequestHandler):
            __slots__ = ()

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                if guard._doomed.pop(self, False):  # evicted in the same accept burst, before it was made
                    self.force_close()

            def connection_lost(self, exc: BaseException | None) -> None:
                guard._open.pop(self, None)
                guard._busy.pop(self, None)
                super().connection_lost(exc)

        def make() -> asyncio.BaseProtocol:
            decision = admit(num_open=len(self._open), cap=self.limits.max_connections,
                             idle_lru=[h for h in self._open if h not in self._busy])
            if not decision.admit:
                self.num_refused += 1
                self.warn(f"refused a connection: {decision.reason}")
                return _Refused()
            if decision.evict is not None:
                self.num_evicted += 1
                victim = decision.evict
                self._open.pop(victim, None)  # now: its connection_lost comes later
                if victim.transport is None:
                    self._doomed[victim] = True  # not made yet: closed as soon as it is
                else:
                    victim.force_close()
            handler = _Tracked(server, loop=loop, **kwargs)
            self._open[handler] = None
            return handler

        return make


class GuardedSite(web.TCPSite):
    """web.TCPSite whose connections go through a ConnectionGuard."""

    __slots__ = ("_guard",)

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, guard: ConnectionGuard) -> None:
        super().__init__(runner, host, port, backlog=guard.limits.backlog)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard.factory(server), self._host, self._port,
                                                backlog=self._backlog)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


def path_int(text: str) -> int | None:
    """A non-negative integer path segment: ASCII digits only, at most MAX_PATH_INT_DIGITS; else None."""
    if not (0 < len(text) <= MAX_PATH_INT_DIGITS and text.isascii() and text.isdigit()):
        return None
    return int(text)


def bearer_token(request: web.Request) -> bytes:
    """The `Authorization: Bearer` value as bytes (any byte a client sent survives; nothing raises)."""
    given = request.headers.get("Authorization", "").removeprefix("Bearer ")
    return given.encode("utf-8", "surrogateescape")
