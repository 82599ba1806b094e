"""`ftrun launch --inject`: the fault grammar shared with `ftrun emulate --inject`, and the plan of what is due
(pure), the catch-up's slow-fetch fault plan, and the CLI's refusals. Fast: nothing is started."""

from __future__ import annotations

import pytest

from ftrun.cli import main
from ftrun.launch.inject import Action, InjectPlan, check, parse
from ftrun.train.inject import CatchupFault, parse_catchup_fault
from ftrun import faultspec
from harness.run.faults import Hang, HostLoss, Kill, SlowFetch, parse_inject as parse_emulated


@pytest.mark.parametrize("spec", ["kill replica=1 step=15 at=0.5", "kill replica=2 step=3", "kill replica=0 time=4.5",
                                  "slow fetch replica=1 delay=0.2", "slow fetch replica=2 factor=3 delay=0.1"])
def test_the_forms_both_worlds_accept_mean_the_same_fault(spec):
    real, emulated = parse(spec), parse_emulated(spec)
    assert real.replica == emulated.replica
    if isinstance(emulated, Kill):
        assert real.kind == "crash"
        assert (real.at_step, real.at_s, real.at_fraction) == (emulated.at_step, emulated.at_s, emulated.at_fraction)
    else:
        assert isinstance(emulated, SlowFetch) and real.kind == "slow_fetch"
        assert (real.factor, real.delay_s) == (emulated.factor, emulated.delay_s)


@pytest.mark.parametrize("spec", ["hang replica=1 rank=0 time=2 duration=3", "hang replica=2 time=1",
                                  "cut replica=1 time=2 duration=1", "cut replica=0 time=0",
                                  "hang replica=1 step=5 at=0.5 duration=1", "cut replica=2 step=3"])
def test_hangs_and_host_losses_mean_the_same_in_both_worlds(spec):
    real, emulated = parse(spec), parse_emulated(spec)
    kind = {"hang": Hang, "cut": HostLoss}[spec.split()[0]]
    assert isinstance(emulated, kind) and real.kind == {"hang": "hang", "cut": "host_loss"}[spec.split()[0]]
    assert (real.replica, real.rank, real.at_step, real.at_fraction) == \
        (emulated.replica, emulated.rank, emulated.at_step, emulated.at_fraction)
    assert real.at_s == (emulated.at_s if emulated.at_step is None else None)
    assert real.duration_s == (emulated.duration_s or 0.0)


def test_one_table_of_forms_each_world_refuses_what_it_cannot_inject():
    assert {f.name for f in faultspec.FORMS} >= {"kill", "hang", "cut", "kill lighthouse", "slow fetch"}
    for form in faultspec.FORMS:
        assert form.envs <= set(faultspec.ENVS) and form.envs
    for spec, why in [("kill lighthouse time=1", "`ftrun launch` cannot inject 'kill lighthouse'"),
                      ("slow host replica=1 factor=2", "cannot inject 'slow host'"), ("release", "cannot inject"),
                      ("hang host=1 time=1", "names replicas, not hosts"), ("cut building=1 time=1 duration=2",
                                                                           "no buildings"),
                      ("kill replica=1 step=2 hosts=replace", "cannot inject kill with hosts"),
                      ("kill replica=1 step=2 at=ftar", "at=ftar"), ("kill replica=1 rank=0 step=2", "every rank")]:
        with pytest.raises(ValueError, match="bad --inject") as e:
            parse(spec)
        assert why in str(e.value), str(e.value)
        parse_emulated(spec) if "rank=0 step" not in spec else None  # the emulator injects it


def test_hangs_and_host_losses_parse():
    hang = parse("hang replica=0 rank=1 step=3 duration=2")
    assert (hang.kind, hang.rank, hang.at_step, hang.duration_s) == ("hang", 1, 3, 2.0)
    loss = parse("cut replica=2 time=4")
    assert (loss.kind, loss.replica_id, loss.at_s, loss.duration_s) == ("host_loss", "r2", 4.0, 0.0)
    assert parse(loss.describe()) == loss and parse(hang.describe()) == hang


@pytest.mark.parametrize("bad,message", [
    ("", "empty"), ("explode replica=1", "unknown fault 'explode'"), ("kill step=3", "missing fields: replica"),
    ("kill replica=1", "exactly one of step= or time="), ("kill replica=1 step=2 time=3", "exactly one"),
    ("kill replica=1 step=2 at=1", "at= must be in [0, 1)"), ("kill replica=1 time=2 at=0.5", "at= goes with step="),
    ("kill replica=1 step=2 hosts=replace", "cannot inject kill with hosts"), ("hang step=1", "needs replica="),
    ("hang host replica=1 step=2", "unknown fault 'hang host'"), ("slow fetch replica=1", "factor= > 1 or delay= > 0"),
    ("slow fetch replica=1 factor=0.5", "factor= must be >= 1"), ("hang replica=1 step=2 duration=-1", "duration="),
    ("kill replica=1 step=x", "invalid literal"), ("kill replica=1 step=2 step=3", "repeated"),
])
def test_bad_specs_name_the_problem_and_the_forms(bad, message):
    with pytest.raises(ValueError) as e:
        parse(bad)
    assert message in str(e.value) and "expected one of" in str(e.value)


def test_check_refuses_replicas_and_ranks_the_job_lacks():
    with pytest.raises(ValueError, match="replicas 0..2"):
        check([parse("kill replica=3 step=1")], replicas=3, ranks_per_replica=1)
    with pytest.raises(ValueError, match="ranks 0..1"):
        check([parse("hang replica=0 rank=2 step=1")], replicas=3, ranks_per_replica=2)
    with pytest.raises(ValueError, match="one slow fetch per replica"):
        check([parse("slow fetch replica=0 delay=1"), parse("slow fetch replica=0 factor=2")], replicas=3,
              ranks_per_replica=1)


def test_a_mid_step_kill_fires_a_fraction_of_a_step_after_the_victims_next_quorum():
    plan = InjectPlan([parse("kill replica=1 step=5 at=0.5")])
    up = {"r0", "r1", "r2"}
    assert plan.due(10.0, 5, 0.1, up, False, {"r1": (5, 9.9)}, {"r1": (4, 9.8)}) == []  # committed 5, no quorum yet
    assert plan.due(10.01, 5, 0.1, up, False, {"r1": (5, 9.9)}, {"r1": (5, 10.0)}) == []  # armed for 10.0 + 0.05
    assert plan.next_at() == pytest.approx(10.05)
    [action] = plan.due(10.05, 5, 0.1, up, False, {"r1": (5, 9.9)}, {"r1": (5, 10.0)})
    assert action == Action("crash", parse("kill replica=1 step=5 at=0.5"))
    assert plan.due(11.0, 9, 0.1, up, False, {"r1": (9, 10.9)}, {"r1": (9, 10.95)}) == [] and plan.pending == []


def test_a_boundary_kill_fires_at_the_victims_own_commit():
    plan = InjectPlan([parse("kill replica=1 step=5")])
    up = {"r0", "r1", "r2"}
    assert plan.due(10.0, 5, 0.1, up, False, {"r1": (4, 9.9)}) == []  # the job is at 5, r1 not yet
    assert [a.what for a in plan.due(10.0, 5, 0.1, up, False, {"r1": (5, 9.95)})] == ["crash"]


def test_a_step_kill_of_a_replica_that_was_down_fires_once_the_job_is_past_the_step():
    plan = InjectPlan([parse("kill replica=1 step=5")])
    assert plan.due(1.0, 6, 0.1, {"r0", "r2"}, False, {}) == []  # armed now, but r1 is down: it waits
    [action] = plan.due(2.0, 7, 0.1, {"r0", "r1", "r2"}, False, {"r1": (0, 1.9)})
    assert action.what == "crash"


def test_a_hang_stops_and_resumes_and_a_host_loss_is_a_cut_where_hosts_are_namespaces():
    plan = InjectPlan([parse("hang replica=0 step=2 duration=3"), parse("cut replica=1 time=1 duration=2")])
    up = {"r0", "r1"}
    assert plan.due(0.5, 2, None, up, True, {"r0": (2, 0.4)}) == [Action("stop", parse("hang replica=0 step=2 duration=3"))]
    plan.start(1.0)  # every replica joined: time= counts from here
    assert [a.what for a in plan.due(2.0, 3, None, up, True)] == ["cut"]
    assert [a.what for a in plan.due(3.5, 3, None, up, True)] == ["resume"]
    assert [a.what for a in plan.due(4.0, 3, None, up, True)] == ["uncut"]
    assert plan.due(9.0, 3, None, up, True) == []


def test_a_host_loss_without_namespaces_stops_the_ranks():
    plan = InjectPlan([parse("cut replica=1 step=0")])
    assert [a.what for a in plan.due(0.0, 0, None, {"r1"}, False, {"r1": (0, 0.0)})] == ["stop"]


def test_the_slow_fetch_applies_while_its_replica_catches_up():
    plan = InjectPlan([parse("slow fetch replica=1 delay=0.2")])
    assert plan.slow_fetch_for({"r0", "r2"}) is None
    assert plan.slow_fetch_for({"r1"}).delay_s == 0.2


def test_the_catchup_slow_fault_round_trips_through_its_env_form():
    fault = CatchupFault(kind="slow", factor=2.0, delay=0.25)
    assert parse_catchup_fault(fault.encode()) == (fault,)
    assert parse_catchup_fault("kind=slow,delay=0.1")[0].delay == 0.1
    with pytest.raises(ValueError, match="factor"):
        parse_catchup_fault("kind=slow,factor=0.5")


@pytest.mark.parametrize("argv,message", [
    (["--inject", "explode replica=1"], "argument --inject: unknown fault 'explode'"),
    (["--inject", "kill replica=7 step=1"], "--inject 'kill replica=7 step=1 at=0': the job has replicas 0..2"),
    (["--inject", "kill replica=1 step=9"], "the job ends at step 5 (--steps), so it would never fire"),
])
def test_launch_refuses_bad_injections_naming_the_flag(argv, message, capsys):
    try:
        code = main(["launch", "--steps", "5", *argv, "-m", "ftrun.train.ft_worker"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_a_self_killing_script_does_a_mid_step_crash_and_the_timer_is_a_backstop():
    kill = parse("kill replica=1 step=5 at=0.5")
    plan = InjectPlan([kill, parse("kill replica=2 step=5")], self_kill=True)
    assert plan.self_kills() == [kill]  # the boundary kill stays the supervisor's
    up = {"r1", "r2"}
    assert plan.due(10.06, 5, 0.1, up, False, {}, {"r1": (5, 10.0)}) == []  # a backstop: 1 + 0.1 s later
    assert plan.next_at() == pytest.approx(10.0 + 0.05 + 1.1)
    assert plan.self_killed("r1") == kill and plan.self_killed("r1") is None and plan.self_kills() == []
    assert plan.due(12.0, 5, 0.1, up, False, {}, {"r1": (5, 10.0)}) == []  # fired: the backstop is gone
