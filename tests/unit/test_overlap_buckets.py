"""Buckets of the exchange overlapped with backward (ftrun.train.buckets): pure, table-style."""

from __future__ import annotations

import pytest

from ftrun.train.buckets import Bucket, BucketTracker, plan_buckets
from ftrun.train.overlap import may_overlap


def test_buckets_take_parameters_in_backward_order_and_close_at_the_threshold():
    # 5 parameters of 4, 8, 2, 6, 3 float32 elements at offsets 0, 4, 12, 14, 20 (23 elements in all)
    plan = plan_buckets([4, 8, 2, 6, 3], elem_size=4, bucket_bytes=32)
    assert plan == (Bucket(0, (4, 3), 14, 23),  # 9 elements = 36 bytes >= 32: closes
                    Bucket(1, (2, 1), 4, 14),  # 2 + 8 = 10 elements
                    Bucket(2, (0,), 0, 4))  # the last, partial bucket (16 bytes)


def test_buckets_cover_the_buffer_back_to_front_without_gaps():
    numels = [3, 1, 7, 0, 5, 2, 9]
    for bucket_bytes in (1, 4, 10, 28, 1000):
        plan = plan_buckets(numels, elem_size=4, bucket_bytes=bucket_bytes)
        assert [b.index for b in plan] == list(range(len(plan)))
        assert plan[0].stop == sum(numels) and plan[-1].start == 0
        assert all(a.start == b.stop for a, b in zip(plan, plan[1:]))
        order = [p for b in plan for p in b.params]
        assert order == list(range(len(numels) - 1, -1, -1))
        assert all(b.params == tuple(sorted(b.params, reverse=True)) for b in plan)


def test_a_parameter_larger_than_a_bucket_is_a_bucket_of_its_own_and_one_huge_bucket_holds_all():
    assert [b.params for b in plan_buckets([10, 100, 10], elem_size=4, bucket_bytes=40)] == [(2,), (1,), (0,)]
    assert plan_buckets([10, 100, 10], elem_size=4, bucket_bytes=1 << 30) == (Bucket(0, (2, 1, 0), 0, 120),)
    assert plan_buckets([5], elem_size=2, bucket_bytes=1) == (Bucket(0, (0,), 0, 5),)


@pytest.mark.parametrize("kwargs, match", [
    ({"numels": [1], "elem_size": 4, "bucket_bytes": 0}, "bucket_bytes"),
    ({"numels": [1], "elem_size": 4, "bucket_bytes": -8}, "bucket_bytes"),
    ({"numels": [1], "elem_size": 4, "bucket_bytes": 1.5}, "bucket_bytes"),
    ({"numels": [1], "elem_size": 4, "bucket_bytes": True}, "bucket_bytes"),
    ({"numels": [], "elem_size": 4, "bucket_bytes": 8}, "at least one"),
    ({"numels": [1, -1], "elem_size": 4, "bucket_bytes": 8}, ">= 0"),
    ({"numels": [1], "elem_size": 0, "bucket_bytes": 8}, "elem_size"),
])
def test_bad_plans_raise(kwargs, match):
    numels = kwargs.pop("numels")
    with pytest.raises(ValueError, match=match):
        plan_buckets(numels, **kwargs)


def test_tracker_releases_buckets_in_order_whatever_order_the_hooks_fire():
    plan = plan_buckets([4, 8, 2, 6, 3], elem_size=4, bucket_bytes=32)  # buckets (4,3) (2,1) (0,)
    t = BucketTracker(plan)
    assert t.mark(1) == [] and t.mark(2) == []  # bucket 1 complete, but bucket 0 is not yet
    assert t.mark(0) == []
    assert t.unmarked() == [4, 3]
    assert t.mark(4) == [] and not t.done
    assert t.mark(3) == [0, 1, 2] and t.done
    assert t.unmarked() == []


def test_tracker_in_backward_order_releases_each_bucket_as_it_completes():
    t = BucketTracker(plan_buckets([4, 8, 2, 6, 3], elem_size=4, bucket_bytes=32))
    assert [t.mark(p) for p in (4, 3, 2, 1, 0)] == [[], [0], [], [1], [2]]


def test_tracker_refuses_unknown_and_twice_marked_parameters():
    t = BucketTracker(plan_buckets([4, 8], elem_size=4, bucket_bytes=4))
    with pytest.raises(ValueError, match="no bucket"):
        t.mark(2)
    t.mark(1)
    with pytest.raises(ValueError, match="twice"):
        t.mark(1)


@pytest.mark.parametrize("trains, healed, num_behind, kept, expected", [
    (True, False, 0, False, True),  # a plain training step
    (False, False, 0, False, False),  # not training this step
    (False, True, 0, False, False),  # healed this step: zeros, serial
    (True, False, 1, False, False),  # someone behind: the joiner paths stay serial
    (True, False, 0, True, False),  # a kept gradient is restored, not recomputed
])
def test_which_steps_overlap(trains, healed, num_behind, kept, expected):
    assert may_overlap(trains=trains, healed=healed, num_behind=num_behind, kept=kept) is expected
