"""TelemetryServer.register in both Envs: a registration the collector closed unanswered (its listener's caps
close connections beyond them in a burst) is tried again; a refusal or an unreachable collector is not."""

from __future__ import annotations

import pytest

from ftrun.diagnose.collect import REGISTER_RETRY_S, DiagnoseClosed, DiagnoseError, RankInfo, TelemetryServer
from ftrun.diagnose.telemetry import Recorder
from ftrun.env.base import serve_connections
from tests.env_factories import ENV_FACTORIES

TOKEN = "job-token"


@pytest.fixture(params=sorted(ENV_FACTORIES))
def env(request):
    return ENV_FACTORIES[request.param]()


def _register_against(env, answer, timeout=5.0):
    """Register a one-rank TelemetryServer with a collector stand-in whose `answer(n)` for its n-th connection
    is a reply to send, or None to close it unread. Returns (what register raised or None, connections, seconds)."""
    def body():
        listener = env.net.listen("127.0.0.1:0")
        seen = []

        def handle(conn):
            n = len(seen)
            seen.append(n)
            reply = answer(n)
            if reply is not None:
                conn.recv(timeout=5.0)
                conn.send(reply, timeout=5.0)
            conn.close()

        accept = serve_connections(env, listener, handle, name="collector-accept", conn_name="collector-conn")
        server = TelemetryServer(env=env, token=TOKEN, ranks={RankInfo("r0/0", 0, 0, "h0"): Recorder(env.clock)})
        server.addr = "127.0.0.1:1"  # registered, never pulled
        t0, raised = env.clock.now(), None
        try:
            server.register(listener.addr, timeout=timeout)
        except DiagnoseError as e:
            raised = e
        took = env.clock.now() - t0
        listener.close()
        accept.join(timeout=5.0)
        return raised, len(seen), took

    return env.run(body)


def test_a_registration_closed_unanswered_is_tried_again_until_it_is_answered(env):
    raised, connections, took = _register_against(env, lambda n: None if n < 2 else {"type": "ok"})
    assert raised is None and connections == 3
    assert took >= REGISTER_RETRY_S[0] * 3  # backed off: 0.05 s, then 0.1 s


def test_a_refusal_is_raised_at_once_not_tried_again(env):
    raised, connections, _ = _register_against(env, lambda n: {"type": "error", "error": "wrong job token"})
    assert isinstance(raised, DiagnoseError) and not isinstance(raised, DiagnoseClosed)
    assert "wrong job token" in str(raised) and connections == 1


def test_a_collector_that_keeps_closing_is_given_up_within_the_timeout(env):
    raised, connections, took = _register_against(env, lambda n: None, timeout=0.5)
    assert isinstance(raised, DiagnoseClosed) and "closed the connection before answering 'register'" in str(raised)
    assert 2 <= connections <= 4 and took < 0.5 + 0.25, (connections, took)


def test_an_unreachable_collector_is_raised_when_connect_gives_up(env):
    """connect itself waits for a listener until the timeout; register adds nothing to that."""
    def body():
        listener = env.net.listen("127.0.0.1:0")
        addr = listener.addr
        listener.close()  # nobody listens there now
        server = TelemetryServer(env=env, token=TOKEN, ranks={RankInfo("r0/0", 0, 0, "h0"): Recorder(env.clock)})
        t0 = env.clock.now()
        with pytest.raises(DiagnoseError, match="cannot reach") as info:
            server.register(addr, timeout=0.5)
        return info.value, env.clock.now() - t0

    raised, took = env.run(body)
    assert not isinstance(raised, DiagnoseClosed) and took < 0.5 + 0.25
