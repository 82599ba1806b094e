"""The lighthouse's message decoders under hostile input: every message is either accepted with every
field in range or refused with BadRequest naming the problem (hypothesis), never another exception.
Example counts follow the active hypothesis profile (its default: 100 per test)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from ftrun.quorum import protocol
from ftrun.quorum.decide import Decision, Participant
from ftrun.quorum.protocol import MAX_COUNTER, MAX_REQUEST_COUNTER, BadRequest

GOOD = {"type": "quorum", "step": 3, "commit_failed": False, "last_quorum_id": 2, "data_addrs": ["a", "b"]}

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**64 - 1),
                    st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=12)
keys = st.sampled_from(["type", "step", "commit_failed", "last_quorum_id", "data_addrs", "own_failures", "token",
                        "replica_id", "quorum_id", "max_step", "min_replicas", "reason", "behind", "participants"])
messages = st.dictionaries(keys, values, max_size=8)


def _wire(msg):
    """What the lighthouse's reader hands over: the message after a msgpack round trip."""
    return msgpack.unpackb(msgpack.packb(msg, use_bin_type=True), raw=False)


@settings(deadline=None)
@given(st.fixed_dictionaries({}, optional={k: values for k in GOOD}).map(lambda m: {**GOOD, **m}) | messages)
def test_quorum_request_is_parsed_in_range_or_refused(msg):
    try:
        step, failed, last_qid, addrs, own, fresh = protocol.parse_quorum_request(_wire(msg))
    except BadRequest as e:
        assert str(e)
        return
    assert 0 <= step <= MAX_REQUEST_COUNTER and 0 <= last_qid <= MAX_REQUEST_COUNTER
    assert 0 <= own <= MAX_REQUEST_COUNTER and isinstance(failed, bool) and isinstance(fresh, bool)
    assert all(isinstance(a, str) for a in addrs)


@settings(deadline=None)
@given(messages)
def test_hello_is_parsed_or_refused(msg):
    try:
        token, rid = protocol.parse_hello(_wire(msg))
    except BadRequest:
        return
    assert isinstance(token, str) and rid and rid.isprintable()


@settings(deadline=None)
@given(messages)
def test_decision_is_decoded_in_range_or_refused(msg):
    try:
        d = protocol.decode_decision(_wire(msg))
    except BadRequest:
        return
    assert 0 <= d.quorum_id <= MAX_COUNTER and 0 <= d.max_step <= MAX_COUNTER and d.min_replicas >= 1
    assert set(d.behind) <= set(d.replica_ids)


ids = st.text(alphabet="abcr0123456789", min_size=1, max_size=6)


@settings(deadline=None)
@given(st.dictionaries(ids, st.tuples(st.integers(0, MAX_COUNTER), st.lists(st.text(max_size=5), max_size=3)),
                       min_size=1, max_size=5),
       st.integers(0, MAX_COUNTER), st.integers(1, 9), st.text(max_size=20))
def test_decision_round_trips(rows, quorum_id, min_replicas, reason):
    parts = tuple(Participant(rid, step, tuple(addrs)) for rid, (step, addrs) in sorted(rows.items()))
    max_step = max(p.step for p in parts)
    d = Decision(True, reason, quorum_id, parts, max_step, tuple(p.replica_id for p in parts if p.step < max_step),
                 min_replicas=min_replicas)
    assert protocol.decode_decision(_wire(protocol.encode_decision(d))) == d


@pytest.mark.parametrize("field,value", [
    ("last_quorum_id", 2**64 - 1), ("last_quorum_id", MAX_REQUEST_COUNTER + 1), ("step", 2**63), ("step", -1),
    ("last_quorum_id", True), ("own_failures", -5), ("data_addrs", ["x" * 2000]), ("fresh", 1),
])
def test_out_of_range_request_is_refused_naming_the_field(field, value):
    with pytest.raises(BadRequest, match=field):
        protocol.parse_quorum_request({**GOOD, field: value})


def test_hostile_replica_ids_are_refused():
    for bad in ["", "a\nb", "x" * 300, 7, None]:
        with pytest.raises(BadRequest, match="replica id"):
            protocol.parse_hello({"type": "hello", "token": "t", "replica_id": bad})


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                           | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=4), max_leaves=10)
state_docs = st.fixed_dictionaries({}, optional={"quorum_id": json_values, "participants": json_values,
                                                 "max_step": json_values}) | json_values


@settings(deadline=None)
@given(state_docs)
def test_persisted_state_loads_in_range_or_is_refused(doc):
    import json

    from ftrun.quorum.service import STATE_KEY, LighthouseStateError, load_state
    from ftrun.storage import MemoryStorage

    storage = MemoryStorage()
    storage.write_atomic(STATE_KEY, json.dumps(doc).encode())
    try:
        state = load_state(storage)
    except LighthouseStateError as e:
        assert STATE_KEY in str(e)
        return
    assert 0 <= state.quorum_id <= MAX_COUNTER and 0 <= state.max_step <= MAX_COUNTER
    assert all(isinstance(p, str) and p for p in state.prev_participants)
