"""Table tests of the relative slow-link test (ftrun.diagnose.link): a link is slow at >= factor x the
median of comparable transfers (same op key, same size class), with no absolute threshold."""

from __future__ import annotations

import numpy as np
import pytest

from ftrun.diagnose.link import class_medians, row_median, size_class, slow_links


def _job(n=12, k=6, busy=1e-3, nbytes=1 << 20, seed=0):
    rng = np.random.default_rng(seed)
    key = np.broadcast_to(np.arange(k, dtype=np.int64)[None, :], (n, k)).copy()
    sent = np.full((n, k), float(nbytes))
    b = busy * rng.uniform(0.9, 1.1, (n, k))
    return key, sent, b, np.ones((n, k), bool)


# (scale of every transfer, slow rank's multiple, slow?) : the same verdict at microseconds and seconds
CASES = [
    (40e-6, 4.0, True),
    (4.0, 4.0, True),
    (40e-6, 3.4, True),
    (4.0, 2.5, False),
    (40e-6, 1.0, False),
]


@pytest.mark.parametrize("scale,mult,expected", CASES)
def test_a_link_is_slow_relative_to_comparable_links_at_any_scale(scale, mult, expected):
    key, sent, busy, use = _job(busy=scale)
    busy[5] *= mult
    slow, ratio, extra = slow_links(key, sent, busy, use, factor=3.0, min_ops=4)
    assert bool(slow[5]) is expected and not slow[np.arange(12) != 5].any()
    if expected:  # the ratio and the extra wire time are given for slow links only
        assert ratio[5] == pytest.approx(mult, rel=0.15)
    assert np.isnan(ratio[~slow]).all()
    assert bool(extra[5] > 0) is expected and (extra[np.arange(12) != 5] == 0).all()


def test_transfers_of_another_size_class_are_not_compared():
    key, sent, busy, use = _job()
    sent[:4] = 64 << 20  # four ranks carry 64x the bytes and take 64x as long: their own class, not slow
    busy[:4] *= 64
    slow, _, _ = slow_links(key, sent, busy, use, factor=3.0, min_ops=4)
    assert not slow.any()
    med = class_medians(key, sent, busy, use, min_peers=3)
    assert np.allclose(med[:4] / busy[:4], 1.0, atol=0.15) and np.allclose(med[4:] / busy[4:], 1.0, atol=0.15)


def test_transfers_of_another_op_are_not_compared():
    key, sent, busy, use = _job()
    key[:6] += 100  # half the ranks' history is another all-reduce, 5x as long on the wire
    busy[:6] *= 5
    slow, _, _ = slow_links(key, sent, busy, use, factor=3.0, min_ops=4)
    assert not slow.any()


@pytest.mark.parametrize("noisy,expected", [(1, False), (3, False), (4, True)])
def test_a_link_is_slow_in_most_of_its_transfers_not_in_one(noisy, expected):
    key, sent, busy, use = _job()
    busy[3, :noisy] *= 50  # `noisy` transfers out of six
    slow, _, _ = slow_links(key, sent, busy, use, factor=3.0, min_ops=4)
    assert slow.tolist() == [expected if r == 3 else False for r in range(12)]


def test_too_few_comparable_transfers_or_ops_give_no_verdict():
    key, sent, busy, use = _job(n=2)
    busy[0] *= 10
    slow, _, _ = slow_links(key, sent, busy, use, factor=3.0, min_ops=4)  # a class of two: not compared
    assert not slow.any() and np.isnan(class_medians(key, sent, busy, use, min_peers=3)).all()
    key, sent, busy, use = _job()
    busy[5] *= 10
    use[5, 3:] = False  # three all-reduces < min_ops
    slow, ratio, _ = slow_links(key, sent, busy, use, factor=3.0, min_ops=4)
    assert not slow.any() and np.isnan(ratio[5])
    use[5, 3] = True  # four: slow
    assert slow_links(key, sent, busy, use, factor=3.0, min_ops=4)[0][5]


def test_unused_cells_are_ignored():
    key, sent, busy, use = _job()
    busy[:, 0] = 99.0
    use[:, 0] = False
    med = class_medians(key, sent, busy, use, min_peers=3)
    assert np.isnan(med[:, 0]).all() and np.nanmax(med) < 2e-3


@pytest.mark.parametrize("kwargs", [dict(factor=1.0, min_ops=4), dict(factor=3.0, min_ops=0),
                                    dict(factor=3.0, min_ops=4, min_peers=2)])
def test_bad_parameters_raise(kwargs):
    key, sent, busy, use = _job()
    with pytest.raises(ValueError, match="slow_links"):
        slow_links(key, sent, busy, use, **kwargs)


def test_mismatched_shapes_raise():
    key, sent, busy, use = _job()
    with pytest.raises(ValueError, match="one 2-d shape"):
        class_medians(key, sent[:, :3], busy, use, min_peers=3)


def test_size_class_and_row_median():
    assert size_class(np.array([0.0, 1.0, 2.0, 3.0, 1024.0, 2047.0])).tolist() == [0, 0, 1, 1, 10, 10]
    a = np.array([[1.0, 5.0, 3.0, 100.0], [2.0, 4.0, 0.0, 0.0]])
    valid = np.array([[True, True, True, False], [True, True, False, False]])
    assert row_median(a, valid).tolist() == [3.0, 3.0]
    assert np.isnan(row_median(a, np.zeros_like(valid))).all()
