import pytest

from ftrun.launch.faults import KillAt, KillPlan, parse_duration


@pytest.mark.parametrize("text,seconds", [("90", 90), ("30s", 30), ("1.5m", 90), ("2h", 7200), ("250ms", 0.25)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "ten", "5 days", "-3s"])
def test_bad_durations_are_rejected(bad):
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(bad)


def test_kill_every_fires_on_schedule_and_respects_min_up():
    plan = KillPlan(every_s=10.0, min_up=2, seed=1)
    plan.start(0.0)
    up = ["r0", "r1", "r2"]
    assert plan.due(9.9, 0, up) is None
    victim = plan.due(10.0, 0, up)
    assert victim in up and plan.next_at == 20.0
    assert plan.due(20.0, 0, ["r0", "r1"]) is None  # would leave 1 < min_up=2 replicas up


def test_kill_at_step_targets_the_named_replica_once():
    plan = KillPlan(at_steps=[KillAt.parse("step=5,replica=r2"), KillAt.parse("step=9")], seed=0)
    plan.start(0.0)
    up = ["r0", "r1", "r2"]
    assert plan.due(1.0, 4, up) is None
    assert plan.due(1.0, 5, up) == "r2"
    assert plan.due(1.0, 6, up) is None
    assert plan.due(1.0, 9, up) in up
    assert plan.due(1.0, 100, up) is None


def test_a_named_kill_waits_for_its_replica_instead_of_killing_another():
    """r2 is down (or killing it would leave too few healthy replicas): the kill waits for r2; it never
    falls on r0 or r1 in its place."""
    plan = KillPlan(at_steps=[KillAt.parse("step=5,replica=r2")], min_up=1, seed=0)
    plan.start(0.0)
    assert plan.due(1.0, 5, ["r0", "r1"]) is None  # r2 not up
    assert plan.due(1.0, 6, ["r0", "r1", "r2"], healthy=["r2"]) is None  # its loss would leave none healthy
    assert plan.pending == [KillAt(5, "r2")]
    assert plan.due(1.0, 7, ["r0", "r1", "r2"], healthy=["r0", "r2"]) == "r2"
    assert plan.pending == []


def test_random_kills_are_deterministic_with_a_seed():
    def schedule(seed):
        plan = KillPlan(random_mean_s=5.0, seed=seed)
        plan.start(0.0)
        out = []
        for t in range(0, 200):
            v = plan.due(float(t), 0, ["a", "b", "c"])
            if v:
                out.append((t, v))
        return out

    assert schedule(3) == schedule(3) and schedule(3) != schedule(4)
    assert 20 <= len(schedule(3)) <= 60  # about 200 / 5


def test_bad_plans_are_rejected():
    with pytest.raises(ValueError, match="choose one"):
        KillPlan(every_s=1.0, random_mean_s=1.0)
    with pytest.raises(ValueError, match="every_s"):
        KillPlan(every_s=0.0)
    with pytest.raises(ValueError, match="kill-at"):
        KillAt.parse("replica=r1")
