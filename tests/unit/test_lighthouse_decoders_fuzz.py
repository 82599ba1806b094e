"""Every lighthouse decoder, wire and on-disk, turns any malformed input into its documented error
(hypothesis; issue 12). Nothing a peer sends or a state file holds may raise anything else, and what
is accepted is in range (so the lighthouse can always encode and persist what it decoded).

Decoders: the frame (header + msgpack payload, ftrun.env.wire), the hello, the quorum request, the
finished report, the decision (the replica's side) and the persisted lighthouse state. Messages are
valid ones with one part replaced by an arbitrary msgpack value (ints to 2^64 - 1, 2^53 and 2^52
edges, floats, bytes, deep nesting), packed and decoded as the reader does; plus raw bytes.

The default suite runs a few examples per decoder (the `decoders` profile); HYPOTHESIS_PROFILE=fuzz
runs 100,000 examples per decoder (FUZZ_EXAMPLES=N for another count):

    HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest -q -m fuzz -p no:randomly -o timeout=0 \\
        --hypothesis-show-statistics tests/unit/test_lighthouse_decoders_fuzz.py
"""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import given, strategies as st

from ftrun.env import wire
from ftrun.env.base import ProtocolError
from ftrun.quorum import protocol
from ftrun.quorum.decide import Decision, Participant
from ftrun.quorum.service import STATE_KEY, LighthouseStateError, load_state
from tests.unit.fuzzing import HOSTILE_TEXT, PROFILE, doc_paths

pytestmark = pytest.mark.fuzz


EDGES = [0, -1, 2**52, 2**52 + 1, 2**53 - 1, 2**53, 2**63 - 1, 2**64 - 1, -2**63]
scalars = (st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64 - 1) | st.sampled_from(EDGES)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40) | st.binary(max_size=16)
           | st.sampled_from(["", "\0", "x" * 300, "\u00b2", "quorum", "hello", "finished", "\n", "r0"]))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                  max_size=4), max_leaves=12)
DEEP = [[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]


def _mutate(doc, path: list, value, drop: bool):
    """A copy of `doc` with the item at `path` replaced by `value` (or, with `drop`, a key removed)."""
    doc = msgpack.unpackb(msgpack.packb(doc), raw=False)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if not path:
        return value if not drop else {}
    if drop and isinstance(node, dict):
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return doc


def messages(valid: dict) -> st.SearchStrategy[bytes]:
    """msgpack payloads: `valid` with one part replaced or dropped, an extra key, or raw bytes."""
    paths = list(doc_paths(valid))
    mutated = st.builds(_mutate, st.just(valid), st.sampled_from(paths), values | st.just(DEEP), st.booleans())
    extra = st.builds(lambda k, v: {**valid, k: v}, st.text(max_size=8), values)
    return st.one_of(mutated.map(msgpack.packb), extra.map(msgpack.packb), st.binary(max_size=200),
                     st.sampled_from([msgpack.packb([1] * 10), msgpack.packb({1: 2}), b"\xc1", b"\xdf\xff\xff\xff\xff"]))


def _accepted(payload: bytes, parse):
    """The reader's path: `parse` of the frame's payload as wire.decode_msg returns it; None when either
    rejects it with its documented error (ProtocolError, protocol.BadRequest); anything else raises."""
    try:
        msg = wire.decode_msg(payload)
    except ProtocolError:
        return None
    try:
        return parse(msg)
    except protocol.BadRequest:
        return None


# -- the frame --------------------------------------------------------------------------------------
frames = st.one_of(
    st.builds(lambda kind, length, body: wire.HEADER.pack(kind, length) + body,
              st.integers(0, 255), st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, wire.MAX_MSG_BYTES,
                                                                               wire.MAX_MSG_BYTES + 1]),
              st.binary(max_size=64)),
    st.builds(lambda p: wire.HEADER.pack(wire.KIND_MSG, len(p)) + p, messages({"type": "heartbeat"})),
    st.binary(min_size=wire.HEADER_SIZE, max_size=200),
)


@PROFILE
@given(frame=frames)
def test_frame_decode_raises_only_protocol_errors(frame):
    try:
        kind, length = wire.parse_header(frame[:wire.HEADER_SIZE])
    except ProtocolError:
        return
    assert kind in (wire.KIND_MSG, wire.KIND_BULK)
    if kind == wire.KIND_BULK:
        return
    assert length <= wire.MAX_MSG_BYTES
    received = min(len(frame) - wire.HEADER_SIZE, length)
    assert 0 <= wire.next_alloc(received, length) <= max(received, wire.ALLOC_STEP)
    try:
        msg = wire.decode_msg(frame[wire.HEADER_SIZE:wire.HEADER_SIZE + length])
    except ProtocolError:
        return
    assert isinstance(msg, dict)


# -- hello ------------------------------------------------------------------------------------------
@PROFILE
@given(payload=messages({"type": "hello", "token": "t0k", "replica_id": "r0"}))
def test_hello_raises_only_bad_request(payload):
    parsed = _accepted(payload, protocol.parse_hello)
    if parsed is None:
        return
    token, rid = parsed
    assert isinstance(token, str) and rid.isprintable() and 0 < len(rid) <= protocol.MAX_REPLICA_ID_CHARS


# -- quorum request ---------------------------------------------------------------------------------
REQUEST = {"type": "quorum", "step": 7, "commit_failed": False, "own_failures": 0, "fresh": False,
           "last_quorum_id": 3, "data_addrs": ["a:1", "b:2"]}


@PROFILE
@given(payload=messages(REQUEST))
def test_quorum_request_raises_only_bad_request(payload):
    parsed = _accepted(payload, protocol.parse_quorum_request)
    if parsed is None:
        return
    step, failed, qid, addrs, own, fresh = parsed
    assert all(type(v) is int and 0 <= v <= protocol.MAX_REQUEST_COUNTER for v in (step, qid, own))
    assert type(failed) is bool and type(fresh) is bool
    assert len(addrs) <= protocol.MAX_ADDRS and all(isinstance(a, str) and len(a) <= protocol.MAX_ADDR_CHARS
                                                    for a in addrs)


# -- finished report ----------------------------------------------------------------------------------
@PROFILE
@given(payload=messages({"type": "finished", "step": 40}))
def test_finished_report_raises_only_bad_request(payload):
    step = _accepted(payload, protocol.parse_finished)
    if step is None:
        return
    assert type(step) is int and 0 <= step <= protocol.MAX_REQUEST_COUNTER


# -- decision (what a replica accepts from the lighthouse) --------------------------------------------
DECISION = protocol.encode_decision(Decision(True, "fast path", 5, (Participant("r0", 7, ("a:1",)),
                                                                     Participant("r1", 3, ("b:2",))),
                                             7, ("r1",), min_replicas=2))


@PROFILE
@given(payload=messages(DECISION))
def test_decision_decode_raises_only_bad_request(payload):
    d = _accepted(payload, protocol.decode_decision)
    if d is None:
        return
    assert 0 <= d.quorum_id <= protocol.MAX_COUNTER and 0 <= d.max_step <= protocol.MAX_COUNTER
    assert d.min_replicas >= 1 and set(d.behind) <= set(d.replica_ids)
    assert len(set(d.replica_ids)) == len(d.participants)
    assert all(type(p.step) is int and 0 <= p.step <= protocol.MAX_COUNTER for p in d.participants)
    wire.encode_msg(protocol.encode_decision(d))  # what was accepted encodes again


# -- persisted lighthouse state -------------------------------------------------------------------------
class _Stored:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, key: str) -> bytes | None:
        assert key == STATE_KEY
        return self.data


STATE = {"quorum_id": 9, "participants": ["r0", "r1"], "max_step": 39, "finished_step": 40}
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.sampled_from(EDGES)
                           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                           max_leaves=12)
state_files = st.one_of(
    st.builds(_mutate, st.just(STATE), st.sampled_from(list(doc_paths(STATE))), json_values, st.booleans())
    .map(lambda d: json.dumps(d).encode()),
    st.builds(lambda key, text: json.dumps(STATE).replace(f'"{key}": {json.dumps(STATE[key])}',
                                                          f'"{key}": {text}').encode(),
              st.sampled_from(sorted(STATE)), st.sampled_from(HOSTILE_TEXT)),
    st.sampled_from(HOSTILE_TEXT).map(str.encode),
    st.binary(max_size=200),
)


@PROFILE
@given(data=state_files)
def test_lighthouse_state_load_raises_only_state_errors(data):
    try:
        state = load_state(_Stored(data))
    except LighthouseStateError:
        return
    for v in (state.quorum_id, state.max_step, state.finished_step or 0):
        assert type(v) is int and 0 <= v <= protocol.MAX_COUNTER
    assert all(protocol.check_replica_id(p) == p for p in state.prev_participants)
