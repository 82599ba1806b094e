"""Checkpoints are verified before DCP unpickles anything (HMAC-signed manifests), and a stale or forked
writer cannot replace a complete checkpoint of another lineage."""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch

from ftrun.checkpoint import manifest as mf
from ftrun.checkpoint import store
from ftrun.data.loader_state import LoaderState
from ftrun.data.sampler import DataLayout

LAYOUT = DataLayout(dataset_size=64, num_replicas=2, ranks_per_replica=1, batch_size_per_rank=4)
KEY = mf.checkpoint_key("job-token")


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def ledger(step: int, *, solo: bool = False) -> LoaderState:
    """The ledger after `step` steps; `solo`: r0 trained alone (another lineage at the same step)."""
    s = LoaderState.initial(LAYOUT, ("r0", "r1"))
    for n in range(step):
        s = s.advance(step=n, contributors=("r0",) if solo else ("r0", "r1"))
    return s


def save(root, step, *, key=KEY, solo=False):
    model, opt = make(step)
    return store.save(root, step=step, model=model, optimizer=opt, loader_state=ledger(step, solo=solo), key=key)


class Payload:
    """A pickle that creates a file when loaded: what a crafted `.metadata` could do."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


# -- keys and MACs ---------------------------------------------------------------------------------
def test_the_key_is_derived_from_the_token_and_a_signed_manifest_round_trips():
    assert mf.checkpoint_key("job-token") == KEY != mf.checkpoint_key("other") and KEY != b"job-token"
    with pytest.raises(ValueError, match="non-empty"):
        mf.checkpoint_key("")
    m = mf.Manifest(1, (mf.FileEntry("loader_state.bin", 2, 3, "ab" * 32),), "loader_state.bin", "x")
    signed = mf.sign(m, KEY)
    assert mf.decode(mf.encode(signed)) == signed and mf.check_mac(signed, KEY) is None
    assert "does not verify" in mf.check_mac(signed, mf.checkpoint_key("other"))
    assert "unsigned" in mf.check_mac(m, KEY)
    with pytest.raises(ValueError, match="SHA-256"):
        mf.sign(mf.Manifest(1, (mf.FileEntry("loader_state.bin", 2, 3),), "loader_state.bin"), KEY)


def test_a_signed_manifest_checks_sha256_where_a_forged_crc32_would_pass():
    m = mf.Manifest(1, (mf.FileEntry("loader_state.bin", 2, 7, "ab" * 32),), "loader_state.bin")
    forged = {"loader_state.bin": (7, "cd" * 32)}  # same size and CRC32, other content
    assert mf.check_files(m, {"loader_state.bin": 2}.get, forged.get) == []
    assert mf.check_files(m, {"loader_state.bin": 2}.get, forged.get, sha256=True) == [
        "loader_state.bin: SHA-256 does not match the signed manifest"]


def test_a_signed_checkpoint_restores_with_the_key(tmp_path):
    info = save(tmp_path, 2)
    assert info.manifest.mac and all(f.sha256 for f in info.manifest.files)
    model, opt = make(9)
    step, state = store.restore(tmp_path, model, opt, key=KEY)
    assert (step, state) == (2, ledger(2))
    assert torch.equal(model.weight, make(2)[0].weight)


def test_a_crafted_metadata_is_refused_before_it_is_unpickled(tmp_path, caplog):
    save(tmp_path, 1)
    info = save(tmp_path, 2)
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(Payload(marker))
    (info.path / ".metadata").write_bytes(crafted)
    # the attacker fixes up size and CRC32 too; without the key it cannot fix the MAC
    doc = json.loads((info.path / mf.MANIFEST).read_bytes())
    for f in doc["files"]:
        if f["name"] == ".metadata":
            f["size"], f["crc32"] = len(crafted), mf.crc32_file(info.path / ".metadata")
    (info.path / mf.MANIFEST).write_text(json.dumps(doc))
    model, opt = make(9)
    with caplog.at_level(logging.WARNING, logger="ftrun.checkpoint"):
        assert store.restore(tmp_path, model, opt, key=KEY)[0] == 1  # falls back to the good one
    assert not marker.exists()
    assert "MAC does not verify" in caplog.text
    del doc["mac"]  # unsigned is not trusted either
    (info.path / mf.MANIFEST).write_text(json.dumps(doc))
    assert store.latest_complete(tmp_path, key=KEY).step == 1 and not marker.exists()
    # the threat is real: without a key the folder is trusted like code, and DCP runs the pickle
    with pytest.raises(store.CheckpointCorrupt):
        store.restore(tmp_path, model, opt)
    assert marker.exists()


def test_a_file_swapped_under_a_signed_manifest_is_refused(tmp_path):
    info = save(tmp_path, 2)
    distcp = next(info.path.glob("*.distcp"))
    distcp.write_bytes(bytes(distcp.stat().st_size))  # same size, other bytes
    manifest, problems = store.verify(info.path, key=KEY)
    assert any("SHA-256" in p or "CRC32" in p for p in problems)
    assert store.latest_complete(tmp_path, key=KEY) is None


def test_a_checkpoint_of_another_job_key_is_not_used(tmp_path):
    save(tmp_path, 2, key=mf.checkpoint_key("another job"))
    assert store.latest_complete(tmp_path, key=KEY) is None
    assert store.latest_complete(tmp_path).step == 2  # CRCs alone still match


# -- forks ---------------------------------------------------------------------------------------------
def test_a_writer_of_another_lineage_at_the_same_step_is_refused(tmp_path):
    save(tmp_path, 2)
    with pytest.raises(store.CheckpointFork, match="lineage"):
        save(tmp_path, 2, solo=True)
    assert store.latest_complete(tmp_path, key=KEY).manifest.lineage == ledger(2).lineage
    save(tmp_path, 2)  # the same state again is fine


def test_a_stale_writer_below_a_complete_newer_checkpoint_is_refused(tmp_path):
    save(tmp_path, 4)
    with pytest.raises(store.CheckpointFork, match=r"a newer step \(4\)"):
        save(tmp_path, 2)
    assert [s.step for s in store.scan(tmp_path, key=KEY)] == [4]


def test_torn_corrupt_or_untrusted_newer_checkpoints_do_not_block_the_writer(tmp_path):
    info = save(tmp_path, 6)
    (info.path / mf.MANIFEST).unlink()  # torn
    info = save(tmp_path, 5)
    next(info.path.glob("*.distcp")).write_bytes(b"rot")  # corrupt
    save(tmp_path, 4, key=None)  # unsigned: not trusted under the key
    assert save(tmp_path, 3).step == 3
    assert store.latest_complete(tmp_path, key=KEY).step == 3
