"""Every env.net service a job runs, each a real instance on 127.0.0.1 port 0, against peers without the job
token: a frame no service can read (bytes of another protocol, a length prefix past the 16 MiB cap, a bulk
frame first, bad msgpack, a list instead of a map), wrong-typed fields or a wrong token. Each such connection
is closed at once, and while it and a peer that sends half a frame or nothing at all stay connected, a peer
with the token is still served (the replica tree: its child still joins while the tree builds). (The HTTP servers: test_http_bounds.py; the listener's caps:
tests/unit/test_real_net_limits.py.) The catch-up server also drops a peer that asks for a shard and stops reading it.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import struct

import msgpack
import pytest
import torch

from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.net_transport import NetCatchupServer
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.diagnose.collect import Collector, request
from ftrun.env import wire
from ftrun.env.admission import ListenLimits
from ftrun.env.base import NetError
from ftrun.env.real import RealEnv
from ftrun.ftar.ring import RingListener, ping_request
from ftrun.launch.agent import Agent
from ftrun.launch.remote import AgentClient
from ftrun.quorum.client import LighthouseClient
from ftrun.quorum.service import Lighthouse
from ftrun.replica.tree_comm import TreeComm

pytestmark = pytest.mark.timeout(60)
TOKEN = "job-token"


def _frame(payload: bytes, kind: int = wire.KIND_MSG) -> bytes:
    return wire.HEADER.pack(kind, len(payload)) + payload


def _msg(obj) -> bytes:
    return _frame(msgpack.packb(obj, use_bin_type=True))


REFUSED = {  # closed by the service as soon as it has read them
    "another protocol": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "length past the cap": wire.HEADER.pack(wire.KIND_MSG, 2**64 - 1),
    "bulk frame first": wire.HEADER.pack(wire.KIND_BULK, 2**40),
    "bad msgpack": _frame(b"\xc1\xc1\xc1"),
    "a list, not a map": _msg([1, 2, 3]),
    "wrong types": _msg({"type": 5, "token": 7, "replica_id": None, "epoch": "x", "op": [], "step": "1"}),
    "wrong token": _msg({"type": "hello", "token": "guess", "replica_id": "r9", "epoch": 1, "ping": 1,
                         "op": "manifest", "step": 0}),
    "no token": _msg({"type": "hello", "replica_id": "r9", "epoch": 1, "op": "manifest", "step": 0}),
}
HELD = {  # a service may keep these until its first-message timeout; they must not stop it serving others
    "half a frame": struct.pack("!BQ", wire.KIND_MSG, 100) + b"abc",
    "nothing": b"",
}


def _lighthouse(env):
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1), token=TOKEN)
    lh.start()

    def good():
        c = LighthouseClient(env=env, addr=lh.addr, token=TOKEN, replica_id="r0", timeouts=Timeouts())
        c.connect()
        try:
            return c.quorum(0).quorum_id == 1
        finally:
            c.close()

    return lh.addr, good, lh.stop


def _ring(env):
    ring = RingListener(env, TOKEN, "127.0.0.1:0")

    def good():
        conn = env.net.connect(ring.addr, timeout=5.0)
        try:
            conn.send(ping_request(TOKEN, 7))
            return conn.recv(timeout=5.0) == {"pong": 7}
        finally:
            conn.close()

    return ring.addr, good, ring.close


def _collector(env):
    c = Collector(env=env, token=TOKEN)
    c.start()
    return c.addr, lambda: request(env, c.addr, {"type": "verdict", "token": TOKEN}, 5.0)["type"] == "verdict", c.stop


def _agent(env, tmp_path):
    a = Agent(env=env, token=TOKEN, bind="127.0.0.1:0", out=str(tmp_path))
    task = env.spawn(a.serve, name="agent")

    def good():
        client = AgentClient(env, a.addr, TOKEN, connect_timeout_s=5.0)
        try:
            return client.call({"type": "poll", "ids": [1]}) == {"codes": [None]}
        finally:
            client.close()

    def stop():
        AgentClient(env, a.addr, TOKEN, connect_timeout_s=5.0).call({"type": "bye"})
        assert task.join(10.0)

    return a.addr, good, stop


def _catchup(env):
    server = NetCatchupServer(env=env, token=TOKEN, config=CatchupConfig())
    addr = server.start()

    def good():
        conn = env.net.connect(addr, timeout=5.0)
        try:
            conn.send({"op": "manifest", "step": 3, "token": TOKEN, "wait": 0})
            return conn.recv(timeout=5.0)["status"] == 404  # nothing published: the step is not here
        finally:
            conn.close()

    return addr, good, server.stop


def _tree(env):
    """Rank 0 of a 2-rank replica tree, building: it takes its one child (rank 1, built by `good`) with the token
    and closes every other connection; `good` then runs an all-reduce over the tree."""
    listeners = [env.net.listen("127.0.0.1:0") for _ in range(2)]
    addrs = [ln.addr for ln in listeners]
    built = env.queue()
    root = env.spawn(lambda: built.put(TreeComm.build(env=env, rank=0, world_size=2, listener=listeners[0],
                                                      addrs=addrs, token=TOKEN, timeout_s=30.0)), name="tree-root")
    comms = []

    def good():
        comms.append(TreeComm.build(env=env, rank=1, world_size=2, listener=listeners[1], addrs=addrs, token=TOKEN,
                                    timeout_s=5.0))
        comms.insert(0, built.get(timeout=10.0))
        total = env.queue()
        task = env.spawn(lambda: total.put(comms[0].all_reduce_int([1], "sum")), name="tree-root-reduce")
        ok = comms[1].all_reduce_int([2], "sum") == [3] and total.get(timeout=5.0) == [3]
        return ok and task.join(5.0)

    def stop():
        for comm in comms:
            comm.close()
        for ln in listeners:
            ln.close()
        assert root.join(10.0) and root.exception is None

    return addrs[0], good, stop


SERVICES = {"lighthouse": _lighthouse, "ftar ring": _ring, "diagnose collector": _collector,
            "launch agent": _agent, "catch-up over env.net": _catchup, "replica tree": _tree}


def _start(service: str, env, tmp_path):
    """(host, port, good, stop) of `service` started in `env`."""
    make = SERVICES[service]
    addr, good, stop = make(env, tmp_path) if service == "launch agent" else make(env)
    host, port = addr.rsplit(":", 1)
    return host, port, good, stop


def _closed_by_peer(sock: socket.socket) -> bool:
    """True once the service closed the connection (whatever it answered before)."""
    sock.settimeout(5.0)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return False
    return True


@pytest.mark.parametrize("service", list(SERVICES))
def test_peers_without_the_token_are_closed_and_never_stop_a_peer_with_it(service, tmp_path):
    env = RealEnv()

    def body():
        host, port, good, stop = _start(service, env, tmp_path)
        held = []
        try:
            for data in HELD.values():
                for _ in range(8):
                    held.append(socket.create_connection((host, int(port)), timeout=5.0))
                    held[-1].sendall(data)
            refused = {}
            for name, data in REFUSED.items():
                with socket.create_connection((host, int(port)), timeout=5.0) as s:
                    s.sendall(data)
                    refused[name] = _closed_by_peer(s)
            assert refused == {name: True for name in REFUSED}
            assert good()  # with 16 connections held half-sent or silent
        finally:
            for s in held:
                s.close()
            stop()

    env.run(body)


def test_catchup_over_env_net_drops_a_peer_that_stops_reading_mid_shard():
    """A peer that asks for a shard far larger than the socket buffers and never reads it holds the server's
    send only for catchup_stall_s: then its connection is closed, and its slot (the listener's only one here)
    and task are free for a peer with the token."""
    stall_s = 0.5
    env = RealEnv(net_limits=ListenLimits(max_connections=1, max_pending=1))
    config = CatchupConfig(max_shard_bytes=32 << 20, timeouts=Timeouts(catchup_stall_s=stall_s))

    def good(addr):
        conn = env.net.connect(addr, timeout=5.0)
        try:
            conn.send({"op": "manifest", "step": 1, "token": TOKEN, "wait": 0})
            return conn.recv(timeout=5.0)["status"] == 200
        finally:
            conn.close()

    def body():
        server = NetCatchupServer(env=env, token=TOKEN, config=config)
        addr = server.start()
        server.publish(1, {"w": torch.ones(8 << 20)})  # one 32 MiB shard
        host, port = addr.rsplit(":", 1)
        stalled = socket.socket()
        try:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel buffers little of it
            stalled.connect((host, int(port)))
            stalled.sendall(_msg({"op": "shard", "step": 1, "index": 0, "token": TOKEN, "wait": 5}))
            stalled.settimeout(10.0)
            assert stalled.recv(1, socket.MSG_PEEK)  # the server read the request (it no longer counts as
            # pending, which a newer connection would evict) and is sending the shard
            t0 = env.clock.now()
            served = False
            while not served and env.clock.now() - t0 < stall_s + 10.0:
                try:
                    served = good(addr)  # refused at the cap while the stalled peer holds the slot
                except NetError:
                    env.clock.sleep(0.05)
            served_after = env.clock.now() - t0
            return served, served_after, _closed_by_peer(stalled)  # it reads what was buffered, then the close
        finally:
            stalled.close()
            server.stop()

    served, served_after, closed = env.run(body)
    assert served and 0.8 * stall_s <= served_after < stall_s + 5.0, served_after
    assert closed


def _num_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("service", list(SERVICES))
def test_a_flood_of_silent_connections_past_the_pending_cap_holds_few_descriptors_and_a_real_peer_gets_in(
        service, tmp_path, caplog):
    """120 connections that send nothing against a listener that keeps at most 8 pending: each new one closes the
    oldest pending one, so the service holds the descriptors of at most 8 of them (a socket and a wake-up eventfd
    each; before, a replica tree's build kept every closed one's eventfd until it ended), a peer with the token
    is served at once, and the log says so once as the flood begins, not once per connection."""
    max_pending, num_silent = 8, 120
    bound = 2 * max_pending + 4  # a socket and an eventfd for each pending connection; a few closed ones not yet
    # collected (e.g. the last one a handler's traceback still holds)
    env = RealEnv(net_limits=ListenLimits(max_pending=max_pending))

    def body():
        host, port, good, stop = _start(service, env, tmp_path)
        silent = []
        try:
            with caplog.at_level("WARNING", logger="ftrun"):
                before = _num_descriptors()
                for _ in range(num_silent):
                    silent.append(socket.create_connection((host, int(port)), timeout=5.0))
                closed = sum(1 for s in silent[:num_silent - max_pending] if _closed_by_peer(s))  # all accepted
                held = num_silent
                for _ in range(500):  # polls until the closed ones are collected; no timing is asserted
                    gc.collect()
                    held = _num_descriptors() - before - num_silent  # beyond the flood's own sockets
                    if held <= bound:
                        break
                    env.clock.sleep(0.01)
            warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert held <= bound and closed == num_silent - max_pending, (held, closed)
            assert len(warnings) == 1 and "have not sent their first message" in warnings[0], warnings
            assert good()
        finally:
            for s in silent:
                s.close()
            stop()

    env.run(body)


def test_a_flood_of_bad_hellos_to_the_lighthouse_is_one_warning_line(caplog):
    """Each connection refused at its hello is answered and closed; the warnings are rate-limited (one line, the
    next one counting those left out), so 30 wrong-token hellos log once, where before each logged a line."""
    env = RealEnv()

    def body():
        addr, good, stop = _lighthouse(env)
        host, port = addr.rsplit(":", 1)
        try:
            with caplog.at_level("WARNING", logger="ftrun.quorum"):
                for _ in range(30):
                    with socket.create_connection((host, int(port)), timeout=5.0) as s:
                        s.sendall(REFUSED["wrong token"])
                        assert _closed_by_peer(s)
            assert good()
        finally:
            stop()

    env.run(body)
    warnings = [r.getMessage() for r in caplog.records if r.name == "ftrun.quorum" and r.levelno >= logging.WARNING
                and r.getMessage().startswith("rejecting connection")]
    assert len(warnings) == 1 and warnings[0].endswith("wrong job token"), warnings
