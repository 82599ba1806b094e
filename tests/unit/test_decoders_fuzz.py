"""Every on-disk and wire decoder turns any malformed content into its documented error (hypothesis).

Decoders: the checkpoint manifest (through `store.verify` on a real folder, so file names reach the
filesystem), the catch-up manifest, the catch-up HTTP response head, the loader_state record (with a
valid CRC, so the body's content is what is fuzzed), the loader_state a catch-up snapshot carries in
its metadata (`LoaderState.from_dict`), the audit log and a sharded checkpoint's rank reports. Inputs are valid documents with
one part replaced by an arbitrary value, hostile shapes (deep nesting, 1e400, 5,000-digit numbers, NUL
and 300-character names, a name that is a folder) and raw bytes.

The default suite runs a few examples per decoder (the `decoders` profile); `make test-fuzz` runs
HYPOTHESIS_PROFILE=fuzz: 100,000 examples per decoder, printing hypothesis' statistics.
"""

from __future__ import annotations

import json
import struct
import zlib

import msgpack
import pytest
from hypothesis import given, strategies as st

from ftrun.catchup.errors import CatchupPeerError
from ftrun.catchup.manifest import Manifest as CatchupManifest, decode_manifest, encode_manifest, layout_for
from ftrun.catchup.wire import parse_head
from ftrun.checkpoint import manifest as mf
from ftrun.data.audit import Attempt, AuditLogError, Commit, encode_record, read_log
from ftrun.data.loader_state import (
    LoaderState, LoaderStateCorrupt, LoaderStateError, decode as decode_loader_state, encode,
)
from ftrun.data.sampler import DataLayout
from tests.unit.fuzzing import HOSTILE_TEXT, PROFILE, doc_paths

pytestmark = pytest.mark.fuzz


# -- hostile values ----------------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
           | st.sampled_from(["", "\0", "x" * 300, "a/b", "..", ".", "manifest.json", "sub", "\u00b2"]))
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                      max_size=4), max_leaves=12)


def _mutate(doc, path: list, value):
    """A copy of `doc` with the item at `path` (keys/indices, possibly stale) replaced by `value`."""
    doc = json.loads(json.dumps(doc))
    node = doc
    for key in path[:-1]:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and node:
            node = node[key % len(node)]
    last = path[-1] if path else None
    if isinstance(node, dict) and isinstance(last, str):
        node[last] = value
    elif isinstance(node, list) and node and isinstance(last, int):
        node[last % len(node)] = value
    return doc


def documents(valid: dict) -> st.SearchStrategy[bytes]:
    """JSON bytes: `valid` with one part replaced (or a key dropped), hostile text, or raw bytes."""
    paths = list(doc_paths(valid))
    mutated = st.builds(_mutate, st.just(valid), st.sampled_from(paths), json_values)
    return st.one_of(
        mutated.map(lambda d: json.dumps(d).encode()),
        st.sampled_from(HOSTILE_TEXT).map(str.encode),
        st.builds(lambda d, text: json.dumps(d).replace('"STEP"', text).encode(),
                  st.builds(_mutate, st.just(valid), st.sampled_from(paths), st.just("STEP")),
                  st.sampled_from(HOSTILE_TEXT[:5])),
        st.binary(max_size=200),
    )


# -- checkpoint manifest (through verify, on a real folder) ----------------------------------------------
CKPT_VALID = json.loads(mf.encode(mf.Manifest(3, (mf.FileEntry("a.distcp", 4, zlib.crc32(b"abcd")),
                                                  mf.FileEntry("loader_state.bin", 2, zlib.crc32(b"xy"))),
                                              "loader_state.bin", "abc")))
CKPT_VALID["files"].append({"name": "sub", "size": 4096, "crc32": 0})  # a name that is a folder


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "step-00000003"
    path.mkdir()
    (path / "a.distcp").write_bytes(b"abcd")
    (path / "loader_state.bin").write_bytes(b"xy")
    (path / "sub").mkdir()
    return path


@PROFILE
@given(data=documents(CKPT_VALID), key=st.sampled_from([None, b"k" * 32]))
def test_checkpoint_manifest_verify_never_raises(ckpt_dir, data, key):
    from ftrun.checkpoint import store

    (ckpt_dir / mf.MANIFEST).write_bytes(data)
    manifest, problems = store.verify(ckpt_dir, key=key)
    assert manifest is not None or problems
    try:
        decoded = mf.decode(data)
    except mf.ManifestError:
        return
    assert all(0 < len(f.name.encode("utf-8", "surrogatepass")) <= mf.MAX_NAME_BYTES for f in decoded.files)
    assert type(decoded.step) is int and 0 <= decoded.step < 2**63


# -- a sharded checkpoint's rank reports (the writer replica's vote) --------------------------------------
REPORT_VALID = json.loads(mf.encode_report(1, files=[mf.FileEntry("__1_0.distcp", 4, 7, "ab" * 32)]))


@PROFILE
@given(data=documents(REPORT_VALID))
def test_shard_vote_never_raises_and_commits_only_valid_reports(data):
    good = mf.encode_report(0, files=[mf.FileEntry(".metadata", 2, 1, "cd" * 32)])
    vote = mf.shard_vote([good, data], {".metadata", "__1_0.distcp"}, 2)
    if vote.commit:  # only a report that claims exactly the folder's other file, with sane fields
        assert {f.name for f in vote.files} == {".metadata", "__1_0.distcp"}, vote.files
        assert all(type(f.size) is int and 0 <= f.size < 2**63 and 0 <= f.crc32 <= 0xFFFFFFFF for f in vote.files)
    else:
        assert vote.reason and not vote.files


# -- catch-up manifest -------------------------------------------------------------------------------
_layout = layout_for([("a", "float32", (3,)), ("b", "int64", (2, 2))], 24)
CATCHUP_VALID = json.loads(encode_manifest(CatchupManifest(5, _layout, tuple(range(len(_layout.shards))),
                                                           {"k": 1})))


@PROFILE
@given(data=documents(CATCHUP_VALID))
def test_catchup_manifest_decode_raises_only_peer_errors(data):
    try:
        m = decode_manifest(data, step=5)
    except CatchupPeerError:
        return
    assert sum(s.nbytes for s in m.layout.shards) == m.layout.total_bytes


# -- catch-up response head --------------------------------------------------------------------------
header_text = st.text(st.characters(codec="latin-1"), max_size=30)
heads = st.one_of(
    st.builds(lambda status, length, extra: (f"HTTP/1.1 {status} OK\r\nContent-Length: {length}\r\n{extra}\r\n\r\n"
                                             ).encode("latin-1"),
              st.sampled_from(["200"] * 6 + ["\u00b2", "9" * 5000, "abc", ""]) | header_text,
              st.sampled_from(["\u00b2", "9" * 5000, "-1", "1e400", "12"]) | header_text,
              st.sampled_from(["Transfer-Encoding: chunked", "Connection: close", "X"]) | header_text),
    st.binary(max_size=200),
)


@PROFILE
@given(raw=heads)
def test_response_head_parse_raises_only_peer_errors(raw):
    try:
        head = parse_head(raw)
    except CatchupPeerError:
        return
    assert 0 <= head.content_length < 10**18 and 100 <= head.status <= 999


# -- loader_state record (valid CRC: the body is what is fuzzed) ---------------------------------------------
LAYOUT = DataLayout(dataset_size=40, num_replicas=2, ranks_per_replica=2, batch_size_per_rank=2, seed=3)
_state = LoaderState.initial(LAYOUT, ("r0", "r1")).advance(step=0, contributors=("r0", "r1"))
_HEADER = struct.Struct(">4sBIQ")
LS_VALID = msgpack.unpackb(encode(_state)[_HEADER.size:], raw=False)
ls_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1) | st.floats()
              | st.text(max_size=40) | st.binary(max_size=8) | st.sampled_from(["", "\0", "x" * 300, "\u00b2"]))
ls_values = st.recursive(ls_scalars,
                         lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                         max_leaves=12)


def _with_crc(body: bytes) -> bytes:
    return _HEADER.pack(b"FTLS", 1, zlib.crc32(body), len(body)) + body


ls_bodies = st.one_of(
    st.builds(lambda p, v: msgpack.packb(_mutate(LS_VALID, p, v)), st.sampled_from(list(doc_paths(LS_VALID))),
              ls_values | st.integers(2**62, 2**63 - 1)),
    st.sampled_from([msgpack.packb({**LS_VALID, "replicas": [{**r, "committed_batches": [2**62] * 2}
                                                             for r in LS_VALID["replicas"]]}),
                     msgpack.packb({**LS_VALID, "layout": {**LS_VALID["layout"], "ranks_per_replica": 10**12}})]),
    st.binary(max_size=200),
)


@PROFILE
@given(body=ls_bodies)
def test_loader_state_decode_raises_only_corrupt(body):
    try:
        state = decode_loader_state(_with_crc(body))
    except LoaderStateCorrupt:
        return
    assert max(state.committed_batches) < 2**62


# -- loader_state in a catch-up snapshot's metadata (JSON) ----------------------------------------------
@PROFILE
@given(data=documents(_state.to_dict()))
def test_loader_state_from_dict_raises_only_loader_state_errors(data):
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        return  # not JSON: the catch-up manifest decoder rejects it before from_dict sees it
    try:
        state = LoaderState.from_dict(raw)
    except LoaderStateError:
        return
    assert state.step >= 0 and max(state.committed_batches) < 2**62


# -- audit log ---------------------------------------------------------------------------------------
AUDIT_VALID = [json.loads(encode_record(Attempt("r0", 1, "genesis", 0, 3))),
               json.loads(encode_record(Commit("r0", 1, "genesis", "abc", ("r0", "r1"), (0, 0))))]


@PROFILE
@given(lines=st.lists(st.one_of(documents(AUDIT_VALID[0]), documents(AUDIT_VALID[1])), max_size=3),
       tail=st.binary(max_size=20))
def test_audit_log_read_raises_only_audit_errors(lines, tail):
    data = b"".join(line.replace(b"\n", b" ") + b"\n" for line in lines) + tail
    try:
        records, _problems = read_log(data)
    except AuditLogError:
        return
    for r in records:
        assert isinstance(r.step, int) and r.step >= 0
        if isinstance(r, Commit):
            assert len(r.contributors) == len(r.positions)
