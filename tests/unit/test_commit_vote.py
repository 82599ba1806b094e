import pytest

from ftrun.replica.vote import commit_outcome


@pytest.mark.parametrize("vote,failures,max_retries,commit,give_up,after", [
    (1, 0, 3, True, False, 0),
    (1, 2, 3, True, False, 0),
    (0, 0, 3, False, False, 1),
    (0, 2, 3, False, False, 3),
    (0, 3, 3, False, True, 4),
    (0, 0, 0, False, True, 1),
])
def test_commit_outcome(vote, failures, max_retries, commit, give_up, after):
    o = commit_outcome(vote, failures, max_retries)
    assert (o.commit, o.give_up, o.failures_in_a_row) == (commit, give_up, after)


def test_bad_vote_is_rejected():
    with pytest.raises(ValueError):
        commit_outcome(2, 0, 3)


def test_endpoints_round_trip_and_reject_bad_input():
    from ftrun.replica.endpoints import decode_endpoints, encode_endpoints

    eps = {"ftar": "127.0.0.1:4000", "catchup": "http://127.0.0.1:5000"}
    assert decode_endpoints(encode_endpoints(eps)) == eps
    assert decode_endpoints("") == {}
    with pytest.raises(ValueError):
        encode_endpoints({"Bad": "x"})
    with pytest.raises(ValueError):
        decode_endpoints("ftar")
