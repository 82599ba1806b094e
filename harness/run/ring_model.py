"""Analytic FTAR rings: an unfaulted ring all-reduce as one timed wait per rank instead of one engine event
and task switch per chunk and hop.

`AnalyticFtarEngine` is the real FtarEngine (its listener, `reconfigure` with the real ring connections and
transport negotiation, `abort`, `send_abort`, `close`) whose `all_reduce` does not run the chunk schedule
(ftrun.ftar.run.RingRun). Every participant posts its arrival and its modeled duration to the job's
`RingBoard`; once all n have arrived the ring ends at max(arrival) + max(duration), and each participant
waits until then. What a fault does to a real ring still happens:

- a participant that crashes (or is killed) closes its ring connections; a `LinkWatch` task waiting on each
  of this rank's two ring connections (EmuConnection.wait_closed: it reads no frame) sees the close and ends
  the all-reduce with RecoverableError at that moment, and this rank closes its links in turn, so the abort
  travels around the ring as the real engine's does;
- `abort(epoch)` (a hung peer's notice) closes the links: the same path;
- a participant that never arrives: the others give up ftar timeout_s after their own arrival.

Faults that stall a ring without closing it (a silent host, a hung process, a building cut) need the
chunk-level engine. A driver that injects such faults itself (the diagnose bench) names the ring positions
(the local rank k every member of a ring shares) around its fault in `RingBoard.chunk_positions`; a call on
such a ring runs the real chunk engine (FtarEngine.all_reduce) on the same connections. The mode is latched
per (ring, call) at the first arrival, so all members agree. Otherwise the job uses analytic rings only
when it has no such fault (EmulatedJob.analytic_rings).

Telemetry (ftrun.diagnose.telemetry, when the rank has a Recorder): ENTER at arrival; once every member has
arrived, the modeled totals (Recorder.ftar_model: start, end, chunk steps, sends, bytes, send busy time);
DONE at the end, or FAIL naming the side whose connection closed; a call refused because its epoch was aborted
records ENTER and FAIL at once, as the chunk engine does. summarize reads these as it reads a chunk
run's records, its progress interpolated between start and end.

The duration (`ring_seconds`) is the schedule's modeled cost: every step of this rank's schedule takes the
longer of its chunk's transfer (the route to the next rank at the NIC's rate shared by the rank's ring
neighbours on its host, and across zones by the oversubscription; a slowed link's rate, Fabric.slow_link)
and its reduce kernel, plus one route latency per hop of the pipeline's fill. The send busy time
(`RankCost.busy`) is what the chunk engine measures: its sends block while the host NIC's backlog exceeds
the socket buffer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, NamedTuple

from ftrun.env.base import EnvTimeout, NetError
from ftrun.ftar.engine import FtarEngine
from ftrun.ftar.kernels import DType
from ftrun.ftar.ring import FatalError, RecoverableError
from ftrun.ftar.schedule import Reduce, ReduceCopy, Schedule, Send, schedule


@lru_cache(maxsize=256)
def _schedule(n: int, index: int, nbytes: int, elem: int, chunk_bytes: int, num_chunks: int) -> Schedule:
    return schedule(n, index, nbytes, elem_size=elem, chunk_bytes=chunk_bytes, num_chunks=num_chunks)


@lru_cache(maxsize=256)
def _summary(n: int, index: int, nbytes: int, elem: int, chunk_bytes: int, num_chunks: int) -> "StepSummary":
    return step_summary(_schedule(n, index, nbytes, elem, chunk_bytes, num_chunks))


# (ranks, ((chunk bytes, reduces, steps), ...), ((send bytes, sends), ...))
StepSummary = tuple[int, tuple[tuple[int, bool, int], ...], tuple[tuple[int, int], ...]]


def step_summary(sched: Schedule) -> StepSummary:
    """What ring_seconds and busy_seconds need of a schedule: its ring size, how many steps move how many
    bytes with or without a reduce kernel, and how many sends of how many bytes (a few distinct kinds
    however long the schedule)."""
    counts: dict[tuple[int, bool], int] = {}
    sends: dict[int, int] = {}
    for step in sched.steps:
        key = (step.ops[0].nbytes, any(isinstance(op, (Reduce, ReduceCopy)) for op in step.ops))
        counts[key] = counts.get(key, 0) + 1
        if isinstance(step.ops[-1], Send):
            sends[step.ops[-1].nbytes] = sends.get(step.ops[-1].nbytes, 0) + 1
    return (sched.num_ranks, tuple((nb, red, c) for (nb, red), c in sorted(counts.items())),
            tuple(sorted(sends.items())))


def send_totals(summary: StepSummary) -> tuple[int, int, int]:
    """(chunk steps, sends, bytes sent) of a step summary."""
    return (sum(c for _, _, c in summary[1]), sum(c for _, c in summary[2]), sum(nb * c for nb, c in summary[2]))


class RankCost(NamedTuple):
    """One rank's modeled all-reduce: its duration and what its send busy time depends on (`busy`)."""

    seconds: float  # ring_seconds: this rank's part of the ring's duration
    nic_s: float  # the wire time its sends and its host's other rings' take on the host NIC
    burst_s: float  # its busy time when the NIC keeps up with the ring (see busy)
    sndbuf_s: float  # the socket buffer, in NIC time
    send_frac: float  # the fraction of its chunk steps that send (all but the last hop's)

    def busy(self, ring_s: float) -> float:
        """Send busy time, as the chunk engine measures it (ftrun.diagnose.summary: per send, its completion
        less the later of its chunk step and the previous send's): a send blocks while the host NIC's backlog
        exceeds the socket buffer. When the host NIC is the ring's bottleneck (its time is at least 90 % of
        the sending steps' share of the ring's modeled duration `ring_s`) the backlog never drains: the sends
        are busy for the NIC time less one buffer. Otherwise each chunk goes out in a burst with the host's
        other rings' chunks and blocks for its mean place in the burst less the buffer (`burst_s`)."""
        if self.nic_s >= 0.9 * ring_s * self.send_frac:
            return max(0.0, self.nic_s - self.sndbuf_s)
        return self.burst_s


def rank_cost(summary: StepSummary, *, seconds: float, nic_rate: float, share: int, sndbuf_s: float,
              overhead_bytes: int = 0) -> RankCost:
    """A RankCost of a step summary: `share` ranks on the host send a chunk each per step through a NIC of
    `nic_rate` bytes/s (a slowed link's rate while it lasts) with a socket buffer of `sndbuf_s` NIC seconds."""
    if nic_rate <= 0 or share < 1 or sndbuf_s < 0:
        raise ValueError(f"need nic_rate > 0, share >= 1 and sndbuf_s >= 0, got {nic_rate}, {share}, {sndbuf_s}")
    wires = [(c, (nb + overhead_bytes) / nic_rate) for nb, c in summary[2]]
    nic = sum(c * share * w for c, w in wires)
    burst = sum(c * max(0.0, (share + 1) / 2 * w - sndbuf_s) for c, w in wires)
    steps, sends, _ = send_totals(summary)
    return RankCost(seconds, nic, burst, sndbuf_s, sends / steps if steps else 0.0)


def ring_seconds(summary: StepSummary, *, rate: float, latency: float, kernel_s: Callable[[int], float],
                 overhead_bytes: int = 0) -> float:
    """Modeled seconds of one rank's all-reduce (its schedule's step_summary): each schedule step the longer
    of sending its chunk at `rate` bytes/s and its reduce kernel (`kernel_s(nbytes)`), plus `latency` per hop
    of the fill (2N - 2 hops)."""
    if rate <= 0 or latency < 0:
        raise ValueError(f"need rate > 0 and latency >= 0, got {rate}, {latency}")
    num_ranks, kinds = summary[0], summary[1]
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
    """The job's analytic rings, keyed by (epoch, ring addresses, call number on that ring).

    `chunk_positions`: ring positions (a ring's shared local rank) whose next calls run chunk by chunk; a
    driver sets it around a fault it injects (the diagnose bench). `chunked` latches a call's mode."""

    def __init__(self) -> None:
        self._rings: dict[tuple, _Ring] = {}
        self.num_rings = 0  # all-reduces modeled (each once, however many participants)
        self.chunk_positions: frozenset[int] = frozenset()
        self.num_chunked = 0  # all-reduces run chunk by chunk (each once)
        self._modes: dict[tuple, list] = {}  # key -> [chunked, arrivals still to come]

    def chunked(self, key: tuple, n: int, position: int) -> bool:
        """Whether call `key` of an n-member ring runs chunk by chunk: decided by the first member to arrive
        (its position in chunk_positions), the same answer for the other n - 1."""
        mode = self._modes.get(key)
        if mode is None:
            mode = [position in self.chunk_positions, n]
            if mode[0]:
                self.num_chunked += 1
            if n > 1:
                self._modes[key] = mode
            return mode[0]
        mode[1] -= 1
        if mode[1] <= 1:
            del self._modes[key]  # every member has asked
        return mode[0]

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
    """Waits on one ring connection, without reading from it (a chunk-level call may use the connection
    meanwhile), for as long as the links are in use: a close (the peer crashed or aborted, or this rank
    closed it) is recorded with the ring index of that side and wakes the rank's current all-reduce."""

    def __init__(self, engine: "AnalyticFtarEngine", links: Any, conn: Any, side: int) -> None:
        self.engine, self.links, self.conn, self.side = engine, links, conn, side

    def __call__(self) -> None:
        try:
            self.conn.wait_closed(timeout=None)
            error: BaseException = NetError(f"ring connection to {self.conn.peer_addr} ended")
        except NetError as e:
            error = e
        self.engine._link_failed(self.links, error, self.side)


Cost = Callable[[StepSummary, str], RankCost]


class AnalyticFtarEngine(FtarEngine):
    """FtarEngine whose all_reduce is modeled per ring (see the module docstring). `cost(summary, next_addr)`:
    this rank's RankCost for a schedule's step_summary, sending to the rank listening at next_addr.
    `position`: the ring position (local rank) of this engine's rings, which RingBoard.chunk_positions
    names (-1: never chunk by chunk)."""

    def __init__(self, *, board: RingBoard, cost: Cost, position: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._board, self._cost, self.position = board, cost, position
        self._ring_key: tuple = ()
        self._link_error: tuple[Any, BaseException, int] | None = None  # (links, what ended them, side)
        self._waker: Any = None
        self._calls = 0

    def reconfigure(self, *, epoch: int, ring: list[str], index: int, timeout: float | None = None,
                    joining: bool = False) -> None:
        super().reconfigure(epoch=epoch, ring=ring, index=index, timeout=timeout, joining=joining)
        links, n = self._links, len(ring)
        self._ring_key, self._calls, self._next_addr = (epoch, tuple(ring)), 0, ring[(index + 1) % n]
        if links is not None and n > 1:
            sides = {id(links.prev): (links.prev, (index - 1) % n), id(links.next): (links.next, (index + 1) % n)}
            for conn, side in sides.values():
                if conn is not None:
                    self.env.spawn(LinkWatch(self, links, conn, side), name="ftar-link-watch")

    def _link_failed(self, links: Any, error: BaseException, side: int = -1) -> None:
        if self._link_error is None or self._link_error[0] is not links:
            self._link_error = (links, error, side)
        if self._links is links and self._waker is not None:
            self._waker.set()

    def _failed_links(self, links: Any) -> tuple[BaseException, int] | None:
        err = self._link_error
        return (err[1], err[2]) if err is not None and err[0] is links else None

    def all_reduce(self, buf: Any, dtype: DType | str | None = None) -> None:
        links = self._links
        if links is None:
            raise FatalError("all_reduce before reconfigure (or after a failed one): rebuild the ring first")
        if links.epoch <= self.aborted_epoch:
            self._record_refused(links, buf.nbytes)
            self._fail(links, NetError(f"ring epoch {links.epoch} was aborted (a participant of its quorum hung)"))
        dt = DType.parse(dtype if dtype is not None else buf.dtype)
        n, index = self._ring
        summary = _summary(n, index, buf.nbytes, dt.itemsize, self.config.chunk_bytes, self.config.num_chunks)
        if not summary[1]:
            return
        self._calls += 1
        key = (*self._ring_key, self._calls)
        if self._board.chunked(key, n, self.position):
            return super().all_reduce(buf, dtype)
        tel = self.telemetry
        steps, sends, sent_bytes = send_totals(summary)
        if tel:
            tel.ftar_enter(links.epoch, buf.nbytes, n, index, steps)
        clock = self.env.clock
        waker = self._waker = self.env.event()
        cost = self._cost(summary, self._next_addr)
        ring = self._board.arrive(key, n, clock.now(), cost.seconds, waker)
        try:
            self._wait(links, ring, waker, (steps, sends, sent_bytes, cost))
        finally:
            self._waker = None
            self._board.leave(key, ring)
        if tel:
            tel.ftar_end(True)

    def _wait(self, links: Any, ring: _Ring, waker: Any, totals: tuple[int, int, int, RankCost]) -> None:
        clock, timeout, tel = self.env.clock, self.config.timeout_s, self.telemetry
        give_up = clock.now() + timeout
        modeled = False
        while True:
            failed = self._failed_links(links)
            if failed is not None:
                self._fail(links, failed[0], failed[1], entered=True)
            now = clock.now()
            if ring.end is not None and not modeled and tel:
                steps, sends, sent_bytes, cost = totals
                tel.ftar_model(ring.latest, ring.end, steps, sends, sent_bytes, cost.busy(ring.longest))
                modeled = True
            if ring.end is not None and now >= ring.end:
                return
            until = ring.end if ring.end is not None else give_up
            if until <= now:
                self._fail(links, EnvTimeout(f"the ring's other ranks did not all arrive within {timeout}s"),
                           entered=True)
            waker.clear()
            waker.wait(timeout=until - now)

    def _fail(self, links: Any, e: BaseException, side: int = -1, *, entered: bool = False) -> None:
        if entered and self.telemetry:
            self.telemetry.ftar_end(False, side)
        links.close()  # neighbours see the close at once: the abort travels around the ring
        if self._links is links:
            self._links = None
        n, index = self._ring
        raise RecoverableError(f"all-reduce aborted on ring rank {index} of {n}: {type(e).__name__}: {e}") from e
