"""Persistent-checkpoint decisions: cadence, which replica writes, what to prune, whether a restarted
job's layout can take a checkpoint's ledger. Pure.

Model and optimizer state are replicated, so one replica writes them (paper §4.4). The writer of the
checkpoint at step n is chosen from the quorum of step n, at its start: every participant that is not
behind then holds the state after n committed steps (the one the checkpoint must contain), and every
rank of every participant computes the same answer without talking to anyone.

Asynchronous writes (CheckpointConfig.async_write). The writer's step is blocked only while its ranks
stage the state (a copy in host memory); the write and the manifest commit run in the background while
training goes on. At most one checkpoint is in flight per writer: a cadence that comes while the last
write is still running is skipped (`async_action`), logged as a "checkpoint_skipped" event. Waiting
instead would block the writer's step for the rest of that write, the very stall that makes the other
replicas drop a writer whose write outlasts the FTAR timeout; a skip costs only recency (the job's
newest checkpoint is the in-flight one, once it lands).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Hashable, Iterable, Literal

from ftrun.data.loader_state import HasStep, LoaderState, LoaderStateError
from ftrun.data.sampler import DataLayout

STEP_DIR = re.compile(r"^step-(\d{8,})$")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """every_steps: checkpoint after every that many committed steps. keep: complete checkpoints kept.
    async_write: stage the state to host memory inside the step and write it in the background (see the
    module docstring); False writes inside the step, which then lasts as long as the write. On by
    default: a synchronous write longer than the FTAR timeout gets the writer dropped by the other
    replicas, and the retried step's next writer is dropped the same way, one replica after another.
    Its cost is a host-memory copy of the rank's state while the write runs."""

    every_steps: int = 100
    keep: int = 3
    async_write: bool = True

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CheckpointConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.async_write, bool):
            raise ValueError(f"CheckpointConfig.async_write must be true or false, got {self.async_write!r}")


def step_dir(step: int) -> str:
    """Folder name of the checkpoint after `step` committed steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    m = STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def should_checkpoint(step: int, config: CheckpointConfig) -> bool:
    """Whether the state after `step` committed steps is checkpointed (never the untrained step 0)."""
    return step > 0 and step % config.every_steps == 0


AsyncAction = Literal["stage", "in_flight", "skip"]


def async_action(due: Hashable, in_flight: Hashable | None) -> AsyncAction:
    """What the writer does with the checkpoint `due` (e.g. (step, lineage)) when `in_flight` is being
    written in the background (None: nothing is): "stage" it, nothing ("in_flight": a retry of the step
    whose checkpoint is being written), or "skip" it (one write at a time; module docstring)."""
    if in_flight is None:
        return "stage"
    return "in_flight" if in_flight == due else "skip"


def checkpoint_writer(participants: Iterable[HasStep]) -> str | None:
    """The lowest replica id among the participants at the quorum's step (not behind); None if none.

    `participants` are the quorum's (replica_id, step) pairs, e.g. StepQuorum.participants.
    """
    ps = list(participants)
    if not ps:
        return None
    top = max(p.step for p in ps)
    return min(p.replica_id for p in ps if p.step == top)


def prune_plan(complete: Iterable[int], incomplete: Iterable[int], keep: int) -> list[int]:
    """Steps whose folders to delete: complete checkpoints beyond the newest `keep`, and incomplete ones
    older than the newest complete checkpoint (an incomplete newer one may be a write in progress)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    done = sorted(set(complete), reverse=True)
    newest = done[0] if done else None
    drop = done[keep:]
    if newest is not None:
        drop += [s for s in set(incomplete) if s < newest]
    return sorted(drop)


def ledger_for_layout(ledger: LoaderState, layout: DataLayout,
                      replica_ids: Iterable[str] | None = None) -> LoaderState:
    """A checkpoint's ledger for a job restarted with `layout` (and `replica_ids`, needed to reshard).

    Same replicas and replica batch: the same ledger. Batches are chunks of one global order
    (ftrun.data.sampler) and do not depend on how a replica batch is split between its ranks, so a job
    restarted with another number of ranks per replica and the same replica batch trains exactly the
    batches the ledger says are next (same positions, same lineage).

    Another replica count or replica batch (e.g. 3x2 -> 2x4 keeping the global batch): a new era
    (LoaderState.resharded) that partitions what the checkpoint's lineage has not trained yet among the
    new replicas, so every sample of the global order is still trained exactly once. Needs `replica_ids`.

    Raises LoaderStateError if the data order would change (dataset size or seed) or if the replica
    count or replica batch changes and `replica_ids` is not given.
    """
    old = ledger.layout
    same = (old.dataset_size, old.num_replicas, old.seed, old.replica_batch_size) == \
        (layout.dataset_size, layout.num_replicas, layout.seed, layout.replica_batch_size)
    if same:  # the caller checks that the replica ids are the job's
        return ledger if old == layout else replace(ledger, layout=layout)
    if replica_ids is None or (old.dataset_size, old.seed) != (layout.dataset_size, layout.seed):
        raise LoaderStateError(
            f"loader_state was written for {old}, the job has {layout}: a restart may change num_replicas or the "
            "replica batch only with the job's replica ids (a new data era), and never dataset_size or seed")
    return ledger.resharded(layout, tuple(replica_ids))
