"""The cross-replica gradient exchange of one step: FTAR among the participants of the step's quorum.

Rank r of every participating replica forms one ring (in the quorum's participant order), found through
the "ftar" endpoint each rank published with the quorum request. The ring is rebuilt whenever the quorum
id changes (membership change or a failed commit) and used as it is otherwise. A replica that healed
this step contributes zeros. The result is the mean over the contributors (participants not behind), so
a healing replica does not dilute the gradient.

Failures: RecoverableError (a peer died or stalled) is for the caller to report to the Manager, which
turns it into a 'don't commit' vote; the healthy replica retries the step under the next quorum.

Waiting for a joiner (paper §6.1, ftrun.catchup.wait): a step with a joiner always builds a new ring,
and the ring cannot be built before the joiner, done healing, enters it; `setup_timeout_s` bounds each
wait of that build (the wait limit) where the default would be ftar_timeout_s. `setup_s`/`setup_ok`
tell the caller how long the last build took and whether it completed (the joiner arrived).
"""

from __future__ import annotations

import logging

import numpy as np

from ftrun.ftar.engine import FtarEngine
from ftrun.ftar.ring import RecoverableError
from ftrun.replica.endpoints import decode_endpoints
from ftrun.replica.manager import StepQuorum

log = logging.getLogger("ftrun.ftar")


class GradientExchange:
    """`joiner_wait_s`: a rank that healed this step computes nothing and enters the exchange at once,
    so building its ring waits for the healthy replicas to finish computing the step. Its setup waits
    are bounded by joiner_wait_s, not the engine's ftar_timeout_s, which can be shorter than a step
    (found by the emulator: at 11 s steps and a 5 s timeout every joiner failed its first step, forever).
    Default None: ftar_timeout_s."""

    def __init__(self, *, engine: FtarEngine, rank: int, joiner_wait_s: float | None = None) -> None:
        if joiner_wait_s is not None and joiner_wait_s <= 0:
            raise ValueError(f"joiner_wait_s must be > 0, got {joiner_wait_s}")
        self.engine, self.rank, self.joiner_wait_s = engine, rank, joiner_wait_s
        self._epoch: int | None = None
        self.setup_s = 0.0  # seconds the last `average` spent building its ring (0.0: the ring was reused)
        self.setup_ok = True  # whether that build completed

    def abort_for_hung_peer(self, replica_id: str, quorum_id: int, ranks: tuple[str, ...] = ()) -> None:
        """The lighthouse's notice that `replica_id`, a participant of quorum `quorum_id`, hung: fail a
        blocked exchange of that quorum now (a 'no' vote caused by a peer) instead of after the FTAR
        timeout, on this rank and on every rank whose FTAR listener is in `ranks` (the replica's other
        ranks: each has its own ring through the hung replica). Called from the lighthouse client's
        heartbeat task, which must not block: the requests go out from a task of their own."""
        if self.engine.abort(quorum_id):
            log.warning("replica %s hung or died in quorum %d: aborting this rank's all-reduce", replica_id, quorum_id)
        others = [a for a in ranks if a and a != self.engine.addr]
        if others:
            timeout = min(self.engine.config.timeout_s, 5.0)
            self.engine.env.spawn(lambda: [self.engine.send_abort(a, quorum_id, timeout) for a in others],
                                  name="ftar-abort-ranks")

    def ring_for(self, quorum: StepQuorum) -> list[str]:
        if len(quorum.peer_addrs) != len(quorum.participants):
            raise RecoverableError(f"quorum {quorum.quorum_id} carries {len(quorum.peer_addrs)} peer addresses "
                                   f"for {len(quorum.participants)} participants")
        ring = []
        for p, peer in zip(quorum.participants, quorum.peer_addrs):
            addr = decode_endpoints(peer).get("ftar") if peer else None
            if not addr:
                raise RecoverableError(f"replica {p.replica_id} published no FTAR endpoint for rank {self.rank}")
            ring.append(addr)
        return ring

    def average(self, quorum: StepQuorum, grads: np.ndarray, *, dtype: str | None = None,
                setup_timeout_s: float | None = None) -> None:
        """Replace `grads` (C-contiguous, in place) by the mean over the quorum's contributors.
        `setup_timeout_s` bounds each wait of building a new ring (default: the engine's ftar_timeout_s).
        Raises RecoverableError (the caller votes no), FatalError (bad arguments, a local fault)."""
        if quorum.healed:
            grads.fill(0)  # caught up this step: contributes nothing, receives everyone's mean
        self.prepare(quorum, setup_timeout_s=setup_timeout_s)
        self.reduce(quorum, grads, dtype=dtype)

    def prepare(self, quorum: StepQuorum, *, setup_timeout_s: float | None = None) -> None:
        """The ring of `quorum`: built unless this quorum's ring is built already (`average`'s first half;
        the overlapped exchange calls it before the first bucket). Raises as `average`."""
        if quorum.healed and setup_timeout_s is None:
            setup_timeout_s = self.joiner_wait_s
        self.setup_s, self.setup_ok = 0.0, True
        if self._epoch != quorum.quorum_id:
            self._epoch = None
            clock = self.engine.env.clock
            started, self.setup_ok = clock.now(), False
            try:
                self.engine.reconfigure(epoch=quorum.quorum_id, ring=self.ring_for(quorum),
                                        index=quorum.replica_index, timeout=setup_timeout_s, joining=quorum.healed)
                self.setup_ok = True
            finally:
                self.setup_s = clock.now() - started
            self._epoch = quorum.quorum_id

    def reduce(self, quorum: StepQuorum, grads: np.ndarray, *, dtype: str | None = None) -> None:
        """`grads` (all of the buffer, or one bucket of it) <- its mean over the contributors, on the ring
        `prepare` built (`average`'s second half). Raises as `average`."""
        try:
            self.engine.all_reduce(grads, dtype)
        except RecoverableError:
            self._epoch = None  # the ring is gone; the failed commit bumps the quorum id for the rebuild
            raise
        if quorum.num_contributors > 1:
            np.divide(grads, quorum.num_contributors, out=grads, casting="unsafe")

    def forget_ring(self) -> None:
        """The ring is in an unknown place of its sequence (an overlapped exchange given up mid-way):
        the next exchange rebuilds it."""
        self._epoch = None
