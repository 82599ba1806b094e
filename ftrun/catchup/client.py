"""Fetch a published step's state from healthy sources, in parallel, into one preallocated buffer.

    state = fetch_state(step, sources, token, timeouts)           # dict name -> tensor
    result = fetch(step, sources, token, timeouts, config=...)    # + metadata, bytes per source, failures

The manifest comes from the first source that has the step (waiting up to long_poll_s for it to be
published). Shards are then fetched concurrently, one keep-alive connection per source, per the pure
fetch plan (ftrun.catchup.plan); each lands directly in its slice of the destination buffer and is
checked against the manifest's CRC32. A bad shard (checksum mismatch, short body, server error) is
retried from another source; a source that cannot be reached, stalls, no longer has the step, or sent
max_source_failures bad shards is dropped and its unfinished shards replanned onto the others. When no
source is left: CatchupError naming what failed at each. A 401 raises CatchupAuthError at once; no
source having the step raises CatchupStepError; the whole fetch is bounded by catchup_timeout_s
(CatchupTimeout).

Runs its own asyncio event loop in the calling task and blocks it until done. The returned tensors are
views into one flat uint8 buffer (`buffer` if given and large enough — reuse it across fetches so a
steady-state fetch allocates nothing).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.conn import ConnectionLost, HttpConnection, SourceStalled
from ftrun.catchup.errors import (CatchupAuthError, CatchupError, CatchupPeerError, CatchupStepError,
                                  CatchupTimeout, CatchupUsageError)
from ftrun.catchup.manifest import Manifest, ShardSpec, decode_manifest
from ftrun.catchup.plan import FetchPlan, plan_fetch, reassign, replan
from ftrun.catchup.snapshot import tensor_views
from ftrun.catchup.wire import ResponseHead, split_url
from ftrun.config import Timeouts

log = logging.getLogger("ftrun.heal")

MAX_SMALL_BODY = 64 << 20  # manifests and error bodies


@dataclass(frozen=True)
class FetchResult:
    step: int
    tensors: dict[str, torch.Tensor]  # views into one flat buffer
    metadata: dict[str, Any]
    num_bytes: int
    seconds: float
    bytes_by_source: dict[str, int]
    failures: tuple[str, ...]  # what went wrong and was worked around

    @property
    def gbps(self) -> float:
        return self.num_bytes / max(self.seconds, 1e-9) / 1e9


class _SourceFailed(Exception):
    """Drop this source: unreachable, stalled, or it no longer has the step."""


class _ShardFailed(Exception):
    """This shard's bytes from this source are bad: retry it elsewhere."""


def fetch_state(step: int, sources: Sequence[str], token: str, timeouts: Timeouts, *,
                config: CatchupConfig | None = None, buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The state of `step` as name -> tensor. See `fetch`."""
    return fetch(step, sources, token, timeouts, config=config, buffer=buffer).tensors


def fetch(step: int, sources: Sequence[str], token: str, timeouts: Timeouts, *,
          config: CatchupConfig | None = None, buffer: torch.Tensor | None = None) -> FetchResult:
    """Fetch the state of `step` from `sources` ("http://host:port" catch-up endpoints).

    Args:
        timeouts: bounds the whole fetch (catchup_timeout_s) and each connect (connect_timeout_s).
        config: stall_s, long_poll_s and max_source_failures (its own timeouts are not used).
        buffer: a CPU uint8 tensor to receive into (used when large enough).
    Raises:
        CatchupUsageError: bad arguments. CatchupAuthError: token refused. CatchupStepError: no source
        has the step. CatchupTimeout: past catchup_timeout_s. CatchupError: every source failed.
    """
    if step < 0 or not sources or len(set(sources)) != len(sources):
        raise CatchupUsageError(f"need a step >= 0 and distinct sources, got step {step}, {list(sources)}")
    try:
        addrs = {s: split_url(s) for s in sources}
    except ValueError as e:
        raise CatchupUsageError(str(e)) from None
    config = replace(config or CatchupConfig(), timeouts=timeouts)
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(_Fetch(step, addrs, token, config, buffer).run())
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()


class _Fetch:
    def __init__(self, step: int, addrs: dict[str, tuple[str, int]], token: str, config: CatchupConfig,
                 buffer: torch.Tensor | None) -> None:
        self.step, self.addrs, self.token, self.config, self.buffer = step, addrs, token, config, buffer
        self.sources = list(addrs)
        self.conns: dict[str, HttpConnection] = {}
        self.failures: list[str] = []
        self.bad_shards = {s: 0 for s in self.sources}
        self.bytes_by_source = {s: 0 for s in self.sources}
        self.done: set[int] = set()
        self.inflight: set[int] = set()
        self.plan: FetchPlan | None = None

    async def run(self) -> FetchResult:
        loop = asyncio.get_running_loop()
        start, limit = loop.time(), self.config.timeouts.catchup_timeout_s
        self.deadline = start + limit
        try:
            manifest, dest = await asyncio.wait_for(self._fetch_all(), limit)
        except asyncio.TimeoutError:
            num = len(self.plan.sizes) if self.plan else "?"
            raise CatchupTimeout(f"fetching step {self.step} took more than {limit:g}s ({len(self.done)} of "
                                 f"{num} shards done; failures: {self._failure_text()})") from None
        finally:
            for conn in self.conns.values():
                conn.close()
        return FetchResult(self.step, tensor_views(dest, manifest.layout), manifest.metadata,
                           manifest.layout.total_bytes, loop.time() - start, self.bytes_by_source,
                           tuple(self.failures))

    async def _fetch_all(self) -> tuple[Manifest, torch.Tensor]:
        manifest, failed = await self._manifest()
        shards = manifest.layout.shards
        dest = self._destination(manifest.layout.total_bytes)
        self.view = memoryview(dest.numpy()) if dest.numel() else memoryview(bytearray())
        self.failures += [f"skipped {error}" for error in failed]  # sources that failed the manifest
        usable = self.sources[len(failed):]
        self.plan = plan_fetch([s.nbytes for s in shards], usable)
        self.changed = asyncio.Event()
        log.info("catch-up step %d: %s", self.step, self.plan.reason)
        workers = [asyncio.create_task(self._worker(src, manifest)) for src in usable]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        if len(self.done) < len(shards):
            raise CatchupError(f"step {self.step}: {len(shards) - len(self.done)} of {len(shards)} shards could "
                               f"not be fetched; every source failed: {self._failure_text()}")
        return manifest, dest

    def _destination(self, nbytes: int) -> torch.Tensor:
        b = self.buffer
        if b is not None and b.dtype == torch.uint8 and b.device.type == "cpu" and b.is_contiguous() \
                and b.dim() == 1 and b.numel() >= nbytes:
            return b[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8)

    # -- manifest ------------------------------------------------------------------------------
    async def _manifest(self) -> tuple[Manifest, list[Exception]]:
        """The manifest from the first source that has the step, and what the ones before it said."""
        step_errors: list[CatchupStepError] = []
        errors: list[Exception] = []
        for source in self.sources:
            wait = max(0.0, min(self.config.long_poll_s, self.deadline - asyncio.get_running_loop().time()))
            try:
                head, body = await self._get_small(source, f"/catchup/{self.step}/manifest?wait={wait:.3f}", wait)
                if head.status == 200:
                    return decode_manifest(body, step=self.step), step_errors + errors
                error = self._status_error(source, head, body)  # raises on 401
                (step_errors if isinstance(error, CatchupStepError) else errors).append(error)
            except (OSError, asyncio.TimeoutError, CatchupPeerError) as e:
                conn = self.conns.pop(source, None)
                if conn is not None:
                    conn.close()
                errors.append(CatchupError(f"{source}: {type(e).__name__}: {e}"))
        text = "; ".join(str(e) for e in step_errors + errors)
        if step_errors and not errors:
            first = step_errors[0]
            raise CatchupStepError(f"no source has step {self.step}: {text}", status=first.status, have=first.have)
        raise CatchupError(f"no manifest for step {self.step} from any source: {text}")

    async def _get_small(self, source: str, path: str, wait: float) -> tuple[ResponseHead, bytes]:
        conn = await self._connection(source)

        def pick(head: ResponseHead) -> memoryview:
            if head.content_length > MAX_SMALL_BODY:
                raise CatchupPeerError(f"{source} sent a {head.content_length}-byte body for {path}")
            return memoryview(bytearray(head.content_length))

        resp = await conn.get(path, pick, head_wait_s=wait, stall_s=self.config.stall_s)
        return resp.head, resp.body.tobytes()

    def _status_error(self, source: str, head: ResponseHead, body: bytes) -> CatchupError:
        try:
            doc = json.loads(body)
            message, have = str(doc.get("error")), doc.get("have")
        except (ValueError, AttributeError):
            message, have = body[:200].decode("latin-1"), None
        text = f"{source} answered {head.status}: {message}"
        if head.status == 401:
            raise CatchupAuthError(text)
        if head.status in (404, 409, 410):
            return CatchupStepError(text, status=head.status, have=have if type(have) is int else None)
        return CatchupPeerError(text)

    async def _connection(self, source: str) -> HttpConnection:
        conn = self.conns.get(source)
        if conn is None or not conn.usable:
            host, port = self.addrs[source]
            conn = await HttpConnection.open(host, port, self.token, self.config.timeouts.connect_timeout_s)
            self.conns[source] = conn
        return conn

    # -- shards --------------------------------------------------------------------------------
    async def _worker(self, source: str, manifest: Manifest) -> None:
        while True:
            index = self._next_shard(source)
            if index is None:
                if len(self.done) == len(manifest.layout.shards) or source not in self.plan.sources:
                    return
                await self.changed.wait()
                continue
            self.inflight.add(index)
            try:
                await self._get_shard(source, manifest.layout.shards[index], manifest.crcs[index])
                self.done.add(index)
            except _ShardFailed as e:
                if self._shard_failed(source, index, str(e)):
                    return
            except _SourceFailed as e:
                self._source_failed(source, str(e))
                return
            finally:
                self.inflight.discard(index)
                self._notify()

    def _next_shard(self, source: str) -> int | None:
        return next((i for i in self.plan.shards_of(source) if i not in self.done and i not in self.inflight), None)

    async def _get_shard(self, source: str, shard: ShardSpec, crc: int) -> None:
        def pick(head: ResponseHead) -> memoryview:
            if head.status == 200:
                if head.content_length != shard.nbytes:
                    raise CatchupPeerError(f"shard {shard.index} is {head.content_length} bytes, "
                                           f"the manifest says {shard.nbytes}")
                return self.view[shard.offset:shard.offset + shard.nbytes]
            if head.content_length > MAX_SMALL_BODY:
                raise CatchupPeerError(f"{source} sent a {head.content_length}-byte error body")
            return memoryview(bytearray(head.content_length))

        resp = await self._request(source, f"/catchup/{self.step}/shard/{shard.index}", pick)
        if resp.head.status != 200:
            error = self._status_error(source, resp.head, resp.body.tobytes())
            raise (_SourceFailed if isinstance(error, CatchupStepError) else _ShardFailed)(str(error))
        if resp.crc32 != crc:
            raise _ShardFailed(f"fails its CRC32 ({resp.crc32:#010x}, manifest {crc:#010x})")
        self.bytes_by_source[source] += shard.nbytes

    async def _request(self, source: str, path: str, pick):
        """One shard request; a reused connection the server closed while idle is reopened once."""
        wait = self.config.long_poll_s
        for attempt in (0, 1):
            reused = source in self.conns and self.conns[source].usable
            try:
                conn = await self._connection(source)
            except (OSError, asyncio.TimeoutError) as e:
                raise _SourceFailed(f"{source} cannot be reached: {type(e).__name__}: {e}") from None
            try:
                return await conn.get(path + f"?wait={wait:g}", pick, head_wait_s=wait, stall_s=self.config.stall_s)
            except SourceStalled as e:
                raise _SourceFailed(str(e)) from None
            except ConnectionLost as e:
                if not (reused and e.got == 0 and attempt == 0):
                    raise _ShardFailed(str(e)) from None
            except CatchupPeerError as e:
                raise _ShardFailed(str(e)) from None
        raise AssertionError("unreachable")

    def _shard_failed(self, source: str, index: int, why: str) -> bool:
        """Retry the shard elsewhere; True if the source is dropped for sending too many bad shards."""
        self.bad_shards[source] += 1
        self.failures.append(f"{source} shard {index}: {why}")
        log.warning("catch-up step %d: %s", self.step, self.failures[-1])
        if self.bad_shards[source] >= self.config.max_source_failures:
            self._source_failed(source, f"{self.bad_shards[source]} bad shards")
            return True
        self.plan = reassign(self.plan, index, source, self.done)
        return False

    def _source_failed(self, source: str, why: str) -> None:
        self.failures.append(f"dropped {source}: {why}")
        self.plan = replan(self.plan, source, self.done)
        log.warning("catch-up step %d: dropped %s (%s); %s", self.step, source, why, self.plan.reason)
        conn = self.conns.pop(source, None)
        if conn is not None:
            conn.close()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def _failure_text(self) -> str:
        return "; ".join(self.failures) or "none"
