"""The loader_state ledger, its encoding, the two-slot store, and DataProgress."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from dataclasses import replace

import msgpack
import pytest

from ftrun.quorum.decide import Participant as P  # a participant: (replica_id, step)
from ftrun.storage import MemoryStorage
from ftrun.data.loader_state import (
    GENESIS, LoaderState, LoaderStateCorrupt, LoaderStateError, LoaderStateStore, contributors, decode, encode,
    next_lineage,
)
from ftrun.data.progress import DataProgress
from ftrun.data.sampler import DataLayout, Sampler
from ftrun.storage import FileStorage

LAYOUT = DataLayout(dataset_size=40, num_replicas=3, ranks_per_replica=2, batch_size_per_rank=2, seed=3)
IDS = ("r0", "r1", "r2")



def initial() -> LoaderState:
    return LoaderState.initial(LAYOUT, IDS)


# -- ledger ----------------------------------------------------------------------------------------
def test_contributors_are_the_participants_at_the_step():
    assert contributors([P("r2", 5), P("r0", 5), P("r1", 3)], 5) == ("r0", "r2")
    assert contributors([], 5) == ()


# (name, steps as contributor lists, expected committed_batches)
LEDGER_CASES = [
    ("nothing committed", [], (0, 0, 0)),
    ("everyone trains", [["r0", "r1", "r2"]] * 3, (3, 3, 3)),
    ("r1 behind for two steps", [IDS, ["r0", "r2"], ["r0", "r2"], IDS], (4, 2, 4)),
    ("a heal step trains nobody's batch from the healer", [["r0"], ["r0"], ["r0", "r1"]], (3, 1, 0)),
]


@pytest.mark.parametrize(("name", "steps", "expected"), LEDGER_CASES, ids=[c[0] for c in LEDGER_CASES])
def test_advance(name, steps, expected):
    s = initial()
    for n, who in enumerate(steps):
        s = s.advance(step=n, contributors=who)
    assert s.committed_batches == expected and s.step == len(steps)


def test_lineage_is_a_content_hash_chain():
    a = initial().advance(step=0, contributors=["r0", "r1"])
    b = initial().advance(step=0, contributors=["r1", "r0"])
    c = initial().advance(step=0, contributors=["r0"])
    assert a.lineage == b.lineage == next_lineage(GENESIS, 0, [("r0", 0), ("r1", 0)])
    assert a.lineage != c.lineage
    assert a.advance(step=1, contributors=["r0"]).lineage != c.advance(step=1, contributors=["r0"]).lineage


@pytest.mark.parametrize(("call", "message"), [
    (lambda s: s.advance(step=1, contributors=["r0"]), "cannot commit step 1 on a loader_state at step 0"),
    (lambda s: s.advance(step=0, contributors=["zz"]), "replica 'zz' is not one of"),
    (lambda s: s.position("zz"), "replica 'zz' is not one of"),
    (lambda s: s.check_layout(replace(LAYOUT, seed=4)), "loader_state was written for"),
    (lambda s: LoaderState(LAYOUT, ("a", "b"), (0, 0)), "2 replica ids for a layout of 3 replicas"),
    (lambda s: LoaderState(LAYOUT, ("a", "a", "b"), (0, 0, 0)), "replica ids must be distinct"),
    (lambda s: LoaderState(LAYOUT, IDS, (0, -1, 0)), "bad committed_batches"),
])
def test_misuse_raises_loader_state_error(call, message):
    with pytest.raises(LoaderStateError, match=message):
        call(initial())


def test_rank_positions_hold_every_rank():
    s = initial().advance(step=0, contributors=IDS).advance(step=1, contributors=["r1"])
    ranks = s.rank_positions()
    assert [p.committed_batches for p in ranks["r1"]] == [2, 2]
    assert ranks["r1"][1] == Sampler(LAYOUT).rank_position(1, 1, 2)


# -- encoding --------------------------------------------------------------------------------------
def ledger_at(steps: int) -> LoaderState:
    s = initial()
    for n in range(steps):
        s = s.advance(step=n, contributors=IDS[: 1 + n % 3])
    return s


def test_encode_decode_round_trip():
    s = ledger_at(7)
    assert decode(encode(s)) == s


def test_dict_form_round_trips_through_json():
    s = ledger_at(5)
    assert LoaderState.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    with pytest.raises(LoaderStateError, match="malformed loader_state dict"):
        LoaderState.from_dict({"step": 1})


@pytest.mark.parametrize(("mangle", "problem"), [
    (lambda b: b[:-3], "truncated: body has"),
    (lambda b: b[:10], "truncated: 10 bytes, shorter than the header"),
    (lambda b: b[:30] + bytes([b[30] ^ 0x40]) + b[31:], "CRC32 mismatch"),
    (lambda b: b"XXXX" + b[4:], "not a loader_state v1 record"),
    (lambda b: b"", "truncated: 0 bytes"),
])
def test_decode_names_the_key_and_the_problem(mangle, problem):
    with pytest.raises(LoaderStateCorrupt, match=f"'ls/slot-1' is corrupt: {problem}") as e:
        decode(mangle(encode(ledger_at(3))), key="ls/slot-1")
    assert e.value.key == "ls/slot-1"


def test_decode_rejects_rank_positions_that_do_not_fit_the_layout():
    header = struct.Struct(">4sBIQ")
    good = encode(ledger_at(2))
    body = msgpack.unpackb(good[header.size:], raw=False)
    body["replicas"][0]["committed_batches"][1] += 1  # rank 1 of r0 claims one more batch than rank 0
    raw = msgpack.packb(body)
    bad = header.pack(b"FTLS", 1, zlib.crc32(raw), len(raw)) + raw
    with pytest.raises(LoaderStateCorrupt, match="rank positions of r0"):
        decode(bad)


# -- store -----------------------------------------------------------------------------------------
def test_store_alternates_slots_and_loads_the_newest():
    storage = MemoryStorage()
    store = LoaderStateStore(storage=storage, prefix="ls")
    assert store.load() is None
    assert [store.save(ledger_at(n)) for n in (1, 2, 3)] == ["ls/slot-1", "ls/slot-0", "ls/slot-1"]
    assert store.load() == ledger_at(3)


def test_store_falls_back_to_the_previous_step_when_the_newest_is_torn(caplog):
    storage = MemoryStorage()
    store = LoaderStateStore(storage=storage, prefix="ls")
    store.save(ledger_at(4))
    store.save(ledger_at(5))
    storage.blobs["ls/slot-1"] = storage.blobs["ls/slot-1"][:-7]
    with caplog.at_level(logging.WARNING, logger="ftrun.data"):
        assert store.load() == ledger_at(4)
    assert "'ls/slot-1' is corrupt: truncated" in caplog.text
    assert store.problems and "ls/slot-1" in store.problems[0]


def test_store_raises_when_every_slot_is_bad():
    storage = MemoryStorage()
    store = LoaderStateStore(storage=storage, prefix="ls")
    store.save(ledger_at(1))
    storage.blobs["ls/slot-1"] = b"garbage"
    with pytest.raises(LoaderStateCorrupt, match="ls/slot-1"):
        store.load()


def test_store_works_on_file_storage(tmp_path):
    store = LoaderStateStore(storage=FileStorage(tmp_path))
    store.save(ledger_at(2))
    assert LoaderStateStore(storage=FileStorage(tmp_path)).load() == ledger_at(2)
    assert (tmp_path / "loader_state" / "slot-0").exists()


# -- DataProgress ----------------------------------------------------------------------------------
def test_progress_trains_retries_and_commits():
    prog = DataProgress(replica_id="r1", state=initial())
    quorum = [P("r0", 0), P("r1", 0)]
    first = prog.start(step=0, participants=quorum)
    assert (first.replica, first.step, first.parent, first.position) == ("r1", 0, GENESIS, 0)
    assert list(prog.samples(1)) == list(Sampler(LAYOUT).batch(1, 1, 0))
    prog.abort()
    assert prog.start(step=0, participants=quorum) == first  # the retry reads the same batch
    commit = prog.commit(writer="r1")
    assert (commit.step, commit.contributors, commit.positions) == (0, ("r0", "r1"), (0, 0))
    assert commit.lineage == prog.state.lineage and prog.position == 1


def test_progress_behind_trains_nothing_then_resumes_from_the_healed_ledger():
    peer = initial().advance(step=0, contributors=["r0"]).advance(step=1, contributors=["r0"])
    prog = DataProgress(replica_id="r1", state=initial())
    with pytest.raises(LoaderStateError, match="heal"):
        prog.start(step=2, participants=[P("r0", 2), P("r1", 0)])
    prog.heal(peer)
    assert prog.start(step=2, participants=[P("r0", 2), P("r1", 0)]) is None
    with pytest.raises(LoaderStateError, match="no started step"):
        prog.samples(0)
    commit = prog.commit(writer="r1")
    assert commit.contributors == ("r0",) and prog.state.committed_batches == (3, 0, 0)
    attempt = prog.start(step=3, participants=[P("r0", 3), P("r1", 3)])
    assert attempt.position == 0  # r1 lost no batch while it was away


def test_progress_heal_rejects_a_foreign_or_older_ledger():
    prog = DataProgress(replica_id="r0", state=ledger_at(3))
    with pytest.raises(LoaderStateError, match="step 1"):
        prog.heal(ledger_at(1))
    with pytest.raises(LoaderStateError, match="replicas"):
        prog.heal(LoaderState.initial(LAYOUT, ("a", "b", "c")))
    with pytest.raises(LoaderStateError, match="not one of"):
        DataProgress(replica_id="zz", state=ledger_at(0))
