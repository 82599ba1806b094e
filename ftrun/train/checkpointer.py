"""The checkpoint-writer seam: how the elected writer persists the state after a step commits.

    checkpointer.restore(layout, replica_ids) -> (step, ledger) | None    at start: the latest complete one
    checkpointer.save(step, loader_state)     model + optimizer + user state + ledger after `step`
    write = checkpointer.stage(step, loader_state)    the same, asynchronously: a copy of that state in
    write()                                   host memory now; write() persists and commits it later

The trainer decides when and who (ftrun.checkpoint.policy: cadence and writer election); this only
writes. Every rank of the writer replica calls `save`, every rank of every replica `restore` at start
(collectives over the replica's control group). Real: `DcpCheckpointer` (torch.distributed.checkpoint
under a folder, each rank writing its own shards, one signed manifest committed last by the leader
once every rank has written; a sharded restore reshards into the restoring replica's ranks;
ftrun.checkpoint.store). The emulator writes a manifest of the modeled bytes to its mock object
store (harness.run.seams). A failed save raises; the trainer logs it and carries on.

`stage` is collective like `save` (every rank of the writer replica, at a step boundary); the write it
returns runs in a background task while training goes on, and its collectives must not interleave with
the step's: a one-rank replica has none, a sharded one runs them on a gloo group of its own (made once,
by the first stage: `dist.new_group` is a collective of the replica's default group, which no step
collective uses at a step boundary) and never on the control group or the FSDP group.
"""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import torch
import torch.distributed as dist

from ftrun.data.loader_state import LoaderState
from ftrun.data.sampler import DataLayout
from ftrun.replica.comm import GlooComm, ReplicaComm
from ftrun.train.resume import checkpoint_store, resume

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful


class Checkpointer(Protocol):
    def save(self, step: int, loader_state: LoaderState) -> None:
        """Persist the state after `step` commits, with its ledger. Raises on a failed write."""

    def stage(self, step: int, loader_state: LoaderState) -> Callable[[], None]:
        """Capture the state after `step` commits (the same as `save` would persist) and return the write
        that persists it: run later, in a background task, it raises on a failed write and commits the
        checkpoint last. Raises what `save` raises before it writes (e.g. a fork)."""

    def in_flight(self, local: bool) -> bool:
        """Whether the writer replica still has a background write running, given whether this rank's
        is (`local`): the same answer on every rank of the replica, so that all of them stage the next
        checkpoint or all skip it (a collective of a sharded replica, like `stage`)."""

    def restore(self, layout: DataLayout, replica_ids: tuple[str, ...]) -> tuple[int, LoaderState] | None:
        """Load the latest complete checkpoint into the rank's state: (step, ledger), or None if there
        is none. Raises LoaderStateError for a checkpoint of another layout or job."""


class DcpCheckpointer:
    """Checkpoints of a torch model and optimizer under `root` (keeping the newest `keep`), their
    manifests signed with `key` (ftrun.checkpoint.manifest.checkpoint_key of the job token) and only
    checkpoints signed with it restored. extra: the user's registered state (anything with
    state_dict/load_state_dict), saved as "user.<name>" entries and restored in place. comm: the
    replica's control group (None: a one-rank replica); with more than one rank the model is FSDP2-
    sharded over the process's default group and every rank writes and reads its own shards.
    timeout_s: the collectives of a sharded replica's background writes (None: torch's default)."""

    def __init__(self, *, root: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 keep: int, key: bytes | None = None, extra: Mapping[str, "Stateful"] | None = None,
                 comm: ReplicaComm | None = None, timeout_s: float | None = None) -> None:
        self.root, self.model, self.optimizer, self.keep, self.key = root, model, optimizer, keep, key
        self.extra, self.comm, self.timeout_s = dict(extra or {}), comm, timeout_s
        self._background: tuple[ReplicaComm | None, Any] | None = None  # (comm, DCP group) of background writes

    def restore(self, layout: DataLayout, replica_ids: tuple[str, ...]) -> tuple[int, LoaderState] | None:
        step, ledger = resume(self.root, model=self.model, optimizer=self.optimizer, layout=layout,
                              replica_ids=replica_ids, key=self.key, extra=self.extra, comm=self.comm)
        return (step, ledger) if step > 0 else None

    def save(self, step: int, loader_state: LoaderState) -> None:
        checkpoint_store().save(self.root, step=step, model=self.model, optimizer=self.optimizer,
                                loader_state=loader_state, keep=self.keep, key=self.key, extra=self.extra,
                                comm=self.comm)

    def stage(self, step: int, loader_state: LoaderState) -> Callable[[], None]:
        store = checkpoint_store()
        staged = store.stage(self.root, step=step, model=self.model, optimizer=self.optimizer,
                             loader_state=loader_state, keep=self.keep, key=self.key, extra=self.extra, comm=self.comm)
        comm, group = self._background_channel()
        return lambda: store.write(staged, comm=comm, process_group=group)

    def in_flight(self, local: bool) -> bool:
        if self.comm is None or self.comm.world_size == 1:
            return local
        return bool(self.comm.all_reduce_int([int(local)], "max")[0])  # ranks end their writes microseconds apart

    def _background_channel(self) -> tuple[ReplicaComm | None, Any]:
        """(comm, process group) of the background writes: none for a one-rank replica; for a sharded
        one a gloo group of the replica's ranks used by nothing else (module docstring)."""
        if self._background is None:
            if self.comm is None or self.comm.world_size == 1:
                self._background = (None, None)
            else:
                timeout = datetime.timedelta(seconds=self.timeout_s) if self.timeout_s is not None else None
                group = dist.new_group(backend="gloo", timeout=timeout)
                self._background = (GlooComm.of_group(group, rank=self.comm.rank, world_size=self.comm.world_size),
                                    group)
        return self._background
