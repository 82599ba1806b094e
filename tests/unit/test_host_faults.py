"""host_faults: which host fault is injected when (pure)."""

import pytest

from ftrun.launch.host_faults import KINDS, Fault, HostFaultPlan, parse_kinds, place_replicas


def test_placement_lighthouse_on_host_0_replicas_round_robin_on_the_others():
    assert place_replicas(3, 4) == (0, {"r0": 1, "r1": 2, "r2": 3})
    assert place_replicas(4, 3) == (0, {"r0": 1, "r1": 2, "r2": 1, "r3": 2})
    assert place_replicas(2, 1) == (0, {"r0": 0, "r1": 0})
    with pytest.raises(ValueError, match="--netns-hosts"):
        place_replicas(2, 0)


def test_parse_kinds_names_a_bad_kind():
    assert parse_kinds("host-cut,replica_kill") == ("host_cut", "replica_kill")
    with pytest.raises(ValueError, match="bad fault kind.*host_nap"):
        parse_kinds("host_nap")


def _plan(**kw):
    return HostFaultPlan(placement={"r0": 1, "r1": 2, "r2": 2}, protected_hosts=frozenset({0}), every_s=5.0,
                         min_up=1, **kw)


def test_a_host_fault_takes_out_every_replica_of_the_host_and_only_if_enough_stay_healthy():
    plan = _plan()
    options = plan.candidates(up=["r0", "r1", "r2"], healthy=["r0", "r1", "r2"])
    assert options["host_kill"] == [Fault("host_kill", 1, ("r0",)), Fault("host_kill", 2, ("r1", "r2"))]
    assert [f.host for f in options["host_cut"]] == [1, 2]
    assert len(options["replica_kill"]) == 3
    # only r0 healthy: nothing may take it out, host 2's replicas may go
    options = plan.candidates(up=["r0", "r1", "r2"], healthy=["r0"])
    assert options["host_kill"] == [Fault("host_kill", 2, ("r1", "r2"))]
    assert [f.replicas for f in options["replica_kill"]] == [("r1",), ("r2",)]


def test_faults_come_on_time_waiting_for_a_candidate_and_are_seeded():
    def run(seed):
        plan = _plan(seed=seed)
        plan.start(0.0)
        got = []
        for t in range(0, 60):
            healthy = [] if 20 <= t < 30 else ["r0", "r1", "r2"]  # nobody may go while none is healthy
            fault = plan.due(float(t), ["r0", "r1", "r2"], healthy)
            if fault is not None:
                got.append((t, fault.kind))
        return got

    got = run(1)
    assert [t for t, _ in got] == [5, 10, 15, 30, 35, 40, 45, 50, 55]  # 20 and 25 waited until 30
    assert run(1) == got and {k for _, k in got} <= set(KINDS)
    assert len({k for _, k in got}) > 1


def test_only_the_asked_kinds():
    plan = _plan(kinds=("host_cut",))
    plan.start(0.0)
    assert plan.due(5.0, ["r0", "r1", "r2"], ["r0", "r1", "r2"]).kind == "host_cut"
    assert plan.due(6.0, ["r0", "r1", "r2"], ["r0", "r1", "r2"]) is None  # not due yet
