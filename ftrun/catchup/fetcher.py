"""Fetch a published step's state from healthy sources: the one catch-up client, blocking on the Env.

    result = fetch_with(env, transport, step, sources, config)

The manifest comes from the first source that has the step (each asked in turn, long-polling up to
long_poll_s for it to be published). The shards are then fetched concurrently, one task per source,
per the pure fetch plan (ftrun.catchup.plan); each lands in its slice of one destination buffer and is
checked against the manifest's CRC32 (once: the link's checksum of the bytes as they arrived, if it
computed one). A source that runs out of shards steals the untouched tail of the busiest one's
(plan.steal), so a slow source delays the fetch by one shard at most (two over a transport that
pipelines: the next shard's request goes out behind the one in flight, so the source sends it with no
round trip in between). A bad shard is retried from another source; a source that
cannot be reached, stalls, no longer has the step, or sent max_source_failures bad shards is dropped
and its unfinished shards re-planned onto the others. When no source is left: CatchupError naming what
failed at each. A refused token raises CatchupAuthError at once; no source having the step raises
CatchupStepError; the whole fetch is bounded by catchup_timeout_s (CatchupTimeout).

The transport (ftrun.catchup.transport) is all that differs between HTTP, framed env.net messages and
the emulator's shape-only payloads. Threading: runs in the calling task plus one task per source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupAuthError, CatchupError, CatchupStepError, CatchupTimeout, CatchupUsageError
from ftrun.catchup.manifest import Manifest
from ftrun.catchup.plan import FetchPlan, plan_fetch, reassign, replan, steal
from ftrun.catchup.transport import CatchupTransport, ShardFailed, SourceFailed, SourceLink
from ftrun.env.base import Env

log = logging.getLogger("ftrun.heal")


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


def fetch_with(env: Env, transport: CatchupTransport, step: int, sources: Sequence[str],
               config: CatchupConfig) -> FetchResult:
    """Fetch the state of `step` from `sources` through `transport` (see the module docstring).

    Raises CatchupUsageError (bad arguments), CatchupAuthError, CatchupStepError, CatchupTimeout,
    CatchupError (every source failed).
    """
    if step < 0 or not sources or len(set(sources)) != len(sources):
        raise CatchupUsageError(f"need a step >= 0 and distinct sources, got step {step}, {list(sources)}")
    return _Fetch(env, transport, step, list(sources), config).run()


class _Fetch:
    def __init__(self, env: Env, transport: CatchupTransport, step: int, sources: list[str],
                 config: CatchupConfig) -> None:
        self.env, self.transport, self.step, self.sources, self.config = env, transport, step, sources, config
        self.links: dict[str, SourceLink] = {}
        self.failures: list[str] = []
        self.bad_shards = {s: 0 for s in sources}
        self.bytes_by_source = {s: 0 for s in sources}
        self.done: set[int] = set()
        self.inflight: set[int] = set()
        self.plan: FetchPlan | None = None
        self.lock, self.changed = env.lock(), env.event()
        self.fatal: BaseException | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - self.env.clock.now())

    def run(self) -> FetchResult:
        start = self.env.clock.now()
        self.deadline = start + self.config.timeouts.catchup_timeout_s
        try:
            manifest = self._manifest()
            dest = self.transport.destination(manifest.layout.total_bytes)
            self._shards(manifest, dest)
        finally:
            for link in list(self.links.values()):
                link.close()
        return FetchResult(self.step, self.transport.views(dest, manifest.layout), manifest.metadata,
                           manifest.layout.total_bytes, self.env.clock.now() - start, self.bytes_by_source,
                           tuple(self.failures))

    def _timeout(self) -> CatchupTimeout:
        num = len(self.plan.sizes) if self.plan else "?"
        return CatchupTimeout(f"fetching step {self.step} took more than {self.config.timeouts.catchup_timeout_s:g}s "
                              f"({len(self.done)} of {num} shards done; failures: {self._failure_text()})")

    def _link(self, source: str) -> SourceLink:
        link = self.links.get(source)
        if link is None:
            link = self.links[source] = self.transport.open(source)
        return link

    def _drop_link(self, source: str) -> None:
        link = self.links.pop(source, None)
        if link is not None:
            link.close()

    # -- manifest ------------------------------------------------------------------------------
    def _manifest(self) -> Manifest:
        """The manifest from the first source that has the step; the ones before it are skipped."""
        step_errors: list[CatchupStepError] = []
        errors: list[CatchupError] = []
        for i, source in enumerate(self.sources):
            if self.remaining() <= 0 and i > 0:
                raise self._timeout()
            wait = min(self.config.long_poll_s, self.remaining())
            try:
                manifest = self._link(source).manifest(self.step, wait, self.remaining())
            except CatchupAuthError:
                raise
            except CatchupError as e:
                if self.remaining() <= 0:
                    raise self._timeout() from None
                if isinstance(e, CatchupStepError):
                    step_errors.append(e)
                else:
                    self._drop_link(source)
                    errors.append(CatchupError(f"{source}: {type(e).__name__}: {e}"))
                continue
            self.failures += [f"skipped {e}" for e in step_errors + errors]
            self.usable = self.sources[i:]
            return manifest
        text = "; ".join(str(e) for e in step_errors + errors)
        if step_errors and not errors:
            first = step_errors[0]
            raise CatchupStepError(f"no source has step {self.step}: {text}", status=first.status, have=first.have)
        raise CatchupError(f"no manifest for step {self.step} from any source: {text}")

    # -- shards --------------------------------------------------------------------------------
    def _shards(self, manifest: Manifest, dest: Any) -> None:
        shards = manifest.layout.shards
        self.plan = plan_fetch([s.nbytes for s in shards], self.usable)
        log.info("catch-up step %d: %s", self.step, self.plan.reason)
        tasks = [self.env.spawn(self._worker, src, manifest, dest, name=f"catchup-fetch-{i}")
                 for i, src in enumerate(self.usable)]
        for task in tasks:
            if not task.join(timeout=self.remaining() + 0.001) or self.remaining() <= 0:
                self.fatal = self.fatal or self._timeout()
                for link in list(self.links.values()):
                    link.close()  # unblocks the workers; they exit
                self._notify()
                for t in tasks:
                    t.join(timeout=self.config.stall_s)
                break
        if self.fatal is not None:
            raise self.fatal
        if len(self.done) < len(shards):
            raise CatchupError(f"step {self.step}: {len(shards) - len(self.done)} of {len(shards)} shards could "
                               f"not be fetched; every source failed: {self._failure_text()}")

    def _worker(self, source: str, manifest: Manifest, dest: Any) -> None:
        shards = manifest.layout.shards
        ahead: int | None = None  # this source's next shard, claimed and requested behind the one in flight
        while self.fatal is None:
            with self.lock:
                index, ahead = ahead, None
                if index is None:
                    index = self._claim(source)
                if index is None:
                    if len(self.done) == len(shards) or source not in self.plan.sources:
                        return
                    changed = self.changed
                elif self.transport.pipelines:
                    ahead = self._next_shard(source)
                    if ahead is not None:
                        self.inflight.add(ahead)
            if index is None:
                changed.wait(timeout=max(self.remaining(), 0.001))
                continue
            if not self._fetch_one(source, manifest, dest, index, ahead) and ahead is not None:
                with self.lock:  # its request went with the failed one's connection: back to the plan
                    self.inflight.discard(ahead)
                    ahead = None
                    self._notify()

    def _claim(self, source: str) -> int | None:
        """The next shard for `source` to start (its own, else one stolen from a slower source), marked
        in flight; None if there is none now. Called with the lock held."""
        index = self._next_shard(source)
        if index is None and source in self.plan.sources:
            stolen = steal(self.plan, source, self.done, self.inflight)
            if stolen is not None:  # this source is done with its own: take a slower one's
                self.plan = stolen
                index = self._next_shard(source)
        if index is not None:
            self.inflight.add(index)
        return index

    def _fetch_one(self, source: str, manifest: Manifest, dest: Any, index: int, ahead: int | None) -> bool:
        """Fetch and check one shard (with `ahead`, the next one's request goes out behind it); True
        if it is done."""
        shard = manifest.layout.shards[index]
        ok = False
        try:
            into = dest[shard.offset:shard.offset + shard.nbytes]
            left = self.remaining()
            nxt = None if ahead is None else manifest.layout.shards[ahead]
            pipelined = None if nxt is None else (nxt, dest[nxt.offset:nxt.offset + nxt.nbytes])
            crc = self._link(source).shard(self.step, shard, into, min(self.config.long_poll_s, left), left,
                                           ahead=pipelined)
            if crc is None:  # once per shard: a link that checksummed the bytes as they arrived says so
                crc = self.transport.crc32(into)
            if crc != manifest.crcs[index]:
                raise ShardFailed(f"fails its CRC32 ({crc:#010x}, manifest {manifest.crcs[index]:#010x})")
            with self.lock:
                self.done.add(index)
                self.bytes_by_source[source] += shard.nbytes
            ok = True
        except ShardFailed as e:
            with self.lock:
                self._shard_failed(source, index, str(e))
        except (SourceFailed, CatchupStepError) as e:
            with self.lock:
                self._source_failed(source, str(e))
        except CatchupAuthError as e:
            self.fatal = e
        except CatchupError as e:  # a peer's protocol error on this shard
            with self.lock:
                self._shard_failed(source, index, f"{type(e).__name__}: {e}")
        finally:
            with self.lock:
                self.inflight.discard(index)
                self._notify()
        return ok

    def _next_shard(self, source: str) -> int | None:
        return next((i for i in self.plan.shards_of(source) if i not in self.done and i not in self.inflight), None)

    def _shard_failed(self, source: str, index: int, why: str) -> None:
        """Retry the shard elsewhere; the source is dropped once it sent too many bad shards."""
        self.bad_shards[source] += 1
        self.failures.append(f"{source} shard {index}: {why}")
        log.warning("catch-up step %d: %s", self.step, self.failures[-1])
        self._drop_link(source)  # its connection may be mid-frame
        if self.bad_shards[source] >= self.config.max_source_failures:
            self._source_failed(source, f"{self.bad_shards[source]} bad shards")
            return
        self.plan = reassign(self.plan, index, source, self.done)

    def _source_failed(self, source: str, why: str) -> None:
        if source not in self.plan.sources:
            return
        self.failures.append(f"dropped {source}: {why}")
        self.plan = replan(self.plan, source, self.done)
        log.warning("catch-up step %d: dropped %s (%s); %s", self.step, source, why, self.plan.reason)
        self._drop_link(source)

    def _notify(self) -> None:
        old, self.changed = self.changed, self.env.event()
        old.set()

    def _failure_text(self) -> str:
        return "; ".join(self.failures) or "none"
