"""Pure parts of catch-up: the fetch plan, the wait-limit decision, the snapshot layout and manifest,
step availability, the HTTP response head, and picking sources from a quorum."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from ftrun.catchup.errors import CatchupPeerError, CatchupUsageError
from ftrun.catchup.heal import catchup_sources, should_publish, should_reserve
from ftrun.catchup.manifest import ALIGN, Manifest, decode_manifest, encode_manifest, layout_for
from ftrun.catchup.plan import plan_fetch, reassign, replan, steal
from ftrun.catchup.snapshot import availability, check_metadata, describe
from ftrun.catchup.wait import WaitAction, estimate_fetch_s, should_wait
from ftrun.catchup.wire import encode_get, parse_head, split_url
from ftrun.quorum.decide import Participant
from ftrun.replica.endpoints import encode_endpoints
from ftrun.replica.manager import StepQuorum

MB = 1 << 20


# -- fetch plan ----------------------------------------------------------------------------------
def check_plan(plan, sizes, sources):
    assigned = sorted(i for _, shards in plan.assignment for i in shards)
    assert assigned == list(range(len(sizes)))  # every shard exactly once
    cap = -(-len(sizes) // len(sources))
    assert all(len(shards) <= cap for _, shards in plan.assignment)
    loads = [plan.bytes_of(s) for s in sources]
    if sizes:
        assert max(loads) - min(loads) <= max(sizes)  # balanced by bytes to within one shard


@pytest.mark.parametrize("seed", range(300))
def test_plan_balances_bytes_and_caps_shards_per_source(seed):
    r = random.Random(seed)
    sizes = [r.choice([r.randint(1, 100), 64, 64, r.randint(1, 5)]) for _ in range(r.randint(0, 40))]
    sources = [f"s{j}" for j in range(r.randint(1, 8))]
    plan = plan_fetch(sizes, sources)
    check_plan(plan, sizes, sources)
    assert plan_fetch(sizes, sources) == plan  # deterministic


@pytest.mark.parametrize("sizes, sources, expected", [
    ([32] * 8, ["a", "b"], {"a": (0, 2, 4, 6), "b": (1, 3, 5, 7)}),
    ([32] * 5, ["a", "b"], {"a": (0, 2, 4), "b": (1, 3)}),
    ([100, 10, 10, 10, 10], ["a", "b"], {"a": (0, 4), "b": (1, 2, 3)}),  # the cap keeps b at 3 shards
    ([5, 50, 5], ["a", "b", "c", "d"], {"a": (1,), "b": (0,), "c": (2,), "d": ()}),
    ([], ["a"], {"a": ()}),
])
def test_plan_table(sizes, sources, expected):
    assert dict(plan_fetch(sizes, sources).assignment) == expected


def test_plan_rejects_no_or_duplicate_sources():
    for bad in ([], ["a", "a"]):
        with pytest.raises(ValueError):
            plan_fetch([1], bad)


def test_replan_moves_only_the_dead_sources_unfinished_shards():
    plan = plan_fetch([10] * 9, ["a", "b", "c"])
    assert dict(plan.assignment) == {"a": (0, 3, 6), "b": (1, 4, 7), "c": (2, 5, 8)}
    new = replan(plan, "b", done_shards={0, 1, 2})
    assert new.sources == ("a", "c")
    assert dict(new.assignment) == {"a": (0, 3, 4, 6), "c": (2, 5, 7, 8)}  # survivors keep theirs (in flight)
    assert "b failed" in new.reason
    undone = {i for _, sh in new.assignment for i in sh} - {0, 1, 2}
    assert undone == set(range(3, 9))


@pytest.mark.parametrize("seed", range(100))
def test_replan_property(seed):
    r = random.Random(seed)
    sizes = [r.randint(1, 50) for _ in range(r.randint(1, 30))]
    sources = [f"s{j}" for j in range(r.randint(2, 6))]
    plan = plan_fetch(sizes, sources)
    done = {i for i in range(len(sizes)) if r.random() < 0.4}
    dead = r.choice(sources)
    new = replan(plan, dead, done)
    assert dead not in new.sources
    for src in new.sources:  # nothing a survivor had is taken away
        assert set(plan.shards_of(src)) <= set(new.shards_of(src))
    undone = sorted(i for _, sh in new.assignment for i in sh if i not in done)
    assert undone == sorted(set(range(len(sizes))) - done)


def test_replan_with_no_survivor_has_no_sources():
    new = replan(plan_fetch([1, 2], ["a"]), "a", done_shards={0})
    assert new.sources == () and "no source is left" in new.reason


def test_reassign_moves_a_bad_shard_to_the_least_loaded_other_source():
    plan = plan_fetch([10, 10, 10, 10, 10, 10], ["a", "b", "c"])
    new = reassign(plan, 0, "a", done_shards={1, 4})  # b's shards (1, 4) are done: fewest outstanding bytes
    assert new.source_of(0) == "b" and "retry from b" in new.reason
    same = reassign(plan_fetch([10], ["a"]), 0, "a", done_shards=set())
    assert same.source_of(0) == "a" and "only source" in same.reason



def test_steal_takes_the_tail_half_of_the_busiest_source():
    plan = plan_fetch([MB] * 8, ["a", "b"])
    assert plan.shards_of("a") == (0, 2, 4, 6) and plan.shards_of("b") == (1, 3, 5, 7)
    # b finished all four; a has 0 done and 2 in flight: 4 and 6 are untouched, b takes the tail one
    stolen = steal(plan, "b", done={1, 3, 5, 7, 0}, inflight={2})
    assert stolen.shards_of("a") == (0, 2, 4) and stolen.shards_of("b") == (1, 3, 5, 6, 7)
    assert "b finished its shards and took 1" in stolen.reason and "from a" in stolen.reason


def test_steal_refuses_when_there_is_nothing_to_take():
    plan = plan_fetch([MB] * 4, ["a", "b"])
    assert steal(plan, "b", done=set(), inflight=set()) is None  # b still has its own
    assert steal(plan, "b", done={1, 3}, inflight={0, 2}) is None  # a's shards are all in flight
    assert steal(plan, "c", done={0, 1, 2, 3}, inflight=set()) is None  # not a source of the plan
    single = plan_fetch([MB] * 3, ["a"])
    assert steal(single, "a", done=set(), inflight=set()) is None


def test_steal_leaves_an_idle_victim_its_first_shard_and_takes_a_busy_ones_last():
    plan = plan_fetch([MB] * 4, ["a", "b"])
    stolen = steal(plan, "b", done={1, 3}, inflight=set())  # a has 0 and 2, none started: b takes 2
    assert stolen.shards_of("a") == (0,) and stolen.shards_of("b") == (1, 2, 3)
    assert steal(stolen, "b", done={1, 2, 3}, inflight=set()) is None  # a keeps 0 to start with
    assert steal(stolen, "b", done={1, 2, 3}, inflight={0}) is None  # a's last shard is in flight
    busy = steal(plan, "b", done={1, 3}, inflight={0})  # a is fetching 0: its lone untouched 2 goes
    assert busy.shards_of("a") == (0,) and busy.shards_of("b") == (1, 2, 3)


@pytest.mark.parametrize("seed", range(200))
def test_steal_property_every_shard_once_and_a_fast_source_drains_a_slow_one(seed):
    r = random.Random(seed)
    sizes = [r.randint(1, 100) for _ in range(r.randint(1, 30))]
    sources = [f"s{j}" for j in range(r.randint(2, 5))]
    plan, done, inflight = plan_fetch(sizes, sources), set(), set()
    slow = sources[0]
    for _ in range(10 * len(sizes) + 10):  # only the fast sources finish shards; slow has one in flight
        if not inflight and plan.shards_of(slow):
            inflight.add(plan.shards_of(slow)[0])
        for src in sources[1:]:
            mine = [i for i in plan.shards_of(src) if i not in done and i not in inflight]
            if mine:
                done.add(mine[0])
            else:
                stolen = steal(plan, src, done, inflight)
                if stolen is not None:
                    before = {i for i in plan.shards_of(src)}
                    assert set(stolen.shards_of(src)) > before  # it gained untouched shards only
                    assert not (set(stolen.shards_of(src)) - before) & (done | inflight)
                    plan = stolen
        assert sorted(i for _, sh in plan.assignment for i in sh) == list(range(len(sizes)))
    assert done | inflight == set(range(len(sizes)))  # the slow source kept only its shard in flight


# -- wait limit (paper §6.1) ---------------------------------------------------------------------
@pytest.mark.parametrize("fetch_s, step_s, limit_s, whole_s, action, stall", [
    (5.0, 20.0, 10.0, None, WaitAction.JOIN, 0.0),  # fits in the step
    (20.0, 20.0, 0.0, None, WaitAction.JOIN, 0.0),  # exactly fits
    (25.0, 20.0, 10.0, None, WaitAction.WAIT, 5.0),  # 5 s past, within the limit: healthy replicas wait
    (15.0, 8.0, 10.0, 20.0, WaitAction.WAIT, 7.0),  # joined mid-step, within the limit
    (15.0, 2.0, 10.0, 20.0, WaitAction.NEXT_STEP, 0.0),  # joined late in the step: join one step later
    (40.0, 20.0, 10.0, None, WaitAction.WAIT, 20.0),  # a whole step is too short anyway: must wait
    (25.0, 20.0, 0.0, None, WaitAction.WAIT, 5.0),  # limit 0 and a whole step: deferring never helps
])
def test_should_wait(fetch_s, step_s, limit_s, whole_s, action, stall):
    d = should_wait(fetch_s, step_s, limit_s, whole_step_s=whole_s)
    assert d.action is action and d.stall_s == pytest.approx(stall) and d.reason
    assert d.wait == (action is WaitAction.WAIT)


def test_should_wait_rejects_negative_and_estimates():
    with pytest.raises(ValueError):
        should_wait(-1.0, 1.0, 1.0)
    assert estimate_fetch_s(2_000_000_000, 1e9, latency_s=0.5) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        estimate_fetch_s(1, 0.0)


# -- layout and manifest -------------------------------------------------------------------------
ENTRIES = [("b", "float32", (3,)), ("a", "uint8", (5,)), ("big", "float32", (1000,)), ("s", "int64", ()),
           ("z", "float32", (0, 4)), ("h", "bfloat16", (7, 2))]


@pytest.mark.parametrize("max_shard", [64, 128, 1024, 4096, 1 << 20])
def test_layout_shards_cover_the_buffer_and_respect_the_max(max_shard):
    layout = layout_for(ENTRIES, max_shard)
    assert [t.name for t in layout.tensors] == sorted(n for n, _, _ in ENTRIES)
    for t in layout.tensors:
        assert t.nbytes == 0 or t.offset % ALIGN == 0
    pos = 0
    for s in layout.shards:
        assert s.offset == pos and 0 < s.nbytes <= max_shard + ALIGN
        pos += s.nbytes
    assert pos == layout.total_bytes
    big = [s for s in layout.shards if "big" in s.names]
    if 4000 > max_shard:  # a tensor over the max gets near-equal shards of its own
        assert len(big) == -(-4000 // max_shard) and all(s.names == ("big",) for s in big)
    else:
        assert len(big) == 1


def test_layout_packs_small_tensors_and_lists_padding():
    layout = layout_for([("a", "uint8", (5,)), ("b", "uint8", (5,))], 1 << 20)
    assert [(t.name, t.offset) for t in layout.tensors] == [("a", 0), ("b", 64)]
    assert len(layout.shards) == 1 and layout.shards[0].names == ("a", "b")
    assert layout.gaps() == [(5, 64)]


def test_manifest_round_trip():
    layout = layout_for(ENTRIES, 1024)
    m = Manifest(4, layout, tuple(range(len(layout.shards))), {"loader": [1]})
    assert decode_manifest(encode_manifest(m), step=4) == m


def tamper(doc, path, value):
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(doc).encode()


@pytest.mark.parametrize("path, value", [
    (("format",), "pickle"), (("step",), 5), (("total_bytes",), -1), (("metadata",), []),
    (("tensors", 0, "dtype"), "object"), (("tensors", 0, "nbytes"), 999), (("tensors", 0, "offset"), 1 << 40),
    (("shards", 0, "offset"), 8), (("shards", 0, "crc32"), 1 << 33), (("shards", 0, "nbytes"), True),
    (("shards",), []), (("tensors", 1, "name"), "a"),
])
def test_decode_manifest_rejects_malformed(path, value):
    doc = json.loads(encode_manifest(Manifest(4, layout_for(ENTRIES, 1024), (0,) * 5, {})))
    with pytest.raises(CatchupPeerError):
        decode_manifest(tamper(doc, path, value), step=4)
    with pytest.raises(CatchupPeerError):
        decode_manifest(b"\x80\x04not json", step=4)


# -- step availability ---------------------------------------------------------------------------
@pytest.mark.parametrize("step, state, kind, status, says", [
    (7, dict(ready=7, pending=None, newest=7, retired=None), "serve", 200, "published"),
    (7, dict(ready=None, pending=7, newest=7, retired=None), "wait", 404, "being published"),
    (8, dict(ready=7, pending=None, newest=7, retired=None), "wait", 404, "step 7 (published)"),
    (5, dict(ready=7, pending=None, newest=7, retired=None), "gone", 410, "step 7 (published)"),
    (7, dict(ready=None, pending=None, newest=7, retired=7), "gone", 410, "step 7 (retired)"),
    (0, dict(ready=None, pending=None, newest=None, retired=None), "wait", 404, "nothing"),
])
def test_availability(step, state, kind, status, says):
    a = availability(step, **state)
    assert (a.kind, a.status) == (kind, status) and says in a.reason


# -- HTTP response head --------------------------------------------------------------------------
def test_parse_head():
    h = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nX-Ftrun-Step: 3\r\n\r\n")
    assert (h.status, h.content_length, h.keep_alive, h.headers["x-ftrun-step"]) == (200, 12, True, "3")
    assert not parse_head(b"HTTP/1.1 410 Gone\r\nConnection: close\r\nContent-Length: 0\r\n\r\n").keep_alive
    for bad in (b"HTTP/1.1 200 OK\r\n\r\n", b"SPDY 200\r\nContent-Length: 1\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
                b"HTTP/1.1 200 OK\r\nbroken\r\n\r\n"):
        with pytest.raises(CatchupPeerError):
            parse_head(bad)


def test_request_and_url():
    assert split_url("http://127.0.0.1:8080") == ("127.0.0.1", 8080)
    for bad in ("https://h:1", "http://h", "http://h:1/x", "h:1"):
        with pytest.raises(ValueError):
            split_url(bad)
    req = encode_get("127.0.0.1", 80, "/catchup/1/manifest", "tok")
    assert req.startswith(b"GET /catchup/1/manifest HTTP/1.1\r\n") and b"Authorization: Bearer tok\r\n" in req
    with pytest.raises(ValueError):
        encode_get("h", 1, "/x", "tok\r\nEvil: 1")


# -- sources from a quorum -----------------------------------------------------------------------
def quorum(steps, replica_index, step=7, rank=0):
    """The StepQuorum rank `rank` gets: its peers are rank `rank` of each participant."""
    parts = tuple(Participant(f"r{i}", s) for i, s in enumerate(steps))
    peers = tuple(encode_endpoints({"catchup": f"http://h{i}:{rank}"}) if rank < 2 else "" for i in range(len(steps)))
    return StepQuorum(1, step, parts, replica_index, steps[replica_index] < step, "test", peer_addrs=peers)


def test_catchup_sources_are_healthy_same_rank_rotated():
    assert catchup_sources(quorum([7, 7, 5, 7], 2, rank=1)) == ["http://h3:1", "http://h0:1", "http://h1:1"]
    assert catchup_sources(quorum([7, 5], 1)) == ["http://h0:0"]
    assert catchup_sources(quorum([7, 5], 1, rank=4)) == []  # no endpoint for that rank


def test_should_publish_only_when_someone_is_behind():
    assert should_publish(quorum([7, 5], 0)) and not should_publish(quorum([7, 5], 1))
    assert not should_publish(quorum([7, 7], 0))


@pytest.mark.parametrize("steps, num_replicas, reserve", [
    ([7, 7], 3, True),      # a replica is missing (dead, restarting, not started yet): it will join
    ([7, 7, 7], 3, False),  # all there
    ([7, 7, 5], 3, False),  # the joiner is in the quorum already: this step publishes anyway
    ([7], 2, True),
])
def test_should_reserve_while_the_quorum_lacks_a_replica(steps, num_replicas, reserve):
    assert should_reserve(quorum(steps, 0), num_replicas) is reserve


@pytest.mark.parametrize("metadata, says", [
    ({"state": {"groups": [{"lr": 0.1}, {"lr": torch.tensor(0.1)}]}},
     "metadata['state']['groups'][1]['lr'] is a Tensor"),
    ({"seen": {1, 2}}, "metadata['seen'] is a set"),
    ({"by": {(0, 1): 2}}, "metadata['by'] has a key (0, 1) of type tuple")])
def test_check_metadata_names_the_value_json_cannot_carry(metadata, says):
    with pytest.raises(CatchupUsageError, match="metadata must be JSON-serializable: " + re.escape(says)):
        check_metadata(metadata)
    check_metadata({"a": [1, 2.5, None, True, "x", (3, 4)], "b": {"c": {}}, 7: "int keys are JSON"})
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(CatchupUsageError, match="Circular reference"):
        check_metadata(loop)


def test_describe_refuses_what_has_no_bytes_unless_shape_only():
    meta = {"w": torch.empty(3, 2, device="meta")}
    with pytest.raises(CatchupUsageError, match="tensor 'w' .*meta.* has no bytes to publish"):
        describe(meta)
    assert describe(meta, shape_only=True) == [("w", "float32", (3, 2))]
    with pytest.raises(CatchupUsageError, match="has no bytes to publish"):
        describe({"s": torch.zeros(3).to_sparse()}, shape_only=True)
    with pytest.raises(CatchupUsageError, match="str -> Tensor, got 'n': int"):
        describe({"n": 3})
