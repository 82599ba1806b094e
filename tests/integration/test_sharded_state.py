"""ReplicaState and FlatGrads over FSDP2 local shards: two ranks of one replica as two gloo processes.

Each rank (sharded_state_worker.py) checks its side and reports; the test compares the ranks: the
gradient buffer is exactly the rank's local gradient shards, a state snapshot (what catch-up ships) is
local tensors only and restores bitwise, a symmetric failure inside backward is recovered in place by
resetting FSDP2's iteration state, and two sharded steps equal two plain steps on both ranks' batches.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.rank_procs import run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_state_worker.py")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    done = run_ranks(lambda r, port: [WORKER, str(r), str(port)], 2, timeout_s=50)
    assert [code for code, _, _ in done] == [0, 0], "\n".join(err[-2000:] for _, _, err in done)
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in done]


def test_each_rank_holds_its_own_shards(ranks):
    assert all(r["dtensor"] for r in ranks)
    assert ranks[0]["local_shapes"]["head.weight"] == [2, 6] and ranks[1]["local_shapes"]["head.weight"] == [1, 6]
    assert ranks[0]["local_shapes"]["embed.weight"] == [6, 6] and ranks[1]["local_shapes"]["embed.weight"] == [5, 6]
    total = sum(r["buffer_numel"] for r in ranks)
    assert total == 11 * 6 + 2 * (6 * 6 + 6) + 3 * 6 + 3  # the whole model, split between the ranks


def test_gradient_buffer_is_the_local_gradient_shards(ranks):
    for r in ranks:
        assert r["gather_matches"] and r["scatter_allocates_dtensor"] and r["scatter_matches"]


def test_sharded_steps_match_plain_training(ranks):
    assert all(r["matches_plain"] for r in ranks)
    assert ranks[0]["after_2"] != ranks[1]["after_2"]  # different shards


def test_snapshot_is_local_tensors_and_restores_bitwise(ranks):
    for r in ranks:
        assert r["snapshot_is_local"] and r["restored"] and r["optim_state_dtensor"] and r["bad_refused"]
        assert any(k.startswith("optim.") and k.endswith(".exp_avg") for k in r["snapshot_keys"])
    assert ranks[0]["snapshot_keys"] == ranks[1]["snapshot_keys"]


def test_failed_backward_is_recovered_in_place(ranks):
    for r in ranks:
        assert r["failure_raised"] and r["grads_cleared"]
        assert r["after_4_again"] == r["after_4"], "the retry after a reset trains the same parameters"
