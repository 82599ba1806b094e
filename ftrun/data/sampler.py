"""Deterministic, resumable sampler: which samples rank k of replica r trains for its p-th batch. Pure.

One global order. The job reads one endless stream of sample indices that does not depend on the
replica count: global epoch e is a permutation of range(dataset_size) keyed by (seed, e), epochs
follow each other, and a batch may straddle two epochs (no sample is dropped at an epoch's end).
Element g of the stream (its *global offset*) is sample permute(g % N, N, key(seed, g // N)).

Eras. A job reads the global order through an *era stream* (`StreamOrigin`): first a finite prefix
of global offsets that an earlier era left untrained, then every offset from `tail` on. A fresh job
has the empty prefix and tail 0 (era stream = global order). A full restart that changes the number
of replicas or the replica batch starts a new era whose origin is what the old era left untrained
(`remaining`), so every global offset is trained exactly once across the change.

Chunks. The era stream is cut into chunks of B = ranks_per_replica * batch_size_per_rank elements;
replica r's p-th batch is chunk p * num_replicas + r (its `batch_id`), and rank k gets the k-th slice
of batch_size_per_rank elements. Replicas therefore never share an element, and when they move in
lockstep step s trains exactly the global offsets [s*G, (s+1)*G) with G = num_replicas * B, whatever
the replica count: a job that keeps G constant across a restart trains the same samples per step.

Position, not step. `p` is the replica's *data position*: how many of its batches the job has trained
(see `loader_state.LoaderState`), which differs from the global step once a replica has missed steps
(it leaves holes behind the fastest replica; `remaining` hands them to the next era). Every answer is
a pure function of (layout, origin, replica, rank, position), so a replica resumes anywhere without
replaying the stream, and any process can recompute any rank's batch (the audit does).

Shuffling uses a keyed Feistel permutation with cycle walking, evaluated per element: O(1) memory and
random access, so a dataset of a billion samples costs nothing to shuffle and 100K emulated ranks can
each hold a sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import numpy as np

_MASK64 = (1 << 64) - 1
_FEISTEL_ROUNDS = 6


@dataclass(frozen=True, kw_only=True)
class DataLayout:
    """The global batch layout of a job.

    dataset_size: number of samples; indices 0..dataset_size-1.
    num_replicas: replicas in the job (the configured total, not the live ones).
    ranks_per_replica: ranks that split one replica batch.
    batch_size_per_rank: samples one rank trains per step.
    seed: shuffling seed; the same seed gives the same order on every run.
    """

    dataset_size: int
    num_replicas: int
    ranks_per_replica: int
    batch_size_per_rank: int
    seed: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"DataLayout.{f.name} must be an int, got {value!r}")
            if f.name != "seed" and value < 1:
                raise ValueError(f"DataLayout.{f.name} must be >= 1, got {value}")
        if self.seed < 0:
            raise ValueError(f"DataLayout.seed must be >= 0, got {self.seed}")
        if self.dataset_size < self.num_replicas:
            raise ValueError(
                f"DataLayout.dataset_size ({self.dataset_size}) must be >= num_replicas ({self.num_replicas}) "
                "so that every replica owns at least one sample"
            )

    @property
    def replica_batch_size(self) -> int:
        return self.ranks_per_replica * self.batch_size_per_rank

    def to_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class RankPosition:
    """Where one rank stands in its replica's stream after `committed_batches` batches."""

    committed_batches: int
    epoch: int  # epoch of the rank's next sample
    next_sample: int  # offset of the rank's next sample inside that epoch's permutation


def _mix64(x: int) -> int:
    """splitmix64 finalizer on a Python int (key derivation)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on uint64 arrays (wraps modulo 2**64 like the int version)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(offsets: np.ndarray, size: int, key: int) -> np.ndarray:
    """Apply the keyed permutation of range(size) to `offsets` (each in [0, size)).

    A balanced Feistel network on 2h bits (2**2h < 4*size) is a bijection of [0, 2**2h); cycle walking
    (re-applying it until the value falls below `size`) restricts it to a bijection of [0, size).
    """
    x = np.asarray(offsets, dtype=np.uint64).reshape(-1)
    if size == 1:
        return np.zeros_like(x, dtype=np.int64)
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask, shift = np.uint64((1 << half) - 1), np.uint64(half)
    keys = [np.uint64(_mix64(key + i)) for i in range(_FEISTEL_ROUNDS)]

    def feistel(v: np.ndarray) -> np.ndarray:
        left, right = v >> shift, v & mask
        for k in keys:
            left, right = right, left ^ (_mix64_array(right ^ k) & mask)
        return (left << shift) | right

    y = feistel(x)
    todo = y >= np.uint64(size)
    while todo.any():
        y[todo] = feistel(y[todo])
        todo = y >= np.uint64(size)
    return y.astype(np.int64)


Range = tuple[int, int]  # half-open [start, stop) of global offsets


def _check_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be an int >= 0, got {value!r}")
    return value


@dataclass(frozen=True)
class StreamOrigin:
    """An era's stream in global offsets: the `prefix` ranges (sorted, disjoint, not touching each other
    or `tail`), then every offset from `tail` on. The default is the global order itself."""

    prefix: tuple[Range, ...] = ()
    tail: int = 0

    def __post_init__(self) -> None:
        _check_int(self.tail, "StreamOrigin.tail")
        last = -1
        for item in self.prefix:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise ValueError(f"StreamOrigin.prefix items must be (start, stop) pairs, got {item!r}")
            a, b = (_check_int(v, "StreamOrigin.prefix bound") for v in item)
            if not last < a < b < self.tail:
                raise ValueError(f"StreamOrigin.prefix must be sorted, non-empty, non-touching ranges below "
                                 f"tail {self.tail}; got {item} after offset {last}")
            last = b
        starts = np.array([a for a, _ in self.prefix], dtype=np.int64)
        sizes = np.array([b - a for a, b in self.prefix], dtype=np.int64)
        object.__setattr__(self, "_starts", starts)
        object.__setattr__(self, "_cum", np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    @property
    def prefix_size(self) -> int:
        return int(self._cum[-1])

    @property
    def is_global(self) -> bool:
        """Whether the era stream is the global order itself (a job that never resharded)."""
        return not self.prefix and self.tail == 0

    def to_global(self, elements: np.ndarray) -> np.ndarray:
        """Global offsets of era-stream elements (int64 array in, same shape out)."""
        x = np.asarray(elements, dtype=np.int64)
        size = self.prefix_size
        out = x - size + self.tail
        inside = x < size
        if inside.any():
            piece = np.searchsorted(self._cum, x[inside], side="right") - 1
            out[inside] = self._starts[piece] + (x[inside] - self._cum[piece])
        return out

    def ranges(self, start: int, stop: int) -> list[Range]:
        """Global ranges of the era-stream elements [start, stop), in era-stream order."""
        out: list[Range] = []
        size = self.prefix_size
        if start < size:
            piece = int(np.searchsorted(self._cum, start, side="right")) - 1
            while start < min(stop, size):
                a, b = self.prefix[piece]
                lo = a + start - int(self._cum[piece])
                hi = min(b, lo + stop - start)
                out.append((lo, hi))
                start += hi - lo
                piece += 1
        if start < stop:
            out.append((self.tail + start - size, self.tail + stop - size))
        return out

    def to_list(self) -> list:
        """JSON/msgpack form: [tail, [[start, stop], ...]]."""
        return [self.tail, [list(r) for r in self.prefix]]

    @classmethod
    def from_list(cls, raw: object) -> "StreamOrigin":
        """Inverse of `to_list`. Raises ValueError naming what is wrong."""
        if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[1], list)):
            raise ValueError(f"a stream origin is [tail, [[start, stop], ...]], got {str(raw)[:80]}")
        if not all(isinstance(r, list) and len(r) == 2 for r in raw[1]):
            raise ValueError("stream origin prefix items must be [start, stop] pairs")
        return cls(tuple((r[0], r[1]) for r in raw[1]), raw[0])


def merge_ranges(ranges: Iterable[Range]) -> list[Range]:
    """Sorted union of half-open ranges, touching ones joined. Pure."""
    out: list[Range] = []
    for a, b in sorted(r for r in ranges if r[0] < r[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def remaining(layout: DataLayout, origin: StreamOrigin, committed_batches: Sequence[int]) -> StreamOrigin:
    """What an era (`layout` read through `origin`) left untrained after replica i trained its first
    `committed_batches[i]` batches, as the origin of the next era. Pure.

    Untrained are the holes behind the fastest replica (replica i's positions from committed_batches[i]
    up to the maximum) and the era stream after the chunks of that maximum. The next era reads the
    holes first, in global order, then the rest: the remaining order, which the next era's replica
    count partitions afresh.

    Size: one prefix range per run of adjacent hole chunks, so a replica k batches behind the fastest
    adds up to k ranges (carried by every ledger record of the next era); a lockstep job adds none.
    """
    if len(committed_batches) != layout.num_replicas or min(committed_batches) < 0:
        raise ValueError(f"committed_batches {tuple(committed_batches)} do not fit {layout.num_replicas} replicas")
    size, stride = layout.replica_batch_size, layout.num_replicas
    top = max(committed_batches)
    era: list[Range] = [((p * stride + r) * size, (p * stride + r + 1) * size)
                        for r, done in enumerate(committed_batches) for p in range(done, top)]
    frontier = stride * top * size
    if frontier < origin.prefix_size:
        era.append((frontier, origin.prefix_size))
    tail = origin.tail + max(0, frontier - origin.prefix_size)
    pieces = merge_ranges(g for a, b in merge_ranges(era) for g in origin.ranges(a, b))
    if pieces and pieces[-1][1] >= tail:  # the last hole runs into the tail: one unbounded range
        tail = min(tail, pieces.pop()[0])
    return StreamOrigin(tuple(pieces), tail)


class Sampler:
    """Sample indices of any (replica, rank, position) of an era. Stateless apart from the layout and the
    era's origin (default: the global order); thread-safe."""

    def __init__(self, layout: DataLayout, origin: StreamOrigin | None = None) -> None:
        self.layout = layout
        self.origin = origin if origin is not None else StreamOrigin()

    def shard_size(self, replica: int) -> int:
        """Samples in one epoch of the stream replica `replica` reads from: the dataset (one global order)."""
        self._check_replica(replica)
        return self.layout.dataset_size

    def batch_id(self, replica: int, position: int) -> int:
        """A job-wide unique id of replica `replica`'s batch number `position` in this era (its chunk)."""
        self._check_replica(replica)
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        return position * self.layout.num_replicas + replica

    def batch(self, replica: int, rank: int, position: int) -> np.ndarray:
        """Sample indices (int64, length batch_size_per_rank) rank `rank` trains at data position `position`."""
        if not 0 <= rank < self.layout.ranks_per_replica:
            raise ValueError(f"rank must be in [0, {self.layout.ranks_per_replica}), got {rank}")
        b = self.layout.batch_size_per_rank
        start = self.batch_id(replica, position) * self.layout.replica_batch_size + rank * b
        return self.samples(self.origin.to_global(np.arange(start, start + b, dtype=np.int64)))

    def replica_batch(self, replica: int, position: int) -> np.ndarray:
        """Sample indices of the whole replica batch, shape (ranks_per_replica, batch_size_per_rank)."""
        size = self.layout.replica_batch_size
        start = self.batch_id(replica, position) * size
        flat = self.samples(self.origin.to_global(np.arange(start, start + size, dtype=np.int64)))
        return flat.reshape(self.layout.ranks_per_replica, self.layout.batch_size_per_rank)

    def global_ranges(self, replica: int, position: int) -> list[Range]:
        """The global offsets replica `replica`'s batch at `position` covers (what the audit counts)."""
        size = self.layout.replica_batch_size
        start = self.batch_id(replica, position) * size
        return self.origin.ranges(start, start + size)

    def rank_position(self, replica: int, rank: int, committed_batches: int) -> RankPosition:
        """Where rank `rank` of replica `replica` resumes after `committed_batches` trained batches: the
        global epoch and offset inside it of the rank's next sample."""
        element = self.batch_id(replica, committed_batches) * self.layout.replica_batch_size + \
            rank * self.layout.batch_size_per_rank
        g = int(self.origin.to_global(np.array([element]))[0])
        return RankPosition(committed_batches, g // self.layout.dataset_size, g % self.layout.dataset_size)

    def epoch_key(self, replica: int, epoch: int) -> int:
        """The permutation key of (seed, epoch) (`replica` is checked and ignored: there is one global order)."""
        self._check_replica(replica)
        return _mix64(_mix64(_mix64(self.layout.seed)) ^ epoch)

    def samples(self, offsets: np.ndarray) -> np.ndarray:
        """Sample indices at global offsets (int64 array)."""
        n = self.layout.dataset_size
        epochs, within = np.divmod(np.asarray(offsets, dtype=np.int64), n)
        out = np.empty_like(within)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = permute(within[sel], n, self.epoch_key(0, int(epoch)))
        return out

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.layout.num_replicas:
            raise ValueError(f"replica must be in [0, {self.layout.num_replicas}), got {replica}")
