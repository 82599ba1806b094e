"""Ask-ahead quorum with a real lighthouse: the leader's request for step n+1 goes out at the commit of
step n, start_step reads its reply, and an early request that no longer holds is discarded."""

from __future__ import annotations

import pytest

from ftrun.config import ManagerConfig
from ftrun.quorum.client import LighthouseClient
from ftrun.replica.comm import LocalComm
from ftrun.replica.manager import Manager

from tests.integration.test_replica_manager import T, build_replica, lighthouse, run_all, step_all  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


def client(env, lh, rid):
    c = LighthouseClient(env=env, addr=lh.addr, token="t", replica_id=rid, timeouts=T)
    c.connect()
    return c


def one_rank(env, lh, rid, ask_ahead=True):
    return Manager(config=ManagerConfig(timeouts=T, ask_ahead=ask_ahead), env=env, comm=LocalComm(), replica_id=rid,
                   lighthouse=client(env, lh, rid))


def wait_for(env, cond, what):
    deadline = env.clock.now() + 10.0
    while not cond():
        assert env.clock.now() < deadline, what
        env.clock.sleep(0.01)


def test_the_next_quorum_is_decided_at_the_commit(lighthouse):
    env, lh = lighthouse
    a, b = build_replica(env, lh, "a", 3, ask_ahead=True), build_replica(env, lh, "b", 2, ask_ahead=True)
    out = step_all(env, a + b)
    assert all(committed for _, committed in out)
    # No start_step yet: the leaders' early requests already formed step 1's quorum.
    wait_for(env, lambda: lh.status()["max_step"] == 1, "step 1's quorum was not decided after the commits")
    assert a[0]._lighthouse.asked_ahead and b[0]._lighthouse.asked_ahead
    q1 = lh.status()["quorum_id"]
    out = step_all(env, a + b)
    assert all(committed for _, committed in out) and all(m.step == 2 for m in a + b)
    assert {q.quorum_id for q, _ in out} == {q1} and {q.step for q, _ in out} == {1}
    for m in a + b:
        m.close()


def test_off_asks_at_start_step(lighthouse):
    env, lh = lighthouse
    ms = [one_rank(env, lh, rid, ask_ahead=False) for rid in ("a", "b")]
    assert all(c for _, c in step_all(env, ms))
    env.clock.sleep(0.2)
    assert lh.status()["max_step"] == 0 and lh.status()["pending"] == []
    assert not any(m._lighthouse.asked_ahead for m in ms)
    assert all(c for _, c in step_all(env, ms)) and all(m.step == 2 for m in ms)
    for m in ms:
        m.close()


def test_no_early_request_after_the_final_step(lighthouse):
    env, lh = lighthouse
    ms = [one_rank(env, lh, rid) for rid in ("a", "b")]
    for m in ms:
        m.final_step = 2
    step_all(env, ms)
    assert all(m._lighthouse.asked_ahead for m in ms)  # step 1 is still to train
    step_all(env, ms)
    assert all(m.step == 2 for m in ms) and not any(m._lighthouse.asked_ahead for m in ms)
    env.clock.sleep(0.2)
    assert lh.status()["pending"] == [] and lh.status()["max_step"] == 1
    run_all(env, [m.report_finished for m in ms])
    assert lh.status()["finished_step"] == 2
    for m in ms:
        m.close()


def test_a_failed_commit_asks_at_start_step_and_reports_it(lighthouse):
    env, lh = lighthouse
    ms = [one_rank(env, lh, rid) for rid in ("a", "b")]
    out = step_all(env, ms, fail={("a", 0)})
    assert [c for _, c in out] == [False, True]
    assert not ms[0]._lighthouse.asked_ahead and ms[1]._lighthouse.asked_ahead
    q0 = out[0][0].quorum_id
    out = step_all(env, ms)  # a asks now, saying its commit failed; b's early request is the one it needs
    assert {q.step for q, _ in out} == {1} and all(q.quorum_id > q0 for q, _ in out)  # the failure bumps it
    assert out[0][0].healed and not out[1][0].healed  # (b committed alone: a heals to b's step)
    assert [c for _, c in out] == [False, False]  # one contributor < min_replicas
    assert [m.step for m in ms] == [1, 1] and not any(m._lighthouse.asked_ahead for m in ms)
    for m in ms:
        m.close()


def test_a_changed_step_discards_the_early_request(lighthouse):
    env, lh = lighthouse
    ms = [one_rank(env, lh, rid) for rid in ("a", "b")]
    step_all(env, ms)
    wait_for(env, lambda: lh.status()["max_step"] == 1, "no early quorum")
    first = lh.status()["quorum_id"]
    ms[0].step = 0  # a's state was replaced (e.g. restored) after the ask: its request for step 1 is void
    # b trains step 1 in quorum `first` (a is in it, but a real exchange would fail without it); a drops
    # its early request (the reconnect clears it at the lighthouse) and asks for step 0 anew
    (qa, _), (qb, _) = step_all(env, ms)
    assert (qb.step, qb.quorum_id) == (1, first)
    assert qa.healed and qa.step == 2  # b's next early request: a heals to step 2, never trains step 1
    assert [m.step for m in ms] == [2, 2]  # b committed step 1; a healed to 2 (alone: no commit)
    for m in ms:
        m.close()


def test_a_reply_read_by_the_heartbeat_task_is_kept_for_collect(lighthouse):
    env, lh = lighthouse
    a, b = client(env, lh, "a"), client(env, lh, "b")
    assert a.ask(0) and b.ask(0)
    wait_for(env, lambda: lh.status()["max_step"] == 0 and lh.status()["quorum_id"] > 0, "no quorum")
    env.clock.sleep(10 * T.heartbeat_interval_s)  # the heartbeat task has read the reply by now
    da, db = a.collect(), b.collect()
    assert da == db and da.replica_ids == ("a", "b") and not a.asked_ahead
    with pytest.raises(RuntimeError, match="no early quorum request"):
        a.collect()
    assert a.ask(1)
    with pytest.raises(RuntimeError, match="already|pending"):
        a.ask(1)
    a.discard()
    a.close()
    b.close()


def test_a_discarded_reply_is_never_read_as_the_next_requests(lighthouse):
    env, lh = lighthouse
    a, b = client(env, lh, "a"), client(env, lh, "b")
    assert a.ask(0) and b.ask(0)
    first = b.collect()  # the quorum formed: a's reply waits on its connection
    a.discard()
    assert not a.asked_ahead
    da, db = run_all(env, [lambda: a.quorum(0, commit_failed=True), lambda: b.quorum(0, commit_failed=True)])
    assert da == db and da.quorum_id > first.quorum_id
    a.close()
    b.close()


def test_telemetry_times_the_quorum_wait_from_collect(lighthouse):
    """Root-cause analysis reads an open quorum ask as a leader waiting in the quorum: a leader that
    asked at its commit and is computing must not look like one."""
    from ftrun.diagnose.telemetry import Ev, Op, Recorder

    env, lh = lighthouse
    a, b = client(env, lh, "a"), client(env, lh, "b")
    a.telemetry = Recorder(env.clock)
    quorum_events = lambda: [(int(r["ev"]), int(r["cid"])) for r in a.telemetry.records() if r["op"] == Op.QUORUM]
    assert a.ask(3) and b.ask(3)
    assert quorum_events() == []  # asked, not waiting
    assert a.collect() == b.collect()
    assert quorum_events() == [(Ev.ENTER, 3), (Ev.DONE, 3)]
    a.close()
    b.close()
