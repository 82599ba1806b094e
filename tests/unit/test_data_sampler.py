"""The deterministic sampler: permutation, sharding, epochs, ranks, resumption."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from ftrun.data.sampler import DataLayout, RankPosition, Sampler, permute


def layout(**kw) -> DataLayout:
    base = dict(dataset_size=37, num_replicas=3, ranks_per_replica=2, batch_size_per_rank=2, seed=7)
    return DataLayout(**{**base, **kw})


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 100, 255, 256, 257, 1000])
@pytest.mark.parametrize("key", [0, 1, 2**40 + 3, 2**64 - 1])
def test_permute_is_a_bijection_of_range(size, key):
    out = permute(np.arange(size), size, key)
    assert sorted(out.tolist()) == list(range(size))


def test_permute_depends_on_the_key_and_shuffles():
    a, b = permute(np.arange(1000), 1000, 1), permute(np.arange(1000), 1000, 2)
    assert not np.array_equal(a, b)
    assert (a == np.arange(1000)).sum() < 20  # not (nearly) the identity


def test_permute_random_access_matches_full_evaluation():
    full = permute(np.arange(500), 500, 99)
    picks = np.array([499, 0, 250, 7, 7])
    assert np.array_equal(permute(picks, 500, 99), full[picks])


@pytest.mark.parametrize(("field", "value", "message"), [
    ("dataset_size", 0, "DataLayout.dataset_size must be >= 1"),
    ("num_replicas", 0, "DataLayout.num_replicas must be >= 1"),
    ("ranks_per_replica", -1, "DataLayout.ranks_per_replica must be >= 1"),
    ("batch_size_per_rank", 0, "DataLayout.batch_size_per_rank must be >= 1"),
    ("seed", -1, "DataLayout.seed must be >= 0"),
    ("seed", 1.5, "DataLayout.seed must be an int"),
    ("dataset_size", 2, "DataLayout.dataset_size (2) must be >= num_replicas (3)"),
])
def test_layout_validation_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        layout(**{field: value})


def test_replicas_cut_one_global_order_into_disjoint_chunks():
    s = Sampler(layout())  # 3 replicas x 4 samples: step p trains global offsets [12p, 12p + 12)
    assert [s.shard_size(r) for r in range(3)] == [37] * 3  # one global order, no per-replica shard
    for p in range(10):
        step = np.concatenate([s.replica_batch(r, p).ravel() for r in range(3)])
        assert np.array_equal(step, s.samples(np.arange(12 * p, 12 * p + 12)))
        assert [s.global_ranges(r, p) for r in range(3)] == [[(12 * p + 4 * r, 12 * p + 4 * r + 4)] for r in range(3)]


def test_every_global_epoch_is_a_permutation_and_epochs_differ():
    s = Sampler(layout())
    epochs = [s.samples(np.arange(e * 37, (e + 1) * 37)).tolist() for e in range(4)]
    assert all(sorted(e) == list(range(37)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 4  # reshuffled every epoch


def test_the_global_order_does_not_depend_on_the_replica_count():
    a, b = Sampler(layout()), Sampler(layout(num_replicas=2, ranks_per_replica=2, batch_size_per_rank=3))
    flat_a = np.concatenate([a.replica_batch(r, p).ravel() for p in range(4) for r in range(3)])
    flat_b = np.concatenate([b.replica_batch(r, p).ravel() for p in range(4) for r in range(2)])
    assert np.array_equal(flat_a, flat_b)  # the same global batch of 12: the same samples, step by step


def test_ranks_split_the_replica_batch():
    s = Sampler(layout(ranks_per_replica=3, batch_size_per_rank=4))
    for p in (0, 5, 11):
        whole = s.replica_batch(1, p)
        assert whole.shape == (3, 4)
        for k in range(3):
            assert np.array_equal(s.batch(1, k, p), whole[k])


def test_same_inputs_same_batches_and_seed_changes_them():
    a, b, c = Sampler(layout()), Sampler(layout()), Sampler(layout(seed=8))
    assert all(np.array_equal(a.batch(2, 1, p), b.batch(2, 1, p)) for p in range(20))
    assert any(not np.array_equal(a.batch(2, 1, p), c.batch(2, 1, p)) for p in range(20))


def test_resuming_at_a_position_yields_the_uninterrupted_stream():
    s = Sampler(layout())
    straight = [s.batch(0, 1, p).tolist() for p in range(30)]
    resumed = [s.batch(0, 1, p).tolist() for p in range(17)] + \
              [Sampler(layout()).batch(0, 1, p).tolist() for p in range(17, 30)]
    assert resumed == straight


def test_batch_ids_are_unique_across_replicas_and_positions():
    s = Sampler(layout())
    ids = [s.batch_id(r, p) for r in range(3) for p in range(50)]
    assert len(set(ids)) == len(ids)


def test_dataset_smaller_than_a_batch_wraps_epochs_inside_a_batch():
    s = Sampler(DataLayout(dataset_size=2, num_replicas=2, ranks_per_replica=2, batch_size_per_rank=3))
    counts = Counter(s.replica_batch(0, 0).ravel().tolist())  # 6 samples from a dataset of 2: 3 epochs
    assert counts == Counter({0: 3, 1: 3})


# (committed_batches, rank, expected) for replica 0 of layout(): dataset 37, 3 replicas x 4, rank slice 2
@pytest.mark.parametrize(("committed", "rank", "expected"), [
    (0, 0, RankPosition(0, 0, 0)),
    (0, 1, RankPosition(0, 0, 2)),
    (3, 0, RankPosition(3, 0, 36)),  # global offset 36
    (3, 1, RankPosition(3, 1, 1)),  # global offset 38
    (10, 1, RankPosition(10, 3, 11)),  # global offset 122
])
def test_rank_position(committed, rank, expected):
    assert Sampler(layout()).rank_position(0, rank, committed) == expected


@pytest.mark.parametrize(("call", "message"), [
    (lambda s: s.batch(3, 0, 0), "replica must be in"),
    (lambda s: s.batch(0, 2, 0), "rank must be in"),
    (lambda s: s.batch(0, 0, -1), "position must be >= 0"),
    (lambda s: s.batch_id(0, -1), "position must be >= 0"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call(Sampler(layout()))
