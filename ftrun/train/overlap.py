"""The gradient exchange overlapped with backward: FTAR all-reduces bucket by bucket while backward runs.

One step (the trainer's `_compute_and_exchange` when the step may overlap, see `may_overlap`):

    start(q)      arms the gradient buffer's hooks (FlatGrads.arm) and starts the exchange task, which
                  builds the quorum's ring (GradientExchange.prepare) while forward runs, then waits for
                  buckets and all-reduces each in bucket order (GradientExchange.reduce: sum, then mean)
    backward      each parameter's hook copies its gradient into the buffer; a bucket whose parameters
                  are all in (and every earlier bucket) goes to the exchange task at once
    gather        parameters without a gradient get zeros; the remaining buckets are released
    finish()      the step thread waits for the last bucket and raises the exchange's error, if any
    cancel()      the compute failed (or anything else between start and finish): the ring is given up
                  (engine.abort of the quorum's epoch: peers blocked in a bucket fail at once, and the
                  next step rebuilds the ring), the task is joined, the hooks disarmed

The buckets (ftrun.train.buckets) are cut from the parameter sizes alone, so every replica issues the
same all-reduces in the same order. Which steps overlap is the trainer's rule: a replica that trains the
step, with nobody behind (the joiner paths build their ring against a healing peer and keep/zero their
gradient exactly as the serial exchange does), without a kept gradient; every participant of a quorum
decides the same way. Failures keep the serial exchange's meaning: a RecoverableError from any bucket is
raised by finish() (the caller votes no, caused by a peer), and the buffer is then garbage (the step is
retried from a fresh backward). Each bucket is divided by the contributors right after its sum, which is
what the serial exchange does elementwise, so with the same sums the result is bitwise the same.

Threading: start/finish/cancel from the step thread; the hooks from autograd's (the step thread on
CPU); the exchange task is the engine's only caller between start and finish.
"""

from __future__ import annotations

import logging
from typing import Any

from ftrun.env.base import Env
from ftrun.replica.manager import StepQuorum
from ftrun.train.buckets import Bucket, BucketTracker, plan_buckets
from ftrun.train.exchange import GradientExchange
from ftrun.train.grads import FlatGrads

log = logging.getLogger("ftrun.train")


def may_overlap(*, trains: bool, healed: bool, num_behind: int, kept: bool) -> bool:
    """Whether a step's exchange may overlap its backward (the same answer on every participant of the
    quorum for the same trains/kept): only a plain training step; every joiner path stays serial."""
    return trains and not healed and num_behind == 0 and not kept


class OverlapExchange:
    """Bucketed FTAR during backward for one rank's FlatGrads (see the module docstring).
    Raises ValueError for a bucket_bytes below 1."""

    def __init__(self, *, env: Env, exchange: GradientExchange, flat: FlatGrads, bucket_bytes: int) -> None:
        self.env, self.exchange, self.flat = env, exchange, flat
        self.plan: tuple[Bucket, ...] = plan_buckets(flat.numels, elem_size=flat.buffer.itemsize,
                                                     bucket_bytes=bucket_bytes)
        self._session: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self._session is not None

    def start(self, q: StepQuorum) -> None:
        """Arm the hooks and start the exchange task for quorum `q` (before forward)."""
        if self._session is not None:
            raise RuntimeError("OverlapExchange.start: the previous step's exchange was neither finished nor cancelled")
        tracker, queue, lock = BucketTracker(self.plan), self.env.queue(), self.env.lock()

        def ready(param: int) -> None:
            with lock:
                released = tracker.mark(param)
            for k in released:
                queue.put(k)

        task = self.env.spawn(self._run, q, queue, name="ftar-overlap")
        self._session = {"q": q, "queue": queue, "task": task}
        self.flat.arm(ready)

    def _run(self, q: StepQuorum, queue) -> None:
        self.exchange.prepare(q)
        buf = self.flat.buffer
        for _ in self.plan:
            k = queue.get()
            if k is None:  # cancelled
                return
            b = self.plan[k]
            self.exchange.reduce(q, buf[b.start:b.stop])

    def finish(self) -> None:
        """After backward and the gather: wait for the last bucket's all-reduce; the buffer then holds the
        mean. Raises what the exchange raised (RecoverableError: a peer died or stalled; FatalError)."""
        s, self._session = self._session, None
        if s is None:
            raise RuntimeError("OverlapExchange.finish without start")
        self.flat.disarm()
        s["task"].join()  # every wait inside is bounded (ftar_timeout_s, the setup timeout)
        if s["task"].exception is not None:
            self.exchange.forget_ring()
            raise s["task"].exception

    def cancel(self) -> None:
        """Give up this step's exchange (the compute failed, or the step thread is leaving): a no-op when
        none is running. Peers in the same ring fail their exchange at once instead of by timeout."""
        s, self._session = self._session, None
        if s is None:
            return
        self.flat.disarm()
        s["queue"].put(None)
        if self.exchange.engine.abort(s["q"].quorum_id):
            log.info("step %d: overlapped exchange of quorum %d given up", s["q"].step, s["q"].quorum_id)
        s["task"].join()
        self.exchange.forget_ring()
