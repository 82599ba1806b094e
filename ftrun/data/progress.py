"""One replica's data bookkeeping inside the step flow. Sans-IO: it returns audit records and batches;
the caller writes the records and the loader_state.

Per step, on every rank of the replica (all ranks hold the same ledger and see the same quorum):

    q = manager.start_step()              # healing (if behind) calls progress.heal(peer's ledger)
    attempt = progress.start(step=q.step, participants=q.participants)
    if attempt:                           # None: behind this step, contributes zeros, trains no batch
        leader: audit.append(attempt)     # before the gradient can enter the all-reduce
        samples = progress.samples(rank)
    ... forward / backward / all-reduce ...
    if manager.should_commit():
        optimizer.step(); commit = progress.commit(writer=replica_id)
        leader: audit.append(commit); the step's loader_state writer: store.save(progress.state)
    else:
        progress.abort()                  # the ledger is unchanged; the retry reads the same batch

Threading: one task per instance.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ftrun.data.audit import Attempt, Commit
from ftrun.data.loader_state import HasStep, LoaderState, LoaderStateError, contributors


class DataProgress:
    def __init__(self, *, replica_id: str, state: LoaderState) -> None:
        state.index(replica_id)  # raises if the replica is not in the ledger
        self.replica_id = replica_id
        self.state = state
        self.sampler = state.sampler()
        self._step: int | None = None
        self._contributors: tuple[str, ...] = ()

    @property
    def position(self) -> int:
        """This replica's next batch number."""
        return self.state.position(self.replica_id)

    @property
    def trains(self) -> bool:
        """Whether this replica trains a batch in the started step (False when behind or none started)."""
        return self._step is not None and self.replica_id in self._contributors

    def heal(self, state: LoaderState) -> None:
        """Adopt the ledger of the healthy peer this replica caught up from (it is replicated state)."""
        if state.replica_ids != self.state.replica_ids:
            raise LoaderStateError(f"healed loader_state has replicas {state.replica_ids}, "
                                   f"expected {self.state.replica_ids}")
        state.check_layout(self.state.layout)
        if state.step < self.state.step:
            raise LoaderStateError(f"cannot heal from a loader_state at step {state.step} "
                                   f"to one at step {self.state.step}")
        self.state, self._step = state, None
        self.sampler = state.sampler()  # the same era as ours in a healthy job; follow the ledger regardless

    def start(self, *, step: int, participants: Iterable[HasStep]) -> Attempt | None:
        """Begin training `step`. Returns this replica's Attempt, or None if it is behind this step."""
        if step != self.state.step:
            raise LoaderStateError(f"{self.replica_id}: loader_state is at step {self.state.step}, the quorum "
                                   f"trains step {step}; heal (or restore) first")
        self._step = step
        self._contributors = contributors(participants, step)
        if self.replica_id not in self._contributors:
            return None
        position = self.position
        index = self.state.index(self.replica_id)
        return Attempt(self.replica_id, step, self.state.lineage, position,
                       self.sampler.batch_id(index, position))

    def samples(self, rank: int) -> np.ndarray:
        """Sample indices rank `rank` trains in the started step."""
        if not self.trains:
            raise LoaderStateError(f"{self.replica_id}: no started step in which this replica trains")
        return self.sampler.batch(self.state.index(self.replica_id), rank, self.position)

    def commit(self, *, writer: str) -> Commit:
        """Apply the started step to the ledger (with the optimizer step) and describe it for the audit."""
        if self._step is None:
            raise LoaderStateError(f"{self.replica_id}: commit without a started step")
        before = self.state
        positions = tuple(before.position(r) for r in self._contributors)
        self.state = before.advance(step=self._step, contributors=self._contributors)
        self._step = None
        return Commit(writer, before.step, before.lineage, self.state.lineage, self._contributors, positions)

    def abort(self) -> None:
        """The started step was not committed by this replica; the ledger stays (the retry re-reads the batch)."""
        self._step = None
