"""The catch-up seam's contract: one fetch protocol (ftrun.catchup.fetcher) over every transport —
HTTP (aiohttp server), framed messages over the real env.net, and the emulator's env.net carrying
shape-only payloads. Each body runs as the env's main task, so timeouts hold in virtual time too."""

from __future__ import annotations

import pytest
import torch

from ftrun.catchup import snapshot
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupAuthError, CatchupError, CatchupStepError, CatchupUsageError
from ftrun.catchup.http_transport import HttpCatchup
from ftrun.catchup.net_transport import NetCatchup, NetCatchupServer
from ftrun.catchup.snapshot import SnapshotStore, pieces, tensor_views
from ftrun.config import Timeouts
from ftrun.env.admission import ListenLimits
from ftrun.env.base import PeerClosed
from ftrun.env.real import RealEnv
from harness.engine import EmulatedWorld
from harness.run.seams import ShapePayloads, ShapeSnapshotStore

pytestmark = pytest.mark.timeout(60)
TOKEN = "tok"
CONFIG = CatchupConfig(max_shard_bytes=256, timeouts=Timeouts(catchup_long_poll_s=0.3, catchup_stall_s=2.0,
                                                              catchup_timeout_s=10.0, connect_timeout_s=2.0))


def _state(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    real = {"model.w": torch.randn(40, 7, generator=g), "model.b": torch.arange(9, dtype=torch.int64),
            "optim.m": torch.randn(300, generator=g).to(torch.bfloat16)}
    return real if device == "cpu" else {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in real.items()}


def _http(env, token=TOKEN):
    return HttpCatchup(env=env, token=token, config=CONFIG)


def _net(env, token=TOKEN):
    return NetCatchup(env=env, token=token, config=CONFIG)


def _net_shape(env, token=TOKEN):
    return NetCatchup(env=env, token=token, config=CONFIG, payloads=ShapePayloads(),
                      store=lambda on_change: ShapeSnapshotStore(max_shard_bytes=CONFIG.max_shard_bytes,
                                                                 on_change=on_change))


KINDS = {"http": (RealEnv, _http, "cpu"), "net": (RealEnv, _net, "cpu"),
         "net_shape": (lambda: EmulatedWorld(seed=0).host_env("host-0"), _net_shape, "meta")}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    return KINDS[request.param]


def _run(kind, body):
    make_env, make, device = kind
    env = make_env()
    return env.run(body, env, make, device)


def _same(got: dict, want: dict, device: str) -> bool:
    if sorted(got) != sorted(want):
        return False
    for k, t in want.items():
        g = got[k]
        if g.dtype != t.dtype or tuple(g.shape) != tuple(t.shape):
            return False
        if device == "cpu" and not torch.equal(g, t):
            return False
    return True


def test_a_state_fetched_from_two_sources_arrives_whole(kind):
    def body(env, make, device):
        a, b, me = make(env), make(env), make(env)
        try:
            for s in (a, b):
                s.publish(5, _state(device), {"step": 5})
            r = me.fetch(5, [a.url, b.url])
            return r, _same(r.tensors, _state(device), device)
        finally:
            for s in (a, b, me):
                s.stop()

    result, same = _run(kind, body)
    assert same and result.metadata == {"step": 5} and result.failures == ()
    assert sum(result.bytes_by_source.values()) == result.num_bytes
    assert all(n > 0 for n in result.bytes_by_source.values())  # the plan spread the shards


def test_a_state_published_after_a_reserve_arrives_whole(kind):
    def body(env, make, device):
        a, me = make(env), make(env)
        try:
            a.reserve(_state(device))
            a.publish(5, _state(device), {"step": 5})
            return _same(me.fetch(5, [a.url]).tensors, _state(device), device)
        finally:
            a.stop()
            me.stop()

    assert _run(kind, body)


def test_a_reserved_buffer_is_what_the_next_publish_fills():
    """reserve() faults a buffer in off the caller's path; the next publish copies into it (a reserve for
    a larger layout than the current buffer's), its padding zero; a large enough buffer is kept as is."""
    store = SnapshotStore(env=RealEnv(), max_shard_bytes=CONFIG.max_shard_bytes)
    small, big = _state(), {**_state(), "optim.v": torch.ones(1000)}
    try:
        store.publish(1, small)
        assert store.wait_ready(5.0)
        fitted = store.lookup(1)[1].buffer.capacity
        store.reserve(big)
        store.publish(2, small)
        assert store.wait_ready(5.0)
        published = store.lookup(2)[1]
        assert published.buffer.capacity > fitted  # the reserved one, sized for `big`
        got = tensor_views(published.buffer.flat, published.manifest.layout)
        assert all(torch.equal(got[k], v) for k, v in small.items())
        gaps = published.manifest.layout.gaps()
        assert gaps and not any(published.buffer.flat[a:b].any() for a, b in gaps)
        store.reserve(small)  # fits the buffer it has: nothing to do
        store.publish(3, big)
        assert store.wait_ready(5.0) and store.lookup(3)[1].buffer is published.buffer
    finally:
        store.close()


def test_borrow_is_a_collection_of_names_not_one_string():
    """A string given as `borrow` would lend every tensor whose name is a substring of it: refused, naming it."""
    store = SnapshotStore(env=RealEnv(), max_shard_bytes=CONFIG.max_shard_bytes)
    try:
        for call in (lambda: store.publish(1, _state(), borrow="optim.v"), lambda: store.reserve(_state(), borrow="x")):
            with pytest.raises(CatchupUsageError, match="borrow must be a collection of tensor names"):
                call()
        store.publish(1, _state(), borrow=["nothing.by.this.name"])  # a list works, names not in the state ignored
        assert store.wait_ready(5.0)
    finally:
        store.close()


def test_pieces_take_a_range_from_the_buffer_and_the_lent_bytes():
    mem = memoryview(bytes(range(100)))
    lent = ((10, memoryview(b"A" * 10)), (20, memoryview(b"B" * 5)), (60, memoryview(b"C" * 20)))
    whole = mem[:10].tobytes() + b"A" * 10 + b"B" * 5 + mem[25:60].tobytes() + b"C" * 20 + mem[80:].tobytes()
    for offset, nbytes in [(0, 100), (0, 10), (12, 3), (15, 10), (19, 2), (25, 35), (59, 2), (70, 30), (99, 1)]:
        got = pieces(mem, lent, offset, nbytes)
        assert b"".join(got) == whole[offset:offset + nbytes], (offset, nbytes)
        assert all(len(p) for p in got)
    assert len(pieces(mem, lent, 0, 100)) == 6 and len(pieces(mem, (), 3, 50)) == 1


def test_lent_tensors_are_served_in_place_and_a_change_fails_the_crc(kind, monkeypatch):
    """publish(borrow=...) serves those tensors from their own memory (not copied into the snapshot
    buffer): a joiner gets them whole; changed after they were checksummed and before the retire, they
    fail the shard CRC; the next publish serves the new values."""
    monkeypatch.setattr(snapshot, "LEND_MIN_BYTES", 0)
    if kind[2] == "meta":
        pytest.skip("shape-only snapshots have no bytes to lend")

    def body(env, make, device):
        a, me = make(env), make(env)
        state = _state(device)
        try:
            a.publish(5, state, {"step": 5}, borrow={"model.w", "optim.m"})
            got = me.fetch(5, [a.url]).tensors
            published = a.server.store.lookup(5)[1]
            in_buffer = tensor_views(published.buffer.flat, published.manifest.layout)
            copied = {k: torch.equal(in_buffer[k], state[k]) for k in state}
            state["model.w"][3, 3] += 1.0  # the caller broke its promise
            with pytest.raises(CatchupError, match="CRC32"):
                me.fetch(5, [a.url])
            a.publish(6, state, {"step": 6}, borrow={"model.w", "optim.m"})
            again = me.fetch(6, [a.url]).tensors
            return _same(got, _state(device), device), copied, _same(again, state, device)
        finally:
            a.stop()
            me.stop()

    first, copied, second = _run(kind, body)
    assert first and second
    assert copied == {"model.w": False, "model.b": True, "optim.m": False}


def test_a_step_published_during_the_long_poll_is_served(kind):
    def body(env, make, device):
        a, me = make(env), make(env)
        try:
            def late():
                env.clock.sleep(0.1)
                a.publish(3, _state(device), {})
            env.spawn(late, name="late")
            return me.fetch(3, [a.url]).step
        finally:
            a.stop()
            me.stop()

    assert _run(kind, body) == 3


def test_a_step_nobody_has_raises_a_step_error_after_the_long_poll(kind):
    def body(env, make, device):
        a, me = make(env), make(env)
        try:
            a.publish(2, _state(device), {})
            t0 = env.clock.now()
            with pytest.raises(CatchupStepError):
                me.fetch(4, [a.url])
            waited = env.clock.now() - t0
            a.retire(2)
            with pytest.raises(CatchupStepError):
                me.fetch(2, [a.url])  # retired: answered at once
            return waited
        finally:
            a.stop()
            me.stop()

    assert _run(kind, body) >= CONFIG.long_poll_s * 0.9


def test_a_dead_source_is_dropped_and_its_shards_replanned(kind):
    def body(env, make, device):
        a, dead, me = make(env), make(env), make(env)
        try:
            a.publish(1, _state(device), {})
            dead_url = dead.url
            dead.stop()
            r = me.fetch(1, [a.url, dead_url])
            return r, _same(r.tensors, _state(device), device)
        finally:
            a.stop()
            me.stop()

    result, same = _run(kind, body)
    assert same and result.failures and sum(result.bytes_by_source.values()) == result.num_bytes


def test_a_wrong_token_is_refused(kind):
    def body(env, make, device):
        a, me = make(env), make(env, "other-token")
        try:
            a.publish(1, _state(device), {})
            with pytest.raises(CatchupAuthError):
                me.fetch(1, [a.url])
        finally:
            a.stop()
            me.stop()

    _run(kind, body)


def test_peers_without_the_token_are_disconnected_and_cannot_fill_the_connection_cap():
    """A wrong-token request is answered 401 and its connection closed: peers without the token that stay
    connected after their 401 would each hold a live slot (and a server task) forever, and a few of them
    at the listener's cap would lock every real fetch out."""
    env = RealEnv(net_limits=ListenLimits(max_connections=4, max_pending=2))

    def body():
        a, me = _net(env), _net(env)
        intruders = []
        try:
            a.publish(1, _state(), {})
            for _ in range(4):
                conn = env.net.connect(a.url, timeout=2.0)
                intruders.append(conn)
                conn.send({"op": "manifest", "step": 1, "token": "guess"})
                assert conn.recv(timeout=2.0)["status"] == 401
                with pytest.raises(PeerClosed):  # closed by the server, not left to idle
                    conn.recv(timeout=2.0)
            got = me.fetch(1, [a.url])
            return _same(got.tensors, _state(), "cpu")
        finally:
            for conn in intruders:
                conn.close()
            a.stop()
            me.stop()

    assert env.run(body)


def test_a_peer_that_connects_and_sends_nothing_is_closed_after_the_connect_timeout():
    """A silent connection holds a server task only until connect_timeout_s (as the lighthouse's, the ring's
    and the agent's first message do), not until enough newer connections evict it."""
    env = RealEnv()
    config = CatchupConfig(timeouts=Timeouts(connect_timeout_s=0.3))

    def body():
        server = NetCatchupServer(env=env, token=TOKEN, config=config)
        silent = None
        try:
            silent = env.net.connect(server.start(), timeout=2.0)
            with pytest.raises(PeerClosed):  # closed by the server (a NetTimeout here: still held)
                silent.recv(timeout=10.0)
        finally:
            if silent is not None:
                silent.close()
            server.stop()

    env.run(body)


def test_a_connection_accepted_while_the_server_stops_is_closed():
    """stop() closes the connections it knows of; one accepted just before (its accept returned, its on_accept not
    yet run) is closed when it is registered instead of being served after the stop."""
    class Conn:
        closed = False

        def close(self):
            self.closed = True

    env = RealEnv()

    def body():
        server = NetCatchupServer(env=env, token=TOKEN, config=CONFIG)
        server.start()
        live = Conn()
        server._register(live)
        server.stop()
        late = Conn()
        server._register(late)  # the accepting task's on_accept, run after stop()
        return live.closed, late.closed

    assert env.run(body) == (True, True)


def test_a_net_server_whose_listener_is_gone_says_so_once_and_a_stop_says_nothing(caplog):
    import logging
    import time
    caplog.set_level(logging.ERROR, logger="ftrun.heal")
    env = RealEnv()
    gone, stopped = _net(env).server, _net(env).server  # each started serving
    gone._listener.close()  # as if the socket went away under the server
    stopped.stop()
    deadline = time.monotonic() + 5.0
    while "accepts no more connections" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    records = [r for r in caplog.records if "accepts no more connections" in r.getMessage()]
    assert len(records) == 1 and gone.url in records[0].getMessage()
    gone.stop()
