"""The leader's watch over its replica's other ranks (ftrun.replica.rank_watch): the pure status, and the
watch over real loopback listeners: a rank that answers, one that never answers (as a SIGSTOPped rank's
kernel accepts but nobody replies), one that goes away. Waits are polls bounded by the test timeout;
nothing measures time."""

from __future__ import annotations

import pytest

from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.ftar.ring import parse_greeting, ping_request
from ftrun.replica.rank_watch import RankStatus, RankWatch

pytestmark = pytest.mark.timeout(60)


def test_status_rules():
    s = RankStatus()
    s.answered("a")
    s.answered("b")
    assert s.unhealthy() == []
    s.late("b")
    assert s.unhealthy() == ["b"]
    s.answered("b")  # it answered after all
    assert s.unhealthy() == []
    s.gone("a")
    s.answered("a")  # a lost connection does not come back
    s.late("a")
    assert s.unhealthy() == ["a"] and s.states["a"] == "gone"


def test_ping_greeting():
    assert parse_greeting(ping_request("job", 4), "job") == ("ping", 4)
    assert parse_greeting(ping_request("other", 4), "job") is None


def _until(env, cond):
    for _ in range(3000):
        if cond():
            return True
        env.clock.sleep(0.01)
    return False


@pytest.fixture
def env():
    return RealEnv()


def _engine(env):
    return FtarEngine(env=env, kernels=CpuKernels(), token="job", config=FtarConfig(chunk_bytes=4096, num_chunks=2))


def test_a_rank_that_answers_keeps_the_replica_healthy(env):
    rank = _engine(env)  # its listener's greeter answers the pings
    watch = RankWatch(env=env, token="job", own="me:1", interval_s=0.02, timeout_s=2.0)
    try:
        assert watch.healthy(())  # nothing to watch before the check-in
        assert watch.healthy(("me:1", rank.addr))
        assert _until(env, lambda: len(watch._conns) == 1)
        env.clock.sleep(0.2)  # several rounds of pings
        assert watch.healthy() and watch.status.states == {rank.addr: "ok"}
    finally:
        watch.close()
        rank.close()


def test_a_rank_whose_connection_closes_keeps_the_replica_unhealthy(env):
    dying = env.net.listen("127.0.0.1:0")
    watch = RankWatch(env=env, token="job", own="me:1", interval_s=0.02, timeout_s=2.0)
    try:
        watch.healthy((dying.addr,))
        conn = dying.accept(timeout=10.0)
        conn.send({"pong": conn.recv(timeout=10.0)["ping"]})
        conn.close()  # as the rank's process dying closes it
        assert _until(env, lambda: not watch.healthy())
        assert watch.status.states[dying.addr] == "gone"
    finally:
        watch.close()
        dying.close()


def test_a_rank_that_never_answers_makes_the_replica_unhealthy(env):
    frozen = env.net.listen("127.0.0.1:0")  # accepts (the kernel's backlog would), never answers
    watch = RankWatch(env=env, token="job", own="me:1", interval_s=0.02, timeout_s=0.2)
    try:
        assert watch.healthy((frozen.addr,))
        conn = frozen.accept(timeout=10.0)
        assert _until(env, lambda: not watch.healthy())
        assert watch.status.states[frozen.addr] == "late"
        ping = conn.recv(timeout=10.0)  # it thaws and answers: healthy again
        conn.send({"pong": ping["ping"]})
        assert _until(env, lambda: watch.healthy())
        conn.close()
    finally:
        watch.close()
        frozen.close()


def test_an_unreachable_rank_makes_the_replica_unhealthy(env):
    gone = env.net.listen("127.0.0.1:0")
    addr = gone.addr
    gone.close()
    watch = RankWatch(env=env, token="job", own="me:1", interval_s=0.02, timeout_s=0.5)
    try:
        watch.healthy((addr,))
        assert _until(env, lambda: not watch.healthy())
        assert watch.status.states[addr] == "gone"
    finally:
        watch.close()
