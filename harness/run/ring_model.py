"""Analytic FTAR rings: an unfaulted ring all-reduce as one timed wait per rank instead of one engine event
and task switch per chunk and hop.

`AnalyticFtarEngine` is the real FtarEngine (its listener, `reconfigure` with the real ring connections and
transport negotiation, `abort`, `send_abort`, `close`) whose `all_reduce` does not run the chunk schedule
(ftrun.ftar.run.RingRun). Every participant posts its arrival and its modeled duration to the job's
`RingBoard`; once all n have arrived the ring ends at max(arrival) + max(duration), and each participant
waits until then. What a fault does to a real ring still happens:

- a participant that crashes (or is killed) closes its ring connections; a `LinkWatch` task blocked on each
  of this rank's two ring connections sees the close (nothing else is ever sent on them) and ends the
  all-reduce with RecoverableError at that moment, and this rank closes its links in turn, so the abort
  travels around the ring as the real engine's does;
- `abort(epoch)` (a hung peer's notice) closes the links: the same path;
- a participant that never arrives: the others give up ftar timeout_s after their own arrival.

Faults that stall a ring without closing it (a silent host, a hung process, a building cut, a slow link)
need the chunk-level engine: the job uses analytic rings only when it has none (EmulatedJob.analytic_rings).

The duration (`ring_seconds`) is the schedule's modeled cost: every step of this rank's schedule takes the
longer of its chunk's transfer (the route to the next rank at the NIC's rate shared by the rank's ring
neighbours on its host, and across zones by the oversubscription) and its reduce kernel, plus one route
latency per hop of the pipeline's fill.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

from ftrun.env.base import EnvTimeout, NetError
from ftrun.ftar.engine import FtarEngine
from ftrun.ftar.kernels import DType
from ftrun.ftar.ring import FatalError, RecoverableError
from ftrun.ftar.schedule import Reduce, ReduceCopy, Schedule, schedule


@lru_cache(maxsize=256)
def _schedule(n: int, index: int, nbytes: int, elem: int, chunk_bytes: int, num_chunks: int) -> Schedule:
    return schedule(n, index, nbytes, elem_size=elem, chunk_bytes=chunk_bytes, num_chunks=num_chunks)


@lru_cache(maxsize=256)
def _summary(n: int, index: int, nbytes: int, elem: int, chunk_bytes: int, num_chunks: int) -> "StepSummary":
    return step_summary(_schedule(n, index, nbytes, elem, chunk_bytes, num_chunks))


StepSummary = tuple[int, tuple[tuple[int, bool, int], ...]]  # (ranks, ((chunk bytes, reduces, steps), ...))


def step_summary(sched: Schedule) -> StepSummary:
    """What ring_seconds needs of a schedule: its ring size and how many steps move how many bytes, with or
    without a reduce kernel (a few distinct kinds however long the schedule)."""
    counts: dict[tuple[int, bool], int] = {}
    for step in sched.steps:
        key = (step.ops[0].nbytes, any(isinstance(op, (Reduce, ReduceCopy)) for op in step.ops))
        counts[key] = counts.get(key, 0) + 1
    return sched.num_ranks, tuple((nb, red, c) for (nb, red), c in sorted(counts.items()))


def ring_seconds(summary: StepSummary, *, rate: float, latency: float, kernel_s: Callable[[int], float],
                 overhead_bytes: int = 0) -> float:
    """Modeled seconds of one rank's all-reduce (its schedule's step_summary): each schedule step the longer
    of sending its chunk at `rate` bytes/s and its reduce kernel (`kernel_s(nbytes)`), plus `latency` per hop
    of the fill (2N - 2 hops)."""
    if rate <= 0 or latency < 0:
        raise ValueError(f"need rate > 0 and latency >= 0, got {rate}, {latency}")
    num_ranks, kinds = summary
    total = 0.0
    for nbytes, reduces, count in kinds:
        wire = (nbytes + overhead_bytes) / rate
        total += count * (max(wire, kernel_s(nbytes)) if reduces else wire)
    return total + (2 * num_ranks - 2) * latency


class _Ring:
    """One ring epoch's all-reduce calls: arrivals, durations, and when it ends once all have arrived."""

    __slots__ = ("n", "arrived", "latest", "longest", "end", "waiters", "left", "calls")

    def __init__(self, n: int) -> None:
        self.n, self.arrived, self.latest, self.longest = n, 0, 0.0, 0.0
        self.end: float | None = None
        self.waiters: list[Any] = []
        self.left = 0
        self.calls = 0


class RingBoard:
    """The job's analytic rings, keyed by (epoch, ring addresses, call number on that ring)."""

    def __init__(self) -> None:
        self._rings: dict[tuple, _Ring] = {}
        self.num_rings = 0  # all-reduces modeled (each once, however many participants)

    def arrive(self, key: tuple, n: int, now: float, duration: float, waker: Any) -> _Ring:
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = _Ring(n)
            self.num_rings += 1
        ring.arrived += 1
        ring.latest, ring.longest = max(ring.latest, now), max(ring.longest, duration)
        ring.waiters.append(waker)
        if ring.arrived == ring.n:
            ring.end = ring.latest + ring.longest
            for w in ring.waiters:
                w.set()
        return ring

    def leave(self, key: tuple, ring: _Ring) -> None:
        ring.left += 1
        if ring.left == ring.arrived and self._rings.get(key) is ring:
            del self._rings[key]  # done (or broken: a late arrival finds its links closed)


class LinkWatch:
    """Blocks on one ring connection for as long as the links are in use: a close (the peer crashed or
    aborted, or this rank closed it) is recorded and wakes the rank's current all-reduce."""

    def __init__(self, engine: "AnalyticFtarEngine", links: Any, conn: Any) -> None:
        self.engine, self.links, self.conn = engine, links, conn

    def __call__(self) -> None:
        try:
            self.conn.recv(timeout=None)
            error: BaseException = NetError(f"unexpected frame on an analytic ring connection to {self.conn.peer_addr}")
        except NetError as e:
            error = e
        self.engine._link_failed(self.links, error)


class AnalyticFtarEngine(FtarEngine):
    """FtarEngine whose all_reduce is modeled per ring (see the module docstring). `cost(summary, next_addr)`:
    this rank's modeled seconds for a schedule's step_summary, sending to the rank listening at next_addr."""

    def __init__(self, *, board: RingBoard, cost: Callable[[StepSummary, str], float], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._board, self._cost = board, cost
        self._ring_key: tuple = ()
        self._link_error: tuple[Any, BaseException] | None = None  # (links, what ended them)
        self._waker: Any = None
        self._calls = 0

    def reconfigure(self, *, epoch: int, ring: list[str], index: int, timeout: float | None = None,
                    joining: bool = False) -> None:
        super().reconfigure(epoch=epoch, ring=ring, index=index, timeout=timeout, joining=joining)
        links = self._links
        self._ring_key, self._calls, self._next_addr = (epoch, tuple(ring)), 0, ring[(index + 1) % len(ring)]
        if links is not None and len(ring) > 1:
            for conn in {id(c): c for c in (links.prev, links.next) if c is not None}.values():
                self.env.spawn(LinkWatch(self, links, conn), name="ftar-link-watch")

    def _link_failed(self, links: Any, error: BaseException) -> None:
        if self._link_error is None or self._link_error[0] is not links:
            self._link_error = (links, error)
        if self._links is links and self._waker is not None:
            self._waker.set()

    def _failed_links(self, links: Any) -> BaseException | None:
        err = self._link_error
        return err[1] if err is not None and err[0] is links else None

    def all_reduce(self, buf: Any, dtype: DType | str | None = None) -> None:
        links = self._links
        if links is None:
            raise FatalError("all_reduce before reconfigure (or after a failed one): rebuild the ring first")
        if links.epoch <= self.aborted_epoch:
            self._fail(links, NetError(f"ring epoch {links.epoch} was aborted (a participant of its quorum hung)"))
        dt = DType.parse(dtype if dtype is not None else buf.dtype)
        n, index = self._ring
        summary = _summary(n, index, buf.nbytes, dt.itemsize, self.config.chunk_bytes, self.config.num_chunks)
        if not summary[1]:
            return
        self._calls += 1
        key = (*self._ring_key, self._calls)
        clock = self.env.clock
        waker = self._waker = self.env.event()
        ring = self._board.arrive(key, n, clock.now(), self._cost(summary, self._next_addr), waker)
        try:
            self._wait(links, ring, waker)
        finally:
            self._waker = None
            self._board.leave(key, ring)

    def _wait(self, links: Any, ring: _Ring, waker: Any) -> None:
        clock, timeout = self.env.clock, self.config.timeout_s
        give_up = clock.now() + timeout
        while True:
            error = self._failed_links(links)
            if error is not None:
                self._fail(links, error)
            now = clock.now()
            if ring.end is not None and now >= ring.end:
                return
            until = ring.end if ring.end is not None else give_up
            if until <= now:
                self._fail(links, EnvTimeout(f"the ring's other ranks did not all arrive within {timeout}s"))
            waker.clear()
            waker.wait(timeout=until - now)

    def _fail(self, links: Any, e: BaseException) -> None:
        links.close()  # neighbours see the close at once: the abort travels around the ring
        if self._links is links:
            self._links = None
        n, index = self._ring
        raise RecoverableError(f"all-reduce aborted on ring rank {index} of {n}: {type(e).__name__}: {e}") from e
