"""The emulator finds a scale bug: the runtime's real TreeComm vs a naive flat gather at the leader.

Every rank runs the real ftrun.replica.tree_comm collectives on the emulated network. What makes a flat
gather slow is structural: its leader handles every other rank's message in a row, N - 1 up and N - 1
down per collective, while in the tree every rank handles at most fanout + 1 each way and a message
crosses one level per hop. Both are counted here, at the Connection, per rank, so the assertions are
exact and no machine load can move them. With CPU charging off the modeled time is the network alone,
also deterministic: the tree's grows with its depth. The CPU-charged timing ratio, which does depend on
load, is printed by benchmarks/checkin_scale.py.
"""

from __future__ import annotations

import types

import pytest

from ftrun.replica.tree_comm import FlatComm, TreeComm
from harness.engine import EmulatedWorld

RANKS_PER_HOST = 1  # one rank per host: every tree edge is the same one-rack hop
FANOUT = 16
REPEATS = 3
SIZES = (64, 1024)  # 16x the ranks; with fanout 16, 2 and then 3 levels below the tree's root


class _Counted:
    """A Connection (or Listener) that counts the messages its rank sends and receives."""

    def __init__(self, inner, tally: list[int]) -> None:
        self._inner, self._tally = inner, tally

    def send(self, msg, timeout=None):
        self._tally[0] += 1
        return self._inner.send(msg, timeout=timeout)

    def recv(self, timeout=None):
        msg = self._inner.recv(timeout=timeout)
        self._tally[0] += 1
        return msg

    def accept(self, timeout=None):
        return _Counted(self._inner.accept(timeout=timeout), self._tally)

    def connect(self, addr, timeout):
        return _Counted(self._inner.connect(addr, timeout=timeout), self._tally)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def run_all_reduces(comm_cls, num_ranks: int) -> tuple[list[int], float]:
    """(messages each rank handled per all-reduce, the leader's modeled seconds per all-reduce)."""
    world = EmulatedWorld(seed=0, cpu_charging=False)
    envs = [world.host_env(f"h{r // RANKS_PER_HOST}") for r in range(num_ranks)]
    tallies = [[0] for _ in range(num_ranks)]

    def driver():
        listeners = [envs[r].net.listen("127.0.0.1:0") for r in range(num_ranks)]
        addrs = [ln.addr for ln in listeners]
        handled, took = [0] * num_ranks, [0.0] * num_ranks
        ready = envs[0].event()

        def rank_main(r):
            env = envs[r]
            net = types.SimpleNamespace(net=_Counted(env.net, tallies[r]), clock=env.clock, spawn=env.spawn,
                                        queue=env.queue, event=env.event)
            comm = comm_cls.build(env=net, rank=r, world_size=num_ranks, listener=_Counted(listeners[r], tallies[r]),
                                  addrs=addrs, token="t", fanout=FANOUT, timeout_s=600.0)
            ready.wait(timeout=600.0)
            before, t0 = tallies[r][0], envs[r].clock.now()
            for _ in range(REPEATS):
                assert comm.all_reduce_int([1, r], "sum") == [num_ranks, num_ranks * (num_ranks - 1) // 2]
            handled[r] = (tallies[r][0] - before) // REPEATS
            took[r] = (envs[r].clock.now() - t0) / REPEATS

        tasks = [envs[r].spawn(rank_main, r, name=f"rank{r}") for r in range(num_ranks)]
        envs[0].clock.sleep(60.0)  # far past any wiring time: every rank waits on `ready`
        ready.set()
        for t in tasks:
            assert t.join(timeout=600.0) and t.exception is None, t.exception
        return handled, took[0]

    return world.run_on("driver", driver)


@pytest.fixture(scope="module")
def runs():
    return {(cls, n): run_all_reduces(cls, n) for cls in (FlatComm, TreeComm) for n in SIZES}


def test_the_flat_leader_handles_every_message_while_tree_ranks_handle_at_most_fanout_plus_one(runs):
    for n in SIZES:
        flat, tree = runs[FlatComm, n][0], runs[TreeComm, n][0]
        assert flat[0] == 2 * (n - 1), "the flat leader receives N - 1 values and sends N - 1 results"
        assert flat[1:] == [2] * (n - 1)
        assert tree[0] == 2 * FANOUT, "the tree's root talks to its fanout children only"
        assert max(tree) == 2 * (FANOUT + 1) and sum(tree) == 2 * 2 * (n - 1), "one edge per non-root rank"


def test_the_tree_pays_one_latency_per_level_so_16x_the_ranks_add_one_level(runs):
    # Network only (CPU charging off): exact and repeatable. The leader's collective crosses 2 levels
    # up and down at 64 ranks and 3 at 1024, so it takes 3/2 as long, not 16x.
    small, large = (runs[TreeComm, n][1] for n in SIZES)
    assert run_all_reduces(TreeComm, SIZES[0])[1] == small, "modeled time is deterministic"
    assert 1.45 < large / small < 1.55, (small, large)

