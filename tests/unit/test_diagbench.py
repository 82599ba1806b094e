"""Root-cause bench on the emulator: the scenario fault grammar, the engine's freeze/thaw, per-process kill
and slow link, the bench's pure draw and scoring, and a small emulated bench at ci-small."""

from __future__ import annotations

import dataclasses

import pytest

from ftrun.env.base import PeerClosed
from harness.diagbench import KINDS, Scenario, Shape, Truth, draw, kinds_for, pick, score, summarize
from harness.engine import EmulatedWorld
from harness.profile import NetworkConfig
from harness.run.faults import (CutBuilding, Hang, HostLoss, KillRank, Release, SlowHostAt, SlowLink, check_faults,
                                parse_inject, resolve_host)


# -- grammar -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, fault", [
    ("hang replica=0 rank=3", Hang(replica=0, rank=3)),
    ("hang replica=1 time=2", Hang(replica=1, at_s=2.0)),
    ("cut replica=1 rank=2 time=1 duration=3", HostLoss(replica=1, rank=2, at_s=1.0, duration_s=3.0)),
    ("hang replica=1 step=5 at=0.5 duration=1", Hang(replica=1, at_step=5, at_fraction=0.5, duration_s=1.0)),
    ("cut replica=0 step=3", HostLoss(replica=0, at_step=3)),
    ("hang host=2 time=1.5 duration=2", Hang(host="2", at_s=1.5, duration_s=2.0)),
    ("slow host=4 factor=3", SlowHostAt(host="4", factor=3.0)),
    ("slow link a=1 b=2 factor=5 time=3", SlowLink(a="1", b="2", factor=5.0, at_s=3.0)),
    ("kill replica=1 rank=3 time=2", KillRank(replica=1, rank=3, at_s=2.0)),
    ("release time=4", Release(at_s=4.0)),
])
def test_scenario_forms_parse_and_describe_round_trip(text, fault):
    got = parse_inject(text)
    assert got == fault
    assert parse_inject(got.describe()) == fault


@pytest.mark.parametrize("text, why", [
    ("hang", "exactly one of replica= or host="),
    ("hang replica=1 host=2", "exactly one of replica= or host="),
    ("hang rank=1", "exactly one of replica= or host="),
    ("hang host=1 rank=1", "rank= goes with replica="),
    ("hang replica=1 step=2 time=1", "one of step= or time="),
    ("hang replica=1 time=1 at=0.5", "at= goes with step="),
    ("cut building=1 time=2", "needs time=T and duration=D"),
    ("cut replica=1 building=1 time=2", "exactly one of replica= or building="),
    ("slow link a=1 b=1 factor=2", "two different hosts"),
    ("slow host=1 factor=0.5", "factor="),
    ("slow foo=1", "unknown fault"),
    ("kill replica=0 rank=1 step=2", "time= only"),
    ("kill", "missing fields: replica"),
    ("kill rank=1 time=2", "missing fields: replica"),
    ("hang replica=0 rank=1 duration=0", "duration="),
    ("release step=3", "unknown"),
])
def test_scenario_forms_reject_bad_input_naming_it(text, why):
    with pytest.raises(ValueError, match="bad --inject") as e:
        parse_inject(text)
    assert why in str(e.value)


def test_old_forms_unchanged():
    assert parse_inject("kill replica=1 step=3").describe() == "kill replica=1 step=3 at=0 hosts=relaunch"
    assert parse_inject("slow host replica=1 factor=2").describe() == "slow host replica=1 rank=0 factor=2 step=0"


def test_check_faults_places():
    hosts = ("h0", "h1", "h2")
    assert resolve_host("2", hosts) == "h2" and resolve_host("h1", hosts) == "h1"
    for bad, why in ((Hang(replica=1, rank=8), "ranks 0..3"), (Hang(replica=2), "replicas 0..1"),
                     (Hang(host="3"), "hosts 0..2"), (SlowHostAt("hx", 2.0), "not a")):
        with pytest.raises(ValueError, match=why):
            check_faults([bad], replicas=2, ranks_per_replica=4, buildings=1, hosts=hosts)
    check_faults([Hang(replica=1, rank=3), SlowLink("h0", "2", 4.0)], replicas=2, ranks_per_replica=4, buildings=1,
                 hosts=hosts)


# -- engine: freeze / thaw, per-process kill, slow link --------------------------------------------------
def _world() -> EmulatedWorld:
    return EmulatedWorld(0, cpu_charging=False,
                         network=NetworkConfig(base_latency_us=10.0, host_nic_gbps=80.0, frame_overhead_bytes=0))


def test_freeze_stops_a_process_until_thaw_and_its_timers_expire_meanwhile():
    w = _world()
    a, b = w.host_env("a"), w.host_env("b")
    log = []

    def sleeper(name):
        a.clock.sleep(1.0)
        log.append((name, a.clock.now()))

    def main():
        t1 = a.spawn(sleeper, "frozen", name="p1")
        t2 = a.spawn(sleeper, "free", name="p2")
        b.clock.sleep(0.5)
        w.freeze("a", t1.proc)
        b.clock.sleep(2.0)
        assert log == [("free", 1.0)]  # the frozen process did not run at t=1
        w.thaw("a", t1.proc)
        t1.join(1.0)
        t2.join(1.0)

    w.run_on("b", main)
    assert log == [("free", 1.0), ("frozen", 2.5)]


def test_a_task_spawned_by_a_process_is_in_it_and_a_host_freeze_stops_everything():
    w = _world()
    a, b = w.host_env("a"), w.host_env("b")
    seen = []

    def child():
        a.clock.sleep(1.0)
        seen.append("child")

    def parent():
        t = a.spawn(child, name="child")
        assert t.proc is parent_task[0]
        a.clock.sleep(1.0)
        seen.append("parent")
        t.join(5.0)

    parent_task = []

    def main():
        parent_task.append(a.spawn(parent, name="parent"))
        w.freeze("a")
        b.clock.sleep(3.0)
        assert seen == []
        w.thaw("a")
        parent_task[0].join(5.0)

    w.run_on("b", main)
    assert sorted(seen) == ["child", "parent"]


def test_kill_process_resets_its_connections_and_spares_the_hosts_other_processes():
    w = _world()
    a, b = w.host_env("a"), w.host_env("b")
    got = {}

    def server(name):
        ln = a.net.listen("127.0.0.1:0")
        got[name + "_addr"] = ln.addr
        conn = ln.accept(timeout=5.0)
        got[name] = conn.recv(timeout=10.0)

    def main():
        victim = a.spawn(server, "victim", name="victim")
        other = a.spawn(server, "other", name="other")
        b.clock.sleep(0.1)
        cv = b.net.connect(got["victim_addr"], timeout=1.0)
        co = b.net.connect(got["other_addr"], timeout=1.0)
        b.clock.sleep(0.1)
        w.kill_process("a", victim.proc)
        with pytest.raises(PeerClosed):
            cv.recv(timeout=1.0)
        co.send({"x": 1})
        other.join(1.0)
        assert got["other"] == {"x": 1} and not victim.is_alive()

    w.run_on("b", main)


def test_slow_link_stretches_both_directions_and_restores():
    w = _world()
    a, b = w.host_env("a"), w.host_env("b")
    times = []

    def main():
        ln = b.net.listen("127.0.0.1:0")
        c = a.net.connect(ln.addr, timeout=1.0)
        s = ln.accept(timeout=1.0)
        from harness.engine import ShapeOnly
        for factor in (1.0, 4.0, 1.0):
            w.fabric.slow_link("a", "b", factor)
            t0 = a.clock.now()
            c.send_bytes(ShapeOnly(10_000_000))
            s.recv_into(ShapeOnly(10_000_000), timeout=10.0)
            times.append(b.clock.now() - t0)

    w.run_on("a", main)
    assert times[1] == pytest.approx(4 * times[0], rel=0.05) and times[2] == pytest.approx(times[0], rel=1e-6)


# -- draw and scoring (pure) ----------------------------------------------------------------------------
SHAPE = Shape(replicas=4, ranks_per_replica=8, gpus_per_host=2, buildings=2, max_slow_factor=5.8)


def test_draw_is_seeded_covers_every_kind_and_stays_in_the_job():
    a, b = draw(24, 3, SHAPE), draw(24, 3, SHAPE)
    assert a == b and a != draw(24, 4, SHAPE)
    assert {s.kind for s in a} == set(KINDS)
    for s in a:
        assert 0 <= s.phase < 1
        if s.kind in ("hang_rank", "kill_rank"):
            assert 0 <= s.replica < 4 and 0 <= s.rank < 8
        if s.kind == "slow_host":
            assert 2 <= s.factor <= 5.8 and 0 <= s.host < 16
        if s.kind == "slow_link":  # a ring link: the same host slot in the next replica
            assert s.host_b == (s.host + 4) % 16 and 4 <= s.factor <= 10
        if s.kind == "cut_building":
            assert s.building == 1  # never the lighthouse's building 0
    assert "cut_building" not in kinds_for(Shape(2, 8, 8, 1, 3.0))


def test_draw_on_first_hosts_places_every_fault_there_and_is_the_same_draw_when_every_host_is_allowed():
    first = dataclasses.replace(SHAPE, fault_hosts=1)  # 4 hosts per replica; faults on host slot 0 only
    assert first.place_hosts == 1 and first.place_ranks == 2 and SHAPE.place_hosts == 4 and SHAPE.place_ranks == 8
    a = draw(48, 5, first)
    assert {s.kind for s in a} == set(KINDS)
    for s in a:
        if s.kind in ("hang_rank", "kill_rank"):
            assert 0 <= s.replica < 4 and s.rank in (0, 1)
        if s.kind in ("hang_host", "slow_host", "slow_link"):
            assert s.host % 4 == 0 and 0 <= s.host < 16
        if s.kind == "slow_link":
            assert s.host_b == (s.host + 4) % 16
    assert draw(48, 5, dataclasses.replace(SHAPE, fault_hosts=4)) == draw(48, 5, SHAPE)
    with pytest.raises(ValueError, match="fault_hosts"):
        dataclasses.replace(SHAPE, fault_hosts=-1)


def test_pick_runs_the_named_scenarios_of_the_drawn_plan_as_drawn():
    plan = draw(24, 3, SHAPE)
    assert pick(plan, None) == plan
    assert pick(plan, "17,2") == [plan[2], plan[17]]  # plan order, each exactly as drawn
    assert pick(plan, " 5 ,") == [plan[5]]
    for bad in ("24", "-1", "x", "", ","):
        with pytest.raises(ValueError, match="--only"):
            pick(plan, bad)


def test_scenario_faults_and_places():
    assert Scenario(0, "hang_rank", 0.5, replica=1, rank=3).fault() == Hang(replica=1, rank=3)
    assert Scenario(0, "kill_rank", 0.5, replica=1, rank=3).place() == "kill replica=1 rank=3"
    assert Scenario(0, "slow_link", 0.5, host=1, host_b=5, factor=4.0).place() == "slow link a=1 b=5 factor=4"
    assert Scenario(0, "cut_building", 0.5, building=1).fault(3.0) == CutBuilding(1, 0.0, 3.0)


@pytest.mark.parametrize("verdict, truth, want", [
    ({"kind": "hang", "ranks": ["r1/3"], "hosts": ["h2"]}, Truth(("hang",), ranks=frozenset({"r1/3"})), "exact"),
    ({"kind": "hang", "ranks": ["r1/3", "r1/2"], "hosts": ["h2"]}, Truth(("hang",), ranks=frozenset({"r1/3"})), "miss"),
    ({"kind": "candidates", "ranks": ["r0/3", "r1/3"], "hosts": ["h0", "h2"]},
     Truth(("hang",), ranks=frozenset({"r1/3"})), "candidates"),
    ({"kind": "slow_host", "ranks": ["r1/2", "r1/3"], "hosts": ["h2"]},
     Truth(("slow_host", "slow_rank"), hosts=frozenset({"h2"})), "exact"),
    ({"kind": "slow_host", "ranks": [], "hosts": ["h3"]}, Truth(("slow_host",), hosts=frozenset({"h2"})), "miss"),
    ({"kind": "slow_link", "ranks": [], "hosts": ["h2"]}, Truth(("slow_link",), hosts=frozenset({"h2", "h6"}),
                                                             subset=True), "exact"),
    ({"kind": "hang", "ranks": [], "hosts": []}, Truth(("hang",), hosts=frozenset({"h2"}), subset=True), "miss"),
    ({"kind": "no_hang", "ranks": [], "hosts": []}, Truth(("hang",), hosts=frozenset({"h2"})), "miss"),
])
def test_score(verdict, truth, want):
    assert score(verdict, truth) == want


def test_summarize_keys():
    results = [{"seed": 1, "index": i, "kind": "hang_rank", "place": "hang replica=0 rank=1", "phase": 0.1, "score": s,
                "verdict_kind": "hang", "reason": "r"} for i, s in enumerate(("exact", "exact", "candidates", "miss"))]
    ff = [{"kind": "no_hang", "evicted": False}, {"kind": "slow_host", "evicted": False}]
    out = summarize(results, ff, [0.01, 0.02, 0.03], {"telemetry_bytes_per_rank": 1000})
    assert out["accuracy"] == 0.5 and out["candidate_hits"] == 1 and out["false_positive_runs"] == 1
    assert out["false_evictions"] == 0 and out["analysis_s_p50"] == 0.02 and out["analysis_s_p99"] == 0.03
    assert [m["index"] for m in out["misses"]] == [2, 3] and out["telemetry_bytes_per_rank"] == 1000
    assert {"scenarios", "accuracy", "candidate_hits", "false_positive_runs", "analysis_s_p50", "analysis_s_p99",
            "telemetry_bytes_per_rank", "misses"} <= out.keys()
