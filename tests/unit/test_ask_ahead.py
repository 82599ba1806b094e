"""ftrun.replica.ask_ahead: when the leader asks early, and when an early request's reply may be used."""

from __future__ import annotations

import pytest

from ftrun.replica.ask_ahead import Action, QuorumAsk, on_start_step, reason, should_ask_ahead

pytestmark = pytest.mark.timeout(10)

# (enabled, leader, committed, next_step, final_step) -> ask early?
ASK_TABLE = [
    (True, True, True, 5, None, True),  # the normal case: the job's end is not known
    (True, True, True, 5, 10, True),
    (True, True, True, 9, 10, True),  # step 9 is the last one trained: its quorum is still needed
    (True, True, True, 10, 10, False),  # the final step committed: the replica reports finished instead
    (True, True, True, 11, 10, False),  # past it (a stale final step): nothing to ask for
    (True, True, False, 5, None, False),  # a failed commit: the next request must say commit_failed
    (True, False, True, 5, None, False),  # only the leader talks to the lighthouse
    (False, True, True, 5, None, False),  # ask-ahead off
    (True, True, True, 0, 0, False),  # a job of no steps
]


@pytest.mark.parametrize("enabled,leader,committed,next_step,final_step,expected", ASK_TABLE)
def test_should_ask_ahead(enabled, leader, committed, next_step, final_step, expected):
    assert should_ask_ahead(enabled=enabled, leader=leader, committed=committed, next_step=next_step,
                            final_step=final_step) is expected


@pytest.mark.parametrize("next_step,final_step,what", [(-1, None, "next_step=-1"), (3, -2, "final_step=-2")])
def test_should_ask_ahead_refuses_negative_steps(next_step, final_step, what):
    with pytest.raises(ValueError, match=what):
        should_ask_ahead(enabled=True, leader=True, committed=True, next_step=next_step, final_step=final_step)


SENT = QuorumAsk(step=7, data_addrs=("a", "b"))

# (sent early, wanted at start_step) -> action
START_TABLE = [
    (None, QuorumAsk(step=7), Action.ASK),  # nothing sent early (first step, a retry, ask-ahead off)
    (SENT, QuorumAsk(step=7, data_addrs=("a", "b")), Action.COLLECT),  # unchanged: use its reply
    (SENT, QuorumAsk(step=9, data_addrs=("a", "b")), Action.DISCARD),  # the step changed (state replaced)
    (SENT, QuorumAsk(step=7, commit_failed=True, data_addrs=("a", "b")), Action.DISCARD),  # a retry
    (SENT, QuorumAsk(step=7, own_failures=1, data_addrs=("a", "b")), Action.DISCARD),
    (SENT, QuorumAsk(step=7, fresh=True, data_addrs=("a", "b")), Action.DISCARD),  # a new incarnation
    (SENT, QuorumAsk(step=7, data_addrs=("a", "c")), Action.DISCARD),  # a rank's endpoint moved
]


@pytest.mark.parametrize("sent,wanted,expected", START_TABLE)
def test_on_start_step(sent, wanted, expected):
    assert on_start_step(sent, wanted) is expected


def test_reason_names_what_changed():
    assert reason(SENT, QuorumAsk(step=9, commit_failed=True, data_addrs=("x",))) == (
        "step 7 -> 9; commit_failed False -> True; data addresses changed")
    assert reason(SENT, SENT) == "unchanged"


def test_manager_config_ask_ahead_is_off_by_default_and_must_be_a_bool():
    from ftrun.config import ManagerConfig

    assert ManagerConfig().ask_ahead is False and ManagerConfig(ask_ahead=True).ask_ahead is True
    with pytest.raises(ValueError, match="ManagerConfig.ask_ahead must be a bool, got 'no'"):
        ManagerConfig(ask_ahead="no")
