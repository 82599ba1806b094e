"""FtarEngine.abort ends every phase of a ring's life at once (issue 12: a replica hung inside FTAR is
evicted within the heartbeat timeout on every rank): a running all-reduce, a ring being built (waiting for
the previous rank, negotiating transports) and a later use of that epoch. The abort request over the
listener is checked against the job token. The timeouts are 60 s, so only the abort can end these waits
within the test's timeout; nothing here measures time."""

from __future__ import annotations

import numpy as np
import pytest

from ftrun.diagnose.summary import FAILED, summarize
from ftrun.diagnose.telemetry import Recorder
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.ftar.ring import FatalError, RecoverableError, abort_request, parse_greeting

pytestmark = pytest.mark.timeout(30)
LONG = FtarConfig(chunk_bytes=4096, num_chunks=2, timeout_s=60.0, transport="socket")


@pytest.mark.parametrize("msg,want", [
    ({"token": "job", "epoch": 3}, ("ring", 3)),
    (abort_request("job", 7), ("abort", 7)),
    ({"token": "job", "abort": 7, "epoch": 3}, ("abort", 7)),
    ({"token": "other", "abort": 7}, None),
    ({"token": b"job", "abort": 7}, None),
    ({"abort": 7}, None),
    ({"token": "job", "abort": True}, None),
    ({"token": "job", "abort": -1}, None),
    ({"token": "job", "abort": 2**64 - 1}, None),
    ({"token": "job", "epoch": "3"}, None),
    ({"token": "job"}, None),
    ([1, 2], None),
])
def test_parse_greeting(msg, want):
    assert parse_greeting(msg, "job") == want


@pytest.fixture
def env():
    return RealEnv()


@pytest.fixture
def pair(env):
    engs = [FtarEngine(env=env, kernels=CpuKernels(), token="job", config=LONG) for _ in range(2)]
    yield engs
    for e in engs:
        e.close()


def _run(env, fn):
    box: dict = {}

    def body():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (the test inspects it)
            box["error"] = e
    return env.spawn(body, name="ftar-call"), box


def _ends_aborted(task, box):
    assert task.join(20.0), "the abort did not end the wait"
    err = box.get("error")
    assert isinstance(err, RecoverableError), err
    assert "Timeout" not in str(err) and "within" not in str(err), err  # ended by the abort, not a timeout
    return err


def _build(env, engs, epoch):
    ring = [e.addr for e in engs]
    tasks = [_run(env, lambda e=e, i=i: e.reconfigure(epoch=epoch, ring=ring, index=i)) for i, e in enumerate(engs)]
    for t, box in tasks:
        assert t.join(20.0) and "error" not in box, box


def test_abort_request_ends_a_blocked_all_reduce(env, pair):
    _build(env, pair, epoch=5)
    buf = np.ones(10_000, np.float32)
    task, box = _run(env, lambda: pair[0].all_reduce(buf))  # the peer never joins: it hangs
    assert not task.join(0.2)
    assert pair[1].send_abort(pair[0].addr, 5, timeout=5.0)  # as the replica's leader does
    _ends_aborted(task, box)
    with pytest.raises(FatalError, match="rebuild the ring"):  # the ring is gone
        pair[0].all_reduce(buf)


def test_abort_ends_a_ring_build_waiting_for_the_previous_rank(env, pair):
    ring = [pair[0].addr, pair[1].addr]  # pair[1] never builds: pair[0] waits for its connection
    task, box = _run(env, lambda: pair[0].reconfigure(epoch=3, ring=ring, index=0))
    assert not task.join(0.2)
    assert pair[0].abort(3)
    assert "aborted while it was being built" in str(_ends_aborted(task, box))


def test_abort_ends_a_ring_build_connecting_to_a_dead_next_rank(env):
    """The next rank is dead (a joiner killed while it healed): its address refuses every connect until the
    timeout, and there is no connection for the abort to close; the build checks for the abort between tries."""
    gone = env.net.listen("127.0.0.1:0")
    dead = gone.addr
    gone.close()  # nothing listens there any more: connects are refused
    eng = FtarEngine(env=env, kernels=CpuKernels(), token="job", config=LONG)
    task, box = _run(env, lambda: eng.reconfigure(epoch=9, ring=[eng.addr, dead], index=0))
    assert not task.join(0.2)
    assert eng.abort(9)
    assert "epoch was aborted" in str(_ends_aborted(task, box))
    eng.close()


def test_abort_ends_a_ring_build_in_transport_negotiation(env, pair):
    """The previous rank connects and says hello, then says nothing more: the build waits in the
    negotiation, on a connection that is closed by the abort."""
    peer = env.net.listen("127.0.0.1:0")  # stands in for the next rank: accepts, never answers
    ring = [pair[0].addr, peer.addr]
    task, box = _run(env, lambda: pair[0].reconfigure(epoch=4, ring=ring, index=0))
    silent = env.net.connect(pair[0].addr, timeout=5.0)  # the previous rank's connection
    silent.send({"token": "job", "epoch": 4})
    accepted = peer.accept(timeout=5.0)
    assert accepted.recv(timeout=5.0) == {"token": "job", "epoch": 4}
    assert not task.join(0.2)
    pair[1].send_abort(pair[0].addr, 4, timeout=5.0)
    _ends_aborted(task, box)
    for c in (silent, accepted, peer):
        c.close()


def test_an_abort_that_comes_first_fails_that_epoch_at_once_but_not_the_next(env, pair):
    assert not pair[0].abort(6)  # nothing built yet: remembered
    ring = [e.addr for e in pair]
    with pytest.raises(RecoverableError, match="aborted"):
        pair[0].reconfigure(epoch=6, ring=ring, index=0)
    _build(env, pair, epoch=7)
    buf = np.ones(100, np.float32)
    tasks = [_run(env, lambda e=e: e.all_reduce(buf.copy())) for e in pair]
    assert all(t.join(20.0) and "error" not in box for t, box in tasks)


def test_an_abort_for_a_built_ring_fails_its_next_all_reduce(env, pair):
    _build(env, pair, epoch=8)
    assert pair[0].abort(8)
    with pytest.raises(RecoverableError, match="aborted"):
        pair[0].all_reduce(np.ones(100, np.float32))


def test_an_all_reduce_refused_for_an_aborted_epoch_is_recorded_as_entered_and_failed(env, pair):
    """Its ring peers' records then show the all-reduce that failed around a hung participant (the lighthouse's
    notice came before they entered), which is what the diagnosis reads; nothing recorded looked healthy."""
    rec = pair[0].telemetry = Recorder(env.clock, capacity=64)
    _build(env, pair, epoch=8)
    tasks = [_run(env, lambda e=e: e.all_reduce(np.ones(100, np.float32))) for e in pair]
    assert all(t.join(20.0) and "error" not in box for t, box in tasks)
    assert pair[0].abort(8)
    with pytest.raises(RecoverableError, match="aborted"):
        pair[0].all_reduce(np.ones(100, np.float32))
    s, h = summarize(rec.records(), env.clock.now())
    assert (s["f_qid"][0], s["f_cid"][0], s["f_state"][0], s["f_ring"][0], s["f_index"][0]) == (8, 1, FAILED, 2, 0)
    assert h["cid"][-1] == 0 and h["cid"][-2] == -1  # the healthy all-reduce before it is the one completed


def test_an_abort_request_with_another_token_is_ignored(env, pair):
    _build(env, pair, epoch=9)
    stranger = FtarEngine(env=env, kernels=CpuKernels(), token="not-the-job", config=LONG)
    try:
        assert stranger.send_abort(pair[0].addr, 9, timeout=5.0)
        # then a real request for an older epoch (harmless to ring 9): once it is seen, so was the stranger's
        assert pair[1].send_abort(pair[0].addr, 2, timeout=5.0)
        for _ in range(2000):
            if pair[0].aborted_epoch != -1:
                break
            env.clock.sleep(0.01)
        assert pair[0].aborted_epoch == 2
        tasks = [_run(env, lambda e=e: e.all_reduce(np.ones(100, np.float32))) for e in pair]
        assert all(t.join(20.0) and "error" not in box for t, box in tasks)  # ring 9 still works
    finally:
        stranger.close()
