"""Persistent checkpoints of a sharded (FSDP2) replica, and DCP resharding on restore.

A 2-rank replica (sharded_ckpt_worker.py, real gloo processes) checkpoints step 2: each rank writes its
own shards, the leader commits one signed manifest over every rank's files. Its checkpoint of step 3
then fails on one rank, once by an error (every rank raises, nothing is committed) and once by that
rank being SIGKILLed after its DCP write, before the vote (the leader's vote fails; no manifest). Both
leave step 2 the latest complete checkpoint, and it restores into replicas of 1 (plain model) and 4
ranks with the full parameters, Adam moments, user state and ledger bit for bit. An asynchronous
checkpoint (staged at step 2, written by a background task on a gloo group of its own while both ranks
train on, FSDP and control collectives included) is complete and restores the state of step 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ftrun.checkpoint import manifest as mf
from ftrun.checkpoint import store
from tests.integration.rank_procs import run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_ckpt_worker.py")
KEY = mf.checkpoint_key("job-token")

pytestmark = pytest.mark.timeout(120)


def run(mode: str, world: int, root: Path, fault: str = "none") -> list[tuple[int, dict]]:
    """(exit code, findings) of each rank."""
    found = []
    for code, out, err in run_ranks(lambda r, port: [WORKER, mode, str(r), str(world), str(port), str(root), fault],
                                    world, timeout_s=90):
        lines = out.strip().splitlines()
        assert lines or code == -9, err[-2000:]
        found.append((code, json.loads(lines[-1]) if lines else {}))
    return found


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    roots = {f: tmp_path_factory.mktemp(f"ckpt-{f}") for f in ("error", "die")}
    return {f: (roots[f], run("save", 2, roots[f], f)) for f in roots}


def test_every_rank_writes_its_shards_under_one_signed_manifest(saved):
    root, ranks = saved["die"]
    assert ranks[0][0] == 0 and ranks[1][0] == -9
    assert ranks[0][1]["info"], "the leader returns the committed checkpoint"
    manifest, problems = store.verify(root / "step-00000002", key=KEY)
    assert not problems
    assert {f.name for f in manifest.files} == {"__0_0.distcp", "__1_0.distcp", ".metadata", "loader_state.bin"}
    assert all(f.sha256 for f in manifest.files) and mf.check_mac(manifest, KEY) is None


@pytest.mark.parametrize("fault", ["error", "die"])
def test_a_rank_failing_mid_write_leaves_the_previous_checkpoint_latest(saved, fault):
    root, ranks = saved[fault]
    torn = root / "step-00000003"
    assert torn.is_dir() and not (torn / mf.MANIFEST).exists()
    assert (torn / "__0_0.distcp").exists(), "rank 0 wrote its shard; the manifest was still not committed"
    if fault == "error":  # every rank raises alike, the failing rank's error named
        assert [(code, r["second"]) for code, r in ranks] == [(0, "CheckpointError"), (0, "CheckpointError")]
    else:  # the leader's vote sees the dead rank at once
        assert ranks[0][1]["second"] == "ReplicaCommError"
    assert store.latest_complete(root, key=KEY).step == 2


@pytest.mark.parametrize("world", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_restores_into_another_number_of_ranks(saved, world):
    root, ranks = saved["die"]
    before = ranks[0][1]
    loaded = run("load", world, root)
    for code, r in loaded:
        assert code == 0
        assert (r["step"], r["ledger_step"], r["counter"]) == (2, 2, 2)
        assert (r["params"], r["moments"]) == (before["params"], before["moments"]), "resharded bit for bit"
        assert r["dtensor"] == (world > 1) and r["stepped"]


def test_an_async_checkpoint_written_while_the_replica_trains_on_restores_its_step(tmp_path):
    ranks = run("async", 2, tmp_path)
    assert [(code, r["joined"], r["error"]) for code, r in ranks] == [(0, True, None), (0, True, None)]
    assert store.latest_complete(tmp_path, key=KEY).step == 2
    for code, r in run("load", 1, tmp_path):
        assert code == 0 and (r["step"], r["ledger_step"], r["counter"]) == (2, 2, 2)
        assert (r["params"], r["moments"]) == (ranks[0][1]["params"], ranks[0][1]["moments"]), "the state of step 2"
