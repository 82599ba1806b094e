"""Catch-up state transfer over real HTTP on 127.0.0.1: round trips, faults, step and token errors."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from ftrun.catchup.client import fetch, fetch_state
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupAuthError, CatchupError, CatchupStepError, CatchupTimeout
from ftrun.catchup.fetcher import fetch_with
from ftrun.catchup.heal import make_heal
from ftrun.catchup.http_transport import HttpTransport
from ftrun.catchup.checksum import crc32
from ftrun.catchup.server import CatchupServer, Fault
from ftrun.catchup.wire import HEAD_END, encode_get, parse_head, split_url
from ftrun.config import Timeouts
from ftrun.env.real import IDLE_THREAD_NAME, RealEnv
from ftrun.quorum.decide import Participant
from ftrun.replica.endpoints import encode_endpoints
from ftrun.replica.manager import StepQuorum

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "job-token"
CONFIG = CatchupConfig(max_shard_bytes=256 << 10, timeouts=Timeouts(catchup_long_poll_s=2.0, catchup_stall_s=5.0))
TIMEOUTS = Timeouts(catchup_timeout_s=30.0)


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """About 2.2 MB of mixed tensors: big ones split into shards, small ones packed, odd dtypes."""
    g = torch.Generator().manual_seed(seed)
    state = {f"layers.{i}.weight": torch.randn(64, 97 + i, generator=g) for i in range(12)}
    state.update({f"layers.{i}.bias": torch.randn(97 + i, generator=g) for i in range(12)})
    state["embed"] = torch.randn(1000, 300, generator=g)
    state["optim.exp_avg"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)
    state["optim.step"] = torch.tensor(41, dtype=torch.int64)
    state["mask"] = torch.rand(33, generator=g) > 0.5
    state["rng"] = torch.Generator().manual_seed(seed + 1).get_state()
    state["empty"] = torch.zeros(0, 4)
    return state


def digest(state) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


STATE = make_state()
DIGEST = digest(STATE)


@pytest.fixture
def servers():
    env, started = RealEnv(), []

    def start(n=1, *, fault=None, config=CONFIG, token=TOKEN):
        new = [CatchupServer(env=env, token=token, config=config, fault=fault) for _ in range(n)]
        started.extend(new)
        return new, [s.start() for s in new]

    before = {t.ident for t in threading.enumerate()}
    yield start
    for s in started:
        s.stop()
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()
            and t.name != IDLE_THREAD_NAME]  # the tasks' pool threads wait for the next task
    assert left == [], f"threads left behind: {left}"


def publish_all(servers_, step=7, state=STATE):
    for s in servers_:
        s.publish(step, state, {"step": step, "loader": [1, 2, 3]})


def once(kind, shard=None, **kw):
    """A fault hook that spoils `shard` (default: the first shard the server sends) once."""
    fired = []

    def hook(step, index):
        if shard in (None, index) and not fired:
            fired.append(index)
            return Fault(kind, **kw)
        return None

    return hook


@pytest.mark.parametrize("num_sources", [1, 2, 3])
def test_round_trip_is_bitwise_identical(servers, num_sources):
    srv, urls = servers(num_sources)
    publish_all(srv)
    result = fetch(7, urls, TOKEN, TIMEOUTS, config=CONFIG)
    assert digest(result.tensors) == DIGEST
    assert {k: v.dtype for k, v in result.tensors.items()} == {k: v.dtype for k, v in STATE.items()}
    assert result.metadata == {"step": 7, "loader": [1, 2, 3]} and result.failures == ()
    assert all(result.bytes_by_source[u] > 0 for u in urls)  # every source served its share


def test_steady_state_publish_reuses_the_buffer_and_fetch_reuses_the_destination(servers):
    (srv,), urls = servers(1)
    srv.publish(1, STATE)
    views = srv.store._views
    srv.publish(2, make_state(5))  # same layout, new values: same buffer, same views
    assert srv.store._views is views
    buffer = torch.empty(8 << 20, dtype=torch.uint8)
    out = fetch_state(2, urls, TOKEN, TIMEOUTS, config=CONFIG, buffer=buffer)
    assert digest(out) == digest(make_state(5))
    assert out["embed"].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_a_transport_keeps_its_connections_between_fetches(servers):
    srv, urls = servers(2)
    publish_all(srv)
    env = RealEnv()
    transport = HttpTransport(env=env, token=TOKEN, config=CONFIG)
    try:
        first = fetch_with(env, transport, 7, urls, CONFIG)
        assert set(transport._idle) == set(urls)  # one idle link per source, its connection open
        conns = {u: link._conn for u, link in transport._idle.items()}
        second = fetch_with(env, transport, 7, urls, CONFIG)
        assert digest(first.tensors) == digest(second.tensors) == DIGEST and second.failures == ()
        assert {u: link._conn for u, link in transport._idle.items()} == conns  # the same connections
    finally:
        transport.close()
    assert transport._idle == {} and all(c.usable is False for c in conns.values())


def test_pipelined_shards_arrive_whole_behind_their_heads_when_the_client_reads_late(servers):
    """A shard's body goes from the snapshot's memory straight to the socket, once its head has left
    the transport: a client that pipelines every request and then reads nothing for a while (the
    server's socket buffer fills, so a head may find it full) still gets each head followed by exactly
    its shard's bytes."""
    (srv,), urls = servers(1, config=CatchupConfig(max_shard_bytes=16 << 10, timeouts=CONFIG.timeouts))
    publish_all([srv])  # about 140 shards: many chances for a head to find the socket buffer full
    srv.wait_ready()
    shards, crcs = srv.store.lookup(7)[1].manifest.layout.shards, srv.store.lookup(7)[1].manifest.crcs
    host, port = split_url(urls[0])
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server must wait
        sock.settimeout(10.0)
        sock.connect((host, port))
        sock.sendall(b"".join(encode_get(host, port, f"/catchup/7/shard/{s.index}", TOKEN) for s in shards))
        time.sleep(0.3)
        stream = sock.makefile("rb")
        for shard, crc in zip(shards, crcs):
            head = b""
            while not head.endswith(HEAD_END):
                head += stream.read(1)
            parsed = parse_head(head)
            assert (parsed.status, parsed.content_length) == (200, shard.nbytes)
            assert crc32(stream.read(shard.nbytes)) == crc


@pytest.mark.parametrize("fault, failure", [("corrupt", "CRC32"), ("truncate", "closed the connection")])
def test_a_corrupted_or_truncated_shard_is_fetched_again_from_another_source(servers, fault, failure):
    srv, urls = servers(1, fault=once(fault))
    srv2, urls2 = servers(1)
    publish_all(srv + srv2)
    result = fetch(7, urls + urls2, TOKEN, TIMEOUTS, config=CONFIG)
    assert digest(result.tensors) == DIGEST
    assert len(result.failures) == 1 and result.failures[0].startswith(urls[0]) and failure in result.failures[0]


def test_a_bad_shard_from_the_only_source_is_retried_there(servers):
    srv, urls = servers(1, fault=once("corrupt", 2))
    publish_all(srv)
    result = fetch(7, urls, TOKEN, TIMEOUTS, config=CONFIG)
    assert digest(result.tensors) == DIGEST and len(result.failures) == 1


SOURCE_CHILD = """
import os, signal, sys
from ftrun.catchup.checksum import crc32
from ftrun.catchup.server import CatchupServer, Fault
from ftrun.catchup.wire import HEAD_END, encode_get, parse_head, split_url
from ftrun.env.real import RealEnv
from tests.integration.test_catchup import CONFIG, STATE, TOKEN
def die_mid_shard(step, index):  # half of the first shard goes out, then the process is SIGKILLed
    return Fault("truncate", then=lambda: os.kill(os.getpid(), signal.SIGKILL))
server = CatchupServer(env=RealEnv(), token=TOKEN, config=CONFIG, fault=die_mid_shard)
print(server.start(), flush=True)
server.publish(7, STATE, {"step": 7, "loader": [1, 2, 3]})
sys.stdin.read()
"""


def test_source_sigkilled_mid_transfer_is_replanned_around(servers):
    child = subprocess.Popen([sys.executable, "-c", SOURCE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        child_url = child.stdout.readline().strip()
        assert child_url.startswith("http://127.0.0.1:")
        srv, urls = servers(2)
        publish_all(srv)
        result = fetch(7, [child_url] + urls, TOKEN, TIMEOUTS, config=CONFIG)
        assert child.wait(timeout=10) == -signal.SIGKILL  # it really died during the fetch
        assert digest(result.tensors) == DIGEST
        assert result.failures[0].startswith(f"{child_url} shard ") and "closed the connection" in result.failures[0]
        # Any later failure is the dead source's: its reconnect refused (or reset, if the kernel accepted it
        # while the process died) and it is dropped -- unless the survivors stole its shards and finished first.
        assert all(f.startswith((f"{child_url} shard ", f"dropped {child_url}: ")) for f in result.failures)
        assert result.bytes_by_source[child_url] == 0  # every shard came from a live source
        assert sum(result.bytes_by_source[u] for u in urls) == result.num_bytes
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stdin.close()


def test_all_sources_gone_names_what_failed(servers):
    srv, urls = servers(2)
    publish_all(srv)
    for s in srv:
        s.stop()
    with pytest.raises(CatchupError) as e:
        fetch(7, urls, TOKEN, TIMEOUTS, config=CONFIG)
    assert all(u in str(e.value) for u in urls)


def test_wrong_step_is_a_clear_error(servers):
    srv, urls = servers(2)
    publish_all(srv, step=7)
    with pytest.raises(CatchupStepError) as e:
        fetch(5, urls, TOKEN, TIMEOUTS, config=CONFIG)
    assert e.value.status == 410 and e.value.have == 7
    assert "step 5" in str(e.value) and "step 7" in str(e.value)


def test_retired_step_is_gone(servers):
    (srv,), urls = servers(1)
    srv.publish(7, STATE)
    assert srv.wait_ready(10)
    srv.retire(7)
    with pytest.raises(CatchupStepError) as e:
        fetch(7, urls, TOKEN, TIMEOUTS, config=CONFIG)
    assert e.value.status == 410 and "retired" in str(e.value)


def test_wrong_token_is_401(servers):
    srv, urls = servers(1)
    publish_all(srv)
    with pytest.raises(CatchupAuthError):
        fetch(7, urls, "not-the-token", TIMEOUTS, config=CONFIG)
    req = urllib.request.Request(urls[0] + "/catchup/7/manifest")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401 and "token" in json.loads(e.value.read())["error"]


def test_unpublished_step_long_polls_then_succeeds(servers):
    env = RealEnv()
    config = CatchupConfig(max_shard_bytes=256 << 10, timeouts=Timeouts(catchup_long_poll_s=10.0))
    srv, urls = servers(2, config=config)
    results = []
    task = env.spawn(lambda: results.append(fetch(7, urls, TOKEN, TIMEOUTS, config=config)), name="fetch")
    env.clock.sleep(0.3)
    assert task.is_alive() and not results  # still waiting: nothing published yet
    publish_all(srv)
    assert task.join(timeout=20) and task.exception is None
    assert digest(results[0].tensors) == DIGEST


def test_step_never_published_times_out_with_404(servers):
    config = CatchupConfig(max_shard_bytes=256 << 10, timeouts=Timeouts(catchup_long_poll_s=0.2))
    srv, urls = servers(1, config=config)
    publish_all(srv, step=7)
    with pytest.raises(CatchupStepError) as e:
        fetch(8, urls, TOKEN, TIMEOUTS, config=config)
    assert e.value.status == 404 and "step 8" in str(e.value) and e.value.have == 7


def test_heal_hook_fetches_from_healthy_participants_same_rank(servers):
    srv, urls = servers(2)
    publish_all(srv)
    rank = 1

    def peer(url):  # rank 1's endpoints in one replica
        return encode_endpoints({"catchup": url, "ftar": "127.0.0.1:2"})

    participants = (Participant("a", 7), Participant("b", 7), Participant("c", 5))  # c is behind: never a source
    q = StepQuorum(quorum_id=3, step=7, participants=participants, replica_index=2, healed=True, reason="test",
                   peer_addrs=(peer(urls[0]), peer(urls[1]), peer("http://127.0.0.1:9")))
    loaded = []

    def fetch_fn(step, sources):
        assert step == 7 and sorted(sources) == sorted(urls)
        return fetch_state(step, sources, TOKEN, TIMEOUTS, config=CONFIG)

    make_heal(fetch=fetch_fn, load_state=loaded.append, rank=rank)(q)
    assert digest(loaded[0]) == DIGEST


@pytest.fixture
def hung_source():
    """A listener that accepts connections (in the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_a_hung_source_is_dropped_after_stall_s(servers, hung_source):
    config = CatchupConfig(max_shard_bytes=256 << 10, timeouts=Timeouts(catchup_long_poll_s=0.2, catchup_stall_s=0.3))
    srv, urls = servers(1, config=config)
    publish_all(srv)
    result = fetch(7, [hung_source] + urls, TOKEN, TIMEOUTS, config=config)
    assert digest(result.tensors) == DIGEST
    assert result.failures[0].startswith(f"skipped {hung_source}") and "sent nothing" in result.failures[0]
    assert result.bytes_by_source[urls[0]] == result.num_bytes


def test_the_whole_fetch_is_bounded_by_catchup_timeout(hung_source):
    config = CatchupConfig(timeouts=Timeouts(catchup_long_poll_s=5.0, catchup_stall_s=5.0))
    with pytest.raises(CatchupTimeout) as e:  # the 0.5 s bound, not the 5 s stall of the source
        fetch(7, [hung_source], TOKEN, Timeouts(catchup_timeout_s=0.5), config=config)
    assert "0.5s" in str(e.value)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fresh", [False, True], ids=["reused-buffer", "fresh-buffer"])
def test_bench_smoke(fresh):
    out = subprocess.run([sys.executable, "-m", "ftrun.cli", "bench", "catchup", "--state-mb", "2,4", "--sources", "1,2",
                          "--iters", "1", "--shard-mb", "1", "--json"] + (["--fresh-buffer"] if fresh else []),
                         capture_output=True, text=True, cwd=ROOT, timeout=90, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    rows = figures["results"]
    assert [(r["state_mb"], r["sources"]) for r in rows] == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert all(r["gbps"] > 0 and r["raw_gbps"] > 0 and r["ratio"] == r["gbps"] / r["raw_gbps"] for r in rows)
    assert figures["min_ratio"] == min(r["ratio"] for r in rows)
    assert figures["fresh_buffer"] is fresh and all(r["fresh_buffer"] is fresh for r in rows)
    assert ("a fresh buffer per fetch" if fresh else "one reused buffer") in out.stdout


def test_bench_lists_are_checked():
    from ftrun_bench.catchup import _int_list

    assert _int_list("500,50,50", "--state-mb") == [50, 500]
    for bad in ("50,x", "", "0,2"):
        with pytest.raises(SystemExit, match="--state-mb"):
            _int_list(bad, "--state-mb")
