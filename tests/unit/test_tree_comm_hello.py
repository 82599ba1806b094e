"""TreeComm.build takes a child only with the job token: the hello check as a table, and builds on the emulated
network beside peers that send a wrong token, no token, a rank that is not a child, a duplicate, garbage or
nothing. (The same over real sockets: tests/integration/test_hostile_peers.py.)"""

from __future__ import annotations

import logging

import pytest

from ftrun.env.base import NetError, PeerClosed
from ftrun.replica.comm import ReplicaCommError
from ftrun.replica.tree_comm import TreeComm, check_hello
from harness.engine import EmulatedWorld

TOKEN = "job-token"


@pytest.mark.parametrize("hello, joined, want", [
    ({"rank": 2, "token": TOKEN}, [], (2, "")),
    ({"rank": 3, "token": TOKEN}, [2], (3, "")),
    ({"rank": 2, "token": "guess"}, [], (None, "missing or wrong job token")),
    ({"rank": 2, "token": TOKEN[:-1]}, [], (None, "missing or wrong job token")),
    ({"rank": 2}, [], (None, "missing or wrong job token")),
    ({"rank": 2, "token": 7}, [], (None, "missing or wrong job token")),
    ({"rank": 2, "token": "\ud800"}, [], (None, "missing or wrong job token")),
    ({"rank": 9, "token": TOKEN}, [], (None, "rank 9 is not a child of this rank")),
    ({"rank": 2, "token": TOKEN}, [2], (None, "child 2 joined already")),
    ({"rank": "2", "token": TOKEN}, [], (None, "rank '2' is not an int")),
    ({"rank": True, "token": TOKEN}, [], (None, "rank True is not an int")),
    ({"token": TOKEN}, [], (None, "rank None is not an int")),
    ([2, TOKEN], [], (None, "its hello is a list, not a map")),
])
def test_check_hello(hello, joined, want):
    assert check_hello(hello, TOKEN, {2, 3}, joined) == want


def _emulated(num_ranks):
    world = EmulatedWorld(seed=0, cpu_charging=False)
    return world, [world.host_env(f"h{r}") for r in range(num_ranks)]


HOSTILE = {  # what a peer sends on a connection to rank 0's listener, and the warning it is closed with
    "wrong token": ({"rank": 1, "token": "guess"}, "missing or wrong job token"),
    "no token": ({"rank": 2}, "missing or wrong job token"),
    "not a child": ({"rank": 3, "token": TOKEN}, "rank 3 is not a child of this rank"),
    "a rank that is not an int": ({"rank": "1", "token": TOKEN}, "rank '1' is not an int"),
    "garbage": (b"\x00" * 64, "no hello: expected a control message"),
}


def test_build_closes_each_hostile_peer_and_the_children_still_join(caplog):
    """Rank 0 of 4 (fanout 2: children 1 and 2) is sent each hostile hello, and held by a peer that sends
    nothing, before its children connect; then a duplicate of child 1 comes while child 2 is late. The tree builds,
    every hostile connection is closed at once with one warning, and the collectives work."""
    world, envs = _emulated(4)
    caplog.set_level(logging.WARNING, logger="ftrun.replica")

    def driver():
        env = envs[0]
        listeners = [envs[r].net.listen("127.0.0.1:0") for r in range(4)]
        addrs = [ln.addr for ln in listeners]
        comms = [None] * 4
        hostile = envs[3].spawn(lambda: _hostile_peers(envs[3], addrs[0]), name="hostile")
        builds = [envs[r].spawn(_build_later, envs[r], r, listeners[r], addrs, comms, 0.5 + (r == 2), name=f"rank{r}")
                  for r in range(4)]
        for t in builds + [hostile]:
            assert t.join(timeout=60.0) and t.exception is None, t.exception
        sums = [None] * 4
        tasks = [envs[r].spawn(lambda r=r: sums.__setitem__(r, comms[r].all_reduce_int([r], "sum")), name=f"ar{r}")
                 for r in range(4)]
        for t in tasks:
            assert t.join(timeout=60.0) and t.exception is None, t.exception
        return hostile.result, sums, env.clock.now()

    closed, sums, took = world.run_on("driver", driver)
    assert sums == [[6]] * 4
    assert closed == {**{name: True for name in HOSTILE}, "duplicate": True, "silent": True}
    reasons = [r.getMessage().partition(": ")[2].split(": ")[1] for r in caplog.records if r.name == "ftrun.replica"]
    # one warning for each, with why; the silent peer is closed when the build ends, unlogged
    assert sorted(reasons) == sorted([why.split(": ")[0] for _, why in HOSTILE.values()] + ["child 1 joined already"])
    assert took < 5.0  # the silent peer held nothing up


def _build_later(env, rank, listener, addrs, comms, delay_s):
    env.clock.sleep(delay_s)
    comms[rank] = TreeComm.build(env=env, rank=rank, world_size=4, listener=listener, addrs=addrs, token=TOKEN,
                                 fanout=2, timeout_s=30.0)


def _hostile_peers(env, addr):
    """{what: whether rank 0 closed that connection}, each sent before rank 0's children connect (the silent
    one and the duplicate of child 1 excepted: they come after)."""
    silent = env.net.connect(addr, timeout=5.0)
    conns = {}
    for name, (hello, _) in HOSTILE.items():
        conns[name] = conn = env.net.connect(addr, timeout=5.0)
        if isinstance(hello, bytes):
            conn.send_bytes(hello)
        else:
            conn.send(hello)
    env.clock.sleep(1.0)  # child 1 has joined, child 2 is still to come
    conns["duplicate"] = env.net.connect(addr, timeout=5.0)
    conns["duplicate"].send({"rank": 1, "token": TOKEN})
    conns["silent"] = silent
    return {name: _closed(conn) for name, conn in conns.items()}


def _closed(conn) -> bool:
    try:
        conn.recv(timeout=30.0)
    except PeerClosed:
        return True
    return False


def test_build_times_out_naming_the_missing_children_and_closes_what_it_accepted():
    world, envs = _emulated(3)

    def driver():
        listeners = [envs[r].net.listen("127.0.0.1:0") for r in range(3)]
        addrs = [ln.addr for ln in listeners]
        impostor = envs[1].net.connect(addrs[0], timeout=5.0)
        impostor.send({"rank": 1, "token": "guess"})
        silent = envs[2].net.connect(addrs[0], timeout=5.0)
        t0 = envs[0].clock.now()
        with pytest.raises(ReplicaCommError, match=r"children \[1, 2\] did not join within 2.0s"):
            TreeComm.build(env=envs[0], rank=0, world_size=3, listener=listeners[0], addrs=addrs, token=TOKEN,
                           fanout=2, timeout_s=2.0)
        waited = envs[0].clock.now() - t0
        with pytest.raises(NetError):
            envs[1].net.connect(addrs[0], timeout=0.5)  # the listener is closed
        return waited, _closed(impostor), _closed(silent)

    waited, impostor_closed, silent_closed = world.run_on("driver", driver)
    assert waited == pytest.approx(2.0, abs=0.1) and impostor_closed and silent_closed
