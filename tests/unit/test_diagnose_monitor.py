"""Acting on a verdict on real processes, the pure parts: the lighthouse's eviction rule (decide rule 9),
the silent-culprit rule, and the monitor's pull cadence (step_late, next_interval)."""

from __future__ import annotations

import numpy as np
import pytest

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.diagnose.act import EvictionConfig, decide_eviction, silent_culprits
from ftrun.diagnose.model import HANG, NO_HANG, SLOW_RANK, Layout, Snapshot, Verdict
from ftrun.diagnose.monitor import MonitorConfig, next_interval, quorum_late, step_late
from ftrun.diagnose.summary import DONE, RUNNING, empty_hist, empty_summary
from ftrun.diagnose.telemetry import Ev
from ftrun.quorum.decide import LighthouseState, Member, QuorumRequest, decide, evict, live_members

LH = LighthouseConfig(min_replicas=2, timeouts=Timeouts(heartbeat_timeout_s=5.0, join_timeout_s=3.0))


def _state():
    return LighthouseState(quorum_id=4, prev_participants=("r0", "r1", "r2"),
                           members={r: Member(r, 100.0) for r in ("r0", "r1", "r2")})


def test_an_evicted_replica_stops_counting_and_the_survivors_form_a_quorum_at_once():
    state = _state()
    asks = {r: QuorumRequest(r, 7, 100.2) for r in ("r0", "r2")}
    waiting = decide(100.3, state, asks, LH)
    assert not waiting.ready and "waiting for r1" in waiting.reason  # today: until the join timeout
    state, hit = evict(100.3, state, ("r1",))
    assert hit == ("r1",) and live_members(100.3, state, LH) == {"r0", "r2"}
    d = decide(100.3, state, asks, LH)
    assert d.ready and d.replica_ids == ("r0", "r2") and d.quorum_id == 5, d  # membership changed: new id
    assert "all 2 live replicas asked" in d.reason


def test_evicting_twice_or_an_unknown_replica_is_a_no_op():
    state, hit = evict(100.0, _state(), ("r1",))
    again, hit2 = evict(101.0, state, ("r1", "r9"))
    assert hit == ("r1",) and hit2 == () and again is state


def test_a_restarted_incarnation_is_live_again_after_its_hello():
    state, _ = evict(100.0, _state(), ("r1",))
    state = LighthouseState(quorum_id=state.quorum_id, prev_participants=state.prev_participants,
                            members={**state.members, "r1": Member("r1", 101.0)})  # what the hello does
    assert live_members(101.0, state, LH) == {"r0", "r1", "r2"}


CFG = EvictionConfig(confirm_s=0.5, wait_limit_s=10.0)
HUNG = Verdict(HANG, "r1/0 did not answer", ranks=(2, 5), replicas=(1, 2))
REPLICA_OF = [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("name,now,answered,evicted,fragment", [
    ("a silent culprit's replica is evicted once confirmed", 101.0, [1, 1, 0, 1, 1, 1], (1,), "culprit silent"),
    ("a culprit that answers beside a silent rank of its replica: that replica", 101.0, [1, 1, 1, 0, 1, 1], (1,),
     "culprit silent"),
    ("only the silent culprits' replicas", 101.0, [1, 1, 0, 1, 1, 0], (1, 2), "culprit silent"),
    ("culprits that answer are alive: not evicted under the wait limit", 105.0, [1] * 6, (), "alive, maybe slow"),
    ("a silent rank in another replica is not theirs", 105.0, [0, 1, 1, 1, 1, 1], (), "alive, maybe slow"),
    ("... but once the hang outlasts the wait limit", 110.5, [1] * 6, (1, 2), "confirmed hang for 10.50s"),
    ("confirmation first, silent or not", 100.2, [0] * 6, (), "confirming"),
])
def test_silent_culprits_rule(name, now, answered, evicted, fragment):
    silent = silent_culprits(HUNG, np.array(answered, bool), REPLICA_OF)
    e = decide_eviction(now, HUNG, 100.0, 6, CFG, silent=silent, replica_of=REPLICA_OF)
    assert e.replicas == evicted and fragment in e.reason, e


def test_the_same_hang_is_confirmed_by_its_replicas_as_its_ranks_change():
    from ftrun.diagnose.act import same_culprits
    assert same_culprits(HUNG, Verdict(HANG, "peers gave up", ranks=(3,), replicas=(1, 2)))
    assert not same_culprits(HUNG, Verdict(HANG, "another", ranks=(3,), replicas=(1,)))


def test_a_slow_rank_under_the_wait_limit_is_never_evicted_even_when_silent():
    slow = Verdict(SLOW_RANK, "slow", ranks=(2,), replicas=(1,), lag_s=3.0)
    e = decide_eviction(200.0, slow, 100.0, 3, CFG, silent=(2,), replica_of=REPLICA_OF)
    assert e.replicas == () and "never evicted" in e.reason


def _snap(now=50.0, answered=(True,) * 4, ftar_state=DONE, f_enter=49.9, t_ev=Ev.DONE, t_t=49.0, usual=0.05):
    n = len(answered)
    s = np.concatenate([empty_summary() for _ in range(n)])
    s["f_state"], s["f_enter"], s["t_ev"], s["t_t"], s["t_cid"] = ftar_state, f_enter, t_ev, t_t, 3
    h = np.stack([empty_hist() for _ in range(n)])
    h["cid"][:, -4:] = np.arange(4)
    h["enter"][:, -4:] = np.arange(4)
    h["done"][:, -4:] = np.arange(4) + usual
    layout = Layout(replica=np.arange(n) // 2, group=np.arange(n) % 2, host=np.zeros(n, np.int64),
                    ring_pos=np.arange(n) // 2)
    return Snapshot(now=now, answered=np.array(answered), summary=s, hist=h), layout


MON = MonitorConfig(interval_s=2.0, late_interval_s=0.25, late_factor=3.0, late_min_s=0.25, quorum_late_factor=2.0,
                    cold_late_s=0.5)


@pytest.mark.parametrize("name,kwargs,late", [
    ("healthy: every collective done", {}, False),
    ("an all-reduce running a little longer than usual is not late", dict(ftar_state=RUNNING, f_enter=49.85), False),
    ("an all-reduce running past late_factor x usual and late_min_s is late", dict(ftar_state=RUNNING, f_enter=49.6),
     True),
    ("a slow job's usual time raises the bar", dict(ftar_state=RUNNING, f_enter=49.0, usual=0.5), False),
    ("a replica collective waiting long is late", dict(t_ev=Ev.ENTER, t_t=49.5), True),
    ("a rank that does not answer is late", dict(answered=(True, False, True, True)), True),
])
def test_step_late(name, kwargs, late):
    assert step_late(*_snap(**kwargs), MON) is late


def test_next_interval_pulls_fast_while_late_or_hung():
    assert next_interval({"kind": NO_HANG}, False, MON) == 2.0
    assert next_interval({"kind": NO_HANG}, True, MON) == 0.25
    assert next_interval({"kind": HANG}, False, MON) == 0.25
    with pytest.raises(ValueError, match="late_interval_s"):
        MonitorConfig(interval_s=0.1, late_interval_s=0.25)
    with pytest.raises(ValueError, match="cold_late_s"):
        MonitorConfig(cold_late_s=0.0)
    with pytest.raises(ValueError, match="quorum_late_factor"):
        MonitorConfig(quorum_late_factor=1.0)


@pytest.mark.parametrize("name,verdict,now,wait", [
    ("a hang confirming: pulled again once its confirmation is due", {"kind": HANG, "eviction": {"retry_at": 50.1}},
     50.0, pytest.approx(0.1)),
    ("a confirmation already due: at once", {"kind": HANG, "eviction": {"retry_at": 49.0}}, 50.0, 0.0),
    ("a retry past the late interval (an alive culprit, the wait limit): the late interval",
     {"kind": HANG, "eviction": {"retry_at": 60.0}}, 50.0, 0.25),
    ("nothing to confirm", {"kind": NO_HANG, "eviction": {"retry_at": None}}, 50.0, 2.0),
])
def test_a_hang_is_confirmed_by_the_next_pull_not_a_period_later(name, verdict, now, wait):
    assert next_interval(verdict, False, MON, now) == wait


@pytest.mark.parametrize("name,times,now,waiting_since,late", [
    ("no quorum yet: start-up is never late", [], 20.0, 19.0, False),
    ("too few quorums for a period: within cold_late_s", [10.0, 10.3], 10.7, None, False),
    ("too few quorums for a period: past cold_late_s", [10.0, 10.3], 10.9, None, True),
    ("the next quorum within quorum_late_factor periods", [10.0, 10.3, 10.6, 10.9], 11.4, None, False),
    ("overdue past quorum_late_factor periods", [10.0, 10.3, 10.6, 10.9], 11.6, None, True),
    ("short steps: late_min_s is the floor", [10.0, 10.01, 10.02, 10.03], 10.2, None, False),
    ("no period yet: a request the lighthouse holds past late_min_s", [10.0], 10.5, 10.2, True),
    ("no period yet: a request held within late_min_s", [10.0], 10.4, 10.2, False),
    ("with a period a held request is judged by the period (asks spread over a step)", [10.0, 10.3, 10.6, 10.9],
     11.0, 10.7, False),
])
def test_quorum_late(name, times, now, waiting_since, late):
    assert quorum_late(times, now, MON, waiting_since) is late
