"""Table tests of the eviction decision, false-positive cases included."""

from __future__ import annotations

import pytest

from ftrun.diagnose.act import EvictionConfig, decide_eviction, same_culprits, sight
from ftrun.diagnose.analysis import CANDIDATES, HANG, NO_HANG, SLOW_HOST, SLOW_LINK, SLOW_RANK, Verdict

CFG = EvictionConfig(confirm_s=1.0, wait_limit_s=10.0, max_fraction=0.5)
HUNG = Verdict(HANG, "rank 3 of replica 2 did not answer", ranks=(19,), hosts=(2,), replicas=(2,))
HOST = Verdict(HANG, "8 ranks on host5 did not answer", ranks=tuple(range(40, 48)), hosts=(5,), replicas=(1,))
CUT = Verdict(HANG, "building cut", ranks=(1, 9, 17, 25, 33, 41, 49), hosts=(0, 1), replicas=(0, 1, 2, 3, 4, 5, 6))

# (name, now, verdict, first_seen, live replicas, evicted replicas, reason fragment, retry_at)
CASES = [
    ("no hang", 50.0, Verdict(NO_HANG, "no hang"), None, 12, (), "no hang", None),
    ("first sight of a hang waits for confirmation", 50.0, HUNG, None, 12, (), "confirming until 51", 51.0),
    ("a hang younger than confirm_s waits", 50.5, HUNG, 50.0, 12, (), "confirming until 51", 51.0),
    ("a confirmed hang evicts its replica at once", 51.0, HUNG, 50.0, 12, (2,), "confirmed hang for 1.00s", None),
    ("a confirmed hung host evicts its replica", 53.0, HOST, 50.0, 12, (1,), "confirmed hang", None),
    ("a verdict naming most replicas is a partition", 60.0, CUT, 50.0, 12, (), "names 7 of 12 live replicas", None),
    ("candidates are never evicted", 60.0, Verdict(CANDIDATES, "sent, not received", ranks=(3, 11), replicas=(0, 1)),
     50.0, 12, (), "cannot tell sender from receiver", None),
    ("a slow host under the wait limit is never evicted", 60.0,
     Verdict(SLOW_HOST, "slow host", ranks=(8,), hosts=(1,), replicas=(0,), lag_s=9.9), 10.0, 12, (),
     "slow but alive, lag 9.90s under the wait limit", None),
    ("a slow rank under the wait limit is never evicted", 60.0,
     Verdict(SLOW_RANK, "slow rank", ranks=(8,), replicas=(0,), lag_s=0.4), 10.0, 12, (), "never evicted", None),
    ("a slow link is never evicted", 60.0, Verdict(SLOW_LINK, "link", ranks=(8, 16), replicas=(0, 1), lag_s=0.3),
     10.0, 12, (), "never evicted", None),
    ("a rank slower than the wait limit is evicted", 60.0,
     Verdict(SLOW_RANK, "slow rank", ranks=(8,), replicas=(0,), lag_s=12.0), 10.0, 12, (0,),
     "beyond the wait limit", None),
]


@pytest.mark.parametrize("name,now,verdict,first_seen,live,evicted,fragment,retry_at", CASES, ids=[c[0] for c in CASES])
def test_decide_eviction(name, now, verdict, first_seen, live, evicted, fragment, retry_at):
    e = decide_eviction(now, verdict, first_seen, live, CFG)
    assert e.replicas == evicted and fragment in e.reason, e
    assert e.retry_at == retry_at


def test_same_culprits_compares_kind_and_ranks_only():
    assert same_culprits(HUNG, Verdict(HANG, "other words", ranks=(19,), replicas=(2,)))
    assert not same_culprits(HUNG, Verdict(CANDIDATES, "x", ranks=(19,)))
    assert not same_culprits(HUNG, None)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="num_live_replicas"):
        decide_eviction(0.0, HUNG, None, 0, CFG)
    with pytest.raises(ValueError, match="max_fraction"):
        EvictionConfig(max_fraction=1.0)


R1 = Verdict(HANG, "r1/1 silent", ranks=(3,), replicas=(1,))
R1_BESIDE = Verdict(HANG, "r1/0 never joined, r1/1 silent", ranks=(2, 3), replicas=(1,))
R1_R2 = Verdict(HANG, "r1/1 silent, r2/0 never joined", ranks=(3, 4), replicas=(1, 2))


@pytest.mark.parametrize("name,prev,cur,carried", [
    ("first sight", None, (R1, (3,)), False),
    ("the same culprits and silent ranks: confirmation goes on", (R1, (3,)), (R1, (3,)), True),
    ("a rank of the same replica joins the culprits: the same hang", (R1, (3,)), (R1_BESIDE, (3,)), True),
    ("another replica named too: another culprit set", (R1, (3,)), (R1_R2, (3,)), False),
    ("the transient second replica leaves: starts again", (R1_R2, (3,)), (R1, (3,)), False),
    ("the silent rank answers again: starts again", (R1, (3,)), (R1, ()), False),
    ("another rank went silent: starts again", (R1_BESIDE, (3,)), (R1_BESIDE, (2, 3)), False),
    ("another kind", (R1, (3,)), (Verdict(CANDIDATES, "pair", ranks=(3,), replicas=(1,)), (3,)), False),
])
def test_confirmation_only_carries_over_an_unchanged_culprit_set(name, prev, cur, carried):
    before = None if prev is None else sight(None, prev[0], prev[1], 10.0)
    now = sight(before, cur[0], cur[1], 10.4)
    assert now.first_seen == (10.0 if carried else 10.4) and now.silent == cur[1]


def test_a_culprit_set_that_changed_between_two_pulls_never_evicts():
    """Pull after pull the verdict alternates; however long it lasts, no pull confirms it."""
    s = None
    for i, (v, silent) in enumerate([(R1_R2, (3,)), (R1, (3,))] * 5):
        s = sight(s, v, silent, 10.0 + 0.4 * i)
        e = decide_eviction(10.0 + 0.4 * i, v, s.first_seen, 3, EvictionConfig(confirm_s=0.25), silent=silent,
                            replica_of=[0, 0, 1, 1, 2, 2])
        assert e.replicas == (), e
    s2 = sight(s, R1, (3,), 14.4)  # the same culprits on a second pull: now it is confirmed
    assert decide_eviction(14.4, R1, s2.first_seen, 3, EvictionConfig(confirm_s=0.25), silent=(3,),
                           replica_of=[0, 0, 1, 1, 2, 2]).replicas == (1,)
