"""The FTAR engine: the CPU control loop that runs the pure ring schedule over env.net.

Per all-reduce, two tasks per rank: this one receives and computes (Recv, Reduce, ReduceCopy, in
schedule order) and a sender task drains a queue of Sends to the next rank, so a rank always receives
while it sends. A staging slot is reused only after its previous Send completed (the schedule's rule),
which also caps bytes in flight per peer at 2 x C x S.

Zero-copy where the schedule allows it: a hop-0 send goes straight from the data buffer (no
CopyToSlot), and an all-gather receive lands straight in the data buffer and is forwarded from there
(no CopyFromSlot). Only reduce-scatter receives pass through staging.

Errors. A peer that dies or closes, or a wait past ftar_timeout_s, ends the operation with
RecoverableError: this rank closes both ring connections, which ends its neighbours' operations at
once (PeerClosed), and so on around the ring, so every survivor learns within milliseconds instead of
waiting out a timeout. Queued sends are dropped; the ring must be rebuilt with `reconfigure` before the
next all-reduce; the data buffer holds partial sums and must be refilled. Bad arguments or a kernel
failure raise FatalError.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ftrun.env.base import Env, EnvTimeout, NetError
from ftrun.ftar.kernels import DType, KernelError, Kernels
from ftrun.ftar.ring import FatalError, RecoverableError, RingLinks, RingListener, connect_ring
from ftrun.ftar.schedule import (
    CopyFromSlot, CopyToSlot, Recv, Reduce, ReduceCopy, Schedule, Send, schedule,
)


@dataclass(frozen=True, kw_only=True)
class FtarConfig:
    chunk_bytes: int = 4 << 20  # S: message and staging-slot size
    num_chunks: int = 4  # C: chunks in flight per peer
    timeout_s: float = 10.0  # any single wait inside an all-reduce

    def __post_init__(self) -> None:
        if self.chunk_bytes < 16 or self.chunk_bytes % 16:
            raise ValueError(f"FtarConfig.chunk_bytes must be a positive multiple of 16, got {self.chunk_bytes}")
        if self.num_chunks < 1:
            raise ValueError(f"FtarConfig.num_chunks must be >= 1, got {self.num_chunks}")
        if self.timeout_s <= 0:
            raise ValueError(f"FtarConfig.timeout_s must be > 0, got {self.timeout_s}")


@lru_cache(maxsize=64)
def _schedule(n: int, index: int, nbytes: int, elem: int, chunk_bytes: int, num_chunks: int) -> Schedule:
    return schedule(n, index, nbytes, elem_size=elem, chunk_bytes=chunk_bytes, num_chunks=num_chunks)


class FtarEngine:
    """Fault-tolerant ring all-reduce for one rank. Threading: one caller at a time."""

    def __init__(self, *, env: Env, kernels: Kernels, token: str, config: FtarConfig = FtarConfig(),
                 bind: str = "127.0.0.1:0") -> None:
        self.env, self.kernels, self.config, self._token = env, kernels, config, token
        self._listener = RingListener(env, token, bind)
        self.addr = self._listener.addr  # publish as this rank's "ftar" endpoint
        self._links: RingLinks | None = None
        self._ring: tuple[int, int] = (0, 0)  # (size, index)
        self._staging = np.empty(0, np.uint8)

    def reconfigure(self, *, epoch: int, ring: list[str], index: int) -> None:
        """(Re)build the ring for a new participant set: `ring` lists every rank's ftar address in
        ring order and `index` is this rank's place. Epochs must increase. Raises RecoverableError if
        a neighbour cannot be reached, FatalError on bad arguments."""
        if not 0 <= index < len(ring) or len(set(ring)) != len(ring) or ring[index] != self.addr:
            raise FatalError(f"bad ring: index {index} of {ring} (this rank listens at {self.addr})")
        if self._links is not None:
            if epoch <= self._links.epoch:
                raise FatalError(f"ring epoch must increase: {epoch} after {self._links.epoch}")
            self._links.close()
            self._links = None
        self._links = connect_ring(self.env, self._listener, self._token, epoch=epoch, ring=ring, index=index,
                                   timeout=self.config.timeout_s)
        self._ring = (len(ring), index)

    def all_reduce(self, buf: np.ndarray, dtype: DType | str | None = None) -> None:
        """Sum `buf` (C-contiguous numpy array) elementwise across the ring, in place."""
        links = self._links
        if links is None:
            raise FatalError("all_reduce before reconfigure (or after a failed one): rebuild the ring first")
        dt = DType.parse(dtype if dtype is not None else buf.dtype)
        if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise FatalError("all_reduce needs a writable C-contiguous numpy array")
        n, index = self._ring
        sched = _schedule(n, index, buf.nbytes, dt.itemsize, self.config.chunk_bytes, self.config.num_chunks)
        if not sched.steps:
            return
        need = sched.num_slots * sched.slot_bytes
        if self._staging.nbytes < need:
            self._staging = np.empty(need, np.uint8)
        try:
            _Run(self, links, sched, buf.reshape(-1).view(np.uint8), dt).go()
        except RecoverableError:
            self._links = None
            raise

    def close(self) -> None:
        if self._links is not None:
            self._links.close()
            self._links = None
        self._listener.close()


class _Run:
    """One all-reduce on one rank: the receive/compute loop here, sends in a second task."""

    def __init__(self, engine: FtarEngine, links: RingLinks, sched: Schedule, data: np.ndarray, dt: DType) -> None:
        self.env, self.k, self.links, self.sched, self.data, self.dt = engine.env, engine.kernels, links, sched, data, dt
        self.staging, self.timeout = engine._staging, engine.config.timeout_s
        self.slot_free = [self.env.event() for _ in range(sched.num_slots)]
        for ev in self.slot_free:
            ev.set()
        self.sends = self.env.queue()
        self.send_error: BaseException | None = None

    def go(self) -> None:
        sender = self.env.spawn(self._send_loop, name="ftar-send")
        try:
            for step in self.sched.steps:
                self._run_step(step.ops)
        except (NetError, EnvTimeout) as e:
            self._abort()
            raise RecoverableError(self._describe(e)) from e
        except (KernelError, ValueError) as e:
            self._abort()
            raise FatalError(f"local fault in all-reduce: {e}") from e
        finally:
            self.sends.put(None)
            finished = sender.join(timeout=self.timeout)
        if not finished and self.send_error is None:
            self.send_error = EnvTimeout(f"sends did not finish within {self.timeout}s")
        if self.send_error is not None:
            self._abort()
            raise RecoverableError(self._describe(self.send_error)) from self.send_error

    def _run_step(self, ops: tuple) -> None:
        first, send = ops[0], ops[-1] if isinstance(ops[-1], Send) else None
        if isinstance(first, CopyToSlot):  # hop 0: send this rank's own segment straight from data
            src = self.data[first.offset:first.offset + first.nbytes]
        else:
            local = ops[1]
            self._wait_slot(first.slot)
            if isinstance(local, CopyFromSlot):  # all-gather: receive straight into place
                src = self.data[local.offset:local.offset + local.nbytes]
                self.links.prev.recv_into(memoryview(src), timeout=self.timeout)
            else:
                base = first.slot * self.sched.slot_bytes
                src = self.staging[base:base + first.nbytes]
                self.links.prev.recv_into(memoryview(src), timeout=self.timeout)
                self._reduce(local, base)
        if send is not None:
            self.slot_free[send.slot].clear()
            self.sends.put((send.slot, src))

    def _reduce(self, op: Reduce | ReduceCopy, base: int) -> None:
        if isinstance(op, Reduce):
            self.k.reduce(self.staging, base, self.data, op.offset, op.nbytes, self.dt)
        else:
            self.k.reduce_copy(self.staging, base, self.data, op.offset, self.data, op.offset, op.nbytes, self.dt)

    def _wait_slot(self, slot: int) -> None:
        if not self.slot_free[slot].wait(timeout=self.timeout):
            raise EnvTimeout(f"send from slot {slot} did not complete within {self.timeout}s")
        if self.send_error is not None:
            raise self.send_error

    def _send_loop(self) -> None:
        while True:
            try:
                item = self.sends.get(timeout=self.timeout)
            except EnvTimeout as e:
                self.send_error = e
                return
            if item is None:
                return
            slot, src = item
            try:
                self.links.next.send_bytes(memoryview(src), timeout=self.timeout)
            except NetError as e:
                self.send_error = e
                self._abort()
                self.slot_free[slot].set()  # wake the receiver so it sees the error
                return
            self.slot_free[slot].set()

    def _abort(self) -> None:
        self.links.close()  # neighbours see PeerClosed at once: the abort travels around the ring

    def _describe(self, e: BaseException) -> str:
        n, r = self.sched.num_ranks, self.sched.rank
        return f"all-reduce aborted on ring rank {r} of {n}: {type(e).__name__}: {e}"
