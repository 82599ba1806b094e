"""The FTAR engine over real sockets: sums, abort propagation, reconfigure, bad input, a SIGKILLed peer."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from ftrun.env.real import IDLE_THREAD_NAME, RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.ftar.ring import FatalError, RecoverableError
from tests.integration.ftar_worker import io_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = FtarConfig(chunk_bytes=4096, num_chunks=2, timeout_s=5.0)


def _busy_threads() -> int:
    """Threads but the tasks' pool threads waiting for their next task."""
    return sum(1 for t in threading.enumerate() if t.name != IDLE_THREAD_NAME)


def engines(env, n, config=SMALL):
    return [FtarEngine(env=env, kernels=CpuKernels(), token="job", config=config) for _ in range(n)]


def in_parallel(env, fns):
    tasks = [env.spawn(fn, name=f"t{i}") for i, fn in enumerate(fns)]
    for t in tasks:
        assert t.join(20.0), "hung"
    return [t.exception for t in tasks]


def build(env, engs, epoch=1):
    ring = [e.addr for e in engs]
    errors = in_parallel(env, [lambda e=e, i=i: e.reconfigure(epoch=epoch, ring=ring, index=i) for i, e in enumerate(engs)])
    assert errors == [None] * len(engs)


# socket: links with blocking bulk calls (real_bulk, the default); socket+threads: a sender task waiting in
# poll()
TRANSPORTS = ["auto", "socket", "socket+threads"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("n,count,dtype", [(2, 1000, "float32"), (3, 12_345, "float16"), (4, 100_003, "bfloat16"),
                                           (5, 7, "float32"), (3, 0, "float32"), (1, 50, "float32")])
def test_sum_is_correct_and_bitwise_identical(n, count, dtype, transport):
    env = RealEnv()
    engs = engines(env, n, FtarConfig(chunk_bytes=4096, num_chunks=2, timeout_s=5.0, **io_config(transport)))
    build(env, engs)
    if n > 1:
        expected = "shared" if transport == "auto" else "socket"
        assert all(e.transports == (expected, expected) for e in engs)
        mine = f"-{os.getpid()}-"  # other jobs on the machine may be mid-handshake
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("ftrun-ftar-") and mine in f], \
            "staging files left behind"
    rng = np.random.default_rng(n)
    if dtype == "bfloat16":  # bfloat16 travels as its uint16 bit pattern
        vals = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
        bufs = [(v.view(np.uint32) >> 16).astype(np.uint16) for v in vals]
        as_float = lambda b: (b.astype(np.uint32) << 16).view(np.float32)
        expect = np.sum([as_float(b).astype(np.float64) for b in bufs], axis=0)
    else:
        bufs = [rng.standard_normal(count).astype(dtype) for _ in range(n)]
        as_float = lambda b: b.astype(np.float64)
        expect = np.sum([b.astype(np.float64) for b in bufs], axis=0)
    errors = in_parallel(env, [lambda e=e, b=b: e.all_reduce(b, dtype) for e, b in zip(engs, bufs)])
    assert errors == [None] * n
    assert all(np.array_equal(b, bufs[0]) for b in bufs)
    tol = {"float32": 1e-5, "float16": 2e-2, "bfloat16": 6e-2}[dtype] * n
    assert np.allclose(as_float(bufs[0]), expect, rtol=tol, atol=tol)
    for e in engs:
        e.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_travels_the_ring_and_survivors_reconfigure(transport):
    env = RealEnv()
    before = _busy_threads(), len(os.listdir("/proc/self/fd"))
    engs = engines(env, 4, FtarConfig(chunk_bytes=1 << 16, num_chunks=2, timeout_s=30.0, **io_config(transport)))
    build(env, engs)
    bufs = [np.ones(4 << 20, np.float32) for _ in engs]
    results = {}

    def run(i):
        t0 = env.clock.now()
        try:
            engs[i].all_reduce(bufs[i])
            results[i] = ("ok", env.clock.now() - t0)
        except RecoverableError as e:
            results[i] = ("recoverable", str(e))

    tasks = [env.spawn(run, i, name=f"r{i}") for i in range(3)]  # rank 3 never joins: it "dies"
    env.clock.sleep(0.2)
    engs[3].close()
    for t in tasks:
        assert t.join(10.0)  # far below the 30 s timeout (benchmarks/detection.py measures how far)
    assert all(results[i][0] == "recoverable" for i in range(3))
    assert not any("Timeout" in results[i][1] for i in range(3)), results  # a closed peer, not a timeout
    survivors = engs[:3]
    build(env, survivors, epoch=2)
    bufs = [np.full(100_000, i + 1, np.float32) for i in range(3)]
    assert in_parallel(env, [lambda e=e, b=b: e.all_reduce(b) for e, b in zip(survivors, bufs)]) == [None] * 3
    assert all((b == 6).all() for b in bufs)
    for e in survivors:
        e.close()
    # nothing leaked: closed links' threads exit and release their sockets (later on a loaded box)
    deadline = env.clock.now() + 10.0
    while (now := (_busy_threads(), len(os.listdir("/proc/self/fd")))) != before \
            and env.clock.now() < deadline:
        env.clock.sleep(0.05)
        gc.collect()
    assert now == before


@pytest.mark.parametrize("same_machine", [True, False])
def test_socket_links_within_one_machine_get_the_small_buffers(same_machine, monkeypatch):
    """Small socket buffers keep a same-machine link's bytes in cache between the two kernels' copies;
    links between machines keep the connection's 4 MiB (the window must cover the bandwidth-delay product)."""
    from ftrun.ftar import engine as engine_mod

    monkeypatch.setattr(engine_mod, "same_machine", lambda a, b: same_machine)
    env = RealEnv()
    engs = engines(env, 2, FtarConfig(chunk_bytes=1 << 16, num_chunks=2, timeout_s=10.0, transport="socket",
                                      local_socket_buffer_bytes=256 << 10))
    build(env, engs)
    for e in engs:
        for conn in (e._links.next, e._links.prev):
            got = [conn._sock.getsockopt(socket.SOL_SOCKET, o) for o in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
            if same_machine:
                assert got == [2 * (256 << 10)] * 2  # Linux doubles what it is given
            else:
                assert min(got) > 2 * (256 << 10)
    bufs = [np.full(1 << 20, i + 1, np.float32) for i in range(2)]
    assert in_parallel(env, [lambda i=i: engs[i].all_reduce(bufs[i]) for i in range(2)]) == [None, None]
    assert all((b == 3).all() for b in bufs)
    for e in engs:
        assert not e._links.next._sock.getblocking()  # the all-reduce's holds were released
        e.close()


def test_config_rejects_bad_socket_settings():
    for bad in ("select", "pump"):  # pump: a mode that was removed
        with pytest.raises(ValueError, match="socket_io must be 'blocking' or 'threads'"):
            FtarConfig(socket_io=bad)
    with pytest.raises(ValueError, match="local_socket_buffer_bytes"):
        FtarConfig(local_socket_buffer_bytes=64 << 10)
    for bad in (262144.0, "256k", True):  # a float passed, then failed every ring's negotiation (setsockopt)
        with pytest.raises(ValueError, match="local_socket_buffer_bytes must be an int"):
            FtarConfig(local_socket_buffer_bytes=bad)
    assert FtarConfig(local_socket_buffer_bytes=0).local_socket_buffer_bytes == 0


def test_bad_arguments_are_fatal():
    env = RealEnv()
    (e,) = engines(env, 1)
    with pytest.raises(FatalError, match="before reconfigure"):
        e.all_reduce(np.ones(4, np.float32))
    with pytest.raises(FatalError, match="bad ring"):
        e.reconfigure(epoch=1, ring=["127.0.0.1:1"], index=0)
    e.reconfigure(epoch=1, ring=[e.addr], index=0)
    with pytest.raises(FatalError, match="C-contiguous"):
        e.all_reduce(np.ones((4, 4), np.float32)[:, 1])
    with pytest.raises(FatalError, match="epoch must increase"):
        e.reconfigure(epoch=1, ring=[e.addr], index=0)
    with pytest.raises(ValueError):
        e.all_reduce(np.ones(4, np.int64))
    e.close()


def test_wrong_token_cannot_join_a_ring():
    env = RealEnv()
    a = FtarEngine(env=env, kernels=CpuKernels(), token="job", config=FtarConfig(timeout_s=0.5))
    b = FtarEngine(env=env, kernels=CpuKernels(), token="other-job", config=FtarConfig(timeout_s=0.5))
    ring = [a.addr, b.addr]
    errors = in_parallel(env, [lambda: a.reconfigure(epoch=1, ring=ring, index=0),
                               lambda: b.reconfigure(epoch=1, ring=ring, index=1)])
    assert all(isinstance(x, RecoverableError) for x in errors)
    a.close()
    b.close()


class Worker:
    def __init__(self, transport):
        self.p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests/integration/ftar_worker.py")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": ROOT, "FTAR_TRANSPORT": transport})
        self.addr = self.read()["addr"]

    def send(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def read(self):
        line = self.p.stdout.readline()
        assert line, "worker exited"
        return json.loads(line)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_built_ring_leaves_no_unread_bytes_so_closing_it_loses_nothing(transport):
    """A socket closed with unread bytes resets its connection and drops what it had not sent yet, so
    the ring build must read every reply (the next rank's "attached" one included, even over sockets),
    and a rank that closes right after its all-reduce must not cut the tail of its neighbour's."""
    env = RealEnv()
    engs = engines(env, 2, FtarConfig(chunk_bytes=1 << 16, num_chunks=2, timeout_s=10.0, **io_config(transport)))
    build(env, engs)
    for e in engs:
        for conn in (e._links.next, e._links.prev):
            with pytest.raises(BlockingIOError):
                conn._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    bufs = [np.full(1 << 20, i + 1, np.float32) for i in range(2)]

    def reduce_then_close(i):
        engs[i].all_reduce(bufs[i])
        engs[i].close()

    assert in_parallel(env, [lambda i=i: reduce_then_close(i) for i in range(2)]) == [None, None]
    assert all((b == 3).all() for b in bufs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkilled_peer_mid_all_reduce(transport):
    workers = [Worker(transport) for _ in range(4)]
    try:
        ring = [w.addr for w in workers]
        for i, w in enumerate(workers):
            w.send(cmd="ring", epoch=1, ring=ring, index=i)
        assert all(w.read()["ok"] for w in workers)
        victim = workers[2]
        victim.send(cmd="die_after_reduces", n=5)
        assert victim.read()["ok"]
        for i, w in enumerate(workers):
            w.send(cmd="allreduce", nbytes=64 << 20, seed=i)
        died = victim.read()["dying_at"]
        survivors = [w for w in workers if w is not victim]
        results = [w.read() for w in survivors]
        assert [r["error"] for r in results] == ["RecoverableError"] * 3
        delays = [r["at"] - died for r in results]
        print("RecoverableError delays after the SIGKILL (s):", delays)
        assert max(delays) < 0.5, delays
        ring = [w.addr for w in survivors]
        for i, w in enumerate(survivors):
            w.send(cmd="ring", epoch=2, ring=ring, index=i)
        assert all(w.read()["ok"] for w in survivors)
        for i, w in enumerate(survivors):
            w.send(cmd="allreduce", nbytes=4 << 20, seed=i)
        sums = [w.read() for w in survivors]
        expect = sum(np.random.default_rng(i).standard_normal(1 << 20).astype(np.float32) for i in range(3))
        assert len({s["sha"] for s in sums}) == 1
        assert np.allclose(sums[0]["head"], expect[:4], rtol=1e-5)
    finally:
        for w in workers:
            w.p.kill()
            w.p.wait()
