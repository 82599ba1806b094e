"""The emulated Env's own behavior beyond the shared contract: virtual time, determinism, the network
model (latency by hop class, bandwidth, oversubscription, back-pressure), host kills, CPU charging,
deadlock detection and the ShapeOnly extension. CPU charging is off unless a test is about it."""

from __future__ import annotations

import gc
import time

import pytest

from ftrun.env.base import CANCEL_CHECK_S, ConnectError, EnvTimeout, NetTimeout, PeerClosed, ProtocolError, TaskKilled
from harness.engine import DeadlockError, EmulatedWorld, ShapeOnly
from harness.profile import NetworkConfig, load_profile
from harness.topology import HopClass, Topology

NET = NetworkConfig(base_latency_us=10.0, host_nic_gbps=80.0, frame_overhead_bytes=0)  # 10 GB/s NICs
RATE = NET.host_nic_bytes_per_s


def world(**kw) -> EmulatedWorld:
    kw.setdefault("cpu_charging", False)
    return EmulatedWorld(kw.pop("seed", 0), kw.pop("topology", None), **kw)


def ci_world(**kw) -> tuple[EmulatedWorld, Topology]:
    profile = load_profile("ci-small")
    topo = Topology.from_profile(profile)
    return world(topology=topo, network=kw.pop("network", NET), **kw), topo


def connect(src_env, dst_env):
    """A (client on src, server on dst) connection pair; call inside run."""
    listener = dst_env.net.listen("127.0.0.1:0")
    client = src_env.net.connect(listener.addr, timeout=1.0)
    server = listener.accept(timeout=1.0)
    listener.close()
    return client, server


def test_virtual_time_costs_no_wall_time():
    w = world()
    env = w.host_env("host-0")

    def body():
        env.clock.sleep(3600.0)
        return env.clock.now()

    t0 = time.perf_counter()
    assert env.run(body) == 3600.0
    assert time.perf_counter() - t0 < 1.0


def test_listen_gives_host_addresses_and_connect_resolves_them():
    w = world()
    a, b = w.host_env("host-a"), w.host_env("host-b")

    def body():
        listener = b.net.listen("127.0.0.1:0")
        assert listener.addr == "host-b:1" and b.net.listen("localhost:0").addr == "host-b:2"
        with pytest.raises(OSError):
            b.net.listen("127.0.0.1:1")
        client = a.net.connect(listener.addr, timeout=1.0)
        server = listener.accept(timeout=1.0)
        unix = b.net.listen("unix:/tmp/emulated.sock")  # per host: nothing touches the filesystem
        assert b.net.connect(unix.addr, timeout=1.0).peer_addr == "unix:/tmp/emulated.sock"
        with pytest.raises(ConnectError):
            a.net.connect(unix.addr, timeout=0.1)  # another host's unix socket is not reachable
        return client.peer_addr, server.peer_addr == client.local_addr

    assert w.host_env("host-a").run(body) == ("host-b:1", True)


def scenario(w: EmulatedWorld) -> list:
    """Several hosts exchanging messages with sleeps; returns what h0 received and when, in order."""
    envs = [w.host_env(f"h{i}") for i in range(4)]
    got = []

    def worker(i, addr):
        conn = envs[i].net.connect(addr, timeout=1.0)
        for k in range(3):
            envs[i].clock.sleep(0.001 * ((i * 7 + k) % 3))
            conn.send({"from": i, "k": k, "t": envs[i].clock.now()})
        conn.close()

    def body():
        listener = envs[0].net.listen("127.0.0.1:0")
        for i in range(1, 4):
            envs[0].spawn(worker, i, listener.addr, name=f"worker{i}")
        conns = [listener.accept(timeout=1.0) for _ in range(3)]
        for c in conns:
            while True:
                try:
                    got.append((c.recv(timeout=1.0), envs[0].clock.now()))
                except PeerClosed:
                    break
        return got

    return envs[0].run(body)


def test_same_seed_same_trace_and_results():
    w1, w2 = world(trace=True), world(trace=True)
    r1, r2 = scenario(w1), scenario(w2)
    assert r1 == r2 and w1.trace == w2.trace and len(w1.trace) > 10


def test_latency_jitter_follows_the_seed():
    net = NetworkConfig(latency_jitter=0.5)
    runs = [scenario(world(seed=s, network=net)) for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def one_way(w: EmulatedWorld, src: str, dst: str, payload) -> float:
    """Virtual seconds from send to receipt of one frame from src to dst."""
    a, b = w.host_env(src), w.host_env(dst)

    def body():
        client, server = connect(a, b)
        t0 = a.clock.now()
        if isinstance(payload, dict):
            client.send(payload)
            server.recv(timeout=5.0)
        else:
            client.send_bytes(payload)
            server.recv_into(ShapeOnly(len(payload)), timeout=5.0)
        return a.clock.now() - t0

    return a.run(body)


def test_latency_by_hop_class():
    w, topo = ci_world()
    hosts = topo.hosts  # ci-small: 2 hosts per rack, 2 racks per zone, 2 zones per building, 2 buildings
    pairs = {HopClass.SAME_RACK: (hosts[0], hosts[1]), HopClass.OTHER_RACK: (hosts[0], hosts[2]),
             HopClass.OTHER_ZONE: (hosts[0], hosts[4]), HopClass.OTHER_BUILDING: (hosts[0], hosts[8])}
    for hop, (a, b) in pairs.items():
        assert topo.hop_class(a, b) is hop
        elapsed = one_way(w, a, b, {"x": 1})
        assert elapsed == pytest.approx(NET.latency_s(hop), rel=1e-3), hop
    factors = [one_way(w, *pairs[h], {"x": 1}) / NET.latency_s(HopClass.SAME_RACK) for h in pairs]
    assert [round(f) for f in factors] == [1, 7, 15, 30]  # paper §2.1
    assert one_way(w, hosts[3], hosts[3], {"x": 1}) == pytest.approx(NET.latency_s(HopClass.SAME_HOST), rel=1e-3)


def test_bulk_time_is_latency_plus_serialization():
    w, topo = ci_world()
    size = 100 * 2**20
    elapsed = one_way(w, topo.hosts[0], topo.hosts[1], ShapeOnly(size))
    assert elapsed == pytest.approx(NET.latency_s(HopClass.SAME_RACK) + (size + 9) / RATE, rel=1e-6)


def test_receiver_nic_is_shared_between_senders():
    w, topo = ci_world()
    size = 10 * 2**20
    dst = w.host_env(topo.hosts[0])
    srcs = [w.host_env(h) for h in topo.hosts[1:3]]

    def body():
        pairs = [connect(s, dst) for s in srcs]
        t0 = dst.clock.now()
        for client, _ in pairs:
            client.send_bytes(ShapeOnly(size))
        for _, server in pairs:
            server.recv_into(ShapeOnly(size), timeout=5.0)
        return dst.clock.now() - t0

    assert dst.run(body) == pytest.approx(2 * size / RATE, rel=0.01)  # two frames through one rx NIC


def test_cross_zone_traffic_is_oversubscribed():
    w, topo = ci_world()
    size, chunks = 8 * 2**20, 32
    zone0, zone1 = topo.hosts[0:4], topo.hosts[4:8]  # 4 hosts per zone in ci-small
    envs = [(w.host_env(a), w.host_env(b)) for a, b in zip(zone0, zone1)]

    def sender(env, client):
        for _ in range(chunks):
            client.send_bytes(ShapeOnly(size // chunks))

    def body():
        pairs = [connect(a, b) for a, b in envs]
        t0 = envs[0][0].clock.now()
        for (env, _), (client, _) in zip(envs, pairs):
            env.spawn(sender, env, client, name=f"sender-{env.host}")
        for _, server in pairs:
            for _ in range(chunks):
                server.recv_into(ShapeOnly(size // chunks), timeout=5.0)
        return envs[0][0].clock.now() - t0

    # 4 NICs' worth of traffic through a zone uplink worth 4 NICs / 2.8 (chunks interleave in the FIFO)
    expected = NET.latency_s(HopClass.OTHER_ZONE) + 2.8 * size / RATE
    assert envs[0][0].run(body) == pytest.approx(expected, rel=0.01)


def test_large_sends_block_once_the_send_buffer_is_full():
    w, topo = ci_world()
    a, b = w.host_env(topo.hosts[0]), w.host_env(topo.hosts[1])
    size = 64 * 2**20

    def body():
        client, server = connect(a, b)
        t0 = a.clock.now()
        client.send_bytes(ShapeOnly(size))
        blocked = a.clock.now() - t0
        server.recv_into(ShapeOnly(size), timeout=5.0)
        with pytest.raises(NetTimeout):
            client.send_bytes(ShapeOnly(size), timeout=1e-6)
        return blocked, client.closed

    blocked, closed = a.run(body)
    assert blocked == pytest.approx((size + 9 - NET.send_buffer_kib * 1024) / RATE, rel=1e-6) and closed


def test_shape_only_frames_and_bulk_copies():
    w = world()
    env = w.host_env("h")

    def body():
        client, server = connect(env, env)
        client.send_bytes(ShapeOnly(16))
        buf = bytearray(b"x" * 16)
        server.recv_into(memoryview(buf), timeout=1.0)  # a real buffer keeps its bytes
        data = bytearray(b"abcd")
        client.send_bytes(data)
        data[:] = b"zzzz"  # the frame was snapshotted at send time
        server.recv_into(ShapeOnly(4), timeout=1.0)
        client.send_bytes(bytes(data))
        got = bytearray(4)
        server.recv_into(memoryview(got), timeout=1.0)
        client.send_bytes(ShapeOnly(8))
        with pytest.raises(ProtocolError):
            server.recv_into(ShapeOnly(4), timeout=1.0)
        return bytes(buf), bytes(got), server.closed

    assert env.run(body) == (b"x" * 16, b"zzzz", True)
    with pytest.raises(ValueError):
        ShapeOnly(-1)


def test_messages_are_validated_and_copied_like_the_real_wire():
    w = world()
    env = w.host_env("h")

    def body():
        client, server = connect(env, env)
        with pytest.raises(TypeError):
            client.send(["not", "a", "dict"])
        with pytest.raises(TypeError):
            client.send({"s": {1, 2}})
        msg = {"xs": [1, 2], "t": (3, 4)}
        client.send(msg)
        msg["xs"].append(3)
        got = server.recv(timeout=1.0)
        client.send({1: "int key"})
        with pytest.raises(ProtocolError):  # msgpack encodes it; the receiver rejects it, as for real
            server.recv(timeout=1.0)
        return got

    assert env.run(body) == {"xs": [1, 2], "t": [3, 4]}


def test_kill_host_kills_its_tasks_and_peers_see_peer_closed():
    w, topo = ci_world()
    victim, survivor = w.host_env(topo.hosts[8]), w.host_env(topo.hosts[0])  # other building: 300 us

    def body():
        listener = victim.net.listen("127.0.0.1:0")
        client = survivor.net.connect(listener.addr, timeout=1.0)
        server = listener.accept(timeout=1.0)
        sleeper = victim.spawn(victim.clock.sleep, 100.0, name="victim-sleeper")
        holder = victim.spawn(server.recv, 100.0, name="victim-rx")
        survivor.clock.sleep(0.01)
        t_kill = survivor.clock.now()
        w.kill_host(victim.host)
        with pytest.raises(PeerClosed):
            client.recv(timeout=10.0)
        seen_after = survivor.clock.now() - t_kill
        assert sleeper.join(1.0) and holder.join(1.0)
        with pytest.raises(ConnectError):
            survivor.net.connect(listener.addr, timeout=0.1)  # listener gone: refused until the deadline
        restarted = victim.spawn(lambda: "back", name="restarted")  # a killed host can run new tasks
        assert restarted.join(1.0)
        return seen_after, type(sleeper.exception), type(holder.exception), restarted.result

    seen_after, e1, e2, result = survivor.run(body)
    assert seen_after == pytest.approx(NET.latency_s(HopClass.OTHER_BUILDING), rel=1e-3)
    assert (e1, e2, result) == (TaskKilled, TaskKilled, "back")


def test_silent_kill_is_seen_only_through_timeouts():
    w = world()
    victim, survivor = w.host_env("victim"), w.host_env("survivor")

    def body():
        client, _server = connect(survivor, victim)
        w.kill_host("victim", silent=True)
        client.send({"lost": True})  # no error: the peer just never answers
        with pytest.raises(NetTimeout):
            client.recv(timeout=0.5)
        listener = victim.net.listen("127.0.0.1:0")
        with pytest.raises(ConnectError):
            survivor.net.connect(listener.addr, timeout=0.2)
        w.revive_host("victim")
        return survivor.net.connect(listener.addr, timeout=0.2).closed

    assert survivor.run(body) is False


def test_a_cancelled_connect_to_a_silent_host_ends_within_a_check_interval():
    """A silent host answers no SYN: one attempt would wait for the whole timeout, so a cancellable
    connect caps each attempt at CANCEL_CHECK_S and ends at the first check after `cancelled()` is true."""
    w = world()
    victim, survivor = w.host_env("victim"), w.host_env("survivor")

    def body():
        listener = victim.net.listen("127.0.0.1:0")
        w.kill_host("victim", silent=True)
        start = survivor.clock.now()
        with pytest.raises(ConnectError, match="within 0.7s: no answer"):  # not cancelled: the full timeout
            survivor.net.connect(listener.addr, timeout=0.7, cancelled=lambda: False)
        assert survivor.clock.now() - start == pytest.approx(0.7, abs=1e-3)
        start = survivor.clock.now()
        with pytest.raises(ConnectError, match="cancelled"):
            survivor.net.connect(listener.addr, timeout=30.0, cancelled=lambda: survivor.clock.now() >= start + 0.1)
        return survivor.clock.now() - start

    assert survivor.run(body) == pytest.approx(CANCEL_CHECK_S, abs=1e-3)  # the first attempt's cap


@pytest.mark.parametrize("woken_before_kill", [False, True])
def test_killing_a_frozen_host_ends_its_tasks_without_a_thaw(woken_before_kill):
    """SIGKILL ends a SIGSTOPped process: a frozen task dies at the kill whether it is still blocked or was
    woken (its timer fired) and parked, and does not wait for a thaw that never comes."""
    w = world()
    victim, survivor = w.host_env("victim"), w.host_env("survivor")

    def body():
        sleeper = victim.spawn(victim.clock.sleep, 1.0, name="victim-sleeper")
        survivor.clock.sleep(0.1)
        w.freeze("victim")
        survivor.clock.sleep(2.0 if woken_before_kill else 0.1)  # past the sleeper's timer: it is parked
        w.kill_host("victim")
        assert sleeper.join(1.0)
        return type(sleeper.exception), survivor.clock.now()

    kind, t_end = survivor.run(body)
    assert kind is TaskKilled and t_end < 3.0


def test_kill_host_from_a_task_on_that_host_kills_the_caller():
    w = world()
    env = w.host_env("h")

    def suicide():
        w.kill_host("h")
        return "unreachable"

    def body():
        t = env.spawn(suicide, name="suicide")
        assert t.join(1.0)
        return t.exception

    assert isinstance(w.host_env("other").run(body), TaskKilled)


def burn(seconds: float) -> None:
    """Use `seconds` of this thread's CPU (what the default cpu_clock="thread" charges)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.parametrize("cpu_clock", ["thread", "perf"])
def test_cpu_charging_moves_virtual_time(cpu_clock):
    def measure(charging: bool, scale: float = 1.0) -> float:
        w = world(cpu_charging=charging, cpu_scale=scale, cpu_clock=cpu_clock)
        env = w.host_env("h")

        def body():
            t0 = env.clock.now()
            burn(0.02)
            env.clock.sleep(0)  # end the slice: the host is busy until its charge is paid
            return env.clock.now() - t0

        return env.run(body)

    assert measure(False) == 0.0
    assert measure(True) >= 0.02
    assert measure(True, scale=10.0) >= 0.2


def test_cpu_lanes_serialize_work_beyond_the_host_cores():
    def finish_time(cores: int) -> float:
        w = world(cpu_charging=True, host_cpu_cores=cores)
        env = w.host_env("h")

        def body():
            tasks = [env.spawn(burn, 0.03, name=f"burn{i}") for i in range(2)]
            assert all(t.join(10.0) for t in tasks)
            env.clock.sleep(0)
            return env.clock.now()

        return env.run(body)

    assert finish_time(1) >= 0.06  # one lane: the two 30 ms slices run one after the other
    assert 0.03 <= finish_time(2) < 0.05  # two lanes: side by side


def test_a_task_woken_mid_slice_starts_after_the_waker():
    w = world(cpu_charging=True, host_cpu_cores=4)
    env = w.host_env("h")

    def body():
        ev = env.event()
        seen = []
        waiter = env.spawn(lambda: (ev.wait(10.0), seen.append(env.clock.now())), name="waiter")
        env.clock.sleep(0)
        burn(0.02)
        ev.set()
        assert waiter.join(10.0)
        return seen[0]

    assert env.run(body) >= 0.02


def test_deadlock_names_the_blocked_tasks():
    w = world()
    env = w.host_env("h")

    def body():
        q = env.queue()
        env.spawn(q.get, name="stuck-getter")
        env.event().wait()

    with pytest.raises(DeadlockError, match="stuck-getter") as info:
        env.run(body)
    assert "main@h" in str(info.value)
    sleeper = world().host_env("h")
    with pytest.raises(DeadlockError):  # an infinite sleep is not a timer that fires at t=inf
        sleeper.run(sleeper.clock.sleep, float("inf"))


def test_gc_is_disabled_while_running_and_restored():
    w = world()
    env = w.host_env("h")
    assert gc.isenabled()
    assert env.run(gc.isenabled) is False
    assert gc.isenabled()


def test_killed_getter_gives_its_item_back():
    w = world()
    env = w.host_env("h")

    def body():
        q = env.queue()
        first = env.spawn(q.get, 1.0, name="first")
        second = env.spawn(q.get, 1.0, name="second")
        env.clock.sleep(0.001)
        q.put("item")  # handed to `first`, which is killed before it runs
        first.kill()
        assert first.join(1.0) and second.join(1.0)
        return type(first.exception), second.result

    assert env.run(body) == (TaskKilled, "item")


def test_waits_that_end_early_do_not_grow_the_timer_heap():
    w = world()
    w.sched.compact_slack = 500
    env = w.host_env("h")
    sizes = []

    def producer(q):
        for i in range(5000):
            env.clock.sleep(0.001)
            q.put(i)

    def body():
        q = env.queue()
        env.spawn(producer, q, name="producer")
        for i in range(5000):
            assert q.get(timeout=60.0) == i  # each get blocks and leaves a stale 60 s timer behind
            sizes.append(len(w.sched._timers))
        return max(sizes)

    assert env.run(body) < 2500  # checked between slices every few thousand loop turns; 5000 without


def test_nested_run_is_a_plain_call_and_from_profile_places_hosts():
    profile = load_profile("ci-small")
    w = EmulatedWorld.from_profile(profile)
    host = w.topology.host_of(replica=3, rank=7)
    env = w.host_env(host)
    assert env.run(lambda: env.run(lambda: 42)) == 42
    assert w.topology.ranks_on(host) == [(3, 6), (3, 7)] and w.sched.charging is False


def test_host_env_is_an_env_and_cached():
    from ftrun.env.base import Env

    w = world()
    env = w.host_env("h")
    assert isinstance(env, Env) and w.host_env("h") is env and env.host == "h"
    with pytest.raises(ValueError):
        w.host_env("bad:name")
    with pytest.raises(RuntimeError, match="inside env.run"):
        env.clock.sleep(1.0)  # blocking outside the loop is a usage error
    env.run(lambda: env.clock.sleep(0.5))
    stats = w.stats()
    assert stats["virtual_s"] == 0.5 and stats["tasks_spawned"] == 1 and stats["tasks_live"] == 0
