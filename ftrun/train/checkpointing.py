"""One rank's part in persistent checkpoints: when its replica is the elected writer, write the state
after a step commits, inside the step or in the background.

    writer.at_step(q, ledger)    at the step boundary (the trainer's `_serve`), before the compute
    writer.wait()                block until a background write in flight has committed or failed

Synchronous (CheckpointConfig.async_write = false): `Checkpointer.save` inside the step, which then
lasts as long as the write; a write longer than the FTAR timeout gets the writer dropped by the other
replicas. Asynchronous (the default): `Checkpointer.stage` inside the step (a host-memory copy, the
only part the step waits for), then the write and its manifest commit in a task of its own
(env.spawn: virtual time in the emulator), one at a time: a cadence that finds the last write running
is skipped (ftrun.checkpoint.policy.async_action). Either way a failed write costs that checkpoint
only (readers skip a folder without a valid manifest) and is logged, not raised; a write that dies
with its process leaves no manifest.

Events (through `emit`): "checkpoint_staged" (seconds the step waited), "checkpoint" (seconds of the
write; background: true when asynchronous), "checkpoint_skipped" (in_flight: the step being written),
"checkpoint_failed" (error).

Threading: `at_step` and `wait` run in the trainer's task; the write task shares `checkpointed` and
`emit` with it (one attribute assignment; `emit` must take events from either task).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ftrun.checkpoint.policy import CheckpointConfig, async_action, checkpoint_writer, should_checkpoint
from ftrun.data.loader_state import LoaderState
from ftrun.env.base import Env, Task
from ftrun.replica.manager import StepQuorum
from ftrun.train.checkpointer import Checkpointer

log = logging.getLogger("ftrun.train")

Key = tuple[int, str]  # (step, lineage) of a checkpoint


class CheckpointWriter:
    """checkpointer: the rank's Checkpointer seam. checkpointed: the key of a checkpoint that exists
    (e.g. the one the replica resumed from): never rewritten, since a rewrite first discards it.
    emit(kind, **fields): the trainer's events."""

    def __init__(self, *, checkpointer: Checkpointer, config: CheckpointConfig, env: Env, replica_id: str,
                 rank: int, emit: Callable[..., None], checkpointed: Key | None = None) -> None:
        self.checkpointer, self.config, self.env = checkpointer, config, env
        self.replica_id, self.rank, self._emit = replica_id, rank, emit
        self.checkpointed = checkpointed
        self._writing: tuple[Task, Key] | None = None  # the background write and its key

    def at_step(self, q: StepQuorum, ledger: LoaderState) -> None:
        """The checkpoint of the state after q.step commits, if it is due and this replica writes it
        (every rank of the writer replica: its own shards). Not redone for a retry on the same state."""
        key = (q.step, ledger.lineage)
        if (self.checkpointed == key or not should_checkpoint(q.step, self.config)
                or checkpoint_writer(q.participants) != self.replica_id):
            return
        if self.config.async_write:
            self._stage(key, ledger)
        else:
            self._write(lambda: self.checkpointer.save(q.step, ledger), key)

    def wait(self) -> None:
        """Block until the background write in flight (if any) has committed or failed."""
        if self._writing is not None:
            self._writing[0].join()
            self._writing = None

    def _stage(self, key: Key, ledger: LoaderState) -> None:
        step = key[0]
        busy = self.checkpointer.in_flight(self._writing is not None and self._writing[0].is_alive())
        writing = self._writing[1] if busy and self._writing is not None else None  # busy: the same on every rank
        action = async_action(key, writing)
        if action == "in_flight":  # a retry of the step whose checkpoint is being written
            return
        if action == "skip":
            log.warning("replica %s: checkpoint of step %d skipped: the one of step %d is still being written",
                        self.replica_id, step, writing[0])
            self._emit("checkpoint_skipped", step=step, in_flight=writing[0])
            return
        started = self.env.clock.now()
        try:
            write = self.checkpointer.stage(step, ledger)
        except Exception as e:
            self._failed(step, e)
            return
        self._emit("checkpoint_staged", step=step, seconds=self.env.clock.now() - started)
        task = self.env.spawn(self._write, write, key, True, name=f"checkpoint-{self.replica_id}-{self.rank}-{step}")
        self._writing = (task, key)

    def _write(self, write: Callable[[], Any], key: Key, background: bool = False) -> None:
        started = self.env.clock.now()
        try:
            write()
        except Exception as e:  # storage trouble must not take the replica down; the next cadence retries
            self._failed(key[0], e)
            return
        self.checkpointed = key
        self._emit("checkpoint", step=key[0], seconds=self.env.clock.now() - started,
                   **({"background": True} if background else {}))

    def _failed(self, step: int, e: Exception) -> None:
        log.error("replica %s: checkpoint of step %d failed: %s", self.replica_id, step, e)
        self._emit("checkpoint_failed", step=step, error=f"{type(e).__name__}: {e}")
