"""One all-reduce on one rank: the schedule's ops executed over the ring's two links.

Each link has a transport chosen when the ring was built:
- socket (any two hosts): a Send is a bulk frame; the receiver reads it into its staging slot (or, for
  an all-gather chunk, straight into the data buffer). A hop-0 send goes straight from the data buffer.
- shared (same host): the sender's staging slots are mapped by the receiver; a Send is a small control
  message naming slot and seq, the receiver reads the bytes in place and acknowledges the slot.

This task receives and computes in schedule order; a sender task drains the queue of outgoing frames so
the rank receives while it sends, and in shared mode an ack task frees slots as the next rank acknowledges
them. With FtarConfig.socket_io = "blocking" (the default), when both links are sockets and the
connections offer `hold_bulk` (ftrun.env.real_bulk), both tasks move each frame in one blocking call that
waits in the kernel, and the holds are released when the all-reduce ends ("threads": they wait in poll()).
A staging slot is rewritten only once its previous send is complete (socket) or acknowledged (shared),
which also caps the bytes in flight per peer at 2 x C x S.

Buffers are numpy uint8 arrays, or, with shape-only kernels (emulation), stand-ins whose slices are what
the Env's connections send and receive for those bytes (harness.engine.ShapeOnly). Kernel calls return
modeled device seconds (0.0 for real backends), which the rank waits out on its clock.
"""

from __future__ import annotations

import traceback

import numpy as np

from ftrun.env.base import EnvTimeout, NetError
from ftrun.ftar.kernels import DType, KernelError, Kernels
from ftrun.ftar.ring import FatalError, RecoverableError, RingLinks
from ftrun.ftar.schedule import CopyFromSlot, CopyToSlot, Reduce, ReduceCopy, Schedule, Send


class RingRun:
    telemetry = None  # the rank's ftrun.diagnose.telemetry.Recorder (set by the engine), or None

    def __init__(self, *, env, kernels: Kernels, links: RingLinks, sched: Schedule, data: np.ndarray, dtype: DType,
                 staging: np.ndarray, prev_slots: np.ndarray | None, out_shared: bool, timeout: float,
                 socket_io: str = "threads") -> None:
        self.env, self.k, self.links, self.sched, self.data, self.dt = env, kernels, links, sched, data, dtype
        self.staging, self.prev_slots, self.out_shared, self.timeout = staging, prev_slots, out_shared, timeout
        self.slot_free = [env.event() for _ in range(sched.num_slots)]
        for ev in self.slot_free:
            ev.set()
        self.sends = env.queue()
        self.error: BaseException | None = None
        both_sockets = prev_slots is None and not out_shared and isinstance(data, np.ndarray)
        # Where bulk frames go out and come in: the links, or (blocking) holds on them for this all-reduce.
        self.out, self.inc, self.held = links.next, links.prev, []
        self.blocking = socket_io == "blocking" and both_sockets and hasattr(links.next, "hold_bulk")

    # -- driver --------------------------------------------------------------------------------
    def go(self) -> None:
        if self.blocking:
            try:
                self.held.append(self.links.next.hold_bulk(self.timeout))
                self.held.append(self.links.prev.hold_bulk(self.timeout))
            except NetError as e:
                self._fail(e)
            self.out, self.inc = self.held
        helpers = [self.env.spawn(self._send_loop, name="ftar-send")]
        if self.out_shared:
            helpers.append(self.env.spawn(self._ack_loop, self.sched.num_sends, name="ftar-acks"))
        try:
            for step in self.sched.steps:
                self._run_step(step.ops)
                if self.telemetry: self.telemetry.ftar_step(step.partition, step.hop, step.ops[0].nbytes)
        except (NetError, EnvTimeout) as e:
            self._fail(e)
        except (KernelError, ValueError) as e:
            self._abort()
            raise FatalError(f"local fault in all-reduce: {e}") from e
        finally:
            self.sends.put(None)
            finished = all(h.join(timeout=self.timeout) for h in helpers)
            for held in self.held:
                held.release()
            # Let go of the buffers at once: shared staging is unmapped when the last view goes.
            self.staging = self.prev_slots = self.data = None  # type: ignore[assignment]
        if self.error is None and not finished:
            self._fail(EnvTimeout(f"the next rank did not take its data within {self.timeout}s"))
        if self.error is not None:
            self._fail(self.error)
        if self.telemetry: self.telemetry.ftar_end(True)

    def _fail(self, e: BaseException) -> None:
        if self.telemetry: self.telemetry.ftar_end(False)
        self._abort()
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)  # frames hold views of the staging buffers
        n, r = self.sched.num_ranks, self.sched.rank
        raise RecoverableError(f"all-reduce aborted on ring rank {r} of {n}: {type(e).__name__}: {e}") from e

    def _abort(self) -> None:
        self.links.close()  # neighbours see PeerClosed at once: the abort travels around the ring

    # -- one chunk at one hop ------------------------------------------------------------------
    def _run_step(self, ops: tuple) -> None:
        first, send = ops[0], ops[-1] if isinstance(ops[-1], Send) else None
        if isinstance(first, CopyToSlot):
            out = self._region(first.offset, first.nbytes)
        else:
            out = self._receive_and_compute(first, ops[1])
        if send is not None:
            self._send(send, out)

    def _receive_and_compute(self, recv, local):
        slot_off = recv.slot * self.sched.slot_bytes
        if self.prev_slots is not None:  # shared: read the bytes in the slot the previous rank names
            msg = self.links.prev.recv(timeout=self.timeout)
            if self.telemetry: self.telemetry.ftar_recv(recv.nbytes)
            src_slot = msg.get("slot")
            if msg.get("s") != recv.seq or not isinstance(src_slot, int) or not 0 <= src_slot < self.sched.num_slots:
                raise NetError(f"expected chunk {recv.seq} in a slot below {self.sched.num_slots}, got {msg}")
            out = self._compute_from(self.prev_slots, src_slot * self.sched.slot_bytes, recv, local)
            self.links.prev.send({"ack": src_slot}, timeout=self.timeout)
            return out
        if isinstance(local, CopyFromSlot):  # socket, all-gather: receive straight into place
            self._wait_slot(recv.slot)
            target = self._region(local.offset, local.nbytes)
            self.inc.recv_into(target, timeout=self.timeout)
            if self.telemetry: self.telemetry.ftar_recv(recv.nbytes)
            return target
        self._wait_slot(recv.slot)
        self.inc.recv_into(self.staging[slot_off:slot_off + recv.nbytes], timeout=self.timeout)
        if self.telemetry: self.telemetry.ftar_recv(recv.nbytes)
        if isinstance(local, Reduce):
            self._charge(self.k.reduce(self.staging, slot_off, self.data, local.offset, local.nbytes, self.dt))
            return self.staging[slot_off:slot_off + recv.nbytes]
        # ReduceCopy over a socket: data += slot puts the final sum in data in one pass (read 2, write 1,
        # against read 2, write 2 for slot += data; data <- slot), and the send goes from data, as the
        # all-gather's sends do. Same sums bitwise (a + b == b + a). Nothing writes this region again in
        # this all-reduce: the all-gather receives the other segments.
        self._charge(self.k.reduce(self.data, local.offset, self.staging, slot_off, local.nbytes, self.dt))
        return self._region(local.offset, local.nbytes)

    def _compute_from(self, src: np.ndarray, src_off: int, recv, local):
        """The local op with its input in another rank's shared slot; result in our slot (or data)."""
        nb, slot_off = recv.nbytes, recv.slot * self.sched.slot_bytes
        if isinstance(local, CopyFromSlot):
            self._charge(self.k.copy(self.data, local.offset, src, src_off, nb))
            return self._region(local.offset, nb)
        self._wait_slot(recv.slot)
        self._charge(self.k.copy(self.staging, slot_off, src, src_off, nb))
        if isinstance(local, Reduce):
            self._charge(self.k.reduce(self.staging, slot_off, self.data, local.offset, nb, self.dt))
        else:
            self._charge(self.k.reduce_copy(self.staging, slot_off, self.data, local.offset, self.data, local.offset,
                                            nb, self.dt))
        return self.staging[slot_off:slot_off + nb]

    def _send(self, send: Send, out: np.ndarray) -> None:
        if self.out_shared:
            slot_off = send.slot * self.sched.slot_bytes
            if not np.may_share_memory(out, self.staging):  # shared mode sends only from staging
                self._wait_slot(send.slot)
                self._charge(self.k.copy(self.staging, slot_off, out, 0, send.nbytes))
            self.slot_free[send.slot].clear()
            self.sends.put((send.slot, {"s": send.seq, "slot": send.slot}))
        else:
            self.slot_free[send.slot].clear()
            self.sends.put((send.slot, out))

    def _charge(self, seconds: float) -> None:
        """Wait out the device time a kernel models (shape-only kernels; real ones return 0.0)."""
        if seconds:
            self.env.clock.sleep(seconds)

    def _region(self, offset: int, nbytes: int) -> np.ndarray:
        return self.data[offset:offset + nbytes]

    def _wait_slot(self, slot: int) -> None:
        if not self.slot_free[slot].wait(timeout=self.timeout):
            raise EnvTimeout(f"slot {slot} was not released within {self.timeout}s")
        if self.error is not None:
            raise self.error

    # -- helper tasks --------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            try:
                item = self.sends.get(timeout=self.timeout)
            except EnvTimeout as e:
                return self._helper_failed(e, None)
            if item is None:
                return
            slot, payload = item
            try:
                if isinstance(payload, dict):  # shared slot: sent once the next rank acks it (_ack_loop)
                    self.links.next.send(payload, timeout=self.timeout)
                else:
                    self.out.send_bytes(payload, timeout=self.timeout)
                    self.slot_free[slot].set()
                    if self.telemetry: self.telemetry.ftar_sent(self.sched.next_rank, getattr(payload, "nbytes", 0))
            except NetError as e:
                return self._helper_failed(e, slot)

    def _ack_loop(self, expected: int) -> None:
        for _ in range(expected):
            try:
                msg = self.links.next.recv(timeout=self.timeout)
                self.slot_free[int(msg["ack"])].set()
                if self.telemetry: self.telemetry.ftar_sent(self.sched.next_rank, self.sched.slot_bytes)
            except (NetError, KeyError, ValueError, TypeError, IndexError) as e:
                return self._helper_failed(e, None)

    def _helper_failed(self, e: BaseException, slot: int | None) -> None:
        self.error = e
        self._abort()
        for ev in self.slot_free:  # wake the main task so it sees the error
            ev.set()
