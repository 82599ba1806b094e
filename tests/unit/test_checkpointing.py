"""The writer rank's checkpoint driver (ftrun.train.checkpointing) over a recording Checkpointer: who
writes and when, one background write at a time, skips, retries, failures, and `wait`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from ftrun.checkpoint.policy import CheckpointConfig
from ftrun.data.loader_state import LoaderState
from ftrun.data.sampler import DataLayout
from ftrun.env.real import RealEnv
from ftrun.train.checkpointing import CheckpointWriter

LEDGER = LoaderState.initial(DataLayout(dataset_size=64, num_replicas=2, ranks_per_replica=1, batch_size_per_rank=4),
                             ("r0", "r1"))


@dataclass(frozen=True)
class P:
    replica_id: str
    step: int


@dataclass(frozen=True)
class Q:
    step: int
    participants: tuple[P, ...]


def quorum(step: int, *ids: str) -> Q:
    return Q(step, tuple(P(r, step) for r in ids))


class Recording:
    """A Checkpointer whose background writes wait for `gate`; `fail` makes stage or the write raise."""

    def __init__(self, env) -> None:
        self.gate, self.calls, self.fail = env.event(), [], None

    def save(self, step, ledger):
        self.calls.append(("save", step))

    def stage(self, step, ledger):
        self.calls.append(("stage", step))
        if self.fail == "stage":
            raise OSError("injected: no host memory")

        def write():
            assert self.gate.wait(10.0)
            if self.fail == "write":
                raise OSError("injected: the store refused the write")
            self.calls.append(("written", step))
        return write

    def in_flight(self, local):
        return local


def writer(env, **config):
    events, ckpt = [], Recording(env)
    w = CheckpointWriter(checkpointer=ckpt, config=CheckpointConfig(every_steps=3, **config), env=env,
                         replica_id="r0", rank=0, emit=lambda kind, **f: events.append((kind, f["step"])))
    return w, ckpt, events


@pytest.mark.timeout(30)
def test_one_background_write_at_a_time_and_a_retry_is_not_restaged():
    env = RealEnv()
    w, ckpt, events = writer(env)
    w.at_step(quorum(2, "r0", "r1"), LEDGER)  # not due
    w.at_step(quorum(3, "r1", "r2"), LEDGER)  # due, but r1 writes
    w.at_step(quorum(3, "r0", "r1"), LEDGER)
    w.at_step(quorum(3, "r0", "r1"), LEDGER)  # the step's retry: its write is in flight
    w.at_step(quorum(6, "r0", "r1"), LEDGER)  # the next cadence: skipped, not waited for
    assert ckpt.calls == [("stage", 3)] and events == [("checkpoint_staged", 3), ("checkpoint_skipped", 6)]
    ckpt.gate.set()
    w.wait()
    assert ckpt.calls == [("stage", 3), ("written", 3)] and events[-1] == ("checkpoint", 3)
    w.at_step(quorum(3, "r0", "r1"), LEDGER)  # written: never rewritten
    w.at_step(quorum(9, "r0", "r1"), LEDGER)
    w.wait()
    assert ckpt.calls[2:] == [("stage", 9), ("written", 9)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["stage", "write"])
def test_a_failed_checkpoint_is_reported_and_the_next_attempt_stages_again(where):
    env = RealEnv()
    w, ckpt, events = writer(env)
    ckpt.fail = where
    ckpt.gate.set()
    w.at_step(quorum(3, "r0"), LEDGER)
    w.wait()
    assert events[-1] == ("checkpoint_failed", 3) and ("written", 3) not in ckpt.calls
    ckpt.fail = None
    w.at_step(quorum(3, "r0"), LEDGER)  # a retry of the step after the failure writes it again
    w.wait()
    assert ckpt.calls[-1] == ("written", 3) and events[-1] == ("checkpoint", 3)


def test_a_synchronous_writer_saves_inside_the_step():
    env = RealEnv()
    w, ckpt, events = writer(env, async_write=False)
    w.at_step(quorum(3, "r0"), LEDGER)
    w.at_step(quorum(3, "r0"), LEDGER)
    assert ckpt.calls == [("save", 3)] and events == [("checkpoint", 3)]
