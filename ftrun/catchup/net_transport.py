"""Catch-up over `env.net`: framed request/response messages and bulk frames, server and client link.

    request   {"op": "manifest"|"shard", "token": T, "step": S, "index": I, "wait": W}
    response  {"status": 200, "manifest": <JSON bytes>}           manifest
              {"status": 200, "nbytes": N} + one bulk frame of N   shard
              {"status": 401|404|409|410|400, "error": ..., "have": newest}

The same statuses and long-poll rules as the HTTP server (ftrun.catchup.server): a step not published
yet is waited for up to `wait` (at most long_poll_s), a retired or superseded one answers 410 at once,
a wrong token 401 (and the connection closed); a client that does not take a response within
catchup_stall_s (it stopped reading) is dropped. It runs on any Env: with the real one it is TCP, with the
emulator's it is the modeled network, and the published store may hold shape-only payloads (the `payloads`
of the client and the store of the server decide that; nothing here looks at bytes beyond slicing them).
Threading: publish/retire from the training task; one server task per connection.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np
import torch

from ftrun.catchup.checksum import crc32
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupAuthError, CatchupPeerError, CatchupStepError
from ftrun.catchup.fetcher import FetchResult, fetch_with
from ftrun.catchup.manifest import Layout, Manifest, ShardSpec, decode_manifest, layout_for
from ftrun.catchup.server import Fault, FaultHook
from ftrun.catchup.snapshot import SnapshotStore, anonymous_buffer, describe, tensor_views
from ftrun.catchup.transport import ShardFailed, SourceFailed
from ftrun.env.base import ConnectError, Env, EnvTimeout, NetError, NetTimeout, PeerClosed, serve_connections
from ftrun.net import require_token, token_matches

log = logging.getLogger("ftrun.heal")

StoreFactory = Callable[[Callable[[], None]], Any]  # on_change -> a SnapshotStore-like store


class _Preparation:
    """One `BytePayloads.prepare`: its task, and the buffer it makes, handed over at most once: to the first
    fetch that finds it made, or, when it was given up before it was made, closed by the task itself (the
    mapping never outlives the preparation unowned)."""

    def __init__(self, env: Env) -> None:
        self._lock = env.lock()
        self.task: Any = None
        self.buffer: mmap.mmap | None = None
        self._given_up = False

    def made(self, buffer: mmap.mmap) -> None:
        """In the task: keep `buffer` for a fetch, or close it if the preparation was given up meanwhile."""
        with self._lock:
            if not self._given_up:
                self.buffer = buffer
                return
        buffer.close()

    def take(self) -> mmap.mmap | None:
        """Give the preparation up (never waiting for its task) and return its buffer if it was made."""
        with self._lock:
            self._given_up = True
            buffer, self.buffer = self.buffer, None
        return buffer


class BytePayloads:
    """Real bytes: a flat uint8 buffer, typed tensor views, CRC32 (ftrun.catchup.checksum).

    buffer: a CPU uint8 tensor to receive into when it is large enough (reuse it across fetches so a
    steady-state fetch allocates nothing); otherwise each fetch allocates its own, or takes the one
    `prepare` made ahead: a private mapping with its pages already faulted in, handed to the next fetch
    that fits in it (its tensors are views into it and keep it; the fetch after that allocates again).
    A fresh buffer's pages fault in as the bytes arrive, on the joiner's critical path: in
    benchmarks/catchup_launch.py (50.4 MB, 2 cores, load 2.6-3.1) a restarted replica's fetch took 106 ms
    (median of 6) into a fresh buffer and 59 ms into one prepared before it checked in (the trainer's
    `joining`, with its load adopting the parameters: ftrun.train.state), alternating runs.
    A fetch never waits for a preparation still running: it allocates its own and the preparation is given
    up (its task closes the mapping it makes). Waiting would bound the fetch by however long sizing (e.g. a
    throwaway optimizer step) and faulting in take, with no limit, to save the page faults alone (47 ms of
    the 106 above); a fresh buffer costs at most those faults, and a bounded wait would only pick a number.
    """

    def __init__(self, buffer: torch.Tensor | None = None) -> None:
        self.buffer = buffer
        self._preparation: _Preparation | None = None  # the latest prepare, until a fetch or `release` takes it

    def prepare(self, env: Env, size: Callable[[], int]) -> None:
        """Make, in a background task, a receive buffer of `size()` bytes (called there: sizing may cost, e.g.
        a throwaway optimizer step) with its pages faulted in, for the next fetch (returns at once; replaces
        one prepared before)."""
        self.release()
        preparation = self._preparation = _Preparation(env)

        def make() -> None:
            try:
                nbytes = size()
            except Exception as e:  # an optimisation only: the fetch allocates its own
                log.warning("catch-up: could not size a receive buffer to prepare: %s: %s", type(e).__name__, e)
                return
            try:
                preparation.made(anonymous_buffer(nbytes, populate=True))
            except OSError as e:
                log.warning("catch-up: could not prepare a %d-byte receive buffer: %s", nbytes, e)

        preparation.task = env.spawn(make, name="catchup-prepare")

    def release(self) -> None:
        """Drop the prepared buffer if a fetch did not take it, or give up a preparation still running (its
        task closes what it makes). Never waits."""
        buffer = self._take()
        if buffer is not None:
            buffer.close()

    def _take(self) -> mmap.mmap | None:
        preparation, self._preparation = self._preparation, None
        return None if preparation is None else preparation.take()

    def destination(self, nbytes: int) -> memoryview:
        b = self.buffer
        if b is not None and b.dtype == torch.uint8 and b.device.type == "cpu" and b.is_contiguous() \
                and b.dim() == 1 and b.numel() >= nbytes:
            return memoryview(b.numpy())[:nbytes]
        preparing = self._preparation is not None and self._preparation.task.is_alive()
        prepared = self._take()
        if prepared is not None and len(prepared) >= nbytes:
            return memoryview(prepared)[:nbytes]
        if prepared is None and preparing:  # a fetch slower than it could be: say why
            log.info("catch-up: the receive buffer was still being prepared: the fetch allocates its own")
        if prepared is not None:
            prepared.close()  # too small: not kept for a later fetch
        return memoryview(np.empty(nbytes, np.uint8))

    def views(self, dest: memoryview, layout: Layout) -> dict[str, torch.Tensor]:
        flat = torch.frombuffer(dest, dtype=torch.uint8) if len(dest) else torch.empty(0, dtype=torch.uint8)
        return tensor_views(flat, layout)

    def crc32(self, buf: Any) -> int:
        return crc32(buf)


class PayloadTransport:
    """The payload half of a CatchupTransport, shared by every transport: destinations, tensor views and
    checksums come from `self.payloads` (BytePayloads for real bytes, shape-only ones in emulation)."""

    payloads: Any
    pipelines = False  # links take one request at a time

    def destination(self, nbytes: int) -> Any:
        return self.payloads.destination(nbytes)

    def views(self, dest: Any, layout: Layout) -> dict[str, torch.Tensor]:
        return self.payloads.views(dest, layout)

    def crc32(self, buf: Any) -> int:
        return self.payloads.crc32(buf)


def fetch_bytes(state: Mapping[str, torch.Tensor], config: CatchupConfig) -> int:
    """The size of a fetch of a state like `state` (meta tensors stand for shapes): its layout's bytes.
    Raises CatchupUsageError as a publish of it would."""
    return layout_for(describe(state, shape_only=True), config.max_shard_bytes).total_bytes


class ServedCatchup:
    """A CatchupService's delegation, shared by every transport: publish/retire/stop go to `self.server`,
    fetch runs the one fetch driver over `self.transport`."""

    env: Env
    config: CatchupConfig
    server: Any
    transport: Any

    def publish(self, step: int, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None, *,
                borrow: Collection[str] = ()) -> None:
        self.server.publish(step, state, metadata, borrow=borrow)

    def check(self, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> None:
        self.server.store.check(state, metadata)

    def reserve(self, state: Mapping[str, torch.Tensor], *, borrow: Collection[str] = ()) -> None:
        self.server.store.reserve(state, borrow=borrow)

    def retire(self, step: int) -> None:
        self.server.retire(step)

    def prepare_fetch(self, shapes: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self.transport.payloads.prepare(self.env, lambda: fetch_bytes(shapes(), self.config))

    def release_fetch(self) -> None:
        self.transport.payloads.release()

    def fetch(self, step: int, sources: Sequence[str]) -> FetchResult:
        return fetch_with(self.env, self.transport, step, sources, self.config)

    def stop(self) -> None:
        self.release_fetch()
        self.server.stop()


class NetCatchupServer:
    """Serves the rank's published snapshot over env.net (see the module docstring)."""

    def __init__(self, *, env: Env, token: str, config: CatchupConfig = CatchupConfig(),
                 store: StoreFactory | None = None, fault: FaultHook | None = None) -> None:
        self.env, self.config, self._fault = env, config, fault
        self._token = require_token(token, "NetCatchupServer")
        make = store or (lambda on_change: SnapshotStore(env=env, max_shard_bytes=config.max_shard_bytes,
                                                         on_change=on_change))
        self.store = make(self._wake)
        self._changed = env.event()
        self._listener: Any = None
        self._conns: set[Any] = set()
        self._stopped = False
        self.url = ""

    def start(self) -> str:
        self._listener = self.env.net.listen(self.config.bind)
        self.url = self._listener.addr
        serve_connections(self.env, self._listener, self._serve, name="catchup-accept",
                          conn_name="catchup-serve", on_accept=self._register, on_end=self._accept_ended)
        return self.url

    def _accept_ended(self, why: str) -> None:
        """Accepting ended (serve_connections' `on_end`): by stop(), or on its own (the listener is gone), when
        peers can no longer fetch from this rank: said once, so a joiner's failed fetches have a cause in the log."""
        if not self._stopped:
            log.error("catch-up server at %s accepts no more connections: %s", self.url, why)

    def publish(self, step: int, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None, *,
                borrow: Collection[str] = ()) -> None:
        self.store.publish(step, state, metadata, borrow=borrow)

    def retire(self, step: int) -> None:
        self.store.retire(step)

    def stop(self) -> None:
        self._stopped = True
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._conns):
            conn.close()
        self.store.close()
        self._wake()

    def _register(self, conn: Any) -> None:
        """A connection just accepted: kept where stop() closes it, or closed now if stop() already ran
        (between the accept and this call, so its loop over the connections missed it)."""
        self._conns.add(conn)
        if self._stopped:
            conn.close()

    def _wake(self) -> None:
        old, self._changed = self._changed, self.env.event()
        old.set()

    def _serve(self, conn: Any) -> None:
        """Answers requests until the peer closes. The first must come within connect_timeout_s (a client
        sends it as soon as it connects); later ones may wait: the fetcher closes its links when done."""
        try:
            self._answer(conn, conn.recv(timeout=self.config.timeouts.connect_timeout_s))
            while True:
                self._answer(conn, conn.recv(timeout=None))
        except (NetError, EnvTimeout):
            pass
        finally:
            conn.close()
            self._conns.discard(conn)

    def _answer(self, conn: Any, req: Any) -> None:
        token = req.get("token") if isinstance(req, dict) else None
        if not token_matches(token, self._token):
            # closed, as every ftrun listener closes a peer without the token: left open, each one would
            # hold a live connection and its task forever, and a few at the listener's cap lock peers out
            self._reply(conn, {"status": 401, "error": "missing or wrong job token", "have": None})
            conn.close()
            return
        step, index, op = req.get("step"), req.get("index", 0), req.get("op")
        if type(step) is not int or step < 0 or type(index) is not int or index < 0 or op not in ("manifest", "shard"):
            self._reply(conn, {"status": 400, "error": f"bad request {op!r} step {step!r} index {index!r}",
                               "have": None})
            return
        wait = req.get("wait")
        wait = min(float(wait), self.config.long_poll_s) if isinstance(wait, (int, float)) and wait >= 0 else 0.0
        published = self._await_step(conn, step, wait)
        if published is None:
            return
        if op == "manifest":
            self._reply(conn, {"status": 200, "manifest": published.manifest_json})
            return
        shards = published.manifest.layout.shards
        if index >= len(shards):
            self._reply(conn, {"status": 404, "error": f"step {step} has {len(shards)} shards, not {index}",
                               "have": step})
            return
        self._send_shard(conn, published, shards[index])

    def _reply(self, conn: Any, msg: dict) -> None:
        """Send one response. Every send is bounded by catchup_stall_s, the time a client gives a silent
        source (its receive of a shard is bounded alike): a client that stops reading is dropped then (a
        NetTimeout closes the connection), freeing its slot and task, as the HTTP server drops an idle one."""
        conn.send(msg, timeout=self.config.stall_s)

    def _await_step(self, conn: Any, step: int, wait: float) -> Any:
        deadline = self.env.clock.now() + wait
        while True:
            changed = self._changed  # taken before the lookup, so a change in between is not missed
            availability, published = self.store.lookup(step)
            if availability.kind == "serve":
                return published
            remaining = deadline - self.env.clock.now()
            if availability.kind == "gone" or remaining <= 0:
                self._reply(conn, {"status": availability.status, "error": availability.reason,
                                   "have": self.store.newest})
                return None
            changed.wait(timeout=remaining)

    def _send_shard(self, conn: Any, published: Any, shard: ShardSpec) -> None:
        data = published.read(shard.offset, shard.nbytes)
        fault = self._fault(published.step, shard.index) if self._fault else None
        self._reply(conn, {"status": 200, "nbytes": shard.nbytes})
        if fault is None or fault.kind == "slow":
            if fault is not None and fault.delay_s and shard.index == 0:
                self.env.clock.sleep(fault.delay_s)  # a slow source, as the HTTP server's
            t0 = self.env.clock.now()
            try:
                conn.send_bytes(data, timeout=self.config.stall_s)
            except NetTimeout:
                log.warning("catch-up: a client did not take step %d shard %d within %.1fs: connection dropped",
                            published.step, shard.index, self.config.stall_s)
                raise
            if fault is not None and fault.factor > 1.0:  # a throttled source: the shard takes factor x as long
                self.env.clock.sleep((fault.factor - 1.0) * (self.env.clock.now() - t0))
            return
        log.warning("catch-up: injecting %s into step %d shard %d", fault.kind, published.step, shard.index)
        if fault.kind == "corrupt":
            spoiled = bytearray(data)
            spoiled[len(spoiled) // 2] ^= 0xFF
            conn.send_bytes(spoiled, timeout=self.config.stall_s)
        else:
            conn.close()  # "truncate": the frame never completes
        if fault.then is not None:
            fault.then()


class NetLink:
    """One source, over one connection (reopened after a failure)."""

    def __init__(self, env: Env, source: str, token: str, config: CatchupConfig) -> None:
        self.env, self.source, self.token, self.config = env, source, token, config
        self._conn: Any = None

    def _connection(self) -> Any:
        if self._conn is None or self._conn.closed:
            try:
                self._conn = self.env.net.connect(self.source, timeout=self.config.timeouts.connect_timeout_s)
            except (NetError, EnvTimeout, ValueError) as e:
                raise SourceFailed(f"{self.source} cannot be reached: {type(e).__name__}: {e}") from None
        return self._conn

    def _ask(self, req: dict, wait_s: float, limit_s: float) -> dict:
        conn = self._connection()
        try:
            conn.send({**req, "token": self.token, "wait": wait_s}, timeout=min(self.config.stall_s, limit_s))
            resp = conn.recv(timeout=min(wait_s + self.config.stall_s, limit_s))
        except NetTimeout as e:
            self.close()
            raise SourceFailed(f"{self.source} stalled: {e}") from None
        except (PeerClosed, ConnectError, NetError) as e:
            self.close()
            raise SourceFailed(f"{self.source} closed the connection: {type(e).__name__}: {e}") from None
        if not isinstance(resp, dict) or type(resp.get("status")) is not int:
            self.close()
            raise CatchupPeerError(f"{self.source} sent a malformed response")
        status = resp["status"]
        if status == 200:
            return resp
        text = f"{self.source} answered {status}: {resp.get('error')}"
        if status == 401:
            raise CatchupAuthError(text)
        if status in (404, 409, 410):
            have = resp.get("have")
            raise CatchupStepError(text, status=status, have=have if type(have) is int else None)
        raise CatchupPeerError(text)

    def manifest(self, step: int, wait_s: float, limit_s: float) -> Manifest:
        resp = self._ask({"op": "manifest", "step": step}, wait_s, limit_s)
        body = resp.get("manifest")
        if not isinstance(body, (bytes, bytearray)):
            raise CatchupPeerError(f"{self.source} sent no manifest body")
        return decode_manifest(body, step=step)

    def shard(self, step: int, shard: ShardSpec, into: Any, wait_s: float, limit_s: float,
              ahead: Any = None) -> None:
        """The shard's bytes into `into` (None: the fetcher checksums them). Requests are not pipelined
        (the transport's `pipelines` is False), so `ahead` is never given."""
        started = self.env.clock.now()
        resp = self._ask({"op": "shard", "step": step, "index": shard.index}, wait_s, limit_s)
        if resp.get("nbytes") != shard.nbytes:
            self.close()
            raise ShardFailed(f"shard {shard.index} is {resp.get('nbytes')} bytes, the manifest says {shard.nbytes}")
        try:
            left = limit_s - (self.env.clock.now() - started)
            self._conn.recv_into(into, timeout=max(min(self.config.stall_s, left), 0.001))
        except NetTimeout as e:
            self.close()
            raise SourceFailed(f"{self.source} stalled mid-shard: {e}") from None
        except NetError as e:
            self.close()
            raise ShardFailed(f"connection lost mid-shard: {type(e).__name__}: {e}") from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class NetTransport(PayloadTransport):
    """The CatchupTransport over env.net; `payloads` makes destinations, views and checksums."""

    def __init__(self, *, env: Env, token: str, config: CatchupConfig, payloads: Any = None) -> None:
        self.env, self.token, self.config = env, token, config
        self.payloads = payloads if payloads is not None else BytePayloads()

    def open(self, source: str) -> NetLink:
        return NetLink(self.env, source, self.token, self.config)


class NetCatchup(ServedCatchup):
    """The CatchupService over env.net: a started NetCatchupServer and the shared fetch client."""

    def __init__(self, *, env: Env, token: str, config: CatchupConfig = CatchupConfig(),
                 store: StoreFactory | None = None, payloads: Any = None, fault: FaultHook | None = None) -> None:
        self.server = NetCatchupServer(env=env, token=token, config=config, store=store, fault=fault)
        self.transport = NetTransport(env=env, token=token, config=config, payloads=payloads)
        self.env, self.config = env, config
        self.url = self.server.start()


__all__ = ["BytePayloads", "Fault", "NetCatchup", "NetCatchupServer", "NetLink", "NetTransport"]
