"""The emulator finds a scale bug: the runtime's real TreeComm vs a naive flat gather at the leader.

Every rank runs the real ftrun.replica.tree_comm collectives on the emulated network; CPU charging puts
each message's real handling cost on its emulated host, which is what makes a flat gather (the leader
handles N messages in a row) grow linearly while the tree (each rank handles at most fanout + 1) grows
with log N. Asserted as growth ratios over a 16x range of ranks, not as times.
"""

from __future__ import annotations

import gc

from harness.engine import EmulatedWorld
from ftrun.replica.tree_comm import FlatComm, TreeComm

RANKS_PER_HOST = 8
REPEATS = 5


def modeled_all_reduce_s(comm_cls, num_ranks: int) -> float:
    gc.collect()  # the previous world's garbage must not be collected inside a measured slice
    world = EmulatedWorld(seed=0, cpu_charging=True)
    envs = [world.host_env(f"h{r // RANKS_PER_HOST}") for r in range(num_ranks)]

    def driver():
        listeners = [envs[r].net.listen("127.0.0.1:0") for r in range(num_ranks)]
        addrs = [ln.addr for ln in listeners]
        done = {}
        start_at = [None]
        ready = envs[0].event()

        def rank_main(r):
            comm = comm_cls.build(env=envs[r], rank=r, world_size=num_ranks, listener=listeners[r], addrs=addrs,
                                  fanout=16, timeout_s=600.0)
            ready.wait(timeout=600.0)  # everyone starts the collective at the same virtual time
            envs[r].clock.sleep(start_at[0] - envs[r].clock.now())
            took = []
            for _ in range(REPEATS):  # back to back: each collective synchronizes the ranks again
                t0 = envs[r].clock.now()
                total = comm.all_reduce_int([1], "sum")[0]
                took.append(envs[r].clock.now() - t0)
            done[r] = (sorted(took)[REPEATS // 2], total)

        tasks = [envs[r].spawn(rank_main, r, name=f"rank{r}") for r in range(num_ranks)]
        envs[0].clock.sleep(60.0)  # far past any wiring time
        start_at[0] = envs[0].clock.now() + 1.0
        ready.set()
        for t in tasks:
            assert t.join(timeout=600.0) and t.exception is None, t.exception
        assert all(total == num_ranks for _, total in done.values())
        return done[0][0]  # the leader's median collective time

    return world.run_on("driver", driver)


def test_flat_gather_grows_linearly_while_the_tree_stays_logarithmic():
    sizes = (256, 4096)
    flat = [modeled_all_reduce_s(FlatComm, n) for n in sizes]
    tree = [modeled_all_reduce_s(TreeComm, n) for n in sizes]
    flat_growth, tree_growth = flat[1] / flat[0], tree[1] / tree[0]
    print(f"modeled all-reduce at {sizes} ranks: flat {flat} s (x{flat_growth:.1f}), tree {tree} s (x{tree_growth:.1f})")
    # The leader's median over 5 collectives. Flat grows about 16x (linear: the leader handles every
    # message); the tree adds one level. Sub-millisecond tree times carry CPU-charging jitter, hence margins.
    assert flat_growth > 8.0, "16x the ranks should cost the flat gather about 16x"
    assert flat_growth > 4 * tree_growth, "the flat gather grows far faster than the tree"
    assert flat[1] > 10 * tree[1], "at 4096 ranks the flat gather is the bottleneck"
