"""The HTTP servers' pure decisions: admitting a connection at the cap, rate-limiting warnings, limits."""

from __future__ import annotations

import pytest

from ftrun.catchup.http_guard import HttpLimits, admit
from ftrun.net import WarnLimiter

ADMIT_CASES = [
    # (name, num_open, idle_lru, cap, admit, evict)
    ("room left", 3, ["a"], 4, True, None),
    ("empty server", 0, [], 1, True, None),
    ("at the cap: evict the least recently active idle one", 4, ["b", "a"], 4, True, "b"),
    ("at the cap, every connection busy: refuse", 4, [], 4, False, None),
    ("over the cap (evictions pending) still evicts", 5, ["c"], 4, True, "c"),
]


@pytest.mark.parametrize(("name", "num_open", "idle_lru", "cap", "ok", "evict"), ADMIT_CASES,
                         ids=[c[0] for c in ADMIT_CASES])
def test_admit(name, num_open, idle_lru, cap, ok, evict):
    decision = admit(num_open=num_open, idle_lru=idle_lru, cap=cap)
    assert (decision.admit, decision.evict) == (ok, evict)
    assert str(cap) in decision.reason


def test_warn_limiter_allows_one_line_per_window_and_counts_the_rest():
    limiter = WarnLimiter(10.0)
    assert limiter.allow(100.0) == 0
    assert [limiter.allow(t) for t in (101.0, 105.0, 109.9)] == [None, None, None]
    assert limiter.allow(110.0) == 3  # the next line says how many were suppressed
    assert limiter.allow(111.0) is None and limiter.allow(125.0) == 1


@pytest.mark.parametrize(("field", "value"), [
    ("idle_timeout_s", 0), ("idle_timeout_s", -1.0), ("max_connections", 0), ("max_headers", True),
    ("warn_every_s", float("nan")), ("max_line_size", 1.5),
])
def test_limits_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"HttpLimits.{field}"):
        HttpLimits(**{field: value})


def test_limits_map_onto_aiohttp_settings():
    kwargs = HttpLimits(idle_timeout_s=2, max_line_size=100, max_field_size=200, max_headers=7).handler_kwargs()
    assert kwargs == {"keepalive_timeout": 2.0, "max_line_size": 100, "max_field_size": 200, "max_headers": 7}
