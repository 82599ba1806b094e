import pytest

from ftrun.replica.vote import FailureCounts, Vote, commit_outcome

OK, PEER, OWN = Vote.OK, Vote.PEER_FAILURE, Vote.OWN_FAILURE


# vote, counts before (own, peer), max_retries, contributors, min_replicas -> commit, give_up, counts after, own
@pytest.mark.parametrize("vote,before,max_retries,contributors,min_replicas,commit,give_up,after,own", [
    (OK, (0, 0), 3, 1, 1, True, False, (0, 0), False),
    (OK, (2, 7), 3, 2, 2, True, False, (0, 0), False),
    (OWN, (0, 0), 3, 1, 1, False, False, (1, 0), True),
    (OWN, (2, 5), 3, 1, 1, False, False, (3, 5), True),
    (OWN, (3, 0), 3, 1, 1, False, True, (4, 0), True),
    (OWN, (0, 0), 0, 1, 1, False, True, (1, 0), True),
    # a peer's absence spends the peer budget (4 here), never the own one
    (PEER, (3, 0), 3, 1, 1, False, False, (3, 1), False),
    (PEER, (0, 3), 3, 1, 1, False, False, (0, 4), False),
    (PEER, (0, 4), 3, 1, 1, False, True, (0, 5), False),
    # a healthy replica and a joiner: one contribution does not commit when min_replicas is 2
    (OK, (0, 0), 3, 1, 2, False, False, (0, 1), False),
])
def test_commit_outcome(vote, before, max_retries, contributors, min_replicas, commit, give_up, after, own):
    o = commit_outcome(vote, FailureCounts(*before), max_retries=max_retries, max_peer_retries=4,
                       num_contributors=contributors, min_replicas=min_replicas)
    assert (o.commit, o.give_up, o.counts, o.failed_own) == (commit, give_up, FailureCounts(*after), own)
    assert o.reason


def test_bad_vote_is_rejected():
    with pytest.raises(ValueError, match="commit vote"):
        commit_outcome(3, FailureCounts(), max_retries=3, max_peer_retries=3)


def test_endpoints_round_trip_and_reject_bad_input():
    from ftrun.replica.endpoints import decode_endpoints, encode_endpoints

    eps = {"ftar": "127.0.0.1:4000", "catchup": "http://127.0.0.1:5000"}
    assert decode_endpoints(encode_endpoints(eps)) == eps
    assert decode_endpoints("") == {}
    with pytest.raises(ValueError):
        encode_endpoints({"Bad": "x"})
    with pytest.raises(ValueError):
        decode_endpoints("ftar")
