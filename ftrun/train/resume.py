"""Where a starting replica resumes: the latest complete persistent checkpoint, or the beginning.

A replica process always starts here. After a full-job restart every replica restores the same
checkpoint and the ledger stored with it (the rolling loader_state file is newer than the checkpoint
and must not be used: the steps after the checkpoint are retrained on a new lineage, and the audit
follows that one). A single restarted replica restores the checkpoint too and then, being behind the
job, heals from its peers at its first step (catch-up replaces model, optimizer and ledger).

torch.distributed.checkpoint costs most of a second to import, so `ftrun.checkpoint.store` is imported
only when a checkpoint folder exists (restore) or checkpointing is enabled (`checkpoint_store`): a
restarted replica that needs neither checks in that much sooner.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

import torch

from ftrun.checkpoint.policy import ledger_for_layout, parse_step_dir
from ftrun.data.loader_state import LoaderState, LoaderStateError
from ftrun.data.sampler import DataLayout
from ftrun.replica.comm import LocalComm, ReplicaComm

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

log = logging.getLogger("ftrun.checkpoint")


def checkpoint_store():
    """The persistent-checkpoint module (imported on first use; see the module docstring)."""
    from ftrun.checkpoint import store

    return store


def resume(checkpoint_dir: str | os.PathLike | None, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           layout: DataLayout, replica_ids: Iterable[str], key: bytes | None = None,
           extra: Mapping[str, Stateful] | None = None, comm: ReplicaComm | None = None) -> tuple[int, LoaderState]:
    """(step, ledger) to start from; restores model, optimizer and `extra` in place when a checkpoint is used.
    key: use only checkpoints signed under it (ftrun.checkpoint.manifest.checkpoint_key of the job token).
    comm: the replica's control group; every rank calls this, the leader's view of the folder decides
    for all (a sharded replica's ranks must agree to enter DCP's collectives together). The checkpoint
    may come from replicas of another number of ranks, or from another number of replicas, which starts
    a new data era (ftrun.checkpoint.policy.ledger_for_layout).

    Raises LoaderStateError if the checkpoint's ledger was written for a data layout this job cannot
    continue or for another job, and CheckpointCorrupt if the newest complete checkpoint cannot be loaded.
    """
    ids = tuple(replica_ids)
    comm = comm or LocalComm()
    root = Path(checkpoint_dir) if checkpoint_dir is not None else None
    found = root is not None and root.is_dir() and any(parse_step_dir(p.name) is not None for p in root.iterdir())
    if comm.world_size > 1:
        found = comm.broadcast_bytes((b"1" if found else b"") if comm.rank == 0 else None) == b"1"
    if not found:
        return 0, LoaderState.initial(layout, ids)
    store = checkpoint_store()
    try:
        step, ledger = store.restore(root, model, optimizer, key=key, extra=extra, comm=comm)
    except store.NoCheckpoint:
        return 0, LoaderState.initial(layout, ids)
    ledger = ledger_for_layout(ledger, layout, ids)
    if ledger.replica_ids != ids:
        raise LoaderStateError(f"checkpoint ledger has replicas {ledger.replica_ids}, the job has {ids}")
    log.info("resuming from the checkpoint of step %d (lineage %s)", step, ledger.lineage)
    return step, ledger
