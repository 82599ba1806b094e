"""Deterministic, resumable sampler: which samples rank k of replica r trains for its p-th batch. Pure.

Layout. The dataset's sample indices are split into one shard per replica (replica r owns the indices
i with i % num_replicas == r), so replicas never share a sample. Each replica reads its shard as an
endless stream: epoch e is a permutation of the shard keyed by (seed, r, e), epochs follow each other,
and a batch may straddle two epochs (no sample is dropped at an epoch's end). The replica's p-th batch
is stream elements [p*B, (p+1)*B) with B = ranks_per_replica * batch_size_per_rank; rank k gets the
k-th slice of batch_size_per_rank elements.

Position, not step. `p` is the replica's *data position*: how many of its batches the job has trained
(see `loader_state.LoaderState`), which differs from the global step once a replica has missed steps.
Every answer is a pure function of (layout, replica, rank, position), so a replica resumes anywhere
without replaying the stream, and any process can recompute any rank's batch (the audit does).

Shuffling uses a keyed Feistel permutation with cycle walking, evaluated per element: O(1) memory and
random access, so a shard of a billion samples costs nothing to shuffle and 100K emulated ranks can
each hold a sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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


class Sampler:
    """Sample indices of any (replica, rank, position). Stateless apart from the layout; thread-safe."""

    def __init__(self, layout: DataLayout) -> None:
        self.layout = layout

    def shard_size(self, replica: int) -> int:
        """Number of samples replica `replica` owns (one epoch of its stream)."""
        self._check_replica(replica)
        n, r = self.layout.dataset_size, self.layout.num_replicas
        return (n - replica + r - 1) // r

    def batch_id(self, replica: int, position: int) -> int:
        """A job-wide unique id of replica `replica`'s batch number `position` (all its ranks' slices)."""
        self._check_replica(replica)
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        return position * self.layout.num_replicas + replica

    def batch(self, replica: int, rank: int, position: int) -> np.ndarray:
        """Sample indices (int64, length batch_size_per_rank) rank `rank` trains at data position `position`."""
        if not 0 <= rank < self.layout.ranks_per_replica:
            raise ValueError(f"rank must be in [0, {self.layout.ranks_per_replica}), got {rank}")
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        b = self.layout.batch_size_per_rank
        start = position * self.layout.replica_batch_size + rank * b
        return self._stream(replica, np.arange(start, start + b, dtype=np.int64))

    def replica_batch(self, replica: int, position: int) -> np.ndarray:
        """Sample indices of the whole replica batch, shape (ranks_per_replica, batch_size_per_rank)."""
        size = self.layout.replica_batch_size
        start = position * size
        flat = self._stream(replica, np.arange(start, start + size, dtype=np.int64))
        return flat.reshape(self.layout.ranks_per_replica, self.layout.batch_size_per_rank)

    def rank_position(self, replica: int, rank: int, committed_batches: int) -> RankPosition:
        """Where rank `rank` of replica `replica` resumes after `committed_batches` trained batches."""
        shard = self.shard_size(replica)
        element = committed_batches * self.layout.replica_batch_size + rank * self.layout.batch_size_per_rank
        return RankPosition(committed_batches, element // shard, element % shard)

    def epoch_key(self, replica: int, epoch: int) -> int:
        """The permutation key of (seed, replica, epoch)."""
        return _mix64(_mix64(_mix64(self.layout.seed) ^ replica) ^ epoch)

    def _stream(self, replica: int, elements: np.ndarray) -> np.ndarray:
        shard = self.shard_size(replica)
        epochs, offsets = np.divmod(elements, shard)
        out = np.empty_like(elements)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = permute(offsets[sel], shard, self.epoch_key(replica, int(epoch)))
        return out * self.layout.num_replicas + replica

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.layout.num_replicas:
            raise ValueError(f"replica must be in [0, {self.layout.num_replicas}), got {replica}")
