"""Per-rank collective telemetry: a fixed-size ring buffer of 40-byte records (paper §2.3).

A `Recorder` belongs to one rank (the emulator hosts many ranks per process, so nothing here is global).
The runtime calls it from one-line hooks: the FTAR engine and its ring run (one record per chunk
received, per chunk step completed and per chunk sent, plus enter/done/fail per all-reduce), the
replica tree or gloo group (entered, sent up, done), the lighthouse client (asked, answered) and the
trainer's catch-up fetch (`catchup_start`, `catchup_end`). Each record is packed with one
`struct.pack_into` into a preallocated bytearray that numpy views as the structured array `RECORD`;
the oldest records are overwritten.

Record fields: `t` (env.clock), the collective id (`qid`: ring epoch or quorum id; `cid`: all-reduce
number within the epoch, tree collective number, or the step asked/fetched), `step` (the training step
when the rank knows it, else -1), `seq` (the chunk step within the all-reduce), `peer` (ring index or
tree rank of the other side, -1 if none), `nbytes`, `aux` (see `Ev`), `part` (FTAR partition), `op`
(Op) and `ev` (Ev).

An all-reduce the emulator models instead of running it chunk by chunk (analytic rings) records ENTER,
then its totals (MODEL and MODEL_END: start and end, chunk steps, sends, bytes and send busy time), then
DONE or FAIL: two records where a chunk run writes thousands.

`summarize(records, now)` is the pure reduction shipped to the collector: one `SUMMARY` row (the
rank's current collectives) and `HIST_LEN` `HIST` rows (per completed all-reduce: enter and done time,
send busy time and bytes), so the analysis at 98,304 ranks reads kilobytes, not the whole buffers.
"""

from __future__ import annotations

import struct
from enum import IntEnum

import numpy as np

from ftrun.env.base import Clock


class Op(IntEnum):
    FTAR = 1
    TREE = 2
    QUORUM = 3
    CATCHUP = 4


class Ev(IntEnum):
    ENTER = 1  # joined the collective (FTAR: aux = ring size, peer = own ring index, seq = chunk steps)
    RECV = 2  # a chunk arrived from the previous ring rank (FTAR) / the result came down from the parent (tree)
    STEP = 3  # FTAR chunk step `seq` completed (received from `peer` + reduced/copied); aux = its ring hop
    SEND = 4  # a chunk went out to `peer` (FTAR) / our value went up to the parent (tree)
    DONE = 5  # the collective completed on this rank
    FAIL = 6  # it failed here; `peer` is the side that failed when known
    # A modeled all-reduce (the emulator's analytic rings) records its totals instead of per-chunk records,
    # two records written once the ring's members have all arrived (see Recorder.ftar_model):
    MODEL = 7  # t = modeled start; seq = chunk steps, aux = sends, peer = previous ring index, bytes sent = W48
    MODEL_END = 8  # t = modeled end (a future time when written); send busy time in ns = W48


# W48: a 48-bit count in a record, nbytes (u4) holding the low 32 bits and part (u2) the high 16
W48_MAX = (1 << 48) - 1


def w48(rows: np.ndarray) -> np.ndarray:
    """The W48 value of records (see Ev.MODEL), as int64."""
    return rows["nbytes"].astype(np.int64) | (rows["part"].astype(np.int64) << 32)


RECORD = np.dtype([("t", "<f8"), ("qid", "<i4"), ("cid", "<i4"), ("step", "<i4"), ("seq", "<i4"),
                   ("peer", "<i4"), ("nbytes", "<u4"), ("aux", "<i4"), ("part", "<u2"), ("op", "u1"),
                   ("ev", "u1")])
_PACK = struct.Struct("<diiiiiIiHBB")
assert _PACK.size == RECORD.itemsize == 40
_FTAR, _STEP, _RECV, _SEND = int(Op.FTAR), int(Ev.STEP), int(Ev.RECV), int(Ev.SEND)  # plain ints: cheaper to pack
MAX_BYTES = 1_000_000  # the paper's budget: at most 1 MB of telemetry per rank in host memory
DEFAULT_CAPACITY = MAX_BYTES // RECORD.itemsize


class Recorder:
    """One rank's telemetry. Threading: records may come from a rank's tasks concurrently (the FTAR
    send task and its main task) without a lock: under the GIL each `pack_into` is atomic, so a record
    is never torn; two tasks switched between taking and advancing the slot index (rare: a switch
    between two bytecodes) write one slot, and one of the two records is lost."""

    def __init__(self, clock: Clock, capacity: int = DEFAULT_CAPACITY) -> None:
        if not 16 <= capacity <= DEFAULT_CAPACITY:
            raise ValueError(f"Recorder capacity must be in 16..{DEFAULT_CAPACITY} records, got {capacity}")
        self._now = clock.now
        self._buf = bytearray(capacity * RECORD.itemsize)
        self._view = np.frombuffer(self._buf, RECORD)
        assert self._view.nbytes <= MAX_BYTES
        self.capacity, self.written = capacity, 0
        self.step = -1  # the training step, when whoever drives the rank sets it
        self._ftar = (0, 0)  # (epoch, all-reduce number within it) of the current all-reduce
        self._seq = 0  # chunk steps completed in the current all-reduce
        self._prev = -1  # the previous rank's ring index in it
        self._tree_cid = 0
        self._last = [-1] * (max(Op) + 1)  # per Op: the number of the last record `_put` wrote (see holds)

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    def _put(self, qid: int, cid: int, seq: int, peer: int, nbytes: int, aux: int, part: int, op: int,
             ev: int) -> None:
        i = self.written
        self.written = i + 1
        self._last[op] = i
        _PACK.pack_into(self._buf, (i % self.capacity) * 40, self._now(), qid, cid, self.step, seq, peer,
                        nbytes, aux, part, op, ev)

    # -- hooks -------------------------------------------------------------------------------------
    def ftar_enter(self, epoch: int, nbytes: int, ring_size: int, index: int, num_steps: int) -> None:
        cid = self._ftar[1] + 1 if self._ftar[0] == epoch else 0
        self._ftar, self._seq, self._prev = (epoch, cid), 0, (index - 1) % ring_size
        self._put(epoch, cid, num_steps, index, min(nbytes, 0xFFFFFFFF), ring_size, 0, Op.FTAR, Ev.ENTER)

    def ftar_step(self, part: int, hop: int, nbytes: int) -> None:
        """The next chunk step (partition `part`, ring hop `hop`) completed: received from the previous
        ring rank (hop > 0) and reduced or copied, or staged (hop 0); every hop but the last queues a send,
        matched in order by the `ftar_sent` records. (The hot hooks pack inline: a call less per record.)"""
        i, seq = self.written, self._seq + 1
        self.written, self._seq = i + 1, seq
        _PACK.pack_into(self._buf, (i % self.capacity) * 40, self._now(), self._ftar[0], self._ftar[1], self.step,
                        seq, self._prev, nbytes, hop, part, _FTAR, _STEP)

    def ftar_recv(self, nbytes: int) -> None:
        i = self.written
        self.written = i + 1
        _PACK.pack_into(self._buf, (i % self.capacity) * 40, self._now(), self._ftar[0], self._ftar[1], self.step,
                        self._seq, self._prev, nbytes, 0, 0, _FTAR, _RECV)

    def ftar_sent(self, peer: int, nbytes: int) -> None:
        i = self.written
        self.written = i + 1
        _PACK.pack_into(self._buf, (i % self.capacity) * 40, self._now(), self._ftar[0], self._ftar[1], self.step,
                        0, peer, nbytes, 0, 0, _FTAR, _SEND)

    def ftar_model(self, start: float, end: float, num_steps: int, sends: int, sent_bytes: int,
                   busy_s: float) -> None:
        """The current all-reduce is modeled (not run chunk by chunk): it runs from `start` to `end` with
        `num_steps` chunk steps, `sends` of them sending, `sent_bytes` in all, and its sends spend `busy_s`
        on the wire. summarize interpolates its progress between start and end."""
        if not (0 <= sent_bytes <= W48_MAX and 0 <= busy_s * 1e9 <= W48_MAX and end >= start):
            raise ValueError(f"ftar_model: need 0 <= sent_bytes, busy_s in 48 bits and end >= start, got "
                             f"{sent_bytes}, {busy_s}, {start}..{end}")
        epoch, cid = self._ftar
        busy_ns = int(round(busy_s * 1e9))
        for t, seq, nbytes, aux, peer, ev in ((start, num_steps, sent_bytes, sends, self._prev, Ev.MODEL),
                                              (end, 0, busy_ns, 0, -1, Ev.MODEL_END)):
            i = self.written
            self.written = i + 1
            _PACK.pack_into(self._buf, (i % self.capacity) * 40, t, epoch, cid, self.step, seq, peer,
                            nbytes & 0xFFFFFFFF, aux, nbytes >> 32, Op.FTAR, ev)

    def ftar_end(self, ok: bool, peer: int = -1) -> None:
        self._put(self._ftar[0], self._ftar[1], 0, peer, 0, 0, 0, Op.FTAR, Ev.DONE if ok else Ev.FAIL)

    def tree_enter(self, seq: int) -> None:
        self._put(0, seq, 0, -1, 0, 0, 0, Op.TREE, Ev.ENTER)

    def tree_sent(self, seq: int) -> None:
        """Our subtree's value went up to the parent (the root: every child's value is in)."""
        self._put(0, seq, 0, -1, 0, 0, 0, Op.TREE, Ev.SEND)

    def tree_done(self, seq: int) -> None:
        self._put(0, seq, 0, -1, 0, 0, 0, Op.TREE, Ev.DONE)

    def quorum_ask(self, step: int) -> None:
        self._put(0, step, 0, -1, 0, 0, 0, Op.QUORUM, Ev.ENTER)

    def quorum_got(self, step: int, quorum_id: int) -> None:
        self.step = step
        self._put(quorum_id, step, 0, -1, 0, 0, 0, Op.QUORUM, Ev.DONE)

    def catchup_start(self, step: int, num_sources: int) -> None:
        self._put(0, step, 0, -1, 0, num_sources, 0, Op.CATCHUP, Ev.ENTER)

    def catchup_end(self, step: int, nbytes: int, ok: bool) -> None:
        self._put(0, step, 0, -1, min(nbytes, 0xFFFFFFFF), 0, 0, Op.CATCHUP, Ev.DONE if ok else Ev.FAIL)

    # -- reading -----------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Records in the buffer now."""
        return min(self.written, self.capacity)

    def records(self, last: int | None = None) -> np.ndarray:
        """A copy of the buffered records (only the newest `last` of them when given), oldest first."""
        n = self.held if last is None else min(self.held, max(last, 0))
        end = (self.written - 1) % self.capacity + 1 if self.written else 0  # after the newest record's slot
        lo, hi = (end - n) * RECORD.itemsize, end * RECORD.itemsize
        raw = self._buf[lo:hi] if lo >= 0 else self._buf[lo:] + self._buf[:hi]  # one byte copy (a structured
        return np.frombuffer(raw, RECORD)  # concatenate costs ms per MB)

    def last_record(self, op: int) -> np.ndarray | None:
        """The newest record of a TREE, QUORUM or CATCHUP `op` (every one goes through `_put`) as one row, if
        the buffer still holds it."""
        i = self._last[op]
        return self._view[i % self.capacity:i % self.capacity + 1].copy() if self.holds(op) else None

    def holds(self, op: int) -> bool:
        """Whether the buffer may hold a record of `op`: False only if it holds none of `_put`'s (every TREE,
        QUORUM and CATCHUP record, and FTAR's ENTER, DONE and FAIL; not its chunk and model records)."""
        return self._last[op] >= max(self.written - self.capacity, 0)
