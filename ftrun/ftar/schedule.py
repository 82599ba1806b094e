"""The pure FTAR ring all-reduce schedule (paper §4.2): what each rank sends, receives, reduces and copies.

`schedule(num_ranks, rank, nbytes, elem_size=, chunk_bytes=, num_chunks=)` returns the exact, ordered
operations one rank runs for an in-place all-reduce of a buffer of `nbytes` bytes: afterwards every
rank's buffer holds the elementwise sum, bitwise identical on all ranks (each element's sum is formed
once, on one rank, and only copied after that). No I/O, clocks or threads: an engine executes it,
and `execute()` below runs all ranks against numpy arrays for tests.

Memory model. Each rank has its `data` buffer (input and output) and a staging area of
`num_slots = 2 * num_chunks` slots of `chunk_bytes` each (the paper's sendBuf + recvBuf, both S x C;
pre-registered/pinned in a real engine). Every message is sent from a slot and received into a slot;
`data` is written only with final sums, once per element, so an all-reduce abandoned half-way leaves
each element either as it was or at its final sum (a retry must start again from fresh inputs).

Structure. The buffer is cut into partitions of at most S x C x N bytes (S = chunk_bytes,
C = num_chunks, N = num_ranks), run one after another. A partition is cut into N segments (segment g
starts its journey at rank g) and each segment into k <= C chunks of at most S bytes; a full partition
has exactly C chunks of S bytes per segment. Boundaries fall on 16-byte multiples of the buffer when S
allows (so vectorized kernels see aligned chunks) and never split an element. Each (segment, chunk)
flow travels the ring rank g -> g+1 -> ... in 2N-2 hops. At hop t rank r handles the flow of segment
(r - t) mod N, chunk j, in slot 2j + t % 2 (two slots per chunk index, alternating, so a chunk can be
received while the previous hop's chunk in the other slot is still being sent):

    t = 0           CopyToSlot (slot <- data), Send
    1 <= t <= N-2   Recv, Reduce (slot += data), Send                      reduce-scatter
    t = N-1         Recv, ReduceCopy (slot += data; data <- slot), Send    fused last RS step: the
                    result lands in data and in the slot that the first all-gather send uses
    N <= t <= 2N-3  Recv, CopyFromSlot (data <- slot), Send                all-gather
    t = 2N-2        Recv, CopyFromSlot

Counts. Per rank and full partition: (2N-2) x C sends and as many receives, each of S bytes; a
partition moves 2(N-1)/N of its bytes out of every rank. In all, one rank sends about
2(N-1)/N x nbytes in (2N-2) x C x ceil(nbytes / (S x C x N)) messages (fewer in a short last
partition, whose empty chunks are skipped). N = 1 and nbytes = 0 give an empty schedule.

Ordering. Ops are listed partition by partition, hop by hop, chunk by chunk. On each directed link
(r -> r+1) messages carry `seq` = 0, 1, 2, ... in that order, and the receiver lists its Recvs in the
same order, so a FIFO link matches them one to one. An engine may run ops out of list order within
these rules: the ops of one `ChunkStep` run in order; a slot is written (CopyToSlot or Recv) only after
every earlier op on that slot has completed; and it must receive while it sends (blocking sends on
all ranks at once would deadlock the ring). It should cap bytes in flight per peer (C x S by design).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ftrun.ftar.kernels import DType, Kernels

_ALIGN = 16  # bytes: chunk boundaries fall on this grain when chunk_bytes allows (vector loads)


@dataclass(frozen=True, slots=True)
class Send:
    """Send `nbytes` from staging slot `slot` to rank `peer` (always the next rank) as message `seq`."""

    peer: int
    slot: int
    nbytes: int
    seq: int


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive message `seq` (exactly `nbytes`) from rank `peer` (always the previous rank) into `slot`."""

    peer: int
    slot: int
    nbytes: int
    seq: int


@dataclass(frozen=True, slots=True)
class CopyToSlot:
    """slot[0:nbytes] <- data[offset:offset+nbytes] (stage this rank's own segment for hop 0)."""

    slot: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Reduce:
    """slot[0:nbytes] += data[offset:offset+nbytes] (elementwise, in the buffer's dtype)."""

    slot: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReduceCopy:
    """slot += data; data <- slot: the fused last reduce-scatter step (final sum to both places)."""

    slot: int
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class CopyFromSlot:
    """data[offset:offset+nbytes] <- slot[0:nbytes] (an all-gather result arriving)."""

    slot: int
    offset: int
    nbytes: int


Op = Send | Recv | CopyToSlot | Reduce | ReduceCopy | CopyFromSlot
LocalOp = CopyToSlot | Reduce | ReduceCopy | CopyFromSlot


@dataclass(frozen=True, slots=True)
class Chunk:
    offset: int  # byte offset in the data buffer
    nbytes: int


@dataclass(frozen=True, slots=True)
class Segment:
    offset: int
    nbytes: int
    chunks: tuple[Chunk, ...]  # k of them (same k for every segment of a partition); some may be empty


@dataclass(frozen=True, slots=True)
class Partition:
    """One ring round over [offset, offset + nbytes) of the buffer; `segments[g]` starts at rank g."""

    index: int
    offset: int
    nbytes: int
    segments: tuple[Segment, ...]

    @property
    def num_chunks(self) -> int:
        """Chunks per segment (k <= C): the pipeline depth of this partition."""
        return len(self.segments[0].chunks)

    def hop_segment(self, rank: int, hop: int) -> Segment:
        """The segment `rank` receives (hop >= 1) and/or sends (hop <= 2N-3) at `hop`."""
        return self.segments[(rank - hop) % len(self.segments)]

    def hop_messages(self, rank: int, hop: int) -> int:
        """Messages `rank` sends at `hop` <= 2N-3 (as many as rank+1 receives at hop + 1)."""
        return sum(1 for c in self.hop_segment(rank, hop).chunks if c.nbytes)


@dataclass(frozen=True, slots=True)
class ChunkStep:
    """The ops of one chunk at one hop, to run in order: [CopyToSlot | Recv], [local op], [Send]."""

    partition: int
    hop: int
    chunk: int
    segment: int
    ops: tuple[Op, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """One rank's all-reduce. Staging needs `num_slots` slots of `slot_bytes`; slot i starts at
    byte i * slot_bytes of the staging area."""

    num_ranks: int
    rank: int
    nbytes: int
    elem_size: int
    slot_bytes: int
    num_slots: int
    partitions: tuple[Partition, ...]
    steps: tuple[ChunkStep, ...]

    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.num_ranks

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.num_ranks

    def ops(self) -> Iterator[Op]:
        for step in self.steps:
            yield from step.ops

    @property
    def num_sends(self) -> int:
        return sum(1 for op in self.ops() if isinstance(op, Send))


def _check_args(num_ranks: int, nbytes: int, elem_size: int, chunk_bytes: int, num_chunks: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if elem_size < 1:
        raise ValueError(f"elem_size must be >= 1, got {elem_size}")
    if nbytes < 0 or nbytes % elem_size:
        raise ValueError(f"nbytes={nbytes} must be a non-negative multiple of elem_size={elem_size}")
    if chunk_bytes < elem_size or chunk_bytes % elem_size:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of elem_size={elem_size}")
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")


def _split(nbytes: int, parts: int, unit: int) -> list[int]:
    """Cut nbytes into `parts` sizes that are multiples of `unit`, as even as possible, the larger
    ones first; the sub-unit remainder goes to the last part (the smallest, so no part exceeds
    ceil(units / parts) * unit)."""
    units, rest = divmod(nbytes, unit)
    base, extra = divmod(units, parts)
    sizes = [(base + (i < extra)) * unit for i in range(parts)]
    sizes[-1] += rest
    return sizes


def _partition(index: int, offset: int, nbytes: int, num_ranks: int, unit: int,
               chunk_bytes: int, num_chunks: int) -> Partition:
    seg_sizes = _split(nbytes, num_ranks, unit)
    k = max(1, -(-max(seg_sizes) // chunk_bytes))
    while True:  # the remainder placement can push a chunk just over S; one more chunk fixes it
        splits = [_split(s, k, unit) for s in seg_sizes]
        if max(max(s) for s in splits) <= chunk_bytes:
            break
        k += 1
    assert k <= num_chunks, (nbytes, num_ranks, chunk_bytes, num_chunks, k)
    segments, seg_off = [], offset
    for seg_nbytes, sizes in zip(seg_sizes, splits):
        chunks, off = [], seg_off
        for size in sizes:
            chunks.append(Chunk(off, size))
            off += size
        segments.append(Segment(seg_off, seg_nbytes, tuple(chunks)))
        seg_off += seg_nbytes
    return Partition(index, offset, nbytes, tuple(segments))


def partitions(num_ranks: int, nbytes: int, *, elem_size: int, chunk_bytes: int,
               num_chunks: int) -> tuple[Partition, ...]:
    """The partition/segment/chunk structure shared by all ranks (for emulators that model time at
    partition granularity without materializing ops). Raises ValueError on bad arguments."""
    _check_args(num_ranks, nbytes, elem_size, chunk_bytes, num_chunks)
    unit = _ALIGN if chunk_bytes % _ALIGN == 0 and _ALIGN % elem_size == 0 else elem_size
    full = chunk_bytes * num_chunks * num_ranks
    return tuple(
        _partition(i, off, min(full, nbytes - off), num_ranks, unit, chunk_bytes, num_chunks)
        for i, off in enumerate(range(0, nbytes, full))
    )


def _chunk_ops(hop: int, num_ranks: int, slot: int, chunk: Chunk, prev: int, next_: int,
               seqs: list[int]) -> tuple[Op, ...]:
    """The ops of one chunk at one hop; seqs = [next send seq, next recv seq], advanced in place."""
    off, nb = chunk.offset, chunk.nbytes
    if hop == 0:
        ops: list[Op] = [CopyToSlot(slot, off, nb)]
    else:
        ops = [Recv(prev, slot, nb, seqs[1])]
        seqs[1] += 1
        if hop < num_ranks - 1:
            ops.append(Reduce(slot, off, nb))
        elif hop == num_ranks - 1:
            ops.append(ReduceCopy(slot, off, nb))
        else:
            ops.append(CopyFromSlot(slot, off, nb))
    if hop < 2 * num_ranks - 2:
        ops.append(Send(next_, slot, nb, seqs[0]))
        seqs[0] += 1
    return tuple(ops)


def schedule(num_ranks: int, rank: int, nbytes: int, *, elem_size: int, chunk_bytes: int,
             num_chunks: int) -> Schedule:
    """The ops `rank` runs to all-reduce (sum) its `nbytes`-byte buffer in place with `num_ranks`
    ranks in a ring (send to rank+1, receive from rank-1).

    Args: elem_size: bytes per element (no element is ever split); chunk_bytes (S): the largest
    message and slot size, a multiple of elem_size; num_chunks (C): chunks in flight per peer.
    Returns: a Schedule; empty when num_ranks == 1 or nbytes == 0.
    Raises: ValueError on bad arguments (rank out of range, sizes not element multiples, ...).
    """
    _check_args(num_ranks, nbytes, elem_size, chunk_bytes, num_chunks)
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank={rank} out of range for num_ranks={num_ranks}")
    parts = partitions(num_ranks, nbytes, elem_size=elem_size, chunk_bytes=chunk_bytes,
                       num_chunks=num_chunks)
    steps: list[ChunkStep] = []
    if num_ranks > 1:
        prev, next_, seqs = (rank - 1) % num_ranks, (rank + 1) % num_ranks, [0, 0]
        for part in parts:
            for hop in range(2 * num_ranks - 1):
                seg_index = (rank - hop) % num_ranks
                for j, chunk in enumerate(part.segments[seg_index].chunks):
                    if chunk.nbytes:
                        ops = _chunk_ops(hop, num_ranks, 2 * j + hop % 2, chunk, prev, next_, seqs)
                        steps.append(ChunkStep(part.index, hop, j, seg_index, ops))
    return Schedule(num_ranks, rank, nbytes, elem_size, chunk_bytes, 2 * num_chunks, parts, tuple(steps))


def apply_local(op: LocalOp, kernels: Kernels, data: Any, staging: Any, slot_bytes: int,
                dtype: DType) -> float:
    """Run one local (non-message) op with `kernels` on this rank's data buffer and staging area.

    Returns what the kernel returns (modeled seconds; 0.0 for backends that do real work).
    """
    slot_off = op.slot * slot_bytes
    if isinstance(op, CopyToSlot):
        return kernels.copy(staging, slot_off, data, op.offset, op.nbytes)
    if isinstance(op, Reduce):
        return kernels.reduce(staging, slot_off, data, op.offset, op.nbytes, dtype)
    if isinstance(op, ReduceCopy):
        return kernels.reduce_copy(staging, slot_off, data, op.offset, data, op.offset, op.nbytes, dtype)
    if isinstance(op, CopyFromSlot):
        return kernels.copy(data, op.offset, staging, slot_off, op.nbytes)
    raise TypeError(f"not a local op: {op!r}")


class SimulationError(RuntimeError):
    """The schedules are inconsistent: a mismatched message, or no rank can make progress."""


def execute(schedules: Sequence[Schedule], buffers: Sequence[Any], *, dtype: DType | str,
            kernels: Kernels | None = None, rng: random.Random | None = None) -> None:
    """Run every rank's schedule in one process, passing messages in memory (per-link FIFO matched
    by (src, dst, seq)). For tests and examples.

    Args: schedules[i] is rank i's schedule; buffers[i] its data, a C-contiguous numpy array of
    nbytes bytes (any dtype; summed as `dtype`), updated in place. kernels defaults to the CPU
    backend. rng: if given, ranks advance one op at a time in a random interleaving (seeded, so
    deterministic); else each rank runs until it blocks, in rank order.
    Raises: SimulationError on a message mismatch or a deadlock; ValueError on bad arguments.
    """
    if kernels is None:
        from ftrun.ftar.cpu_kernels import CpuKernels

        kernels = CpuKernels()
    n = len(schedules)
    if len(buffers) != n or any(s.rank != i or s.num_ranks != n for i, s in enumerate(schedules)):
        raise ValueError("need one schedule per rank, in rank order, and one buffer per rank")
    if any(not b.flags.c_contiguous or b.nbytes != s.nbytes for b, s in zip(buffers, schedules)):
        raise ValueError("each buffer must be C-contiguous (updated in place) and schedule.nbytes long")
    sim = _Simulation(schedules, [b.reshape(-1).view(np.uint8) for b in buffers], kernels, DType.parse(dtype))
    sim.run(rng)


class _Simulation:
    """All ranks' state: program counters, staging areas, and the in-memory links."""

    def __init__(self, schedules: Sequence[Schedule], data: list[Any], kernels: Kernels, dtype: DType) -> None:
        self.schedules, self.data, self.kernels, self.dtype = schedules, data, kernels, dtype
        self.staging = [np.zeros(s.num_slots * s.slot_bytes, np.uint8) for s in schedules]
        self.ops = [list(s.ops()) for s in schedules]
        self.pcs = [0] * len(schedules)
        self.links: dict[tuple[int, int], deque[tuple[int, bytes]]] = {}

    def step(self, r: int) -> bool:
        """Run rank r's next op; False if it is a Recv with nothing to receive yet."""
        op, slot_bytes = self.ops[r][self.pcs[r]], self.schedules[r].slot_bytes
        if isinstance(op, Send):
            payload = self.staging[r][op.slot * slot_bytes:][:op.nbytes].tobytes()
            self.links.setdefault((r, op.peer), deque()).append((op.seq, payload))
        elif isinstance(op, Recv):
            link = self.links.get((op.peer, r))
            if not link:
                return False
            seq, payload = link.popleft()
            if seq != op.seq or len(payload) != op.nbytes:
                raise SimulationError(f"rank {r} expected seq {op.seq} ({op.nbytes} B) from {op.peer}, "
                                      f"got seq {seq} ({len(payload)} B)")
            self.staging[r][op.slot * slot_bytes:][:op.nbytes] = np.frombuffer(payload, np.uint8)
        else:
            apply_local(op, self.kernels, self.data[r], self.staging[r], slot_bytes, self.dtype)
        self.pcs[r] += 1
        return True

    def run(self, rng: random.Random | None) -> None:
        """Advance ranks until all are done; SimulationError when none can move or messages remain."""
        pcs, lengths = self.pcs, [len(o) for o in self.ops]
        while live := [r for r in range(len(lengths)) if pcs[r] < lengths[r]]:
            if rng is not None:  # one op of one random rank that can move
                rng.shuffle(live)
                moved = any(self.step(r) for r in live)
            else:  # each rank runs until it blocks
                moved = False
                for r in live:
                    while pcs[r] < lengths[r] and self.step(r):
                        moved = True
            if not moved:
                raise SimulationError(f"deadlock: ranks stuck at op indices {pcs}")
        leftover = {link: len(q) for link, q in self.links.items() if q}
        if leftover:
            raise SimulationError(f"messages never received: {leftover}")
