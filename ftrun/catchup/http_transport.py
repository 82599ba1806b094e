"""Catch-up over HTTP: the CatchupTransport links of the aiohttp state server (ftrun.catchup.server).

Each link is one keep-alive HttpConnection (ftrun.catchup.conn, bodies received straight into the
destination slice) driven by the link's own private asyncio loop: the fetch protocol above it
(ftrun.catchup.fetcher) blocks on the Env like every other part of ftrun, and a link is used by one
task at a time. The transport keeps one idle link per source between fetches (its event loop and
keep-alive connection), so a second fetch from the same source pays for neither again; a link that
failed or was aborted is never kept. A link pipelines (HttpTransport.pipelines): the fetcher hands each
shard request the link's next shard, whose GET goes out at once behind it, so the source starts that
body as soon as it has sent this one. `HttpCatchup` is the CatchupService of a real rank: the started
HTTP server and the shared fetch client over these links.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.conn import ConnectionLost, HttpConnection, SourceStalled
from ftrun.catchup.errors import CatchupAuthError, CatchupPeerError, CatchupStepError, CatchupUsageError
from ftrun.catchup.manifest import Layout, Manifest, ShardSpec, decode_manifest
from ftrun.catchup.net_transport import BytePayloads, PayloadTransport, ServedCatchup
from ftrun.catchup.server import CatchupServer, FaultHook
from ftrun.catchup.transport import ShardFailed, SourceFailed
from ftrun.catchup.wire import ResponseHead, split_url
from ftrun.env.base import Env

MAX_SMALL_BODY = 64 << 20  # manifests and error bodies
MAX_IDLE_LINKS = 16  # idle links an HttpTransport keeps between fetches (one per source)


class HttpLink:
    def __init__(self, source: str, token: str, config: CatchupConfig,
                 keep: Callable[["HttpLink"], bool] | None = None) -> None:
        try:
            self.host, self.port = split_url(source)
        except ValueError as e:
            raise CatchupUsageError(str(e)) from None
        self.source, self.token, self.config, self._keep = source, token, config, keep
        self._loop = asyncio.new_event_loop()
        self._conn: HttpConnection | None = None
        self._sent: dict[Any, asyncio.Future] = {}  # pipelined requests on _conn, by key, not yet waited for
        self._aborted = False  # closed by another task while a request ran: the runner closes the loop

    def _get(self, path: str, pick: Any, wait_s: float, limit_s: float, key: Any = None,
             ahead: tuple[Any, str, Any] | None = None) -> Any:
        """GET `path` (or take the response of the request `key` sent earlier); with `ahead` (key, path,
        pick), that request goes out too, pipelined behind this one, for a later call to take."""
        async def go() -> Any:
            future = self._sent.pop(key, None)
            if future is None:
                if self._conn is None or not self._conn.usable:  # closed, or answering what no one waits for
                    self._drop()
                    self._conn = await HttpConnection.open(self.host, self.port, self.token,
                                                           self.config.timeouts.connect_timeout_s)
                future = self._conn.send(path, pick)
            if ahead is not None and self._conn.open_for_requests:
                self._sent[ahead[0]] = self._conn.send(ahead[1], ahead[2])
            return await self._conn.wait(future, head_wait_s=wait_s, stall_s=self.config.stall_s)

        if self._loop.is_closed() or self._aborted:
            raise SourceFailed(f"{self.source}: link closed")
        try:
            return self._loop.run_until_complete(asyncio.wait_for(go(), max(limit_s, 0.001)))
        except asyncio.CancelledError:  # close() from another task aborted the request
            raise SourceFailed(f"{self.source}: fetch aborted") from None
        except RuntimeError:
            if self._loop.is_closed():  # closed by another task just before the request started
                raise SourceFailed(f"{self.source}: link closed") from None
            raise
        finally:
            if self._aborted:
                self._shutdown()

    def _status_error(self, head: ResponseHead, body: bytes) -> Exception:
        try:
            doc = json.loads(body)
            message, have = str(doc.get("error")), doc.get("have")
        except (ValueError, AttributeError, RecursionError):  # a deeply nested body must not end the fetch
            message, have = body[:200].decode("latin-1"), None
        text = f"{self.source} answered {head.status}: {message}"
        if head.status == 401:
            return CatchupAuthError(text)
        if head.status in (404, 409, 410):
            return CatchupStepError(text, status=head.status, have=have if type(have) is int else None)
        return CatchupPeerError(text)

    def _small(self, head: ResponseHead) -> memoryview:
        if head.content_length > MAX_SMALL_BODY:
            raise CatchupPeerError(f"{self.source} sent a {head.content_length}-byte body")
        return memoryview(bytearray(head.content_length))

    def manifest(self, step: int, wait_s: float, limit_s: float) -> Manifest:
        try:
            resp = self._get(f"/catchup/{step}/manifest?wait={wait_s:.3f}", self._small, wait_s, limit_s)
        except (OSError, asyncio.TimeoutError, CatchupPeerError) as e:
            self._drop()
            raise SourceFailed(f"{type(e).__name__}: {e}") from None
        if resp.head.status != 200:
            raise self._status_error(resp.head, resp.body.tobytes())
        return decode_manifest(resp.body.tobytes(), step=step)

    def shard(self, step: int, shard: ShardSpec, into: Any, wait_s: float, limit_s: float,
              ahead: tuple[ShardSpec, Any] | None = None) -> int:
        """The shard's bytes into `into`; returns their CRC32, computed as they arrived. `ahead`: the
        shard (and its buffer) this link is asked for next; its request goes out now, pipelined, so
        its bytes follow this shard's with no round trip in between."""
        pipelined = None
        if ahead is not None:
            pipelined = ((step, ahead[0].index), self._shard_path(step, ahead[0], wait_s),
                         self._shard_pick(ahead[0], ahead[1]))
        resp = self._request(self._shard_path(step, shard, wait_s), self._shard_pick(shard, into), wait_s, limit_s,
                             (step, shard.index), pipelined)
        if resp.head.status != 200:
            error = self._status_error(resp.head, resp.body.tobytes())
            if isinstance(error, CatchupAuthError):
                raise error
            raise (SourceFailed if isinstance(error, CatchupStepError) else ShardFailed)(str(error))
        return resp.crc32

    @staticmethod
    def _shard_path(step: int, shard: ShardSpec, wait_s: float) -> str:
        return f"/catchup/{step}/shard/{shard.index}?wait={wait_s:g}"

    def _shard_pick(self, shard: ShardSpec, into: Any) -> Callable[[ResponseHead], memoryview]:
        def pick(head: ResponseHead) -> memoryview:
            if head.status == 200:
                if head.content_length != shard.nbytes:
                    raise CatchupPeerError(f"shard {shard.index} is {head.content_length} bytes, "
                                           f"the manifest says {shard.nbytes}")
                return into
            return self._small(head)

        return pick

    def _request(self, path: str, pick: Any, wait_s: float, limit_s: float, key: Any,
                 ahead: tuple[Any, str, Any] | None) -> Any:
        """One shard request; a reused connection the server closed while idle is reopened once."""
        for attempt in (0, 1):
            reused = self._conn is not None and (self._conn.usable or key in self._sent)
            try:
                return self._get(path, pick, wait_s, limit_s, key, ahead)
            except (OSError, asyncio.TimeoutError) as e:
                self._drop()
                raise SourceFailed(f"{self.source} cannot be reached: {type(e).__name__}: {e}") from None
            except SourceStalled as e:
                self._drop()
                raise SourceFailed(str(e)) from None
            except ConnectionLost as e:
                self._drop()
                if not (reused and e.got == 0 and attempt == 0):
                    raise ShardFailed(str(e)) from None
            except CatchupPeerError as e:
                self._drop()
                raise ShardFailed(str(e)) from None
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        self._sent.clear()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def reusable(self) -> bool:
        """Idle, with its connection open between responses: a later fetch may use it as it is."""
        conn = self._conn
        return not self._loop.is_closed() and not self._loop.is_running() and not self._aborted \
            and conn is not None and conn.usable and not self._sent

    def close(self) -> None:
        """Idempotent; from another task while a request runs, it aborts that request. An idle, healthy
        link goes back to its transport's pool instead of closing."""
        loop, conn = self._loop, self._conn
        if loop.is_closed():
            return
        if loop.is_running():
            self._aborted = True
            if conn is not None:
                loop.call_soon_threadsafe(conn.close)
            return
        if self._keep is not None and self.reusable and self._keep(self):
            return
        self._shutdown()

    def _shutdown(self) -> None:
        if self._loop.is_closed():
            return
        self._drop()
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()


class HttpTransport(PayloadTransport):
    """The CatchupTransport over HTTP sources ("http://host:port")."""

    pipelines = True  # each shard's request goes out while the one before it is received

    def __init__(self, *, env: Env, token: str, config: CatchupConfig, payloads: Any = None) -> None:
        self.token, self.config = token, config
        self.payloads = payloads if payloads is not None else BytePayloads()
        self._idle: dict[str, HttpLink] = {}
        self._lock = env.lock()
        self._closed = False

    def open(self, source: str) -> HttpLink:
        with self._lock:
            link = self._idle.pop(source, None)
        if link is not None and link.reusable:
            return link
        if link is not None:
            link._shutdown()
        return HttpLink(source, self.token, self.config, keep=self._keep)

    def _keep(self, link: HttpLink) -> bool:
        with self._lock:
            if self._closed or link.source in self._idle or len(self._idle) >= MAX_IDLE_LINKS:
                return False
            self._idle[link.source] = link
            return True

    def close(self) -> None:
        """Close the idle links; links still in use close as usual when their fetch ends."""
        with self._lock:
            self._closed, links, self._idle = True, list(self._idle.values()), {}
        for link in links:
            link._shutdown()


class HttpCatchup(ServedCatchup):
    """The CatchupService over HTTP: the started aiohttp CatchupServer and the shared fetch client."""

    def __init__(self, *, env: Env, token: str, config: CatchupConfig = CatchupConfig(),
                 fault: FaultHook | None = None) -> None:
        self.env, self.config = env, config
        self.server = CatchupServer(env=env, token=token, config=config, fault=fault)
        self.transport = HttpTransport(env=env, token=token, config=config)
        self.url = self.server.start()

    def stop(self) -> None:
        self.transport.close()
        super().stop()
