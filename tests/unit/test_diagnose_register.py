"""TelemetryServer.register in both Envs: a registration the collector closed unanswered (its listener's caps
close connections beyond them in a burst) is tried again; a refusal or an unreachable collector is not. A rank
(serve_rank) registers in the background: it goes on at once, a failure is one warning, and stopping its server
cancels a registration in flight."""

from __future__ import annotations

import logging

import pytest

from ftrun.diagnose.attach import serve_rank
from ftrun.diagnose.collect import REGISTER_RETRY_S, DiagnoseClosed, DiagnoseError, RankInfo, TelemetryServer
from ftrun.diagnose.telemetry import Recorder
from ftrun.env.base import PeerClosed, serve_connections
from tests.env_factories import ENV_FACTORIES

TOKEN = "job-token"
RANK = RankInfo("r0/0", 0, 0, "h0")


@pytest.fixture(params=sorted(ENV_FACTORIES))
def env(request):
    return ENV_FACTORIES[request.param]()


def _collector(env, answer, seen=None):
    """A collector stand-in whose `answer(n)` for its n-th connection is a reply to send, or None to close it
    unread; each connection is noted in `seen` (its number, then "answered" or "closed"). (listener, accept task)."""
    listener = env.net.listen("127.0.0.1:0")
    seen = [] if seen is None else seen

    def handle(conn):
        n = sum(1 for s in seen if isinstance(s, int))
        seen.append(n)
        reply = answer(n)
        if reply is not None:
            conn.recv(timeout=5.0)
            conn.send(reply, timeout=5.0)
        seen.append("closed" if reply is None else "answered")
        conn.close()

    return listener, serve_connections(env, listener, handle, name="collector-accept", conn_name="collector-conn")


def _register_against(env, answer, timeout=5.0):
    """Register a one-rank TelemetryServer with a collector stand-in (`_collector`). Returns (what register
    raised or None, connections, seconds)."""
    def body():
        seen = []
        listener, accept = _collector(env, answer, seen)
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
        return raised, sum(1 for s in seen if isinstance(s, int)), took

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


def test_a_rank_goes_on_while_the_collector_turns_its_registration_away_and_registers_after(env):
    """serve_rank (a rank's build) returns while the collector closes its registrations unread; the rank's first
    step comes before the collector takes one, and the registration lands afterwards. (Registering in the build
    held it until the registration's timeout, and the registration was then given up.)"""
    def body():
        seen, stepped = [], env.event()
        listener, accept = _collector(env, lambda n: {"type": "ok"} if stepped.is_set() else None, seen)
        _, server = serve_rank(env, token=TOKEN, info=RANK, collector=listener.addr, register_timeout_s=2.0)
        while seen.count("closed") < 2:  # the rank goes on while its registration is turned away
            env.clock.sleep(0.01)
        seen.append("first step")
        stepped.set()
        registered = server.registered.wait(timeout=10.0)
        server.stop()
        listener.close()
        accept.join(timeout=5.0)
        return registered, [s for s in seen if isinstance(s, str)]

    registered, events = env.run(body)
    assert registered
    assert events[:3] == ["closed", "closed", "first step"] and events[-1] == "answered", events


def test_a_failed_registration_is_one_warning_naming_the_collector_and_why_and_the_rank_goes_on(env, caplog):
    caplog.set_level(logging.WARNING, logger="ftrun.diagnose")

    def body():
        listener, accept = _collector(env, lambda n: {"type": "error", "error": "wrong job token"})
        _, server = serve_rank(env, token=TOKEN, info=RANK, collector=listener.addr, register_timeout_s=2.0)
        ended = server.registration.join(timeout=10.0)
        registered = server.registered.is_set()
        server.stop()
        listener.close()
        accept.join(timeout=5.0)
        return ended, registered, listener.addr

    ended, registered, addr = env.run(body)
    assert ended and not registered
    [warning] = [r.getMessage() for r in caplog.records if r.name == "ftrun.diagnose"]
    assert "r0/0 not registered" in warning and addr in warning and "wrong job token" in warning, warning


def test_stopping_the_server_cancels_a_registration_awaiting_its_reply(env, caplog):
    """The collector read the registration and never answers: stop() closes its connection (the collector sees
    it closed, long before the registration's timeout), the registration's task ends, nothing is logged."""
    caplog.set_level(logging.WARNING, logger="ftrun.diagnose")

    def body():
        listener, events = env.net.listen("127.0.0.1:0"), env.queue()

        def handle(conn):
            conn.recv(timeout=5.0)
            events.put("read")
            try:
                conn.recv(timeout=60.0)  # never answered
            except PeerClosed:
                events.put("closed by the rank")
            conn.close()

        accept = serve_connections(env, listener, handle, name="collector-accept", conn_name="collector-conn")
        _, server = serve_rank(env, token=TOKEN, info=RANK, collector=listener.addr, register_timeout_s=60.0)
        got = [events.get(timeout=5.0)]
        server.stop()
        got.append(events.get(timeout=5.0))
        left = server.registration.is_alive() or server._task.is_alive()
        listener.close()
        accept.join(timeout=5.0)
        return got, left, server.registered.is_set()

    got, left, registered = env.run(body)
    assert got == ["read", "closed by the rank"] and not left and not registered
    assert not [r for r in caplog.records if r.name == "ftrun.diagnose"]


def test_stopping_the_server_cancels_a_registration_backing_off(env, caplog):
    """The collector keeps closing the registration unread: stop() during the back-off ends the task and no
    further attempt is made; nothing is logged."""
    caplog.set_level(logging.WARNING, logger="ftrun.diagnose")

    def body():
        seen = []
        listener, accept = _collector(env, lambda n: None, seen)
        _, server = serve_rank(env, token=TOKEN, info=RANK, collector=listener.addr, register_timeout_s=60.0)
        while seen.count("closed") < 2:
            env.clock.sleep(0.01)
        server.stop()
        left = server.registration.is_alive()
        tried = sum(1 for s in seen if isinstance(s, int))
        env.clock.sleep(2 * REGISTER_RETRY_S[1])  # longer than any back-off: an attempt would have come
        listener.close()
        accept.join(timeout=5.0)
        return left, tried, sum(1 for s in seen if isinstance(s, int))

    left, tried, tried_later = env.run(body)
    assert not left and tried == tried_later
    assert not [r for r in caplog.records if r.name == "ftrun.diagnose"]
