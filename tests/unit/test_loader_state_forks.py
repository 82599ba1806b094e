"""loader_state writers refuse to replace state of another lineage at the same or a higher step."""

from __future__ import annotations

import pytest

from ftrun.data.loader_state import LoaderState, LoaderStateFork, LoaderStateStore, fork_refusal
from ftrun.data.sampler import DataLayout
from ftrun.storage import FileStorage, MemoryStorage

LAYOUT = DataLayout(dataset_size=40, num_replicas=3, ranks_per_replica=1, batch_size_per_rank=2)
IDS = ("r0", "r1", "r2")

REFUSAL_CASES = [
    # (name, held, new, found, refused)
    ("empty store", [], (1, "a"), [], False),
    ("next step", [(4, "d"), (5, "e")], (6, "f"), [], False),
    ("the same state again", [(4, "d"), (5, "e")], (5, "e"), [], False),
    ("another lineage at the newest step", [(4, "d"), (5, "e")], (5, "x"), [], True),
    ("below the newest step", [(39, "p"), (40, "q")], (11, "s"), [], True),
    ("below, but the store held it at open (full restart)", [(39, "p"), (40, "q")], (11, "s"),
     [(39, "p"), (40, "q")], False),
    ("after the restart's first write, the other old slot", [(39, "p"), (11, "s")], (12, "t"),
     [(39, "p"), (40, "q")], False),
    ("written since open: no longer the restart's to supersede", [(41, "r"), (40, "q")], (11, "s"),
     [(39, "p"), (40, "q")], True),
    ("same step, other lineage, found at open", [(40, "q")], (40, "z"), [(40, "q")], False),
]


@pytest.mark.parametrize(("name", "held", "new", "found", "refused"), REFUSAL_CASES, ids=[c[0] for c in REFUSAL_CASES])
def test_fork_refusal(name, held, new, found, refused):
    reason = fork_refusal(held, new, found=frozenset(found))
    assert (reason is not None) == refused
    if refused:
        assert f"step {new[0]}" in reason and "stale or forked" in reason


def run(state: LoaderState, steps: range, contributors=IDS) -> LoaderState:
    for n in steps:
        state = state.advance(step=n, contributors=contributors)
    return state


def test_a_frozen_replica_resumed_after_the_job_finished_cannot_overwrite_its_loader_state(tmp_path):
    """The issue's fork: r2 is frozen at step 10 while r0/r1 finish 40 steps; resumed, it trains alone."""
    storage = FileStorage(tmp_path)
    start = run(LoaderState.initial(LAYOUT, IDS), range(10))
    stale = LoaderStateStore(storage=storage)  # r2's process opened the store long ago
    job = LoaderStateStore(storage=storage)
    state = start
    for n in range(10, 40):
        state = state.advance(step=n, contributors=IDS)
        job.save(state)
    solo = start
    for n in range(10, 12):
        solo = solo.advance(step=n, contributors=("r2",))
        with pytest.raises(LoaderStateFork, match="stale or forked"):
            stale.save(solo)
    assert LoaderStateStore(storage=storage).load() == state


def test_a_full_restart_from_an_older_checkpoint_supersedes_what_it_found():
    storage = MemoryStorage()
    first = LoaderStateStore(storage=storage)
    state = LoaderState.initial(LAYOUT, IDS)
    for n in range(8):
        state = state.advance(step=n, contributors=IDS)
        first.save(state)
    restarted = LoaderStateStore(storage=storage)  # the job restarts from a step-5 checkpoint
    branch = run(LoaderState.initial(LAYOUT, IDS), range(5))
    for n in range(5, 10):
        branch = branch.advance(step=n, contributors=("r0", "r1"))  # r2 is gone: a new lineage
        restarted.save(branch)
    assert restarted.load() == branch
    with pytest.raises(LoaderStateFork):
        first.save(state)  # the old incarnation, had it survived, cannot write over the restart
