"""loader_state: every replica's data position, as replicated training state, and its durable copy.

Exactly-once semantics. Replica r's data position is the number of r's batches that the job's
*committed model lineage* has trained, `committed_batches[r]`. It is not r's own commit count and not
the global step. A step attempt that any participant commits (applies its optimizer step for)
contains the gradient of every participant that was not behind: a ring all-reduce cannot complete
without every member's contribution, and a behind replica sends zeros. So a replica whose own commit
failed after the all-reduce (killed, or voting no while others commit) has nevertheless had its batch
trained on the committers' lineage, while a batch that went into an attempt nobody committed has not
been trained. Every committer knows which batches its update contained from the quorum alone:
contributors = the participants at the quorum's step (see `contributors`).

Hence the positions are a *ledger* that is part of the replicated state, like the weights: every
replica that commits step n applies `state.advance(step=n, contributors=...)` together with its
optimizer step, so all replicas on a lineage hold the same ledger. A behind replica adopts the ledger
of the peer it heals from; a full restart takes the ledger snapshot stored in the checkpoint it
restores. Each state carries a `lineage` hash chained over (parent, step, contributors, positions):
equal lineage means equal trained data, and the audit uses it to follow the one history that the
final model actually has (abandoned branches, e.g. steps lost to a full restart, drop out).

Contract for the training loop: a participant that is not behind either puts its batch's gradient
into the all-reduce or makes the all-reduce fail for everyone; it never sends zeros for a batch it was
meant to train.

Durable copy: `LoaderStateStore` writes the job's whole ledger (one record, every rank's position)
into one of two Storage slots chosen by step parity, every step, atomically. One file for the job, as
in the paper: the ledger is replicated, so one writer can write everyone's position in one small
write, and the record is a consistent cut (all positions at the same step). The other slot keeps the
previous step, so a torn or corrupt slot falls back to the previous good version. The store refuses
forks (`fork_refusal`): a write below the newest stored step, or of another lineage at the same step,
raises LoaderStateFork, unless that newest state was already there when this store was opened (a full
restart from an older checkpoint supersedes the states it found; a stale replica cannot supersede
states written after it started).
"""

from __future__ import annotations

import hashlib
import logging
import struct
import zlib
from dataclasses import dataclass, fields, replace
from typing import Collection, Iterable, Protocol

import msgpack
import numpy as np

from ftrun.data.sampler import DataLayout, RankPosition, Sampler, StreamOrigin, remaining
from ftrun.storage import Storage

log = logging.getLogger("ftrun.data")

GENESIS = "genesis"  # lineage of the initial state (nothing trained)
_MAGIC = b"FTLS"
_VERSION = 1
_HEADER = struct.Struct(">4sBIQ")  # magic, version, crc32 of body, body length
MAX_SAMPLE_INDEX = 2**62  # every sample count and stream offset a ledger implies stays below this (int64-safe)


class DataError(Exception):
    """Base of the data package's errors."""


class LoaderStateError(DataError):
    """A loader_state that does not fit the job or the step it is used for (local misuse)."""


class LoaderStateCorrupt(LoaderStateError):
    """Stored loader_state bytes that fail their checks; `key` names the blob."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"loader_state {key!r} is corrupt: {problem}")
        self.key, self.problem = key, problem


class LoaderStateFork(LoaderStateError):
    """A write that would replace stored state of another lineage at the same or a higher step."""


class HasStep(Protocol):
    replica_id: str
    step: int


def contributors(participants: Iterable[HasStep], step: int) -> tuple[str, ...]:
    """Replicas whose batch goes into `step`: the participants asking for that step (others are behind)."""
    return tuple(sorted(p.replica_id for p in participants if p.step == step))


def next_lineage(parent: str, step: int, contributions: Iterable[tuple[str, int]]) -> str:
    """Content hash of a committed step: (parent lineage, step, sorted (replica, position) pairs)."""
    body = f"{parent}|{step}|" + ",".join(f"{r}:{p}" for r, p in sorted(contributions))
    return hashlib.blake2b(body.encode(), digest_size=8).hexdigest()


def reshard_lineage(parent: str, step: int, layout: DataLayout, replica_ids: Iterable[str],
                    origin: StreamOrigin) -> str:
    """Content hash of a restart into another data layout (a new era) at `step` on top of `parent`."""
    body = f"{parent}|{step}|reshard|{sorted(layout.to_dict().items())}|{','.join(replica_ids)}|{origin.to_list()}"
    return hashlib.blake2b(body.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Era:
    """A finished era of a ledger's history: steps [start_step, end_step) read `layout` through `origin`
    with these replicas, which had trained `committed_batches` when the job was restarted into a new
    layout at lineage `lineage` (step end_step)."""

    layout: DataLayout
    replica_ids: tuple[str, ...]
    committed_batches: tuple[int, ...]
    origin: StreamOrigin
    start_step: int
    end_step: int
    lineage: str

    def __post_init__(self) -> None:
        if not len(self.replica_ids) == len(self.committed_batches) == self.layout.num_replicas \
                or len(set(self.replica_ids)) != len(self.replica_ids) or min(self.committed_batches) < 0:
            raise LoaderStateError(f"era of steps [{self.start_step}, {self.end_step}): replicas {self.replica_ids} "
                                   f"and committed_batches {self.committed_batches} do not fit {self.layout}")

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "replica_ids": list(self.replica_ids),
                "committed_batches": list(self.committed_batches), "origin": self.origin.to_list(),
                "start_step": self.start_step, "end_step": self.end_step, "lineage": self.lineage}

    @classmethod
    def from_dict(cls, raw: dict) -> "Era":
        if not isinstance(raw, dict):
            raise TypeError("an era is a dict")
        return cls(DataLayout(**raw["layout"]), tuple(_text(r) for r in raw["replica_ids"]),
                   tuple(_int(c) for c in raw["committed_batches"]), StreamOrigin.from_list(raw["origin"]),
                   _int(raw["start_step"]), _int(raw["end_step"]), _text(raw["lineage"]))


@dataclass(frozen=True)
class LoaderState:
    """The ledger after `step` committed steps. Immutable; `advance` returns the next one.

    replica_ids: the job's replicas in replica-index order (index = the sampler's replica number).
    committed_batches: per replica, how many of its batches the current era has trained (its data position).
    origin: where the current era's stream comes from in the global order (see ftrun.data.sampler).
    eras: the finished eras before the current one, oldest first (empty for a job never resharded); the
    current era began at step `era_start`.
    """

    layout: DataLayout
    replica_ids: tuple[str, ...]
    committed_batches: tuple[int, ...]
    step: int = 0
    lineage: str = GENESIS
    origin: StreamOrigin = StreamOrigin()
    eras: tuple[Era, ...] = ()

    def __post_init__(self) -> None:
        if len(self.replica_ids) != self.layout.num_replicas:
            raise LoaderStateError(
                f"{len(self.replica_ids)} replica ids for a layout of {self.layout.num_replicas} replicas"
            )
        if len(set(self.replica_ids)) != len(self.replica_ids):
            raise LoaderStateError(f"replica ids must be distinct, got {self.replica_ids}")
        if len(self.committed_batches) != len(self.replica_ids) or min(self.committed_batches) < 0:
            raise LoaderStateError(f"bad committed_batches {self.committed_batches} for {self.replica_ids}")
        if self.step < 0:
            raise LoaderStateError(f"step must be >= 0, got {self.step}")
        too_big = [f.name for f in fields(self.layout) if getattr(self.layout, f.name) >= MAX_SAMPLE_INDEX]
        if too_big or (max(self.committed_batches) + 1) * self.layout.replica_batch_size >= MAX_SAMPLE_INDEX \
                or self.step >= MAX_SAMPLE_INDEX:
            raise LoaderStateError(f"loader_state beyond the int64 range of sample indices (layout fields {too_big}, "
                                   f"step {self.step}, committed_batches up to {max(self.committed_batches)})")
        if self.origin.tail + (max(self.committed_batches) + 1) * self.layout.num_replicas \
                * self.layout.replica_batch_size >= MAX_SAMPLE_INDEX:
            raise LoaderStateError(f"loader_state beyond the int64 range of global offsets (tail {self.origin.tail})")
        start = 0
        for era in self.eras:
            if era.start_step != start or era.end_step < start or era.end_step > self.step:
                raise LoaderStateError(f"eras must cover consecutive steps up to step {self.step}; got an era of "
                                       f"steps [{era.start_step}, {era.end_step}) after step {start}")
            start = era.end_step

    @property
    def era_start(self) -> int:
        """The step at which the current era began (0 unless the job was resharded)."""
        return self.eras[-1].end_step if self.eras else 0

    def sampler(self) -> Sampler:
        """The current era's sampler."""
        return Sampler(self.layout, self.origin)

    def resharded(self, layout: DataLayout, replica_ids: Iterable[str]) -> "LoaderState":
        """This ledger continued by a job restarted with `layout` and `replica_ids` (any replica count and
        replica batch): a new era whose stream is what this one left untrained (sampler.remaining), every
        position 0, and a lineage that chains the restart onto this one. The global order must stay:
        the dataset size and seed must be the same."""
        ids = tuple(replica_ids)
        if (layout.dataset_size, layout.seed) != (self.layout.dataset_size, self.layout.seed):
            raise LoaderStateError(f"loader_state was written for {self.layout}, the job has {layout}: a restart may "
                                   "change the replicas and the batch split, not dataset_size or seed")
        origin = remaining(self.layout, self.origin, self.committed_batches)
        era = Era(self.layout, self.replica_ids, self.committed_batches, self.origin, self.era_start, self.step,
                  self.lineage)
        return LoaderState(layout, ids, (0,) * len(ids), self.step,
                           reshard_lineage(self.lineage, self.step, layout, ids, origin), origin, self.eras + (era,))

    @classmethod
    def initial(cls, layout: DataLayout, replica_ids: Iterable[str]) -> "LoaderState":
        ids = tuple(replica_ids)
        return cls(layout, ids, (0,) * len(ids))

    def index(self, replica_id: str) -> int:
        try:
            return self.replica_ids.index(replica_id)
        except ValueError:
            raise LoaderStateError(f"replica {replica_id!r} is not one of {self.replica_ids}") from None

    def position(self, replica_id: str) -> int:
        """The data position (next batch number) of `replica_id`."""
        return self.committed_batches[self.index(replica_id)]

    def advance(self, *, step: int, contributors: Iterable[str]) -> "LoaderState":
        """The ledger after committing `step`, in which each of `contributors` trained its next batch."""
        if step != self.step:
            raise LoaderStateError(f"cannot commit step {step} on a loader_state at step {self.step}")
        counts = list(self.committed_batches)
        pairs = []
        for rid in sorted(set(contributors)):
            i = self.index(rid)
            pairs.append((rid, counts[i]))
            counts[i] += 1
        return replace(self, committed_batches=tuple(counts), step=step + 1,
                       lineage=next_lineage(self.lineage, step, pairs))

    def rank_positions(self) -> dict[str, list[RankPosition]]:
        """Every rank's position (replica id -> per rank), derived from the replica positions."""
        sampler = self.sampler()
        return {rid: [sampler.rank_position(i, k, self.committed_batches[i])
                      for k in range(self.layout.ranks_per_replica)]
                for i, rid in enumerate(self.replica_ids)}

    def to_dict(self) -> dict:
        """Compact JSON-able form (no per-rank table), e.g. for the catch-up snapshot's metadata."""
        return {"step": self.step, "lineage": self.lineage, "layout": self.layout.to_dict(),
                "replica_ids": list(self.replica_ids), "committed_batches": list(self.committed_batches),
                **_era_fields(self)}

    @classmethod
    def from_dict(cls, raw: dict) -> "LoaderState":
        """Inverse of `to_dict`. Raises LoaderStateError naming what is wrong."""
        try:
            return cls(DataLayout(**raw["layout"]), tuple(_text(r) for r in raw["replica_ids"]),
                       tuple(_int(c) for c in raw["committed_batches"]), _int(raw["step"]), _text(raw["lineage"]),
                       *_parse_era_fields(raw))
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise LoaderStateError(f"malformed loader_state dict: {str(e)[:200]}") from e

    def check_layout(self, layout: DataLayout) -> None:
        """Raise LoaderStateError if this state was made for another data layout."""
        if layout != self.layout:
            raise LoaderStateError(f"loader_state was written for {self.layout}, the job has {layout}")


def _era_fields(state: LoaderState) -> dict:
    """The era keys of the dict and record forms; none for a job never resharded (its bytes are unchanged)."""
    if state.origin.is_global and not state.eras:
        return {}
    return {"origin": state.origin.to_list(), "eras": [e.to_dict() for e in state.eras]}


def _parse_era_fields(raw: dict) -> tuple[StreamOrigin, tuple[Era, ...]]:
    if "origin" not in raw and "eras" not in raw:
        return StreamOrigin(), ()
    eras = raw["eras"]
    if not isinstance(eras, list):
        raise TypeError("eras must be a list")
    return StreamOrigin.from_list(raw["origin"]), tuple(Era.from_dict(e) for e in eras)


# -- encoding --------------------------------------------------------------------------------------
_COLUMNS = ("committed_batches", "epoch", "next_sample")


def _rank_table(sampler: Sampler, index: int, committed: int) -> np.ndarray:
    """(ranks, 3) int64 table of RankPosition fields for every rank of one replica (vectorized): the
    global epoch and offset inside it of each rank's next sample."""
    layout = sampler.layout
    element = (committed * layout.num_replicas + index) * layout.replica_batch_size + \
        np.arange(layout.ranks_per_replica, dtype=np.int64) * layout.batch_size_per_rank
    epoch, offset = np.divmod(sampler.origin.to_global(element), layout.dataset_size)
    return np.stack([np.full_like(element, committed), epoch, offset], axis=1)


def encode(state: LoaderState) -> bytes:
    """Header (magic, version, CRC32, length) + msgpack body with every rank's position (columns per replica)."""
    sampler = state.sampler()
    replicas = []
    for i, rid in enumerate(state.replica_ids):
        table = _rank_table(sampler, i, state.committed_batches[i])
        replicas.append({"id": rid, **{name: table[:, c].tolist() for c, name in enumerate(_COLUMNS)}})
    body = msgpack.packb({"step": state.step, "lineage": state.lineage, "layout": state.layout.to_dict(),
                          "replicas": replicas, **_era_fields(state)})
    return _HEADER.pack(_MAGIC, _VERSION, zlib.crc32(body), len(body)) + body


def decode(data: bytes, *, key: str = "<bytes>") -> LoaderState:
    """Parse and check `encode`'s output. Raises LoaderStateCorrupt (naming `key`) on any mismatch."""
    if len(data) < _HEADER.size:
        raise LoaderStateCorrupt(key, f"truncated: {len(data)} bytes, shorter than the header")
    magic, version, crc, length = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION:
        raise LoaderStateCorrupt(key, f"not a loader_state v{_VERSION} record (magic {magic!r}, version {version})")
    body = data[_HEADER.size:]
    if len(body) != length:
        raise LoaderStateCorrupt(key, f"truncated: body has {len(body)} of {length} bytes")
    if zlib.crc32(body) != crc:
        raise LoaderStateCorrupt(key, f"CRC32 mismatch (stored {crc:#010x}, computed {zlib.crc32(body):#010x})")
    try:
        raw = msgpack.unpackb(body, raw=False)
        layout = DataLayout(**raw["layout"])
        tables = [np.array([r[name] for name in _COLUMNS], dtype=np.int64).T for r in raw["replicas"]]
        if any(t.shape != (layout.ranks_per_replica, len(_COLUMNS)) for t in tables):
            raise ValueError(f"every replica must list {layout.ranks_per_replica} rank positions")
        state = LoaderState(layout, tuple(_text(r["id"]) for r in raw["replicas"]),
                            tuple(int(t[0, 0]) for t in tables), _int(raw["step"]), _text(raw["lineage"]),
                            *_parse_era_fields(raw))
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, LoaderStateError,
            msgpack.UnpackException) as e:
        raise LoaderStateCorrupt(key, f"malformed body: {str(e)[:200]}") from e
    sampler = state.sampler()
    for i, (rid, table) in enumerate(zip(state.replica_ids, tables)):
        expect = _rank_table(sampler, i, state.committed_batches[i])
        if not np.array_equal(table, expect):
            raise LoaderStateCorrupt(key, f"rank positions of {rid} do not match the layout "
                                          f"(every rank must be at committed_batches={state.committed_batches[i]})")
    return state


def _int(value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"{str(value)[:32]} is not an int")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise TypeError("ids and lineages are strings of at most 256 characters")
    return value


def fork_refusal(held: list[tuple[int, str]], new: tuple[int, str], *,
                 found: Collection[tuple[int, str]]) -> str | None:
    """Why writing state `new` = (step, lineage) over the stored `held` states would fork the job; None if
    it would not. Pure.

    Allowed: a step above every stored one; the same (step, lineage) again; and anything while the
    newest stored state is one of `found`, the states there when the writer opened the store (a full
    restart from an older checkpoint abandons the states after it). Refused: a step below the newest
    stored one, or another lineage at its step, once it was written after the writer opened the store.
    """
    if not held:
        return None
    newest = max(held)
    if newest[0] < new[0] or new in held or newest in found:
        return None
    what = f"lineage {newest[1]} at the same step" if newest[0] == new[0] else f"step {newest[0]} (lineage {newest[1]})"
    return (f"refusing to write loader_state of step {new[0]} (lineage {new[1]}): the store holds {what}, "
            f"written since this writer opened it; this writer is stale or forked")


# -- durable copy ----------------------------------------------------------------------------------
class LoaderStateStore:
    """The job's loader_state in two Storage slots (`{prefix}/slot-0|1`, by step parity).

    `save` writes one slot atomically, so the other still holds the previous step. `load` returns the
    newest slot that passes its checks and logs (and returns in `problems`) every slot it had to skip.
    Threading: one caller at a time per instance; concurrent writers of different steps are safe.
    """

    def __init__(self, *, storage: Storage, prefix: str = "loader_state") -> None:
        self.storage, self.prefix = storage, prefix
        self.problems: list[str] = []
        self._found = frozenset(self._held())  # the states stored when opened: a restart may supersede them

    def slot_key(self, step: int) -> str:
        return f"{self.prefix}/slot-{step % 2}"

    def save(self, state: LoaderState) -> str:
        """Write `state` into its slot. Raises LoaderStateFork (see `fork_refusal`) instead of replacing
        another lineage's state."""
        refusal = fork_refusal(self._held(), (state.step, state.lineage), found=self._found)
        if refusal is not None:
            raise LoaderStateFork(refusal)
        key = self.slot_key(state.step)
        self.storage.write_atomic(key, encode(state))
        return key

    def _held(self) -> list[tuple[int, str]]:
        """(step, lineage) of every slot that passes its checks."""
        held = []
        for slot in (0, 1):
            data = self.storage.read(f"{self.prefix}/slot-{slot}")
            if data is not None:
                try:
                    state = decode(data)
                except LoaderStateCorrupt:
                    continue  # a torn or corrupt slot holds nothing to protect
                held.append((state.step, state.lineage))
        return held

    def load(self) -> LoaderState | None:
        """The newest good state, None if nothing was ever saved. Raises LoaderStateCorrupt if no slot is good."""
        self.problems = []
        good: list[LoaderState] = []
        bad: list[LoaderStateCorrupt] = []
        for slot in (0, 1):
            key = f"{self.prefix}/slot-{slot}"
            data = self.storage.read(key)
            if data is None:
                continue
            try:
                good.append(decode(data, key=key))
            except LoaderStateCorrupt as e:
                bad.append(e)
                self.problems.append(str(e))
                log.warning("%s; falling back to the other slot", e)
        if good:
            return max(good, key=lambda s: s.step)
        if bad:
            raise bad[0]
        return None
