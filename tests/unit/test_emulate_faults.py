"""The emulator's injected faults: the --inject syntax (pure), the profile's scripted events, and the
engine's building cut (silent: held until it heals, never refused)."""

from __future__ import annotations

import dataclasses

import pytest

from ftrun.env.base import NetTimeout
from harness.engine import EmulatedWorld
from harness.profile import apply_overrides, load_profile
from harness.run import (CutBuilding, JobOptions, Kill, KillLighthouse, SlowFetch, SlowHost, check_faults,
                         faults_from_profile, parse_inject, split_faults)
from harness.run.faults import Hang, HostLoss
from harness.topology import Location, Topology


@pytest.mark.parametrize("text, want", [
    ("kill replica=3 step=5", Kill(3, at_step=5)),
    ("kill replica=3 step=5 at=0.5 hosts=replace", Kill(3, at_step=5, at_fraction=0.5, hosts="replace")),
    (" kill replica=0 time=2.5 ", Kill(0, at_s=2.5)),
    ("kill lighthouse time=4", KillLighthouse(at_s=4.0)),
    ("kill lighthouse step=3 at=0.5 down=10", KillLighthouse(at_step=3, at_fraction=0.5, down_s=10.0)),
    ("slow host replica=1 factor=3", SlowHost(1, 3.0)),
    ("slow host replica=1 rank=9 factor=1.5 step=4", SlowHost(1, 1.5, rank=9, from_step=4)),
    ("slow fetch replica=2 factor=40", SlowFetch(2, factor=40.0)),
    ("slow fetch replica=2 delay=0.75", SlowFetch(2, delay_s=0.75)),
    ("cut building=1 time=2 duration=3.5", CutBuilding(1, 2.0, 3.5)),
])
def test_parse_inject_forms(text, want):
    got = parse_inject(text)
    assert got == want
    assert parse_inject(got.describe()) == want  # describe() is valid input


@pytest.mark.parametrize("text, says", [
    ("", "empty"),
    ("explode replica=1 step=2", "unknown fault 'explode'"),
    ("kill replica=1", "exactly one of step= or time="),
    ("kill replica=1 step=2 time=3", "exactly one of step= or time="),
    ("kill step=3", "missing fields: replica"),
    ("kill replica=1 step=2 at=1.5", "at= must be in [0, 1)"),
    ("kill replica=1 time=2 at=0.5", "at= goes with step="),
    ("kill replica=1 step=2 when=now", "unknown fields: when"),
    ("kill replica=1 replica=2 step=2", "repeated"),
    ("kill replica=x step=2", "invalid literal"),
    ("kill lighthouse", "exactly one of step= or time="),
    ("kill lighthouse time=1 down=-2", "down= must be"),
    ("kill host replica=1 time=2", "unknown fault 'kill host'"),
    ("slow host replica=1", "missing fields: factor"),
    ("slow host replica=1 factor=0.5", "factor= must be a finite number >= 1"),
    ("slow fetch replica=1", "needs factor= > 1 or delay= > 0"),
    ("slow fetch replica=1 delay=inf", "delay= >= 0"),
    ("slow disk replica=1 factor=2", "unknown fault 'slow disk'"),
    ("cut building=1 time=2", "needs time=T and duration=D"),
    ("cut building=1 time=2 duration=0", "duration= must be"),
])
def test_parse_inject_rejects_bad_input_with_a_reason(text, says):
    with pytest.raises(ValueError) as e:
        parse_inject(text)
    assert says in str(e.value) and "expected one of" in str(e.value)


def test_check_faults_against_the_job():
    ok = [Kill(3, at_step=1), SlowHost(0, 2.0, rank=7), CutBuilding(1, 0.0, 1.0), KillLighthouse(at_s=1.0)]
    check_faults(ok, replicas=4, ranks_per_replica=8, buildings=2)
    for bad, says in ((Kill(4, at_step=1), "replicas 0..3"), (SlowHost(0, 2.0, rank=8), "ranks 0..7"),
                      (CutBuilding(2, 0.0, 1.0), "buildings 0..1"),
                      (SlowFetch(1, delay_s=1), None)):
        faults = [bad, bad] if says is None else [bad]
        with pytest.raises(ValueError, match=says or "one SlowFetch per replica"):
            check_faults(faults, replicas=4, ranks_per_replica=8, buildings=2)


def test_split_faults_and_job_options():
    faults = [parse_inject("kill replica=1 step=2"), parse_inject("cut building=0 time=1 duration=1")]
    kills, others = split_faults(faults)
    assert kills == (faults[0],) and others == (faults[1],)
    assert JobOptions(steps=3, kills=kills, faults=others).injected == tuple(faults)
    with pytest.raises(ValueError, match="faults="):
        JobOptions(steps=3, kills=others)  # type: ignore[arg-type]


def test_the_profiles_events_are_fault_specs_in_the_one_grammar():
    base = load_profile("ci-small")
    events = (*base.failures.events, "kill lighthouse time=3 down=1.5", "cut replica=1 rank=2 time=1 duration=2",
              "hang replica=0 time=2")
    profile = dataclasses.replace(base, failures=dataclasses.replace(base.failures, events=events))
    faults = faults_from_profile(profile, seed=0, horizon_s=100.0)
    assert faults == [Kill(1, at_step=3), KillLighthouse(at_s=3.0, down_s=1.5),
                      HostLoss(1, rank=2, at_s=1.0, duration_s=2.0), Hang(replica=0, at_s=2.0)]
    with pytest.raises(ValueError, match=r"\[failures\] events: bad fault 'nope'"):  # refused when loaded
        apply_overrides(base, ['failures.events=["kill replica=1 step=2", "nope"]'])


# -- the engine's building cut ---------------------------------------------------------------------------

def _two_buildings() -> EmulatedWorld:
    topo = Topology(host_names=["a", "b", "c"], locations=[Location(0, 0, 0), Location(1, 1, 1), Location(2, 2, 1)])
    return EmulatedWorld(seed=0, topology=topo, cpu_charging=False)


def test_a_cut_holds_frames_and_connects_until_it_heals_and_refuses_nothing():
    world = _two_buildings()
    world.cut_building(1, 1.0, 3.0)
    a, b, c = (world.host_env(h) for h in "abc")
    seen = {}

    def server(listener):
        conn = listener.accept()
        while True:
            msg = conn.recv(timeout=None)
            seen[msg["n"]] = b.clock.now()
            if msg["n"] == 3:
                return

    def main():
        ab, bc = b.net.listen("127.0.0.1:7"), b.net.listen("127.0.0.1:8")
        b.spawn(server, ab, name="server-ab")
        conn = a.net.connect("b:7", timeout=1.0)  # before the cut
        conn.send({"n": 1})
        a.clock.sleep(1.5 - a.clock.now())
        conn.send({"n": 2})  # during the cut: held, delivered after it heals
        with pytest.raises(NetTimeout):
            conn.recv(timeout=0.5)  # the peer is silent, not gone
        late = a.net.connect("b:7", timeout=5.0)  # the SYN is held too, then answered
        assert a.clock.now() > 3.0
        late.close()
        conn.send({"n": 3})
        inside = c.net.connect("b:8", timeout=0.1)  # building 1 inside itself: not cut
        inside.close()
        a.clock.sleep(1.0)

    a.run(main)
    assert seen[1] < 1.0 and 3.0 < seen[2] < 3.01 and seen[3] > seen[2]


def test_kill_at_ftar():
    k = parse_inject("kill replica=2 step=3 at=ftar")
    assert k == Kill(2, at_step=3, in_ftar=True) and parse_inject(k.describe()) == k
    with pytest.raises(ValueError, match="at=ftar goes with step="):
        parse_inject("kill replica=2 time=3 at=ftar")


@pytest.mark.timeout(120)
def test_a_hang_and_a_host_loss_at_a_step_fire_once_the_job_has_committed_it():
    from harness.cli import build_profile, execute
    from harness.run import parse_inject, split_faults

    profile = build_profile("ci-small", [], steps=6, cpu_charging=False)
    kills, faults = split_faults([parse_inject("hang replica=1 step=2 duration=0.3"),
                                  parse_inject("cut replica=2 rank=0 step=4 at=0.5 duration=0.3")])
    f, job = execute(profile, JobOptions(steps=6, kills=kills, faults=faults))
    fired = [e for e in job.recorder.events if e["event"] == "fault"]
    assert [e["fault"].split()[0] for e in fired] == ["hang", "release", "cut", "release"]  # after duration=
    fired = fired[::2]
    assert fired[0]["step"] >= 2 and fired[1]["step"] >= 4 and f["complete"]
    step_s = profile.train.step_compute_s
    commit4 = min(e["t"] for e in job.recorder.events if e["event"] == "commit" and e["step"] == 4)
    assert fired[1]["t"] >= commit4 + 0.5 * step_s - 1e-9  # at=0.5: half a step after the job reached step 4
