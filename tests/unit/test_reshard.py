"""Restarting into another replica count: the partition math of the remaining global order (pure), the
ledger's eras and their encodings, and the audit across a restart."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import numpy as np
import pytest

from ftrun.data.audit import Attempt, Commit, audit
from ftrun.data.loader_state import (LoaderState, LoaderStateCorrupt, LoaderStateError, decode, encode,
                                     reshard_lineage)
from ftrun.data.sampler import DataLayout, Sampler, StreamOrigin, merge_ranges, remaining

N = 97  # dataset size: prime, so batches straddle epochs at odd places
G = 24  # global batch kept constant across restarts


def layout(replicas: int, ranks: int = 1) -> DataLayout:
    return DataLayout(dataset_size=N, num_replicas=replicas, ranks_per_replica=ranks,
                      batch_size_per_rank=G // (replicas * ranks), seed=3)


def trained_ranges(state: LoaderState) -> list[tuple[int, int]]:
    """Global offsets the current era of `state` has trained (every replica's positions below its count)."""
    s = state.sampler()
    return [g for i, done in enumerate(state.committed_batches) for p in range(done) for g in s.global_ranges(i, p)]


def assert_exact_cover(pieces: list[tuple[int, int]], left: StreamOrigin) -> None:
    """`pieces` (trained) and `left` (not yet) are disjoint and together cover every global offset."""
    everything = sorted(pieces + list(left.prefix) + [(left.tail, left.tail + 1)])
    assert all(b <= a for (_, b), (a, _) in zip(everything, everything[1:])), "an offset trained twice"
    assert merge_ranges(everything) == [(0, left.tail + 1)], "an offset never trained nor left for later"


def run(state: LoaderState, steps: int, rng: random.Random | None, records: list | None = None) -> LoaderState:
    """Commit `steps` steps; with `rng`, each replica misses a step with probability 1/3 (it is behind: a
    mid-step cut leaves holes). Appends the records a replica leader would write."""
    for _ in range(steps):
        contributors = tuple(r for r in state.replica_ids if rng is None or rng.random() > 1 / 3) \
            or state.replica_ids[:1]
        if records is not None:
            s = state.sampler()
            for rid in contributors:
                i = state.index(rid)
                p = state.committed_batches[i]
                records.append(Attempt(rid, state.step, state.lineage, p, s.batch_id(i, p)))
        new = state.advance(step=state.step, contributors=contributors)
        if records is not None:
            records.append(Commit(contributors[0], state.step, state.lineage, new.lineage, contributors,
                                  tuple(state.position(r) for r in contributors)))
        state = new
    return state


def ids(n: int) -> tuple[str, ...]:
    return tuple(f"r{i}" for i in range(n))


# -- partition math (pure) --------------------------------------------------------------------------
def test_remaining_of_a_lockstep_era_is_the_rest_of_the_global_order():
    assert remaining(layout(3), StreamOrigin(), (5, 5, 5)) == StreamOrigin((), 5 * G)


def test_remaining_lists_the_holes_behind_the_fastest_replica_in_global_order():
    lay = DataLayout(dataset_size=37, num_replicas=3, ranks_per_replica=2, batch_size_per_rank=2)  # chunks of 4
    left = remaining(lay, StreamOrigin(), (3, 1, 2))  # holes: r1 at 1, 2 (chunks 4, 7), r2 at 2 (chunk 8)
    assert left == StreamOrigin(((16, 20),), 28)  # chunks 7 and 8 run into the tail at chunk 9
    two = DataLayout(dataset_size=37, num_replicas=2, ranks_per_replica=4, batch_size_per_rank=3)  # chunks of 12
    assert Sampler(two, left).global_ranges(0, 0) == [(16, 20), (28, 36)]
    assert remaining(two, left, (1, 0)) == StreamOrigin((), 36)  # r1's first chunk is [36, 48): a hole at the tail


@pytest.mark.parametrize("cut", [False, True], ids=["lockstep", "mid-step cut"])
@pytest.mark.parametrize("seed", range(6))
def test_every_offset_exactly_once_across_3_to_2_to_4_replicas(cut, seed):
    rng = random.Random(seed) if cut else None
    state = run(LoaderState.initial(layout(3), ids(3)), 7, rng)
    pieces = trained_ranges(state)
    for replicas, ranks, steps in ((2, 4, 5), (4, 2, 6), (3, 2, 3)):
        state = state.resharded(layout(replicas, ranks), ids(replicas))
        assert state.committed_batches == (0,) * replicas and len(state.eras) >= 1
        assert_exact_cover(pieces, state.origin)  # what the old era left is exactly the new era's stream
        state = run(state, steps, rng)
        pieces += trained_ranges(state)
        assert_exact_cover(pieces, remaining(state.layout, state.origin, state.committed_batches))
    # and as samples: every global epoch fully trained is a permutation of the dataset
    covered = merge_ranges(pieces)
    full_epochs = covered[0][1] // N if covered[0][0] == 0 else 0
    counts = Counter(Sampler(layout(3)).samples(np.arange(full_epochs * N)).tolist())
    assert counts == Counter({i: full_epochs for i in range(N)}) or full_epochs == 0


def test_a_lockstep_restart_keeping_the_global_batch_trains_the_same_samples_per_step():
    ref = LoaderState.initial(layout(3, 2), ids(3))  # 3 replicas x 2 ranks x 4
    restarted = run(ref, 6, None).resharded(layout(2, 4), ids(2))  # 2 replicas x 4 ranks x 3
    for step in range(6, 12):
        a, b = Sampler(layout(3, 2)), restarted.sampler()
        want = np.sort(np.concatenate([a.replica_batch(r, step).ravel() for r in range(3)]))
        got = np.sort(np.concatenate([b.replica_batch(r, step - 6).ravel() for r in range(2)]))
        assert np.array_equal(want, got)


def test_stream_origin_maps_era_elements_and_rejects_bad_prefixes():
    o = StreamOrigin(((2, 4), (10, 11)), 20)
    assert o.to_global(np.arange(6)).tolist() == [2, 3, 10, 20, 21, 22]
    assert o.ranges(1, 5) == [(3, 4), (10, 11), (20, 22)] and o.prefix_size == 3
    assert StreamOrigin.from_list(o.to_list()) == o
    for prefix, tail in [(((4, 2),), 9), (((1, 3), (3, 5)), 9), (((1, 3),), 3), (((5, 6), (1, 2)), 9)]:
        with pytest.raises(ValueError, match="StreamOrigin.prefix"):
            StreamOrigin(prefix, tail)
    with pytest.raises(ValueError, match="stream origin"):
        StreamOrigin.from_list({"tail": 1})


# -- the ledger ---------------------------------------------------------------------------------------
def test_resharded_ledger_round_trips_and_keeps_its_history():
    state = run(LoaderState.initial(layout(3), ids(3)), 5, random.Random(1))
    new = run(state.resharded(layout(2, 4), ids(2)), 2, random.Random(2))
    assert new.eras[0].lineage == state.lineage and new.eras[0].committed_batches == state.committed_batches
    assert new.era_start == 5 and new.lineage not in (state.lineage,)
    assert decode(encode(new)) == new and LoaderState.from_dict(new.to_dict()) == new
    assert "eras" not in state.to_dict()  # a job never resharded keeps its old forms
    with pytest.raises(LoaderStateError, match="dataset_size or seed"):
        state.resharded(DataLayout(dataset_size=N + 1, num_replicas=2, ranks_per_replica=1, batch_size_per_rank=12),
                        ids(2))


@pytest.mark.parametrize("corrupt", [
    lambda body: body.__setitem__("origin", [3, [[5, 4]]]),  # a backwards range
    lambda body: body["eras"][0].__setitem__("replica_ids", ["r0", "r0", "r1"]),
    lambda body: body["eras"][0].__setitem__("committed_batches", [1, 2]),
    lambda body: body["eras"][0].__setitem__("end_step", 99),  # beyond the ledger's step
    lambda body: body["eras"][0].pop("lineage"),
    lambda body: body.__setitem__("eras", {"not": "a list"}),
])
def test_decode_rejects_a_malformed_era(corrupt):
    import struct
    import zlib

    import msgpack

    new = run(LoaderState.initial(layout(3), ids(3)), 2, None).resharded(layout(2), ids(2))
    body = msgpack.unpackb(encode(new)[17:])
    corrupt(body)
    bad = msgpack.packb(body)
    forged = struct.pack(">4sBIQ", b"FTLS", 1, zlib.crc32(bad), len(bad)) + bad
    with pytest.raises(LoaderStateCorrupt, match="malformed body"):
        decode(forged)
    with pytest.raises(LoaderStateError):
        LoaderState.from_dict({**new.to_dict(), **{k: body[k] for k in ("origin", "eras")}})


# -- the audit across a restart -----------------------------------------------------------------------
def restarted_job(seed: int, *, forge: bool = False) -> tuple[list, LoaderState]:
    """3 replicas run 8 steps (checkpoint after 5); the job restarts from step 5 as 2 replicas for 6 steps.
    forge: the restarted era wrongly reads the global order from its start again."""
    rng, records = random.Random(seed), []
    at_checkpoint = run(LoaderState.initial(layout(3), ids(3)), 5, rng, records)
    run(at_checkpoint, 3, rng, records)  # abandoned: lost with the restart
    start = at_checkpoint.resharded(layout(2, 4), ids(2))
    if forge:
        start = dataclasses.replace(start, origin=StreamOrigin(), lineage=reshard_lineage(
            at_checkpoint.lineage, 5, start.layout, start.replica_ids, StreamOrigin()))
    return records, run(start, 6, rng, records)


@pytest.mark.parametrize("seed", range(4))
def test_audit_accepts_a_run_whose_replica_count_changed_at_a_restore(seed):
    records, final = restarted_job(seed)
    report = audit(records, final=final)
    assert report.ok, report.summary()
    assert report.num_steps == 11 and {t.era for t in report.trained} == {0, 1}
    assert len(report.trained) == sum(final.committed_batches) + sum(final.eras[0].committed_batches)


def test_audit_flags_a_new_era_that_retrains_old_data():
    records, final = restarted_job(0, forge=True)
    report = audit(records, final=final)
    assert not report.ok and report.duplicates and report.num_steps == 11
    assert any("does not read what the era before left untrained" in p for p in report.problems)


def test_audit_flags_a_batch_missing_after_the_restore():
    records, final = restarted_job(0)
    last = max(i for i, r in enumerate(records) if isinstance(r, Attempt) and r.step == final.step - 1)
    del records[last]
    report = audit(records, final=final)
    assert not report.ok and any("no attempt record" in p for p in report.problems)


def test_progress_trains_the_new_era_and_heals_across_it():
    from types import SimpleNamespace

    from ftrun.data.progress import DataProgress

    start = run(LoaderState.initial(layout(3, 2), ids(3)), 4, random.Random(5)).resharded(layout(2, 4), ids(2))
    ahead, behind = DataProgress(replica_id="r1", state=start), DataProgress(replica_id="r0", state=start)
    quorum = [SimpleNamespace(replica_id=r, step=start.step) for r in ids(2)]
    attempt = ahead.start(step=start.step, participants=quorum)
    assert attempt is not None and attempt.batch_id == 1 and attempt.position == 0
    s = Sampler(layout(2, 4), start.origin)
    assert np.array_equal(ahead.samples(3), s.batch(1, 3, 0))
    ahead.commit(writer="r1")
    behind.heal(ahead.state)  # a replica catching up adopts the ledger, era included
    assert behind.state == ahead.state and behind.sampler.origin == start.origin
    assert np.array_equal(behind.sampler.batch(0, 0, 1), s.batch(0, 0, 1))
