"""Fetch a published step's state from healthy sources: the one catch-up client, blocking on the Env.

    result = fetch_with(env, transport, step, sources, config)

Every source is asked for the manifest at once, one task per source, each long-polling up to
long_poll_s for the step to be published; the first manifest to arrive is the fetch's (the sources
publish the same state at about the same time, but one may be slower: its first publish, or a busy
source). The shards are then fetched concurrently, each source's task going on from its manifest, per
the pure fetch plan (ftrun.catchup.plan) over every source that has not failed its manifest yet; each
lands in its slice of one destination buffer and is checked against the manifest's CRC32 (once: the
link's checksum of the bytes as they arrived, if it computed one). A source that runs out of shards
steals the untouched tail of the busiest one's (plan.steal), so a slow source (or one whose manifest
comes late) delays the fetch by one shard at most (two over a transport that pipelines: the next
shard's request goes out behind the one in flight, so the source sends it with no round trip in
between). A bad shard is retried from another source; a source that cannot be reached, stalls, no
longer has the step, or sent max_source_failures bad shards is dropped and its unfinished shards
re-planned onto the others (so is one whose manifest fails after the plan was made). When no source is
left: CatchupError naming what failed at each. A refused token raises CatchupAuthError at once; no
source having the step raises CatchupStepError; the whole fetch is bounded by catchup_timeout_s
(CatchupTimeout).

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

# A request's own limit runs this much past the fetch's deadline: a fetch out of time ends with the fetch's
# CatchupTimeout, not with the requests that deadline cut short failing first as their sources' faults (a
# timer of the link's event loop may fire a clock tick early).
LIMIT_GRACE_S = 0.05


@dataclass(frozen=True)
class FetchResult:
    step: int
    tensors: dict[str, torch.Tensor]  # views into one flat buffer, this fetch's own unless the caller gave one to reuse
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
        self.manifest: Manifest | None = None
        self.manifest_errors: dict[str, CatchupError] = {}  # source -> why it gave no manifest
        self.dest: Any = None
        self.plan: FetchPlan | None = None
        self.lock, self.changed = env.lock(), env.event()
        self.fatal: BaseException | None = None
        self.stopped = False  # the fetch is over: the tasks exit

    def remaining(self) -> float:
        return max(0.0, self.deadline - self.env.clock.now())

    def run(self) -> FetchResult:
        start = self.env.clock.now()
        self.deadline = start + self.config.timeouts.catchup_timeout_s
        tasks = [self.env.spawn(self._source, src, name=f"catchup-fetch-{i}")
                 for i, src in enumerate(self.sources)]
        try:
            manifest = self._await(lambda: self.manifest is not None
                                   or len(self.manifest_errors) == len(self.sources))
            if manifest is None:
                raise self._no_manifest()
            dest = self.transport.destination(manifest.layout.total_bytes)
            with self.lock:
                self.dest = dest
                self._plan(manifest)
            shards = manifest.layout.shards
            self._await(lambda: len(self.done) == len(shards) or not self.plan.sources)
            if len(self.done) < len(shards):
                raise CatchupError(f"step {self.step}: {len(shards) - len(self.done)} of {len(shards)} shards "
                                   f"could not be fetched; every source failed: {self._failure_text()}")
        finally:
            self._stop(tasks)
        return FetchResult(self.step, self.transport.views(dest, manifest.layout), manifest.metadata,
                           manifest.layout.total_bytes, self.env.clock.now() - start, self.bytes_by_source,
                           tuple(self.failures))

    def _wait_until(self, ready: Any) -> bool:
        """Wait until ready() (checked with the lock held) or the fetch's deadline; True if ready."""
        while True:
            with self.lock:
                if ready():
                    return True
                changed = self.changed
            if self.remaining() <= 0:
                return False
            changed.wait(timeout=max(self.remaining(), 0.001))

    def _await(self, ready: Any) -> Manifest | None:
        """Wait until ready(); raises the fatal error or CatchupTimeout. Returns the manifest (None if
        there is none yet)."""
        if not self._wait_until(lambda: self.fatal is not None or ready()):
            raise self._timeout()
        if self.fatal is not None:
            raise self.fatal
        return self.manifest

    def _stop(self, tasks: list[Any]) -> None:
        """End the tasks: a source still long-polling its manifest, or one that failed, is cut off."""
        with self.lock:
            self.stopped = True
            self._notify()
        if not all(task.join(timeout=0.001) for task in tasks):
            self._close_links()  # unblocks the tasks; they exit
        for task in tasks:
            task.join(timeout=self.config.stall_s)
        self._close_links()

    def _close_links(self) -> None:
        for source in list(self.links):
            self._drop_link(source)

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
    def _source(self, source: str) -> None:
        """One source's task: its manifest (the first to arrive is the fetch's), then its shards."""
        try:
            self._manifest_then_shards(source)
        except BaseException as e:  # a bug, not a source's failure: the fetch ends with it
            with self.lock:
                self.fatal = self.fatal or e
                self._notify()

    def _manifest_then_shards(self, source: str) -> None:
        if self.stopped:
            return
        try:
            manifest = self._link(source).manifest(self.step, min(self.config.long_poll_s, self.remaining()),
                                                   self.remaining() + LIMIT_GRACE_S)
        except CatchupAuthError as e:
            with self.lock:
                self.fatal = self.fatal or e
                self._notify()
            return
        except CatchupError as e:
            with self.lock:
                if self.stopped:
                    return
                self.manifest_errors[source] = e
                self.failures.append(f"skipped {source}: {type(e).__name__}: {e}")
                if not isinstance(e, CatchupStepError):
                    self._drop_link(source)
                if self.plan is not None and source in self.plan.sources:
                    self.plan = replan(self.plan, source, self.done)
                    log.warning("catch-up step %d: skipped %s (%s); %s", self.step, source, e, self.plan.reason)
                self._notify()
            return
        with self.lock:
            if self.manifest is None:
                self.manifest = manifest
                self._notify()
        self._wait_until(lambda: self.plan is not None or self.stopped or self.fatal is not None)
        if self.plan is not None and not self.stopped and self.fatal is None:
            self._worker(source, self.manifest, self.dest)

    def _plan(self, manifest: Manifest) -> None:
        """The fetch plan over every source that has not failed its manifest (called with the lock held)."""
        usable = [s for s in self.sources if s not in self.manifest_errors]
        self.plan = plan_fetch([s.nbytes for s in manifest.layout.shards], usable)
        log.info("catch-up step %d: %s", self.step, self.plan.reason)
        self._notify()

    def _no_manifest(self) -> CatchupError:
        errors = [self.manifest_errors[s] for s in self.sources]
        text = "; ".join(str(e) if isinstance(e, CatchupStepError) else f"{s}: {type(e).__name__}: {e}"
                         for s, e in zip(self.sources, errors))
        if all(isinstance(e, CatchupStepError) for e in errors):
            first = errors[0]
            return CatchupStepError(f"no source has step {self.step}: {text}", status=first.status, have=first.have)
        return CatchupError(f"no manifest for step {self.step} from any source: {text}")

    # -- shards --------------------------------------------------------------------------------
    def _worker(self, source: str, manifest: Manifest, dest: Any) -> None:
        shards = manifest.layout.shards
        ahead: int | None = None  # this source's next shard, claimed and requested behind the one in flight
        while self.fatal is None and not self.stopped:
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
                if self.remaining() <= 0:
                    return
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
            crc = self._link(source).shard(self.step, shard, into, min(self.config.long_poll_s, left),
                                           left + LIMIT_GRACE_S, ahead=pipelined)
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
