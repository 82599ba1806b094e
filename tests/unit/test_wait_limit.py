"""The catch-up wait limit (paper §6.1) as the runtime applies it: the pure bound and outcome
(ftrun.catchup.wait), and the FTAR ring build it bounds, three engines in one process over loopback:
healthy ranks give up on a late joiner within the limit (not ftar_timeout_s), the late joiner fails at
once on the connection its predecessor closed, and the next epoch's ring works; a joiner within the
limit is simply waited for."""

from __future__ import annotations

import numpy as np
import pytest

from ftrun.catchup.wait import (JOIN_TOLERANCE_S, MIN_WAIT_S, WaitAction, exchange_wait_s, should_wait,
                                wait_outcome)
from ftrun.env.real import RealEnv
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.ftar.ring import RecoverableError
from ftrun.train.api import Float32CpuKernels


# -- pure ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_behind, healed, limit, bound", [
    (0, False, 3.0, None),  # nobody to wait for: ftar_timeout_s
    (1, True, 3.0, None),  # the joiner itself: ftar_timeout_s (the others may still be computing)
    (1, False, 3.0, 3.0),  # a healthy rank of a step with a joiner: the wait limit
    (2, False, 30.0, 30.0),  # longer than ftar_timeout_s is the profile's call
    (1, False, 0.0, MIN_WAIT_S),  # "never wait" still allows the loopback round trips of a ring build
])
def test_exchange_wait_s(num_behind, healed, limit, bound):
    assert exchange_wait_s(num_behind=num_behind, healed=healed, wait_limit_s=limit) == bound


def test_exchange_wait_s_rejects_negatives():
    with pytest.raises(ValueError):
        exchange_wait_s(num_behind=1, healed=False, wait_limit_s=-1.0)
    with pytest.raises(ValueError):
        exchange_wait_s(num_behind=-1, healed=False, wait_limit_s=1.0)


@pytest.mark.parametrize("waited, joined, action", [
    (0.0, True, WaitAction.JOIN),  # the joiner was in the ring already
    (JOIN_TOLERANCE_S, True, WaitAction.JOIN),
    (0.8, True, WaitAction.WAIT),  # waited, within the limit: the step commits with everyone
    (1.0, False, WaitAction.NEXT_STEP),  # gave up: the joiner trains the retry
    (0.01, False, WaitAction.NEXT_STEP),  # a ring that broke early is a give-up too (the step is retried)
])
def test_wait_outcome(waited, joined, action):
    out = wait_outcome(waited_s=waited, joined=joined, wait_limit_s=1.0)
    assert out.action is action and out.stall_s == waited and out.reason


def test_wait_outcome_rejects_negatives():
    with pytest.raises(ValueError):
        wait_outcome(waited_s=-0.1, joined=True, wait_limit_s=1.0)


def test_outcome_and_plan_agree_on_the_same_fetch():
    """What the runtime sees (waited = fetch - step) classifies as what the paper's rule predicts."""
    for fetch_s, step_s, limit in [(0.5, 1.0, 1.0), (1.5, 1.0, 1.0), (3.0, 1.0, 1.0)]:
        plan = should_wait(fetch_s, step_s, limit, whole_step_s=10.0)
        waited = min(max(fetch_s - step_s, 0.0), limit)
        seen = wait_outcome(waited_s=waited, joined=fetch_s - step_s <= limit, wait_limit_s=limit)
        assert seen.action is plan.action, (fetch_s, plan, seen)


# -- the ring build it bounds ------------------------------------------------------------------------
FTAR_TIMEOUT = 5.0
LIMIT = 0.3


@pytest.fixture(params=["auto", "socket"])
def ring(request):
    env = RealEnv()
    config = FtarConfig(chunk_bytes=256, num_chunks=2, timeout_s=FTAR_TIMEOUT, transport=request.param)
    engines = [FtarEngine(env=env, kernels=Float32CpuKernels(), token="tok", config=config) for _ in range(3)]
    yield env, engines
    for e in engines:
        e.close()


def _build(env, engine, addrs, index, epoch, timeout, out, joining=False):
    start = env.clock.now()
    try:
        engine.reconfigure(epoch=epoch, ring=addrs, index=index, timeout=timeout, joining=joining)
        out[index] = ("ok", env.clock.now() - start)
    except RecoverableError:
        out[index] = ("gave up", env.clock.now() - start)


def _spawn_builds(env, engines, indices, epoch, timeout, out):
    addrs = [e.addr for e in engines]
    return [env.spawn(_build, env, engines[i], addrs, i, epoch, timeout, out, name=f"build{i}") for i in indices]


def _all_reduce_sums(env, engines, epoch):
    out = {}
    for t in _spawn_builds(env, engines, range(3), epoch, None, out):
        assert t.join(10.0)
    assert all(v[0] == "ok" for v in out.values()), out
    bufs = [np.full(64, i + 1, np.float32) for i in range(3)]
    tasks = [env.spawn(e.all_reduce, b, name=f"ar{i}") for i, (e, b) in enumerate(zip(engines, bufs))]
    for t in tasks:
        assert t.join(10.0) and t.exception is None, t.exception
    assert all((b == 6).all() for b in bufs)


@pytest.mark.timeout(30)
def test_healthy_ranks_give_up_on_a_late_joiner_and_the_joiner_fails_at_once(ring):
    env, engines = ring
    out: dict = {}
    for t in _spawn_builds(env, engines, (0, 2), 1, LIMIT, out):  # rank 1, the joiner, is still healing
        assert t.join(10.0)
    assert [out[i][0] for i in (0, 2)] == ["gave up"] * 2
    assert all(LIMIT * 0.8 <= out[i][1] < LIMIT + 1.0 for i in (0, 2)), out  # the limit, not FTAR_TIMEOUT
    late: dict = {}
    _build(env, engines[1], [e.addr for e in engines], 1, 1, None, late, joining=True)
    assert late[1][0] == "gave up" and late[1][1] < 1.0, late  # its predecessor's closed connection
    _all_reduce_sums(env, engines, 2)  # the next quorum's ring: the stale epoch does not get in the way


@pytest.mark.timeout(30)
def test_a_joiner_within_the_limit_is_waited_for(ring):
    env, engines = ring
    out: dict = {}
    tasks = _spawn_builds(env, engines, (0, 2), 1, 2.0, out)
    env.clock.sleep(0.4)  # the joiner's fetch runs 0.4 s past the healthy ranks' compute
    _build(env, engines[1], [e.addr for e in engines], 1, 1, None, out, joining=True)
    for t in tasks:
        assert t.join(10.0)
    assert all(v[0] == "ok" for v in out.values()), out
    assert all(0.3 <= out[i][1] < 2.0 for i in (0, 2)), out
    bufs = [np.full(64, i + 1, np.float32) for i in range(3)]
    tasks = [env.spawn(e.all_reduce, b, name=f"ar{i}") for i, (e, b) in enumerate(zip(engines, bufs))]
    for t in tasks:
        assert t.join(10.0) and t.exception is None, t.exception
    assert all((b == 6).all() for b in bufs)
