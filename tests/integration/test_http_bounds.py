"""Both HTTP servers under hostile clients: a connection cap that keeps a real fetch working under a
small fd budget, idle/header-read timeouts, and 4xx (never 500) with one rate-limited WARNING line (no
traceback) for every malformed request."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from ftrun.catchup.client import fetch
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.errors import CatchupError
from ftrun.catchup.http_guard import HttpLimits
from ftrun.catchup.server import CatchupServer
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.quorum.http import StatusServer
from ftrun.quorum.service import Lighthouse

pytestmark = pytest.mark.timeout(60)

TOKEN = "job-token"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "http_bounds_worker.py")
FETCH = CatchupConfig(timeouts=Timeouts(catchup_long_poll_s=0.5, catchup_stall_s=1.0))


def raw_request(addr: tuple[str, int], data: bytes) -> bytes:
    """Send raw bytes, return everything the server answers until it closes or goes quiet."""
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def get(path: str, auth: bytes = b"Bearer " + TOKEN.encode()) -> bytes:
    return b"GET " + path.encode("utf-8") + b" HTTP/1.1\r\nHost: x\r\nAuthorization: " + auth + \
        b"\r\nConnection: close\r\n\r\n"


@pytest.fixture
def catchup_server():
    env = RealEnv()
    server = CatchupServer(env=env, token=TOKEN, limits=HttpLimits(idle_timeout_s=0.3, warn_every_s=3600))
    host, port = server.start().removeprefix("http://").rsplit(":", 1)
    server.publish(3, {"w": torch.arange(10, dtype=torch.float32)})
    server.wait_ready(10.0)
    yield server, (host, int(port))
    server.stop()


MALFORMED = [
    ("non-ASCII byte in Authorization", get("/catchup/3/manifest", b"Bearer \xff\xfe"), 401),
    ("non-ASCII token that is valid UTF-8", get("/catchup/3/manifest", "Bearer t\u00f6ken".encode()), 401),
    ("step of U+00B2", get("/catchup/%C2%B2/manifest"), 400),
    ("step of U+00B2, raw UTF-8", get("/catchup/\u00b2/manifest"), 400),
    ("step of 5,000 digits", get("/catchup/" + "9" * 5000 + "/manifest"), 400),
    ("shard of U+00B2", get("/catchup/3/shard/%C2%B2"), 400),
    ("shard of 5,000 digits", get("/catchup/3/shard/" + "1" * 5000), 400),
    ("not HTTP at all", b"\x16\x03\x01\x00\xa5garbage\r\n\r\n", 400),
    ("a header line too long", get("/catchup/status", b"Bearer " + b"a" * 9000), 400),
]


@pytest.mark.parametrize(("name", "data", "status"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_catchup_server_answers_4xx_and_warns_once_without_a_traceback(catchup_server, caplog, name, data, status):
    server, addr = catchup_server
    with caplog.at_level(logging.DEBUG):
        answers = [raw_request(addr, data) for _ in range(5)]
    assert [status_of(a) for a in answers] == [status] * 5
    ours = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(ours) == 1, [r.getMessage() for r in ours]  # rate-limited: 5 requests, one line
    assert ours[0].levelno == logging.WARNING and ours[0].exc_info is None and "\n" not in ours[0].getMessage()
    assert status_of(raw_request(addr, get("/catchup/status"))) == 200  # the server is fine


def test_idle_and_slow_header_connections_are_closed_by_the_server(catchup_server):
    server, addr = catchup_server
    idle = socket.create_connection(addr, timeout=10)
    slow = socket.create_connection(addr, timeout=10)
    slow.sendall(b"GET /catchup/status HTTP/1.1\r\nHost: x\r\n")  # never finishes its head
    try:
        assert idle.recv(1) == b"" and slow.recv(1) == b""  # closed (recv would time out otherwise)
    finally:
        idle.close()
        slow.close()
    assert server.guard.num_open == 0


def test_a_client_that_stops_reading_mid_shard_is_dropped_and_the_server_serves_on(caplog):
    """The body goes straight from the snapshot to the socket; a client that asks for a 32 MB shard and reads
    nothing holds that write no longer than the idle timeout, and the next client gets the state."""
    env = RealEnv()
    server = CatchupServer(env=env, token=TOKEN, limits=HttpLimits(idle_timeout_s=0.3, warn_every_s=3600),
                           config=CatchupConfig(max_shard_bytes=32 << 20))
    url = server.start()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    state = {"w": torch.arange(8 << 20, dtype=torch.float32)}  # 32 MB: far more than both socket buffers
    server.publish(3, state)
    server.wait_ready(10.0)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as stuck, caplog.at_level(logging.WARNING):
            stuck.sendall(get("/catchup/3/shard/0"))
            deadline = time.monotonic() + 10.0
            while not [r for r in caplog.records if "read nothing of step 3 shard 0" in r.getMessage()]:
                assert time.monotonic() < deadline, "the server never dropped a client that reads nothing"
                time.sleep(0.05)
            received, ended = 0, False
            while time.monotonic() < deadline + 10.0:  # what was already sent drains, then the connection ends
                try:
                    chunk = stuck.recv(1 << 20)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    ended = True
                    break
                received += len(chunk)
            assert ended and received < 32 << 20, (ended, received)
        result = fetch(3, [url], TOKEN, Timeouts(catchup_timeout_s=20.0), config=FETCH)
        assert torch.equal(result.tensors["w"], state["w"])
    finally:
        server.stop()


def _worker(cap: int):
    """A server with 192 spare descriptors: a cap of 32 plus a backlog of 128 fit, 400 connections do not."""
    proc = subprocess.Popen([sys.executable, WORKER, "192", str(cap), "128"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url = proc.stdout.readline().strip()
    assert url.startswith("http://"), "worker did not start"
    return proc, url


def _flood(url: str, count: int) -> list[socket.socket]:
    """Up to `count` idle connections; stops early once the server no longer accepts any (its backlog is full)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    socks = []
    for _ in range(count):
        try:
            socks.append(socket.create_connection((host, int(port)), timeout=2.0))
        except TimeoutError:
            break
    return socks


def _close(proc, socks) -> None:
    for s in socks:
        s.close()
    proc.stdin.close()
    proc.wait(timeout=20)


def test_idle_connections_without_the_token_cannot_starve_a_real_fetch():
    """Why item 10, scaled down: 400 idle connections against a server with 192 spare fds and a cap of 32."""
    proc, url = _worker(cap=32)
    socks = []
    try:
        socks = _flood(url, 400)
        assert len(socks) == 400
        result = fetch(3, [url], TOKEN, Timeouts(catchup_timeout_s=20.0), config=FETCH)
        assert torch.equal(result.tensors["w"], torch.arange(1000, dtype=torch.float32))
        closed = sum(1 for s in socks[:300] if s.recv(1) == b"")  # the oldest were evicted
        assert closed == 300
    finally:
        _close(proc, socks)


def test_without_the_cap_the_same_flood_makes_the_fetch_fail():
    """The control: the cap is what keeps the fetch working (no cap: the server runs out of fds)."""
    proc, url = _worker(cap=100_000)
    socks = []
    try:
        socks = _flood(url, 400)
        with pytest.raises(CatchupError):
            fetch(3, [url], TOKEN, Timeouts(catchup_timeout_s=3.0, connect_timeout_s=1.0), config=FETCH)
    finally:
        _close(proc, socks)


def test_lighthouse_status_server_is_bounded_the_same_way(caplog):
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1), token="t0k")
    lh.start()
    http = StatusServer(env=env, lighthouse=lh, token="t0k", limits=HttpLimits(idle_timeout_s=0.3,
                                                                                max_connections=4))
    host, port = http.start().removeprefix("http://").rsplit(":", 1)
    addr = (host, int(port))
    try:
        with caplog.at_level(logging.DEBUG):
            assert status_of(raw_request(addr, get("/status", b"Bearer \xff"))) == 401
            assert status_of(raw_request(addr, b"\x00\x01 not http\r\n\r\n")) == 400
        assert all(r.levelno <= logging.WARNING and r.exc_info is None for r in caplog.records)
        socks = [socket.create_connection(addr, timeout=10) for _ in range(10)]
        assert status_of(raw_request(addr, get("/status", b"Bearer t0k"))) == 200  # evicts an idle one
        assert sum(1 for s in socks if s.recv(1) == b"") == 10  # evicted at the cap or timed out
        for s in socks:
            s.close()
    finally:
        http.stop()
        lh.stop()
    assert not [t for t in threading.enumerate() if t.name == "lighthouse-http" and t.is_alive()]


def test_busy_connections_are_never_evicted_and_a_full_server_answers_503():
    env = RealEnv()
    server = CatchupServer(env=env, token=TOKEN, limits=HttpLimits(max_connections=2),
                           config=CatchupConfig(timeouts=Timeouts(catchup_long_poll_s=2.0)))
    host, port = server.start().removeprefix("http://").rsplit(":", 1)
    addr = (host, int(port))
    polls = [socket.create_connection(addr, timeout=10) for _ in range(2)]
    try:
        for s in polls:  # long-polls for a step nobody publishes: both connections are busy
            s.sendall(get("/catchup/9/manifest?wait=2"))
        while server.guard.num_busy < 2:
            threading.Event().wait(0.01)
        assert status_of(raw_request(addr, get("/catchup/status"))) == 503
        assert [status_of(s.recv(4096)) for s in polls] == [404, 404]  # served to the end, not evicted
        assert server.guard.num_refused == 1 and server.guard.num_evicted == 0
    finally:
        for s in polls:
            s.close()
        server.stop()
