"""The FTAR engine: the CPU control plane that runs the pure ring schedule over env.net.

`reconfigure` builds the ring's two connections and picks each link's data transport: shared staging
slots when the neighbour is on this host, bulk frames on the connection otherwise (see run.py); the
connections always carry control and detect failures. `all_reduce` runs the schedule (run.RingRun).

Errors. A peer that dies or closes, or a wait past ftar_timeout_s (in reconfigure: the call's timeout),
ends the operation with RecoverableError: this rank closes both ring connections, which ends its
neighbours' operations at once (PeerClosed), and so on around the ring, so every survivor learns
within milliseconds instead of waiting out a timeout. Queued sends are dropped; the ring must be rebuilt
with `reconfigure` before the next all-reduce; the data buffer holds partial sums and must be refilled.
Bad arguments or a kernel failure raise FatalError.

Abort. `abort(epoch)`, from another task or through the listener's abort request (ring.abort_request,
sent by the replica's leader when the lighthouse says a participant of that quorum hung or died), ends this
rank's use of ring `epoch` in every phase: a running all-reduce and a ring being built (connect, the
previous rank's arrival, transport negotiation) fail at once with RecoverableError, and a later
reconfigure or all-reduce of that epoch fails at once too (the abort may come before this rank reaches
the exchange). Epochs are quorum ids: the next quorum, without the hung replica, has a higher one.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ftrun.config import FtarConfig  # noqa: F401 (re-exported: the engine's config lives with the others)
from ftrun.env.base import Env, NetError
from ftrun.ftar.kernels import DType, Kernels
from ftrun.ftar.ring import FatalError, RecoverableError, RingLinks, RingListener, abort_request, connect_ring
from ftrun.ftar.run import RingRun
from ftrun.ftar.schedule import Schedule, schedule
from ftrun.ftar.shm import SharedSlots, host_identity, same_machine
from ftrun.net import require_token


@lru_cache(maxsize=64)
def _schedule(n: int, index: int, nbytes: int, elem: int, chunk_bytes: int, num_chunks: int) -> Schedule:
    return schedule(n, index, nbytes, elem_size=elem, chunk_bytes=chunk_bytes, num_chunks=num_chunks)


class FtarEngine:
    """Fault-tolerant ring all-reduce for one rank. Threading: one caller at a time."""

    telemetry = None  # this rank's ftrun.diagnose.telemetry.Recorder, when root-cause telemetry is on

    def __init__(self, *, env: Env, kernels: Kernels, token: str, config: FtarConfig = FtarConfig(),
                 bind: str = "127.0.0.1:0", advertise_host: str | None = None) -> None:
        self.env, self.kernels, self.config = env, kernels, config
        self._token = require_token(token, "FtarEngine")
        warmup = getattr(kernels, "warmup", None)
        if warmup is not None:
            warmup()  # load compiled kernels now: a first all-reduce must not stall its ring for a second
        self._lock = env.lock()  # guards the abort state below against abort() from other tasks
        self.aborted_epoch = -1  # the highest epoch aborted: its ring is never (re)used
        self._building: tuple[int, list] | None = None  # (epoch, connections) of a ring being built
        self._links: RingLinks | None = None
        self._listener = RingListener(env, token, bind, advertise_host, on_abort=self.abort)
        self.addr = self._listener.addr  # publish as this rank's "ftar" endpoint
        self._ring: tuple[int, int] = (0, 0)  # (size, index)
        self._staging = np.empty(0, np.uint8)
        self._own_slots: SharedSlots | None = None  # our staging, mapped by the next rank
        self._prev_slots: SharedSlots | None = None  # the previous rank's staging, mapped here
        self.transports = ("none", "none")  # (from previous rank, to next rank), for reports

    def reconfigure(self, *, epoch: int, ring: list[str], index: int, timeout: float | None = None,
                    joining: bool = False) -> None:
        """(Re)build the ring for a new participant set: `ring` lists every rank's ftar address in
        ring order and `index` is this rank's place. Epochs must increase. `timeout` bounds each wait
        of this call (default: config.timeout_s), e.g. the catch-up wait limit while a joiner heals.
        `joining`: this rank may come after its peers gave up on the epoch (it was catching up); it
        then fails at once on the connection its previous rank closed (see _negotiate). Never every
        rank of a ring. Raises RecoverableError if a neighbour cannot be reached in time, FatalError on
        bad arguments."""
        if not 0 <= index < len(ring) or len(set(ring)) != len(ring) or ring[index] != self.addr:
            raise FatalError(f"bad ring: index {index} of {ring} (this rank listens at {self.addr})")
        if self._links is not None:
            if epoch <= self._links.epoch:
                raise FatalError(f"ring epoch must increase: {epoch} after {self._links.epoch}")
            self._links.close()
            self._links = None
        self._drop_shared()
        t = self.config.timeout_s if timeout is None else timeout
        if t <= 0:
            raise FatalError(f"reconfigure timeout must be > 0, got {t}")
        building: list = []
        with self._lock:
            self._check_not_aborted(epoch)
            self._building = (epoch, building)
        try:
            links = connect_ring(self.env, self._listener, self._token, epoch=epoch, ring=ring, index=index,
                                 timeout=t, building=building, aborted=lambda: epoch <= self.aborted_epoch)
            if len(ring) > 1:
                try:
                    self._negotiate(links, t, joining=joining)
                except (NetError, ValueError, OSError, KeyError, TypeError) as e:
                    links.close()
                    self._drop_shared()
                    raise RecoverableError(f"ring epoch {epoch}: transport negotiation failed: {e}") from e
            with self._lock:
                self._building = None
                if epoch <= self.aborted_epoch:  # aborted between the last wait and here
                    links.close()
                    self._drop_shared()
                    self._check_not_aborted(epoch)
                self._links = links
        finally:
            with self._lock:
                self._building = None
        self._ring = (len(ring), index)

    def _check_not_aborted(self, epoch: int) -> None:
        if epoch <= self.aborted_epoch:
            raise RecoverableError(f"ring epoch {epoch} was aborted (a participant of its quorum hung or died)")

    def _negotiate(self, links: RingLinks, t: float, *, joining: bool) -> None:
        """Pick each link's transport: the next rank tells us its host (backward); if it is ours we share
        our staging with it; we send it our host and offer (forward); we map the previous rank's offered
        staging and acknowledge it (backward).

        A rank sends forward only after its next rank has spoken, so a rank that gave up on the epoch
        (its next rank did not come within `t`) closes the connection to that next rank with nothing in
        it. A joining rank waits for its previous rank first, so when it comes after that give-up it
        reads the close at once. No deadlock: a rank's forward message waits only on its next rank's
        first (backward) message, and a joining rank's previous rank is not joining or itself waits on
        one that is not; a ring of joining ranks only would wait on itself."""
        me = host_identity()
        links.prev.send({"host": me})
        offer = links.prev.recv(timeout=t) if joining else None
        next_host = links.next.recv(timeout=t)["host"]
        share_out = next_host == me and self.config.transport == "auto"
        if share_out:
            self._own_slots = SharedSlots.create(self.config.staging_bytes, tag=f"e{links.epoch}")
        links.next.send({"host": me, "shm": self._own_slots.path if share_out else None})
        if offer is None:
            offer = links.prev.recv(timeout=t)
        for conn, host in ((links.next, next_host), (links.prev, offer["host"])):
            self._size_buffers(conn, host, me)
        shm = offer["shm"]
        if shm is not None:
            self._prev_slots = SharedSlots.attach(str(shm), self.config.staging_bytes)
        links.prev.send({"attached": shm is not None})
        # Read the reply even when nothing was offered: a socket closed with unread bytes resets its
        # connection (RST), which drops the frames still in its send buffer, so the next rank would lose
        # the tail of an all-reduce this rank had finished when the ring is rebuilt or closed.
        attached = links.next.recv(timeout=t)["attached"]
        if share_out and attached:
            self._own_slots.unlink()  # both sides have it mapped: nothing to leave behind in /dev/shm
        self.transports = ("shared" if shm is not None else "socket", "shared" if share_out else "socket")

    def _size_buffers(self, conn, host: str, me: str) -> None:
        """Small socket buffers on a link within this machine (FtarConfig.local_socket_buffer_bytes)."""
        size = self.config.local_socket_buffer_bytes
        set_buffer_bytes = getattr(conn, "set_buffer_bytes", None)  # real connections only
        if size and set_buffer_bytes is not None and same_machine(str(host), me):
            set_buffer_bytes(size)

    def _drop_shared(self) -> None:
        for slots in (self._own_slots, self._prev_slots):
            if slots is not None:
                slots.close()
        self._own_slots = self._prev_slots = None

    def all_reduce(self, buf: np.ndarray, dtype: DType | str | None = None) -> None:
        """Sum `buf` (C-contiguous numpy array) elementwise across the ring, in place.

        With kernels that do not compute values (`computes_values = False`, the emulator's shape-only
        kernels) `buf` may instead be a sized stand-in with `nbytes`, whose slices `buf[a:b]` are what
        the Env's connections send and receive, and `type(buf)(nbytes)` makes staging of the same kind.
        """
        links = self._links
        if links is None:
            raise FatalError("all_reduce before reconfigure (or after a failed one): rebuild the ring first")
        if links.epoch <= self.aborted_epoch:
            self._record_refused(links, buf.nbytes)
            self._links = None
            links.close()
            self._drop_shared()
            raise RecoverableError(f"ring epoch {links.epoch} was aborted (a participant of its quorum hung or died)")
        dt = DType.parse(dtype if dtype is not None else buf.dtype)
        if isinstance(buf, np.ndarray) and buf.flags.c_contiguous and buf.flags.writeable:
            data = buf.reshape(-1).view(np.uint8)
        elif not isinstance(buf, np.ndarray) and not self.kernels.computes_values:
            data = buf  # shape-only kernels touch no memory: a sized stand-in (see all_reduce's docstring)
        else:
            raise FatalError("all_reduce needs a writable C-contiguous numpy array")
        n, index = self._ring
        sched = _schedule(n, index, buf.nbytes, dt.itemsize, self.config.chunk_bytes, self.config.num_chunks)
        if not sched.steps:
            return
        if self.telemetry: self.telemetry.ftar_enter(links.epoch, buf.nbytes, n, index, len(sched.steps))
        staging = self._own_slots.array if self._own_slots is not None else self._local_staging(sched, data)
        run = RingRun(env=self.env, kernels=self.kernels, links=links, sched=sched, data=data,
                      dtype=dt, staging=staging, out_shared=self._own_slots is not None, timeout=self.config.timeout_s,
                      socket_io=self.config.socket_io,
                      prev_slots=self._prev_slots.array if self._prev_slots is not None else None)
        run.telemetry = self.telemetry
        try:
            run.go()
        except RecoverableError:
            self._links = None
            self._drop_shared()
            raise

    def _record_refused(self, links: RingLinks, nbytes: int) -> None:
        """Telemetry of an all-reduce refused at entry because its ring epoch was aborted (the lighthouse's
        notice that a participant hung came first): entered and failed at once, so the ring's records show the
        all-reduce that failed around the hung participant, which records nothing."""
        if self.telemetry:
            n, index = self._ring
            self.telemetry.ftar_enter(links.epoch, nbytes, n, index, 0)
            self.telemetry.ftar_end(False)

    def _local_staging(self, sched: Schedule, data) -> np.ndarray:
        need = sched.num_slots * sched.slot_bytes
        if not isinstance(data, np.ndarray):
            return type(data)(need)  # shape-only staging for a shape-only buffer
        if self._staging.nbytes < need:
            self._staging = np.empty(need, np.uint8)
        return self._staging

    def abort(self, epoch: int) -> bool:
        """Give up on ring `epoch` from another task (a participant of that quorum hung or died): a blocked
        all_reduce or reconfigure of it fails at once with RecoverableError instead of waiting out its
        timeout, and so does any later use of it. True if a ring of that epoch was built or being built."""
        with self._lock:
            self.aborted_epoch = max(self.aborted_epoch, epoch)
            links, building = self._links, self._building
            hit = False
            if building is not None and building[0] <= epoch:
                for conn in list(building[1]):
                    conn.close()
                self._listener.wake(building[0])
                hit = True
            if links is not None and links.epoch <= epoch:
                links.close()
                hit = True
        return hit

    def send_abort(self, addr: str, epoch: int, timeout: float) -> bool:
        """Ask the rank listening at `addr` (its "ftar" endpoint) to abort ring `epoch`. False if it could
        not be reached (it may be gone: then its ring fails anyway)."""
        try:
            conn = self.env.net.connect(addr, timeout=timeout)
        except NetError:
            return False
        try:
            conn.send(abort_request(self._token, epoch), timeout=timeout)
            return True
        except NetError:
            return False
        finally:
            conn.close()

    def close(self) -> None:
        if self._links is not None:
            self._links.close()
            self._links = None
        self._drop_shared()
        self._listener.close()
