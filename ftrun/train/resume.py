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
from typing import Iterable

import torch

from ftrun.checkpoint.policy import parse_step_dir
from ftrun.data.loader_state import LoaderState, LoaderStateError
from ftrun.data.sampler import DataLayout

log = logging.getLogger("ftrun.checkpoint")


def checkpoint_store():
    """The persistent-checkpoint module (imported on first use; see the module docstring)."""
    from ftrun.checkpoint import store

    return store


def resume(checkpoint_dir: str | os.PathLike | None, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           layout: DataLayout, replica_ids: Iterable[str], key: bytes | None = None) -> tuple[int, LoaderState]:
    """(step, ledger) to start from; restores model and optimizer in place when a checkpoint is used.
    key: use only checkpoints signed under it (ftrun.checkpoint.manifest.checkpoint_key of the job token).

    Raises LoaderStateError if the checkpoint's ledger was written for another data layout or job, and
    CheckpointCorrupt if the newest complete checkpoint cannot be loaded.
    """
    ids = tuple(replica_ids)
    root = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if root is None or not root.is_dir() or not any(parse_step_dir(p.name) is not None for p in root.iterdir()):
        return 0, LoaderState.initial(layout, ids)
    store = checkpoint_store()
    if store.latest_complete(root, key=key) is None:
        return 0, LoaderState.initial(layout, ids)
    step, ledger = store.restore(root, model, optimizer, key=key)
    ledger.check_layout(layout)
    if ledger.replica_ids != ids:
        raise LoaderStateError(f"checkpoint ledger has replicas {ledger.replica_ids}, the job has {ids}")
    log.info("resuming from the checkpoint of step %d (lineage %s)", step, ledger.lineage)
    return step, ledger
