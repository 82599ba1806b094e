"""The Storage seam's contract (ftrun.storage), run against every implementation: files, the in-memory
store, and the emulator's mock object store (on the real clock, zero latency here)."""

from __future__ import annotations

import pytest

from ftrun.data.audit import AuditLog, Commit, read_log
from ftrun.data.loader_state import LoaderState, LoaderStateStore
from ftrun.data.sampler import DataLayout
from ftrun.env.real import RealEnv
from ftrun.storage import FileStorage, MemoryStorage, StorageAuditSink
from mocks.storage import MockObjectStore

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(params=["file", "memory", "mock_object_store"])
def storage(request, tmp_path):
    if request.param == "file":
        return FileStorage(tmp_path / "store")
    if request.param == "memory":
        return MemoryStorage()
    return MockObjectStore(env=RealEnv(), write_latency_s=0.0, read_latency_s=0.0, bandwidth_bytes_per_s=1e12)


def test_a_missing_key_reads_none(storage):
    assert storage.read("nothing/here") is None


def test_a_write_replaces_the_whole_blob(storage):
    storage.write_atomic("a/b", b"first version, long")
    storage.write_atomic("a/b", b"second")
    assert storage.read("a/b") == b"second"


def test_keys_outside_the_store_are_refused(storage):
    for key in ("", "/abs", "../up", "a/../../b"):
        with pytest.raises(ValueError, match="storage key"):
            storage.write_atomic(key, b"x")
        with pytest.raises(ValueError, match="storage key"):
            storage.read(key)


def test_loader_state_round_trips_through_the_store(storage):
    layout = DataLayout(dataset_size=64, num_replicas=2, ranks_per_replica=1, batch_size_per_rank=4, seed=1)
    state = LoaderState.initial(layout, ("r0", "r1")).advance(step=0, contributors=("r0", "r1"))
    store = LoaderStateStore(storage=storage)
    store.save(state)
    assert store.load() == state


def test_the_audit_log_appends_records_to_the_store(storage):
    sink = StorageAuditSink(storage, "audit/r0-0.jsonl")
    log = AuditLog(sink)
    records = [Commit(writer="r0", step=s, parent=f"l{s}", lineage=f"l{s + 1}", contributors=("r0",), positions=(s,))
               for s in range(3)]
    for r in records:
        log.append(r)
    got, problems = read_log(storage.read("audit/r0-0.jsonl"))
    assert problems == [] and got == records
