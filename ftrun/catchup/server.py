"""The catch-up state server: a healthy rank's published snapshot over HTTP.

    GET /catchup/{step}/manifest      JSON manifest (ftrun.catchup.manifest)
    GET /catchup/{step}/shard/{i}     the raw bytes of shard i (Content-Length = its size)
    GET /catchup/status               JSON: the step this source has and its state

Every request carries the job token (`Authorization: Bearer TOKEN`; otherwise 401). A request for a step
not published yet waits up to `?wait=S` seconds (at most CatchupConfig.long_poll_s; that by default)
for it — the healthy replicas publish partway through the step — then answers 404. A step retired or
superseded answers 410 at once. Error bodies are JSON: {"error": ..., "step": asked, "have": newest}.
Shards go out with send() straight from the snapshot's memory (its buffer, or the tensors it lends),
no copy through Python. (sendfile of the snapshot's 4 KiB shmem pages cost more CPU at both ends over
loopback: 500 MiB, load ~5, median sender ~110 ms and receiver ~200 ms against ~65 and ~150 ms for
send(), likely because the receiver then copies bytes the sender has just copied, still in cache,
rather than the snapshot's pages.)

Runs aiohttp on its own event loop in one Env task (the ftrun.quorum.http pattern); binds 127.0.0.1 by
default. Bounded as `HttpLimits` says (idle/header-read timeout, connection cap; see http_guard): a
malformed request (a token that is not ASCII, a step or index that is not a short ASCII number) gets a
4xx and one rate-limited WARNING line, never a 500 or a traceback.
Threading: publish/retire from the training task; the server task only reads the snapshot.
A publish or retire aborts shard transfers of the step it replaces within one 8 MiB chunk (the client
retries elsewhere; bytes torn by the overwrite in between fail the shard's CRC).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import torch
from aiohttp import web

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.http_guard import ConnectionGuard, GuardedSite, HttpLimits, bearer_token, path_int
from ftrun.catchup.manifest import ShardSpec
from ftrun.catchup.snapshot import Published, SnapshotStore
from ftrun.env.base import Env
from ftrun.net import require_token

log = logging.getLogger("ftrun.heal")

_SEND_CHUNK = 8 << 20  # one write of a shard's body: a replaced snapshot stops a transfer within this many bytes


@dataclass(frozen=True)
class Fault:
    """Fault injection for tests: how to spoil one shard response, and what to do right after."""

    kind: str  # "corrupt": flip one byte; "truncate": send half the body, then close the connection;
    # "slow": a throttled source: shard 0 (once per fetch) waits delay_s first, a shard takes `factor` x its
    # send time
    then: Callable[[], None] | None = None
    factor: float = 1.0
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("corrupt", "truncate", "slow"):
            raise ValueError(f"Fault.kind must be 'corrupt', 'truncate' or 'slow', got {self.kind!r}")
        if not (1.0 <= self.factor < math.inf and 0.0 <= self.delay_s < math.inf):
            raise ValueError(f"Fault.factor must be >= 1 and delay_s >= 0, got {self.factor}, {self.delay_s}")


FaultHook = Callable[[int, int], "Fault | None"]  # (step, shard index) -> fault to inject, if any


class CatchupServer:
    def __init__(self, *, env: Env, token: str, config: CatchupConfig = CatchupConfig(),
                 fault: FaultHook | None = None, limits: HttpLimits = HttpLimits()) -> None:
        self.env, self.config, self._fault = env, config, fault
        self._token = require_token(token, "CatchupServer")
        self.guard = ConnectionGuard(limits, log, name="catch-up server")
        self.store = SnapshotStore(env=env, max_shard_bytes=config.max_shard_bytes, on_change=self._store_changed)
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None

    # -- training-loop side --------------------------------------------------------------------
    def start(self) -> str:
        """Start serving; returns the base URL ("http://127.0.0.1:PORT")."""
        ready = self.env.event()
        self._task = self.env.spawn(self._serve, ready, name="catchup-http")
        if not ready.wait(timeout=self.config.timeouts.connect_timeout_s) or self._error is not None:
            raise RuntimeError(f"catch-up server did not start on {self.config.bind}: {self._error}")
        return self.url

    def publish(self, step: int, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None, *,
                borrow: Collection[str] = ()) -> None:
        """Snapshot `state` as `step` (see SnapshotStore.publish, `borrow` too); served once checksummed."""
        self.store.publish(step, state, metadata, borrow=borrow)

    def retire(self, step: int) -> None:
        """Stop serving `step` (after it commits); in-flight transfers of it are aborted."""
        self.store.retire(step)

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self.store.wait_ready(timeout)

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
            self._task.join(timeout=self.config.timeouts.connect_timeout_s)
        self.store.close()

    # -- server task ---------------------------------------------------------------------------
    def _serve(self, ready) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run(loop, ready))
        except BaseException as e:
            self._error = e
            ready.set()
            raise
        finally:
            self._loop = None
            loop.close()

    async def _run(self, loop: asyncio.AbstractEventLoop, ready) -> None:
        self._stopping, self._changed = asyncio.Event(), asyncio.Event()
        app = web.Application(middlewares=[self.guard.middleware, self._auth])
        app.add_routes([web.get("/catchup/status", self._status),
                        web.get("/catchup/{step}/manifest", self._manifest),
                        web.get("/catchup/{step}/shard/{index}", self._shard)])
        runner = web.AppRunner(app, shutdown_timeout=1.0, handler_cancellation=True, **self.guard.runner_kwargs())
        await runner.setup()
        host, _, port = self.config.bind.rpartition(":")
        try:
            await GuardedSite(runner, host, int(port), guard=self.guard).start()
            host, port = runner.addresses[0][:2]
            self.url, self._loop = f"http://{self.config.advertise_host or host}:{port}", loop
            ready.set()
            await self._stopping.wait()
            self._wake()
        finally:
            await runner.cleanup()

    def _store_changed(self) -> None:
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed meanwhile: nobody to wake
                pass

    def _wake(self) -> None:
        """On the loop: wake long-polls (shard transfers notice a replaced snapshot between chunks)."""
        self._changed.set()
        self._changed = asyncio.Event()

    # -- handlers ------------------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if "token" in request.query:  # a URL ends up in logs and proxies: the token never goes there
            return self.guard.reply(400, "the job token is refused in a URL; send Authorization: Bearer")
        if not hmac.compare_digest(bearer_token(request), self._token.encode()):
            return self.guard.reply(401, "missing or wrong job token")
        return await handler(request)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.store.status())

    async def _manifest(self, request: web.Request) -> web.StreamResponse:
        step = path_int(request.match_info["step"])
        if step is None:
            return self._malformed("step must be a non-negative integer of at most 19 ASCII digits", None)
        published, err = await self._await_step(step, self._wait_s(request))
        if published is None:
            return err
        return web.Response(body=published.manifest_json, content_type="application/json")

    async def _shard(self, request: web.Request) -> web.StreamResponse:
        step, index = path_int(request.match_info["step"]), path_int(request.match_info["index"])
        if step is None or index is None:
            return self._malformed("step and shard index must be non-negative integers of at most 19 ASCII digits",
                                   step)
        published, err = await self._await_step(step, self._wait_s(request))
        if published is None:
            return err
        shards = published.manifest.layout.shards
        if index >= len(shards):
            return _error(404, f"step {step} has {len(shards)} shards, not shard {index}", step, step)
        return await self._send_shard(request, published, shards[index])

    async def _send_shard(self, request: web.Request, published: Published, shard: ShardSpec) -> web.StreamResponse:
        if published.generation != self.store.generation:  # replaced while this request waited
            return _error(410, f"step {published.step} was replaced", published.step, self.store.newest)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                           "X-Ftrun-Step": str(published.step), "X-Ftrun-Offset": str(shard.offset)})
        resp.content_length = shard.nbytes
        transport = request.transport
        if transport is None:
            return resp
        fault = self._fault(published.step, shard.index) if self._fault else None
        if fault is not None and fault.kind != "slow":
            await resp.prepare(request)
            return await _send_faulty(resp, transport, published, shard, fault)
        # The body goes straight from the snapshot to the socket (below), so the head must have left the
        # transport's buffer first: with no buffer allowed, the writer's drain waits until it has.
        low, high = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=0)
        writer = await resp.prepare(request)
        await writer.drain()
        transport.set_write_buffer_limits(high=high, low=low)  # later responses on the connection buffer as before
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if fault is not None and fault.delay_s and shard.index == 0:
            log.warning("catch-up: a slow source: step %d waits %.3fs", published.step, fault.delay_s)
            await asyncio.sleep(fault.delay_s)
        if transport.is_closing():
            return resp
        sock = transport.get_extra_info("socket").dup()  # the loop's sock_sendall refuses a transport's own fd
        try:
            sock.setblocking(False)
            for piece in published.pieces(shard.offset, shard.nbytes):  # the buffer's, or a lent tensor's
                for start in range(0, len(piece), _SEND_CHUNK):
                    if published.generation != self.store.generation or self._stopping.is_set():
                        transport.abort()  # a publish or retire replaced the snapshot: the client retries elsewhere
                        return resp
                    # A client that stops reading holds a piece no longer than an idle connection may stay.
                    await asyncio.wait_for(loop.sock_sendall(sock, piece[start:start + _SEND_CHUNK]),
                                           self.guard.limits.idle_timeout_s)
        except ConnectionError:  # the client went away mid-shard: nobody to answer
            transport.abort()
            return resp
        except asyncio.TimeoutError:
            log.warning("catch-up: a client read nothing of step %d shard %d for %.1fs: connection dropped",
                        published.step, shard.index, self.guard.limits.idle_timeout_s)
            transport.abort()
            return resp
        finally:
            sock.close()
        if fault is not None and fault.factor > 1.0:  # a throttled source: the shard takes factor x as long
            await asyncio.sleep((fault.factor - 1.0) * (loop.time() - t0))
        await resp.write_eof()
        return resp

    def _malformed(self, message: str, step: int | None) -> web.Response:
        return self.guard.reply(400, message, step=step, have=self.store.newest)

    def _wait_s(self, request: web.Request) -> float:
        try:
            asked = float(request.query.get("wait", self.config.long_poll_s))
        except ValueError:
            asked = self.config.long_poll_s
        if math.isnan(asked):
            asked = self.config.long_poll_s
        return max(0.0, min(asked, self.config.long_poll_s))

    async def _await_step(self, step: int, wait_s: float) -> tuple[Published | None, web.Response | None]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            changed = self._changed  # taken before the lookup, so a change in between is not missed
            availability, published = self.store.lookup(step)
            if availability.kind == "serve":
                return published, None
            if self._stopping.is_set():
                return None, _error(503, "source is stopping", step, self.store.newest)
            if availability.kind == "gone":
                return None, _error(availability.status, availability.reason, step, self.store.newest)
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None, _error(availability.status, f"{availability.reason} (waited {wait_s:g}s)",
                                    step, self.store.newest)
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass


async def _send_faulty(resp: web.StreamResponse, transport: asyncio.BaseTransport, published: Published,
                       shard: ShardSpec, fault: Fault) -> web.StreamResponse:
    data = published.read(shard.offset, shard.nbytes)
    log.warning("catch-up: injecting %s into step %d shard %d", fault.kind, published.step, shard.index)
    if fault.kind == "corrupt":
        spoiled = bytearray(data)
        spoiled[len(spoiled) // 2] ^= 0xFF
        await resp.write(spoiled)
        await resp.write_eof()
    else:
        await resp.write(data[:shard.nbytes // 2])
        transport.close()
    if fault.then is not None:
        fault.then()
    return resp


def _error(status: int, message: str, step: int | None, have: int | None) -> web.Response:
    return web.json_response({"error": message, "step": step, "have": have}, status=status)
