"""The fetch protocol over a transport that pipelines (ftrun.catchup.fetcher): each shard request names
the shard the link is asked for next, that shard is the link's next call, and a failed request gives
its pipelined shard back to the plan, so the state still arrives whole. Over a transport that does not
pipeline, no link is ever handed one."""

from __future__ import annotations

import logging
import threading
import zlib

import pytest
import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupUsageError
from ftrun.catchup.fetcher import fetch_with
from ftrun.catchup.manifest import Manifest, layout_for
from ftrun.catchup.net_transport import BytePayloads, PayloadTransport
from ftrun.catchup.snapshot import anonymous_buffer
from ftrun.catchup.transport import ShardFailed, SourceFailed
from ftrun.config import Timeouts
from ftrun.env.real import RealEnv

pytestmark = pytest.mark.timeout(30)
CONFIG = CatchupConfig(max_shard_bytes=64, timeouts=Timeouts(catchup_timeout_s=10.0, catchup_stall_s=2.0))
DATA = bytes((i * 7) % 251 for i in range(64 * 12))  # 12 shards of 64 bytes
LAYOUT = layout_for([("w", "uint8", (len(DATA),))], CONFIG.max_shard_bytes)
MANIFEST = Manifest(3, LAYOUT, tuple(zlib.crc32(DATA[s.offset:s.offset + s.nbytes]) for s in LAYOUT.shards))


class FakeLink:
    def __init__(self, transport: "FakeTransport", source: str) -> None:
        self.t, self.source = transport, source

    def manifest(self, step, wait_s, limit_s):
        return MANIFEST

    def shard(self, step, shard, into, wait_s, limit_s, ahead=None):
        self.t.calls.append((self.source, shard.index, None if ahead is None else ahead[0].index))
        if ahead is not None:
            assert ahead[1].nbytes == ahead[0].nbytes
        fail = self.t.fail.get((self.source, shard.index))
        if fail is not None:
            raise fail(f"{self.source} shard {shard.index} injected")
        into[:] = DATA[shard.offset:shard.offset + shard.nbytes]
        return None  # the fetcher checksums

    def close(self):
        pass


class FakeTransport(PayloadTransport):
    def __init__(self, pipelines: bool, fail=None) -> None:
        self.pipelines, self.fail, self.calls = pipelines, dict(fail or {}), []
        self.payloads = BytePayloads()

    def open(self, source):
        return FakeLink(self, source)


def _fetch(transport, sources=("a", "b")):
    result = fetch_with(RealEnv(), transport, 3, list(sources), CONFIG)
    flat = result.tensors["w"]
    assert bytes(flat.numpy()) == DATA
    return result


def _by_source(calls):
    out = {}
    for source, index, ahead in calls:
        out.setdefault(source, []).append((index, ahead))
    return out


def test_each_request_names_the_link_s_next_shard():
    t = FakeTransport(pipelines=True)
    _fetch(t)
    for source, seq in _by_source(t.calls).items():
        for (index, ahead), (nxt, _) in zip(seq, seq[1:]):
            if ahead is not None:
                assert nxt == ahead, (source, seq)  # what went out behind a shard is the next one taken
        assert sum(a is not None for _, a in seq) >= len(seq) // 2, seq  # most requests are pipelined
    assert sorted(i for _, i, _ in t.calls) == list(range(12))  # each shard fetched once


@pytest.mark.parametrize("error", [ShardFailed, SourceFailed])
def test_a_failed_request_gives_its_pipelined_shard_back(error):
    t = FakeTransport(pipelines=True)
    _fetch(t, sources=("a",))
    first_pipelined = next((i, a) for s, i, a in t.calls if a is not None)
    t = FakeTransport(pipelines=True, fail={("a", first_pipelined[0]): error})
    result = _fetch(t)
    assert result.failures
    assert first_pipelined[1] in [i for _, i, _ in t.calls]  # fetched after all, by some source


def test_a_transport_that_does_not_pipeline_is_never_handed_a_next_shard():
    t = FakeTransport(pipelines=False)
    _fetch(t)
    assert all(ahead is None for _, _, ahead in t.calls) and len(t.calls) == 12


def test_the_destination_is_a_reused_buffer_when_given_one():
    buffer = torch.zeros(len(DATA), dtype=torch.uint8)
    t = FakeTransport(pipelines=True)
    t.payloads = BytePayloads(buffer)
    _fetch(t)
    assert bytes(buffer.numpy()) == DATA


class LateManifestLink(FakeLink):
    """Source "a" answers its manifest only once source "b" has taken every shard it may (the plan leaves
    a source that has not started its first shard), then with `late` (a manifest, or an error to raise)."""

    def manifest(self, step, wait_s, limit_s):
        if self.source == "a":
            assert self.t.b_done.wait(5), "the fetch waited for a's manifest before fetching from b"
            if isinstance(self.t.late, Exception):
                raise self.t.late
        return MANIFEST

    def shard(self, step, shard, into, wait_s, limit_s, ahead=None):
        out = super().shard(step, shard, into, wait_s, limit_s, ahead)
        if sum(s == "b" for s, _, _ in self.t.calls) == len(LAYOUT.shards) - 1:
            self.t.b_done.set()
        return out


class LateManifestTransport(FakeTransport):
    def __init__(self, late) -> None:
        super().__init__(pipelines=True)
        self.late, self.b_done = late, RealEnv().event()

    def open(self, source):
        return LateManifestLink(self, source)


@pytest.mark.parametrize("late", [MANIFEST, SourceFailed("a stalled")], ids=["late", "fails-late"])
def test_the_first_manifest_to_arrive_starts_the_fetch(late):
    """Every source is asked at once: a source slow to publish delays the fetch by its one shard at most,
    and one whose manifest fails after the plan is made has its shards re-planned onto the others."""
    t = LateManifestTransport(late)
    result = _fetch(t)
    by = _by_source(t.calls)
    assert len(by["b"]) >= len(LAYOUT.shards) - 1, by
    assert sorted(i for _, i, _ in t.calls) == list(range(12))  # each shard fetched once
    if isinstance(late, Exception):
        assert "a" not in by and result.failures[0].startswith("skipped a: SourceFailed: a stalled")
    else:
        assert len(by["a"]) == 1 and not result.failures


def _address_in(t: torch.Tensor, mem: memoryview) -> bool:
    start = torch.frombuffer(mem, dtype=torch.uint8).data_ptr()
    return start <= t.data_ptr() < start + len(mem)


def test_a_prepared_buffer_is_received_into_once_then_fetches_allocate_again():
    t = FakeTransport(pipelines=True)
    t.payloads.prepare(RealEnv(), lambda: len(DATA) + 100)  # larger is fine: the fetch takes its first bytes
    prepared = t.payloads._preparation
    assert prepared.task.join(timeout=5.0)
    made = memoryview(prepared.buffer)
    first = _fetch(t)  # bitwise checked
    assert _address_in(first.tensors["w"], made)
    assert t.payloads._preparation is None and prepared.buffer is None  # taken: the state keeps its views
    second = _fetch(t)
    assert first.tensors["w"].data_ptr() != second.tensors["w"].data_ptr()  # not overwritten by the next
    assert bytes(first.tensors["w"].numpy()) == DATA


def test_the_fetch_lands_in_the_prepared_pages():
    payloads = BytePayloads()
    payloads.prepare(RealEnv(), lambda: 4096)
    assert payloads._preparation.task.join(5.0)
    mem = memoryview(payloads._preparation.buffer)
    dest = payloads.destination(1000)
    assert len(dest) == 1000 and _address_in(torch.frombuffer(dest, dtype=torch.uint8), mem)
    assert not _address_in(torch.frombuffer(payloads.destination(1000), dtype=torch.uint8), mem)  # once


def test_a_prepared_buffer_too_small_is_dropped_and_the_fetch_still_arrives_whole():
    t = FakeTransport(pipelines=True)
    t.payloads.prepare(RealEnv(), lambda: len(DATA) - 1)
    prepared = t.payloads._preparation
    assert prepared.task.join(5.0)
    made = prepared.buffer
    _fetch(t)
    assert t.payloads._preparation is None and made.closed


def test_the_buffer_is_sized_in_the_background_task_and_a_failed_sizing_only_costs_the_preparation(caplog):
    """prepare returns at once: `size` runs in the task that makes the buffer (the caller may be on a critical
    path); sizing that raises is logged, nothing is prepared, and the fetch allocates its own."""
    env, sized_in, release = RealEnv(), [], RealEnv().event()

    def size():
        assert release.wait(5.0)
        sized_in.append(threading.current_thread().name)
        return len(DATA)

    t = FakeTransport(pipelines=True)
    t.payloads.prepare(env, size)
    prepared = t.payloads._preparation
    assert sized_in == [] and prepared.task.is_alive()  # returned before sizing
    release.set()
    assert prepared.task.join(5.0)
    assert bytes(_fetch(t).tensors["w"].numpy()) == DATA and sized_in == ["catchup-prepare"]

    def unsizable():
        raise CatchupUsageError("tensor 'x' has no bytes to publish")

    with caplog.at_level(logging.WARNING, logger="ftrun.heal"):
        t.payloads.prepare(env, unsizable)
        prepared = t.payloads._preparation
        assert prepared.task.join(5.0)
        assert bytes(_fetch(t).tensors["w"].numpy()) == DATA
    assert t.payloads._preparation is None and prepared.buffer is None
    assert "could not size a receive buffer to prepare: CatchupUsageError: tensor 'x'" in caplog.text


def test_release_drops_a_prepared_buffer_no_fetch_took():
    payloads = BytePayloads()
    payloads.prepare(RealEnv(), lambda: 1 << 20)
    prepared = payloads._preparation
    assert prepared.task.join(5.0)
    made = prepared.buffer
    payloads.release()
    assert payloads._preparation is None and prepared.buffer is None and made.closed
    payloads.release()  # idempotent


def test_a_fetch_does_not_wait_for_a_preparation_still_running_and_the_late_buffer_is_unmapped(monkeypatch, caplog):
    """A fetch that finds the buffer still being prepared (here: sizing that blocks until the test lets it go)
    allocates its own at once; the preparation is given up, and the mapping its task makes later is closed,
    not left behind. Before, the fetch joined the task without a bound."""
    import ftrun.catchup.net_transport as net_transport

    made = []

    def recording(nbytes, *, populate=False):
        made.append(anonymous_buffer(nbytes, populate=populate))
        return made[-1]

    monkeypatch.setattr(net_transport, "anonymous_buffer", recording)
    env, sizing = RealEnv(), RealEnv().event()
    t = FakeTransport(pipelines=True)
    t.payloads.prepare(env, lambda: len(DATA) if sizing.wait(10.0) else 0)
    prepared = t.payloads._preparation
    caplog.set_level(logging.INFO, logger="ftrun.heal")
    fetched = env.spawn(lambda: _fetch(t), name="fetch")
    done = fetched.join(timeout=5.0)  # with sizing still blocked
    sizing.set()
    assert done and fetched.exception is None, "the fetch waited for the preparation"
    assert prepared.task.join(5.0) and len(made) == 1
    assert made[0].closed and prepared.buffer is None and t.payloads._preparation is None
    assert "the receive buffer was still being prepared: the fetch allocates its own" in caplog.text
