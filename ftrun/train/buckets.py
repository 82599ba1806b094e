"""Gradient buckets for the exchange overlapped with backward (ftrun.train.overlap). Pure: no torch, no threads.

`plan_buckets` cuts the flat gradient buffer (ftrun.train.grads.FlatGrads: parameters in model order,
each a contiguous slice) into buckets in backward order: backward produces the last parameters' gradients
first, so bucket 0 holds the last parameters. Parameters are taken from the last to the first and a bucket
closes as soon as it holds at least `bucket_bytes`; the last bucket (the model's first parameters) may be
smaller. Every bucket is one contiguous element range of the buffer, which FTAR reduces in place.
The plan is a function of the parameter sizes and `bucket_bytes` only, so every replica cuts the same
buckets and issues the same all-reduces in the same order (a ring needs that).

`BucketTracker` follows one backward: `mark(i)` when parameter i's gradient is in the buffer; it returns
the buckets that may now be reduced, in bucket order, so a bucket is released only after every earlier
bucket (the ring's all-reduces happen in the same order on every rank, whatever order the hooks fire).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Bucket:
    index: int  # the order of its all-reduce
    params: tuple[int, ...]  # parameter indices, backward order (descending)
    start: int  # element range [start, stop) of the flat buffer
    stop: int


def plan_buckets(numels: Sequence[int], *, elem_size: int, bucket_bytes: int) -> tuple[Bucket, ...]:
    """Buckets over parameters of `numels` elements each (model order) stored back to back.
    Raises ValueError for no parameters, a negative size or a bucket_bytes/elem_size below 1."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be an int >= 1, got {bucket_bytes!r}")
    if elem_size < 1:
        raise ValueError(f"elem_size must be >= 1, got {elem_size}")
    if not numels:
        raise ValueError("plan_buckets needs at least one parameter")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {list(numels)}")
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    buckets: list[Bucket] = []
    members: list[int] = []
    for i in range(len(numels) - 1, -1, -1):
        members.append(i)
        if (offsets[members[0] + 1] - offsets[i]) * elem_size >= bucket_bytes or i == 0:
            buckets.append(Bucket(len(buckets), tuple(members), offsets[i], offsets[members[0] + 1]))
            members = []
    return tuple(buckets)


class BucketTracker:
    """Which buckets of `plan` may be reduced during one backward. Not thread-safe: the caller locks."""

    def __init__(self, plan: Sequence[Bucket]) -> None:
        self.plan = tuple(plan)
        self._bucket_of = {p: b.index for b in self.plan for p in b.params}
        self._pending = [len(b.params) for b in self.plan]
        self._marked: set[int] = set()
        self.released = 0  # buckets 0 .. released-1 have been handed out

    def mark(self, param: int) -> list[int]:
        """Parameter `param`'s gradient is complete: the buckets newly released, in order. Raises
        ValueError for an unknown parameter or one marked twice (a second accumulation after its
        bucket may have been reduced would corrupt the exchange)."""
        if param not in self._bucket_of:
            raise ValueError(f"parameter {param} is in no bucket")
        if param in self._marked:
            raise ValueError(f"parameter {param}'s gradient was accumulated twice in one backward")
        self._marked.add(param)
        self._pending[self._bucket_of[param]] -= 1
        out = []
        while self.released < len(self.plan) and self._pending[self.released] == 0:
            out.append(self.released)
            self.released += 1
        return out

    def unmarked(self) -> list[int]:
        """Parameters not marked yet (no gradient so far this backward), in backward order."""
        return [p for b in self.plan for p in b.params if p not in self._marked]

    @property
    def done(self) -> bool:
        return self.released == len(self.plan)
