"""A healthy rank's published state: one flat CPU buffer, its manifest, and the step it belongs to.

`SnapshotStore.publish(step, state)` copies a flat dict name -> tensor into a preallocated buffer (the
buffer and the per-tensor views into it are reused while the state's layout stays the same, so a
steady-state publish allocates nothing), then checksums the shards (ftrun.catchup.checksum, ISA-L) in
the calling task, and returns with the snapshot servable. The checksum ran in a background task before:
the caller went on at once, but a joiner waited for that new thread to get a CPU, and on a host whose
cores the training threads keep busy it waited several ms on the run queue for it (5-7 ms of a 8-10 ms
checksum, traced in benchmarks/catchup_launch.py on 2 cores); the trainer publishes at the start of a
step whose compute waits for the joiner anyway. In that benchmark (alternating runs) a restarted
replica's fetch took a median 48 ms against 69 ms (9 rejoins each, load 3.6-4.9) and 42 ms against 50
ms (12 each, load 0.9-2.6); the healthy peers' stall 14 ms against 22. The buffer is a private
anonymous mapping: a first publish faults it in on a joiner's critical path, and 50 MB faulted and
copied in ~30 ms here against ~42 ms for the memfd it replaced (load ~2, 2 cores). Transparent huge
pages (MADV_HUGEPAGE) were tried: ~15 ms in isolation, but a fresh process's first publish then took
120-140 ms in one launch (likely the kernel compacting memory for them: THP defrag is "madvise" here).
`publish(step, state, borrow=names)` serves the named tensors in place instead (a CPU tensor of at
least LEND_MIN_BYTES, contiguous): no copy, so the snapshot is servable as soon as it is checksummed.
The caller promises not to change them until it retires the step or publishes again (the trainer:
parameters and optimizer state, which only the committed optimizer step or a heal's load changes, and
it retires first; the user's own loop lends nothing, ftrun.train.user_state). Bytes changed anyway
after publish returns (their shard was checksummed) fail the joiner's CRC check, as a replaced
snapshot's torn bytes do. benchmarks/catchup_launch.py's state
(50.4 MB, CPU, 1 torch thread): publish to servable 3.6-16 ms (mostly the CRC, ~3 ms alone) against
7.6-47 ms with the copy, medians of 25 side-by-side publishes at load 5-8 on 2 cores (the checksum then
in a background task); the source keeps no 50 MB snapshot buffer either.
`reserve(state)` makes that buffer ahead of a first publish, in a background task (allocated and faulted
in while the caller trains on): the trainer reserves while its quorum lacks some of the job's replicas,
one of which will join and need the snapshot (the memory a first publish takes, kept as it is). In a
launch (3 x 50 MB, 2 cores) a source's first publish copied in 51-92 ms against 5-16 ms into a buffer
already faulted in; the joiner waits for that copy.
The server sends shards straight from the buffer, without copying them through Python. It is not
page-locked: a GPU state's device-to-host copy goes through pageable memory (registering the mapping
with cudaHostRegister would pin it; that belongs with the CUDA code, not here).

Threading: publish/reserve/retire/close from one task (the training loop); `lookup` from any task (the
server's event loop); `on_change` is called, from the publishing task, whenever what `lookup`
answers may have changed.
"""

from __future__ import annotations

import bisect
import json
import mmap
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import torch

from ftrun.catchup.checksum import crc32
from ftrun.catchup.errors import CatchupUsageError
from ftrun.catchup.manifest import DTYPES, Layout, Manifest, dtype_name, encode_manifest, layout_for
from ftrun.env.base import Env


@dataclass(frozen=True)
class Availability:
    """What a source answers for a step: serve it, wait for it (long-poll), or say it is gone."""

    kind: str  # "serve" | "wait" | "gone"
    status: int  # HTTP status for "gone" (410), or the one to use if a wait runs out (404)
    reason: str


def availability(step: int, *, ready: int | None, pending: int | None, newest: int | None,
                 retired: int | None) -> Availability:
    """Pure: how to answer a request for `step` given the store's state (steps or None)."""
    have = ("nothing" if newest is None else f"step {newest} " + (
        "(published)" if newest == ready else "(publishing)" if newest == pending else "(retired)"))
    if ready is not None and step == ready:
        return Availability("serve", 200, f"step {step} is published")
    if pending is not None and step == pending:
        return Availability("wait", 404, f"step {step} is being published; this source has {have}")
    if (newest is not None and step < newest) or (retired is not None and step == retired):
        return Availability("gone", 410, f"step {step} is retired or superseded; this source has {have}")
    return Availability("wait", 404, f"step {step} is not published; this source has {have}")


def anonymous_buffer(nbytes: int, *, populate: bool = False) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` (at least 1); `populate`: its pages faulted in by the
    kernel as it is made (MAP_POPULATE, one call instead of a fault per page on first touch)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if populate else 0)
    return mmap.mmap(-1, max(nbytes, 1), flags=flags)


class _FlatBuffer:
    """A flat uint8 CPU tensor over an anonymous mapping (anonymous_buffer)."""

    def __init__(self, nbytes: int) -> None:
        self.capacity = nbytes
        self._mmap = anonymous_buffer(nbytes)
        self.mem = memoryview(self._mmap)[:nbytes]
        self.flat = torch.frombuffer(self._mmap, dtype=torch.uint8)[:nbytes]

    def close(self) -> None:
        self.mem.release()
        self.flat = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:  # a view is still held somewhere; the mapping goes with it
            pass


LEND_MIN_BYTES = 64 << 10  # a smaller tensor is copied even when borrowed: one more piece per shard costs more

Lent = tuple[tuple[int, memoryview], ...]  # (offset in the layout, the tensor's own bytes), by offset


@dataclass(frozen=True)
class Published:
    """A servable snapshot. Holds its buffer (and the borrowed tensors' bytes), so a replaced buffer
    lives until no request uses it."""

    step: int
    generation: int
    manifest: Manifest
    manifest_json: bytes
    buffer: _FlatBuffer
    lent: Lent = ()  # the borrowed tensors, served from their own memory; the rest comes from `buffer`

    def pieces(self, offset: int, nbytes: int) -> list[memoryview]:
        """The bytes [offset, offset + nbytes) of the snapshot, in order, as buffer slices."""
        return pieces(self.buffer.mem, self.lent, offset, nbytes)

    def read(self, offset: int, nbytes: int) -> Any:
        """The same bytes as one buffer (joined only when they come from several pieces)."""
        parts = self.pieces(offset, nbytes)
        return parts[0] if len(parts) == 1 else b"".join(parts)


def pieces(mem: Any, lent: Lent, offset: int, nbytes: int) -> list[memoryview]:
    """Pure: [offset, offset + nbytes) of a snapshot whose bytes are `mem` except the `lent` ranges."""
    end, pos, out = offset + nbytes, offset, []
    first = max(bisect.bisect_right(lent, offset, key=lambda e: e[0]) - 1, 0)
    for start, view in lent[first:]:
        if start >= end:
            break
        stop = start + len(view)
        if stop <= pos:
            continue
        if start > pos:
            out.append(mem[pos:start])
            pos = start
        upto = min(stop, end)
        out.append(view[pos - start:upto - start])
        pos = upto
    if pos < end:
        out.append(mem[pos:end])
    return out


def lendable(tensor: torch.Tensor) -> memoryview | None:
    """The bytes of `tensor` for a snapshot to serve in place, or None when it must be copied: not on the
    CPU, not contiguous, a lazy conjugate/negative view, or smaller than LEND_MIN_BYTES."""
    t = tensor.detach()
    if (t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg()
            or t.numel() * t.element_size() < LEND_MIN_BYTES):
        return None
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _names(borrow: Collection[str]) -> frozenset[str]:
    """`borrow` as a set of names; one string is refused (it would match names by substring)."""
    if isinstance(borrow, (str, bytes)):
        raise CatchupUsageError(f"borrow must be a collection of tensor names, got the string {borrow!r}")
    return frozenset(borrow)


def describe(state: Mapping[str, torch.Tensor], *, shape_only: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype name, shape) of each entry; CatchupUsageError for what cannot be published.
    shape_only: meta tensors pass (the emulator's snapshots carry sizes, not bytes)."""
    entries = []
    for name, t in state.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise CatchupUsageError(f"state entries must be str -> Tensor, got {name!r}: {type(t).__name__}")
        if t.layout != torch.strided or (t.device.type == "meta" and not shape_only):
            raise CatchupUsageError(f"tensor {name!r} ({t.layout}, {t.device}) has no bytes to publish")
        try:
            entries.append((name, dtype_name(t.dtype), tuple(t.shape)))
        except ValueError as e:
            raise CatchupUsageError(str(e)) from None
    return entries


def check_metadata(metadata: Mapping[str, Any]) -> None:
    """CatchupUsageError naming the first value of `metadata` that JSON cannot carry (the snapshot never pickles)."""
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as e:  # a ValueError: a circular reference (then not looked for)
        where = _non_json(metadata, "metadata") if isinstance(e, TypeError) else None
        raise CatchupUsageError(f"metadata must be JSON-serializable: {where or e}") from None


def _non_json(value: Any, path: str) -> str | None:
    """Where in `value` (named `path`) the first value JSON cannot carry sits, and its type; None if nowhere."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                return f"{path} has a key {key!r} of type {type(key).__name__}"
            found = _non_json(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_non_json(item, f"{path}[{i}]") for i, item in enumerate(value))), None)
    if value is None or isinstance(value, (str, int, float, bool)):
        return None
    return f"{path} is a {type(value).__name__}"


def tensor_views(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Typed views of each tensor of `layout` into a flat uint8 buffer."""
    return {t.name: flat[t.offset:t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) for t in layout.tensors}


class SnapshotStore:
    def __init__(self, *, env: Env, max_shard_bytes: int, on_change: Callable[[], None] | None = None) -> None:
        self.env, self._max_shard_bytes, self._on_change = env, max_shard_bytes, on_change
        self._lock = env.lock()
        self._ready_event = env.event()
        self._generation = 0
        self._ready: Published | None = None
        self._pending: int | None = None
        self._newest: int | None = None
        self._retired: int | None = None
        self._buffer: _FlatBuffer | None = None
        self._layout: Layout | None = None
        self._views: dict[str, torch.Tensor] = {}
        self._reserving = None  # the task faulting in a reserved buffer (`reserve`), until a publish takes it
        self._spare: _FlatBuffer | None = None  # what it made

    # -- training-loop side --------------------------------------------------------------------
    def publish(self, step: int, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None, *,
                borrow: Collection[str] = ()) -> None:
        """Copy `state` into the snapshot buffer as `step`; the previous step is gone from then on.

        Returns once the copy is done (the caller may change its tensors, except those it lends: the
        `borrow` names that `lendable` accepts are served from their own memory until the step is
        retired or replaced) and the checksums are: the snapshot is servable (`wait_ready`). Raises
        CatchupUsageError for a state that cannot be published (non-tensors, sparse or meta tensors,
        unsupported dtypes, non-JSON metadata).
        """
        borrow = _names(borrow)
        metadata = dict(metadata or {})
        check_metadata(metadata)
        layout = layout_for(describe(state), self._max_shard_bytes)
        generation = self._begin(pending=step)
        views = self._views_for(layout)
        offsets = {t.name: t.offset for t in layout.tensors}
        lent = []
        for name, tensor in state.items():
            view = lendable(tensor) if name in borrow else None
            if view is None:
                views[name].copy_(tensor.detach())
            else:
                lent.append((offsets[name], view))
        self._checksum(generation, step, layout, metadata, self._buffer, tuple(sorted(lent, key=lambda e: e[0])))

    def check(self, state: Mapping[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> None:
        """Raises CatchupUsageError as a publish of `state` and `metadata` would; copies nothing."""
        check_metadata(metadata or {})
        describe(state)

    def reserve(self, state: Mapping[str, torch.Tensor], *, borrow: Collection[str] = ()) -> None:
        """Make the buffer a publish of `state` (or a state of the same layout) needs ahead of it: a
        background task allocates it and faults in the pages the publish will copy into (not those of
        the tensors it will lend, `borrow` as publish's); the next publish takes it. Nothing to do when
        the buffer is large enough already or a reserve is under way. Raises CatchupUsageError as publish."""
        borrow = _names(borrow)
        layout = layout_for(describe(state), self._max_shard_bytes)
        if self._reserving is not None or (self._buffer is not None and self._buffer.capacity >= layout.total_bytes):
            return
        copied = [(t.offset, t.offset + t.nbytes) for t in layout.tensors
                  if t.name not in borrow or lendable(state[t.name]) is None]
        self._reserving = self.env.spawn(self._fault_in, layout.total_bytes, copied, name="catchup-reserve")

    def retire(self, step: int) -> None:
        """Stop serving `step` (call once the step has committed). A no-op for another step."""
        with self._lock:
            if step not in (self._newest, self._pending) and (self._ready is None or self._ready.step != step):
                return
        self._begin(pending=None, retired=step)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the last published step is servable."""
        return self._ready_event.wait(timeout)

    def close(self) -> None:
        self._begin(pending=None)
        self._take_reserved()
        self._views = {}
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    # -- server side ---------------------------------------------------------------------------
    def lookup(self, step: int) -> tuple[Availability, Published | None]:
        with self._lock:
            ready = self._ready
            a = availability(step, ready=ready.step if ready else None, pending=self._pending,
                             newest=self._newest, retired=self._retired)
        return a, (ready if a.kind == "serve" else None)

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def newest(self) -> int | None:
        """The step published last (it may be publishing, published or retired), or None."""
        return self._newest

    def status(self) -> dict[str, Any]:
        with self._lock:
            ready = self._ready.step if self._ready else None
            state = ("none" if self._newest is None else "published" if self._newest == ready
                     else "publishing" if self._newest == self._pending else "retired")
            return {"have": self._newest, "state": state}

    # -- internals -----------------------------------------------------------------------------
    def _begin(self, *, pending: int | None, retired: int | None = None) -> int:
        with self._lock:
            self._generation += 1
            self._ready, self._pending = None, pending
            if pending is not None:
                self._newest = pending
            if retired is not None:
                self._retired = retired
            self._ready_event.clear()
            generation = self._generation
        self._changed()
        return generation

    def _fault_in(self, nbytes: int, ranges: list[tuple[int, int]]) -> None:
        """In the reserve task: a buffer of `nbytes` with the pages of `ranges` touched (torch's fill
        releases the GIL)."""
        buffer = _FlatBuffer(nbytes)
        for start, end in ranges:
            buffer.flat[start:end].zero_()
        self._spare = buffer

    def _take_reserved(self) -> None:
        """Adopt the reserved buffer (waiting for its task) when it is larger than the current one."""
        if self._reserving is None:
            return
        self._reserving.join()
        spare, self._reserving, self._spare = self._spare, None, None
        if spare is None:
            return
        if self._buffer is None or self._buffer.capacity < spare.capacity:
            self._buffer, self._layout, self._views = spare, None, {}  # the old one lives on in any Published
        else:
            spare.close()

    def _views_for(self, layout: Layout) -> dict[str, torch.Tensor]:
        self._take_reserved()
        if self._layout is not None and self._layout.key == layout.key:
            return self._views
        if self._buffer is None or self._buffer.capacity < layout.total_bytes:
            self._buffer = _FlatBuffer(layout.total_bytes)  # the old one lives on in any Published using it
        flat = self._buffer.flat
        for start, end in layout.gaps():  # padding is part of the shards: every replica must send zeros
            flat[start:end].zero_()
        self._layout, self._views = layout, tensor_views(flat, layout)
        return self._views

    def _checksum(self, generation: int, step: int, layout: Layout, metadata: dict[str, Any],
                  buffer: _FlatBuffer, lent: Lent) -> None:
        crcs = []
        for shard in layout.shards:
            if self._generation != generation:
                return
            crc = 0
            for piece in pieces(buffer.mem, lent, shard.offset, shard.nbytes):
                crc = crc32(piece, crc)
            crcs.append(crc)
        manifest = Manifest(step, layout, tuple(crcs), metadata)
        published = Published(step, generation, manifest, encode_manifest(manifest), buffer, lent)
        with self._lock:
            if self._generation != generation:
                return
            self._ready, self._pending = published, None
            self._ready_event.set()
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()
