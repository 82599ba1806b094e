"""The hostile inputs the safety review found, one by one: each decoder gives its documented error and a
reader falls back (the fuzz suite, test_decoders_fuzz.py, covers the space around them)."""

from __future__ import annotations

import json
import logging
import struct
import zlib

import msgpack
import pytest

from ftrun.catchup.errors import CatchupPeerError
from ftrun.catchup.http_guard import path_int
from ftrun.catchup.manifest import decode_manifest
from ftrun.catchup.wire import parse_head
from ftrun.checkpoint import manifest as mf
from ftrun.data.audit import AuditLogError, decode_record
from ftrun.data.loader_state import LoaderState, LoaderStateCorrupt, decode, encode
from ftrun.data.sampler import DataLayout

LAYOUT = DataLayout(dataset_size=40, num_replicas=2, ranks_per_replica=2, batch_size_per_rank=2, seed=3)
DEEP = "[" * 100_000 + "]" * 100_000


def _manifest_doc(**changes) -> dict:
    doc = {"format": mf.FORMAT, "step": 2, "lineage": "abc", "loader_state": "loader_state.bin",
           "files": [{"name": "loader_state.bin", "size": 2, "crc32": zlib.crc32(b"xy")}]}
    doc.update(changes)
    return doc


HOSTILE_MANIFESTS = {
    "step 1e400": json.dumps(_manifest_doc()).replace('"step": 2', '"step": 1e400').encode(),
    "NUL in a name": json.dumps(_manifest_doc(files=[{"name": "a\0b", "size": 1, "crc32": 0},
                                                     {"name": "loader_state.bin", "size": 2, "crc32": 0}])).encode(),
    "300-character name": json.dumps(_manifest_doc(files=[{"name": "x" * 300, "size": 1, "crc32": 0},
                                                          {"name": "loader_state.bin", "size": 2,
                                                           "crc32": 0}])).encode(),
    "100,000-deep nesting": DEEP.encode(),
    "a name that is a folder": json.dumps(_manifest_doc(files=[{"name": "sub", "size": 4096, "crc32": 0},
                                                               {"name": "loader_state.bin", "size": 2,
                                                                "crc32": zlib.crc32(b"xy")}])).encode(),
    "not an object": b"[1, 2]",
    "a string size": json.dumps(_manifest_doc(files=[{"name": "loader_state.bin", "size": "2", "crc32": 0}])).encode(),
}


@pytest.mark.parametrize("name", list(HOSTILE_MANIFESTS))
def test_latest_complete_skips_a_hostile_newest_manifest_to_the_older_checkpoint(tmp_path, caplog, name):
    from ftrun.checkpoint import store

    for step, data in ((1, json.dumps(_manifest_doc(step=1)).encode()), (2, HOSTILE_MANIFESTS[name])):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        (folder / "loader_state.bin").write_bytes(b"xy")
        (folder / "sub").mkdir()
        (folder / mf.MANIFEST).write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="ftrun.checkpoint"):
        info = store.latest_complete(tmp_path)
    assert info is not None and info.step == 1
    assert "step-00000002 skipped" in caplog.text


@pytest.mark.parametrize("name", [n for n in HOSTILE_MANIFESTS if n != "a name that is a folder"])
def test_checkpoint_manifest_decode_raises_manifest_error(name):
    with pytest.raises(mf.ManifestError):
        mf.decode(HOSTILE_MANIFESTS[name])


def test_a_deeply_nested_catchup_manifest_is_a_peer_error_not_a_recursion_error():
    with pytest.raises(CatchupPeerError, match="nested too deeply"):
        decode_manifest(DEEP.encode(), step=1)


def _with_crc(raw: dict) -> bytes:
    body = msgpack.packb(raw)
    return struct.pack(">4sBIQ", b"FTLS", 1, zlib.crc32(body), len(body)) + body


def test_a_loader_state_with_a_valid_crc_and_2_to_the_62_batches_is_corrupt_not_an_overflow():
    raw = msgpack.unpackb(encode(LoaderState.initial(LAYOUT, ("r0", "r1")))[17:])
    for r in raw["replicas"]:
        r["committed_batches"] = [2**62] * 2
    with pytest.raises(LoaderStateCorrupt, match="malformed body"):
        decode(_with_crc(raw))


def test_a_loader_state_claiming_a_trillion_ranks_is_corrupt_without_allocating_them():
    raw = msgpack.unpackb(encode(LoaderState.initial(LAYOUT, ("r0", "r1")))[17:])
    raw["layout"]["ranks_per_replica"] = 10**12
    with pytest.raises(LoaderStateCorrupt, match="rank positions"):
        decode(_with_crc(raw))


@pytest.mark.parametrize("change", [{"committed_batches": [1e400, 0]}, {"step": "3"}, {"replica_ids": [[], "r1"]},
                                    {"layout": [1]}, {"committed_batches": [2**62, 0]}])
def test_a_snapshot_s_loader_state_metadata_of_the_wrong_shape_is_a_loader_state_error(change):
    from ftrun.data.loader_state import LoaderStateError

    raw = {**LoaderState.initial(LAYOUT, ("r0", "r1")).to_dict(), **change}
    with pytest.raises(LoaderStateError):
        LoaderState.from_dict(json.loads(json.dumps(raw)))


@pytest.mark.parametrize("line", [
    b'{"kind":"attempt","replica":"r0","step":"1","parent":"g","position":0,"batch_id":0}',
    b'{"kind":"attempt","replica":"r0","step":1e400,"parent":"g","position":0,"batch_id":0}',
    b'{"kind":"commit","writer":"r0","step":1,"parent":"g","lineage":"x","contributors":["a"],"positions":[]}',
    b'{"kind":"commit","writer":"r0","step":1,"parent":"g","lineage":"x","contributors":[[]],"positions":[0]}',
    b'{"kind":["attempt"]}',
    DEEP.encode(),
    b"\xff\xfe",
])
def test_audit_records_of_the_wrong_shape_are_audit_log_errors(line):
    with pytest.raises(AuditLogError):
        decode_record(line)


@pytest.mark.parametrize("head", [
    b"HTTP/1.1 200 OK\r\nContent-Length: \xc2\xb2\r\n\r\n",  # U+00B2 in latin-1 reads as two characters
    "HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\n".encode("latin-1"),
    b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n",
    "HTTP/1.1 \u00b2\u00b2\u00b2 OK\r\nContent-Length: 1\r\n\r\n".encode("latin-1"),
    b"HTTP/1.1 1 OK\r\nContent-Length: 1\r\n\r\n",  # found by the fuzz run: a status must be 100-999
    b"HTTP/1.1 099 OK\r\nContent-Length: 1\r\n\r\n",
])
def test_response_heads_with_odd_digits_are_peer_errors(head):
    with pytest.raises(CatchupPeerError):
        parse_head(head)


@pytest.mark.parametrize(("text", "value"), [
    ("0", 0), ("17", 17), ("9" * 19, int("9" * 19)), ("\u00b2", None), ("9" * 20, None), ("9" * 5000, None),
    ("", None), ("-1", None), ("1e3", None), ("\u0661", None),  # ARABIC-INDIC DIGIT ONE
])
def test_path_int_accepts_only_short_ascii_numbers(text, value):
    assert path_int(text) == value
