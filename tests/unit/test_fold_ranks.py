"""Rank folding (harness.run.fold): which ranks a folded replica runs, the latency the full tree adds, the
FoldedComm that charges it, and a job that folds ranks training like one that runs them all."""

from __future__ import annotations

import pytest

from ftrun.env.base import PeerClosed
from harness import cli
from harness.engine import EmulatedWorld
from harness.profile import apply_overrides, load_profile
from harness.run import JobOptions, parse_inject, split_faults
from harness.run.fold import FoldedComm, represented_ranks, tree_depth_latency
from ftrun.replica.tree_comm import TreeComm


@pytest.mark.parametrize("n, leads, targets, want", [
    (8192, 8, [], tuple(range(8))),
    (8192, 8, [100, 3, 100], (*range(8), 100)),
    (16, 4, [15, 4], (0, 1, 2, 3, 4, 15)),
    (4, 4, [2], (0, 1, 2, 3)),
])
def test_represented_ranks_are_the_leads_and_every_target(n, leads, targets, want):
    assert represented_ranks(n, leads, targets) == want


@pytest.mark.parametrize("n, leads, targets, what", [
    (8, 0, [], "num_leads"), (8, 9, [], "num_leads"), (8, 2, [8], "outside"), (8, 2, [-1], "outside")])
def test_represented_ranks_rejects_bad_input(n, leads, targets, what):
    with pytest.raises(ValueError, match=what):
        represented_ranks(n, leads, targets)


def test_tree_depth_latency_is_the_longest_root_to_leaf_path():
    hop = lambda a, b: 1.0 if a // 4 != b // 4 else 0.1  # noqa: E731 (4 ranks per host)
    # fanout 2 over 7 ranks: 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6. Deepest: 0 -> 2 -> 5 (0.1 + 1.0)
    assert tree_depth_latency(range(7), 2, hop) == pytest.approx(1.1)
    assert tree_depth_latency([0, 1, 2, 3], 2, hop) == pytest.approx(0.2)  # one host: two same-host hops
    assert tree_depth_latency([0], 16, hop) == 0.0
    with pytest.raises(ValueError, match="fanout"):
        tree_depth_latency(range(3), 0, hop)


def _on_two_folded_ranks(extra_s: float, pass_s: float, steps) -> tuple[dict, object]:
    """({rank: steps(folded comm, rank, clock)} of 2 ranks on one emulated host, their TreeComm in a FoldedComm(extra_s,
    pass_s)), and the host's env."""
    world = EmulatedWorld(0, cpu_charging=False)
    env = world.host_env("h0")

    def body():
        results = {}

        def rank(r):
            comm = TreeComm.build(env=env, rank=r, world_size=2, listener=listeners[r], addrs=addrs, token="t",
                                  timeout_s=5)
            folded = FoldedComm(comm, env, extra_s, pass_s)
            results[r] = steps(folded, r, env.clock)
            folded.close()

        listeners = [env.net.listen("127.0.0.1:0"), env.net.listen("127.0.0.1:0")]
        addrs = [ln.addr for ln in listeners]
        tasks = [env.spawn(rank, r, name=f"r{r}") for r in range(2)]
        for t in tasks:
            assert t.join(timeout=10)
        return results

    return world.run_on("h0", body), env


def test_folded_comm_adds_the_full_trees_latency_per_pass():
    def steps(folded, r, clock):
        t0 = clock.now()
        got = folded.all_reduce_int([r + 1], "max")
        t1 = clock.now()
        data = folded.broadcast_bytes(b"hi" if r == 0 else None)
        return got, data, t1 - t0, clock.now() - t1, folded.rank, folded.world_size

    results, env = _on_two_folded_ranks(0.5, 0.0, steps)
    for r, (got, data, reduce_s, bcast_s, rank, size) in results.items():
        assert got == [2] and data == b"hi" and (rank, size) == (r, 2)
        assert 1.0 <= reduce_s < 1.01 and 0.5 <= bcast_s < 0.51  # two passes, then one, plus the real hops
    with pytest.raises(ValueError, match="extra_s"):
        FoldedComm(object(), env, -1.0)


def test_folded_comm_charges_a_real_collectives_pass_except_to_a_broadcasts_root():
    def steps(folded, r, clock):
        t0 = clock.now()
        folded.all_reduce_int([r], "min")
        t1 = clock.now()
        folded.broadcast_bytes(b"go" if r == 0 else None)
        return t1 - t0, clock.now() - t1

    results, env = _on_two_folded_ranks(0.0, 0.25, steps)
    assert all(0.5 <= reduce_s < 0.51 for reduce_s, _ in results.values())  # 2 passes, every rank
    assert results[0][1] < 0.01 and 0.25 <= results[1][1] < 0.26  # the root's send returns; its receiver pays
    with pytest.raises(ValueError, match="pass_s"):
        FoldedComm(object(), env, 0.0, -1.0)


def _run(fold: str, inject: str, *overrides: str) -> tuple[dict, object]:
    profile = apply_overrides(load_profile("ci-small"), list(overrides))
    kills, faults = split_faults([parse_inject(inject)])
    f, job = cli.execute(profile, JobOptions(steps=10, kills=kills, faults=faults, fold_ranks=fold))
    return f, job


SAME = ("complete", "replicas_consistent", "steps_done", "participants_per_step", "audit_batches",
        "duplicate_batches", "skipped_batches", "catchup_bytes", "unexpected_errors")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inject", ["kill replica=1 step=3", "kill replica=2 rank=5 time=1.0"])
def test_a_job_that_folds_ranks_trains_as_one_that_runs_them_all(inject):
    full, full_job = _run("off", inject, "ranks_per_replica=32", "topology.racks_per_zone=8")
    folded, job = _run("on", inject, "ranks_per_replica=32", "topology.racks_per_zone=8")
    assert {k: folded[k] for k in SAME} == {k: full[k] for k in SAME}
    assert folded["complete"] and folded["replicas_consistent"] and not folded["unexpected_errors"]
    target = [5] if "rank=5" in inject else []
    assert job.ranks == (0, 1, *target) and folded["ranks_run_per_replica"] == 2 + len(target)
    assert full["ranks_run_per_replica"] == 32 and full["ranks_mirrored_per_replica"] == 0
    assert folded["ranks_mirrored_per_replica"] == 30 - len(target) and "mirror" in folded["folding"]
    for key in ("step_time_s", "get_quorum_p50_ms"):  # the full tree's depth is charged: timing stays close
        assert folded[key] == pytest.approx(full[key], rel=0.1), key
    # the ranks not run take no step: every rank-step recorded is a represented rank's
    per_rank = len(job.recorder.start_step_s) / len(job.ranks), len(full_job.recorder.start_step_s) / 32
    assert per_rank[0] == pytest.approx(per_rank[1], rel=0.1)
    assert folded["engine"]["frames"] < full["engine"]["frames"]


def test_fold_ranks_needs_folded_rings():
    with pytest.raises(ValueError, match="fold_ranks"):
        JobOptions(steps=1, fold_ranks="on", ftar_detail="full")
    with pytest.raises(ValueError, match="fold_ranks"):
        JobOptions(steps=1, fold_ranks="sometimes")  # type: ignore[arg-type]


def test_fold_ranks_auto_folds_only_large_replicas():
    from harness.run import EmulatedJob

    small = EmulatedJob(load_profile("ci-small"), JobOptions(steps=1))
    assert small.ranks == tuple(range(8))
    big = EmulatedJob(apply_overrides(load_profile("ci-small"), ["ranks_per_replica=512", "topology.racks_per_zone=128"]), JobOptions(steps=1))
    assert big.ranks == (0, 1) and big.tree_extra_s(big.topology.replica_hosts(0)) > 0
