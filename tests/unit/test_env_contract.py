"""The contract every Env implementation passes (real threads+sockets, emulated greenlets).

Each test body runs as the env's main task through `env.run`, so the same body drives real threads
or the emulator's event loop. Times are read from `env.clock`, so the bounds hold in virtual time too.
"""

from __future__ import annotations

import gc
import logging

import pytest

from ftrun.env.admission import ListenLimits
from ftrun.env.base import (AcceptFailed, ConnectError, EnvTimeout, NetTimeout, PeerClosed, ProtocolError, TaskKilled,
                             serve_connections)
from tests.env_factories import ENV_FACTORIES

ADDR = "127.0.0.1:0"


@pytest.fixture(params=sorted(ENV_FACTORIES))
def env(request):
    return ENV_FACTORIES[request.param]()


def pair(env):
    """A connected (client, server) pair."""
    listener = env.net.listen(ADDR)
    client = env.net.connect(listener.addr, timeout=2.0)
    server = listener.accept(timeout=2.0)
    listener.close()
    return client, server


def test_clock_is_monotonic_and_sleep_waits(env):
    def body():
        t0 = env.clock.now()
        env.clock.sleep(0.05)
        return env.clock.now() - t0

    assert env.run(body) >= 0.05


def test_spawn_join_and_exception(env):
    def body():
        out = []
        ok = env.spawn(out.append, 7, name="ok")
        assert ok.join(timeout=2.0)
        bad = env.spawn(lambda: 1 / 0, name="bad")
        assert bad.join(timeout=2.0)
        slow = env.spawn(env.clock.sleep, 1.0, name="slow")
        assert slow.join(timeout=0.01) is False and slow.is_alive()
        assert slow.join(timeout=2.0)
        return out, bad.exception, ok.exception

    out, bad_exc, ok_exc = env.run(body)
    assert out == [7] and isinstance(bad_exc, ZeroDivisionError) and ok_exc is None


def test_kill_ends_a_task(env):
    def body():
        def spin():
            while True:
                env.clock.sleep(0.01)

        t = env.spawn(spin, name="spin")
        env.clock.sleep(0.03)
        t.kill()
        assert t.join(timeout=2.0)
        return t.exception

    assert isinstance(env.run(body), TaskKilled)


def test_a_task_collected_with_an_exception_nobody_read_logs_it_once(env, caplog):
    """As asyncio does for a task whose exception was never retrieved: logged once, with its traceback, when the
    task is collected. Reading it (`exception`, or a `join` that saw the task end) or a kill (TaskKilled) or a
    return logs nothing."""
    caplog.set_level(logging.ERROR, logger="ftrun.env")

    def fail():
        raise ValueError("nobody is waiting for this")

    def spin():
        while True:
            env.clock.sleep(0.01)

    def body():
        tasks = {name: env.spawn(spin if name == "unread-killed" else fail, name=name)
                 for name in ("unread-dropped", "unread-read", "unread-joined", "unread-killed")}
        tasks["unread-returned"] = env.spawn(lambda: None, name="unread-returned")
        tasks["unread-killed"].kill()
        while any(t.is_alive() for t in tasks.values()):  # ended, seen without join (which reads the outcome)
            env.clock.sleep(0.01)
        assert isinstance(tasks["unread-read"].exception, ValueError) and tasks["unread-joined"].join(timeout=1.0)

    env.run(body)
    gc.collect()
    unread = [r for r in caplog.records if r.name == "ftrun.env" and "nobody read it" in r.getMessage()
              and "task unread-" in r.getMessage()]
    assert [r.getMessage() for r in unread] == ["task unread-dropped raised ValueError, and nobody read it"]
    assert unread[0].exc_info[1].args == ("nobody is waiting for this",)
    assert "in fail" in caplog.text  # the traceback is in the record


def test_event_wakes_waiter_and_times_out(env):
    def body():
        ev = env.event()
        t0 = env.clock.now()
        assert ev.wait(timeout=0.05) is False
        assert env.clock.now() - t0 >= 0.05
        env.spawn(lambda: (env.clock.sleep(0.02), ev.set()), name="setter")
        assert ev.wait(timeout=2.0) and ev.is_set()
        ev.clear()
        return ev.is_set()

    assert env.run(body) is False


def test_queue_order_timeout_and_cross_task(env):
    def body():
        q = env.queue()
        with pytest.raises(EnvTimeout):
            q.get(timeout=0.02)
        env.spawn(lambda: [q.put(i) for i in range(5)], name="producer")
        got = [q.get(timeout=2.0) for _ in range(5)]
        return got, q.qsize()

    assert env.run(body) == ([0, 1, 2, 3, 4], 0)


def test_lock_excludes_and_times_out(env):
    def body():
        lock = env.lock()
        counter = [0]

        def worker():
            for _ in range(50):
                with lock:
                    v = counter[0]
                    env.clock.sleep(0)
                    counter[0] = v + 1

        tasks = [env.spawn(worker, name=f"w{i}") for i in range(3)]
        assert all(t.join(timeout=5.0) for t in tasks)
        assert lock.acquire(timeout=0.1)
        got_again = lock.acquire(timeout=0.02)
        lock.release()
        return counter[0], got_again

    assert env.run(body) == (150, False)


def test_messages_and_bulk_round_trip(env):
    def body():
        client, server = pair(env)
        client.send({"type": "hello", "n": 3, "blob": b"\x00\x01", "xs": [1.5, None, "s"]})
        msg = server.recv(timeout=2.0)
        payload = bytes(range(256)) * 4096 + b"tail"
        server.send_bytes(payload)
        buf = bytearray(len(payload))
        client.recv_into(memoryview(buf), timeout=2.0)
        client.close()
        server.close()
        return msg, bytes(buf) == payload

    msg, same = env.run(body)
    assert msg == {"type": "hello", "n": 3, "blob": b"\x00\x01", "xs": [1.5, None, "s"]} and same


def test_full_duplex_bulk(env):
    size = 4 * 1024 * 1024

    def body():
        client, server = pair(env)
        a, b = bytes([1]) * size, bytes([2]) * size
        got_a, got_b = bytearray(size), bytearray(size)
        t = env.spawn(lambda: server.recv_into(memoryview(got_a), timeout=5.0), name="rx")
        server_tx = env.spawn(server.send_bytes, b, name="tx")
        client.send_bytes(a)
        client.recv_into(memoryview(got_b), timeout=5.0)
        assert t.join(5.0) and server_tx.join(5.0)
        client.close()
        server.close()
        return bytes(got_a) == a and bytes(got_b) == b

    assert env.run(body)


def test_recv_timeout_keeps_connection_usable(env):
    def body():
        client, server = pair(env)
        t0 = env.clock.now()
        with pytest.raises(NetTimeout):
            server.recv(timeout=0.05)
        waited = env.clock.now() - t0
        client.send({"ok": 1})
        return waited, server.recv(timeout=2.0)

    waited, msg = env.run(body)
    assert waited >= 0.05 and msg == {"ok": 1}


def test_peer_close_is_seen_at_once(env):
    def body():
        client, server = pair(env)
        env.spawn(lambda: (env.clock.sleep(0.05), client.close()), name="closer")
        with pytest.raises(PeerClosed):  # not NetTimeout: the close is seen, not waited out
            server.recv(timeout=30.0)
        return True

    assert env.run(body)


def test_local_close_wakes_blocked_receiver(env):
    def body():
        client, server = pair(env)
        errors = []

        def rx():
            try:
                server.recv(timeout=10.0)
            except PeerClosed as e:
                errors.append(e)

        t = env.spawn(rx, name="rx")
        env.clock.sleep(0.05)
        server.close()
        assert t.join(timeout=2.0)
        with pytest.raises(PeerClosed):
            server.send({"x": 1})
        client.close()
        return len(errors)

    assert env.run(body) == 1


def test_frame_mismatch_is_a_protocol_error(env):
    def body():
        client, server = pair(env)
        client.send_bytes(b"abcd")
        with pytest.raises(ProtocolError):
            server.recv(timeout=2.0)
        client2, server2 = pair(env)
        client2.send_bytes(b"abcd")
        with pytest.raises(ProtocolError):
            server2.recv_into(memoryview(bytearray(8)), timeout=2.0)
        client3, server3 = pair(env)
        client3.send({"a": 1})
        with pytest.raises(ProtocolError):
            server3.recv_into(memoryview(bytearray(4)), timeout=2.0)
        return True

    assert env.run(body)


def test_connect_to_nothing_and_accept_timeout(env):
    def body():
        listener = env.net.listen(ADDR)
        addr = listener.addr
        with pytest.raises(EnvTimeout):
            listener.accept(timeout=0.02)
        listener.close()
        with pytest.raises(ConnectError):
            env.net.connect(addr, timeout=0.2)
        return True

    assert env.run(body)


def test_a_cancelled_connect_ends_at_once_and_says_so(env):
    """A connect to an address that refuses, with a 30 s timeout, ends soon after `cancelled()` turns
    true (it is checked between retries), with a ConnectError naming the cancel, not the timeout. A
    `cancelled` that stays false changes nothing: the connect succeeds, or times out as ever."""
    def body():
        listener = env.net.listen(ADDR)
        env.net.connect(listener.addr, timeout=2.0, cancelled=lambda: False).close()
        addr = listener.addr
        listener.close()
        with pytest.raises(ConnectError, match="within"):
            env.net.connect(addr, timeout=0.2, cancelled=lambda: False)
        start = env.clock.now()
        with pytest.raises(ConnectError, match="cancelled") as got:
            env.net.connect(addr, timeout=30.0, cancelled=lambda: env.clock.now() >= start + 0.1)
        return env.clock.now() - start, str(got.value)

    waited, message = env.run(body)
    assert 0.1 <= waited < 1.0, (waited, message)
    assert "within" not in message, message


def test_serve_connections_hands_each_connection_to_its_own_task_until_closed(env):
    """serve_connections: every accepted connection goes to `on_accept` (in the accepting task, before
    its handler starts) and then to its own handler task, so a handler that waits does not hold up the
    next connection; closing the listener ends the accepting task."""
    def body():
        listener = env.net.listen(ADDR)
        order = []

        def handle(conn):
            order.append(("handle", conn.local_addr, conn.peer_addr))
            n = conn.recv(timeout=2.0)["n"]
            conn.send({"echo": n})
            conn.close()

        task = serve_connections(env, listener, handle, name="contract-accept", conn_name="contract-conn",
                                 on_accept=lambda conn: order.append(("accept", conn.local_addr, conn.peer_addr)))
        first = env.net.connect(listener.addr, timeout=2.0)
        second = env.net.connect(listener.addr, timeout=2.0)
        second.send({"n": 2})  # answered while the first connection's handler still waits for its request
        assert second.recv(timeout=2.0) == {"echo": 2}
        first.send({"n": 1})
        assert first.recv(timeout=2.0) == {"echo": 1}
        assert task.is_alive()
        listener.close()
        ended = task.join(timeout=2.0)
        first.close()
        second.close()
        return order, ended, task.exception

    order, ended, exception = env.run(body)
    assert ended and exception is None
    assert sorted(kind for kind, *_ in order) == ["accept", "accept", "handle", "handle"]
    for kind, *conn in order:
        if kind == "handle":
            assert order.index(("accept", *conn)) < order.index(("handle", *conn)), order


def test_serve_connections_retries_a_failed_accept(env, caplog):
    """An accept that failed on an open listener (AcceptFailed: out of descriptors) is logged once and tried
    again; the connection is then served. Only a closed listener ends the accepting task."""
    def body():
        listener = env.net.listen(ADDR)
        failures = [AcceptFailed("accept on test failed: [Errno 24] Too many open files")] * 3

        class Failing:  # the listener, whose next three accepts fail
            addr = listener.addr

            def accept(self, timeout=None):
                if failures:
                    raise failures.pop()
                return listener.accept(timeout)

        served = []
        task = serve_connections(env, Failing(), lambda conn: served.append(conn.recv(timeout=2.0)["n"]),
                                 name="contract-accept", conn_name="contract-conn")
        client = env.net.connect(listener.addr, timeout=2.0)
        client.send({"n": 7})
        deadline = env.clock.now() + 2.0
        while not served and env.clock.now() < deadline:
            env.clock.sleep(0.01)
        listener.close()
        ended = task.join(timeout=2.0)
        client.close()
        return served, failures, ended

    with caplog.at_level(logging.ERROR, logger="ftrun.env"):
        served, failures, ended = env.run(body)
    assert served == [7] and failures == [] and ended
    assert [r.getMessage().count("Too many open files") for r in caplog.records] == [1]  # once for the three


def test_serve_connections_gives_up_on_accepts_that_keep_failing_and_says_why_it_ended(env):
    """give_up_after_s: accepts failing that long in a row end the accepting task, and `on_end` says so; a
    closed listener ends it too, with its own reason."""
    def body():
        listener = env.net.listen(ADDR)

        class Failing:  # every accept fails, as when the process stays out of descriptors
            addr = listener.addr

            def accept(self, timeout=None):
                raise AcceptFailed("accept on test failed: [Errno 24] Too many open files")

        ends: list[tuple[str, float]] = []
        t0 = env.clock.now()
        gave_up = serve_connections(env, Failing(), lambda conn: None, name="contract-accept",
                                    conn_name="contract-conn", give_up_after_s=0.2,
                                    on_end=lambda why: ends.append((why, env.clock.now() - t0)))
        closed = serve_connections(env, listener, lambda conn: None, name="contract-accept",
                                   conn_name="contract-conn", give_up_after_s=0.2,
                                   on_end=lambda why: ends.append((why, env.clock.now() - t0)))
        ended = gave_up.join(timeout=5.0)
        listener.close()
        return ends, ended and closed.join(timeout=5.0)

    ends, ended = env.run(body)
    assert ended and len(ends) == 2
    (failed, failed_after), (closed, _) = ends
    assert failed.startswith("every accept failed for 0.2s: ") and "Too many open files" in failed
    assert 0.2 <= failed_after < 2.0
    assert closed.startswith("the listener is closed")


def test_serve_connections_says_why_when_its_accept_loop_raises_the_unexpected(env, caplog):
    """A listener raising what no branch expects ends the accepting task, logged with its traceback, and
    `on_end` still hears why: an owner (the lighthouse) must not go deaf without knowing."""
    caplog.set_level(logging.ERROR, logger="ftrun.env")

    def body():
        class Broken:
            addr = "broken"

            def accept(self, timeout=None):
                raise RuntimeError("listener state corrupted")

        ends: list[str] = []
        task = serve_connections(env, Broken(), lambda conn: None, name="contract-accept",
                                 conn_name="contract-conn", on_end=ends.append)
        return ends, task.join(timeout=5.0)

    ends, ended = env.run(body)
    assert ended and len(ends) == 1
    assert ends[0] == "the accept loop failed: RuntimeError: listener state corrupted"
    assert "contract-accept: the accept loop failed" in caplog.text and "listener state corrupted" in caplog.text


def test_serve_connections_closes_a_connection_whose_handler_cannot_start(env, caplog):
    """A handler task that cannot be started (env.spawn raised: no thread left) costs that one connection,
    which is closed; the failure is logged once for the run of them and the next connection is served."""
    def body():
        listener = env.net.listen(ADDR)
        failures = [RuntimeError("can't start new thread")] * 2

        class NoThreads:  # the env, whose next two handler tasks cannot be started
            clock = env.clock

            def spawn(self, fn, *args, name):
                if name == "contract-conn" and failures:
                    raise failures.pop()
                return env.spawn(fn, *args, name=name)

        def handle(conn):
            conn.send({"echo": conn.recv(timeout=2.0)["n"]})

        task = serve_connections(NoThreads(), listener, handle, name="contract-accept", conn_name="contract-conn")
        dropped = []
        for _ in range(2):
            client = env.net.connect(listener.addr, timeout=2.0)
            with pytest.raises(PeerClosed):
                client.recv(timeout=2.0)
            dropped.append(client)
        client = env.net.connect(listener.addr, timeout=2.0)
        client.send({"n": 7})
        answer = client.recv(timeout=2.0)
        alive = task.is_alive()
        listener.close()
        ended = task.join(timeout=2.0)
        for conn in (*dropped, client):
            conn.close()
        return answer, alive, ended, task.exception

    with caplog.at_level(logging.WARNING, logger="ftrun.env"):
        answer, alive, ended, exception = env.run(body)
    assert answer == {"echo": 7} and alive and ended and exception is None
    assert [(r.levelno, "new thread" in r.getMessage()) for r in caplog.records] == [
        (logging.ERROR, True), (logging.WARNING, False)]  # once for the two, then served again


def test_serve_connections_logs_and_closes_a_connection_whose_handler_raised(env, caplog):
    """A handler that raised what it did not expect (a bug its peer's input reached) is logged with its
    traceback and its connection closed, so the peer learns at once; the task recorded it where no one
    looks (handler tasks are never joined), and the connection stayed open until garbage collection."""
    def body():
        listener = env.net.listen(ADDR)

        def handle(conn):
            n = conn.recv(timeout=2.0)["n"]
            if n == 1:
                raise RuntimeError("handler bug reached by n=1")
            conn.send({"echo": n})

        task = serve_connections(env, listener, handle, name="contract-accept", conn_name="contract-conn")
        bad = env.net.connect(listener.addr, timeout=2.0)
        bad.send({"n": 1})
        with pytest.raises(PeerClosed):
            bad.recv(timeout=2.0)
        good = env.net.connect(listener.addr, timeout=2.0)
        good.send({"n": 2})
        answer = good.recv(timeout=2.0)
        listener.close()
        task.join(timeout=2.0)
        bad.close()
        good.close()
        return answer

    with caplog.at_level(logging.ERROR, logger="ftrun.env"):
        assert env.run(body) == {"echo": 2}
    [record] = caplog.records
    assert "contract-conn" in record.getMessage() and "handler bug reached by n=1" in record.exc_text


@pytest.mark.parametrize("kind", sorted(ENV_FACTORIES))
def test_serve_connections_under_a_pending_cap_closes_the_oldest_silent_connections_and_serves_a_real_peer(
        kind, caplog):
    """A listener capped at 4 connections not past their first message: each of 12 connections that send
    nothing closes the oldest pending one, whose handler's receive ends at once (PeerClosed, not its 30 s
    timeout); a peer that sends its first message is still served; the burst is logged once as it begins."""
    env = ENV_FACTORIES[kind](net_limits=ListenLimits(max_pending=4))
    caplog.set_level(logging.INFO, logger="ftrun.env")

    def body():
        listener = env.net.listen(ADDR)
        ended = env.queue()  # how long each handler waited, for those whose connection was closed

        def handle(conn):
            t0 = env.clock.now()
            try:
                msg = conn.recv(timeout=30.0)
            except PeerClosed:
                ended.put(env.clock.now() - t0)
                return
            conn.send({"echo": msg["n"]})
            conn.close()

        task = serve_connections(env, listener, handle, name="contract-accept", conn_name="contract-conn")
        silent = [env.net.connect(listener.addr, timeout=2.0) for _ in range(12)]
        closed = []
        for conn in silent[:8]:  # the 8 oldest: each closed by a newer one
            with pytest.raises(PeerClosed):
                conn.recv(timeout=5.0)
            closed.append(ended.get(timeout=5.0))
        real = env.net.connect(listener.addr, timeout=2.0)  # closes one more silent connection
        real.send({"n": 1})
        answer = real.recv(timeout=5.0)
        closed.append(ended.get(timeout=5.0))
        for conn in silent + [real]:
            conn.close()
        listener.close()
        assert task.join(timeout=5.0)
        return closed, answer

    closed, answer = env.run(body)
    assert answer == {"echo": 1}
    assert len(closed) == 9 and max(closed) < 5.0, closed
    warnings = [r.getMessage() for r in caplog.records if r.name == "ftrun.env" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "4 connections have not sent their first message" in warnings[0], warnings


@pytest.mark.parametrize("kind", sorted(ENV_FACTORIES))
def test_a_connection_whose_first_message_was_read_is_not_evicted_by_a_newer_silent_one(kind):
    """Under a pending cap of 1: a peer whose first message arrived before the accept and was read is past it,
    so a newer silent connection does not close it (the emulated listener counted only frames sent after the
    accept, and kept such a connection pending for good)."""
    env = ENV_FACTORIES[kind](net_limits=ListenLimits(max_pending=1))

    def body():
        listener = env.net.listen(ADDR)
        spoke = env.net.connect(listener.addr, timeout=2.0)
        spoke.send({"n": 1})
        env.clock.sleep(0.05)  # the first message is there before the accept
        served = listener.accept(timeout=2.0)
        first = served.recv(timeout=2.0)
        silent = env.net.connect(listener.addr, timeout=2.0)
        newer = listener.accept(timeout=2.0)
        spoke.send({"n": 2})
        second = served.recv(timeout=2.0)
        for conn in (spoke, served, silent, newer):
            conn.close()
        listener.close()
        return first, second

    assert env.run(body) == ({"n": 1}, {"n": 2})


def test_bad_address_is_a_value_error(env):
    with pytest.raises(ValueError):
        env.run(env.net.listen, "no-port-here")


def test_cpu_counts_the_process_busy_not_its_waits(env):
    """clock.cpu() is the process's CPU so far: it does not go back, and a sleep adds (almost) nothing to it."""
    def body():
        c0 = env.clock.cpu()
        env.clock.sleep(0.05)
        c1 = env.clock.cpu()
        return c0, c1

    c0, c1 = env.run(body)
    assert 0 <= c0 <= c1 < c0 + 0.04


def test_a_phase_event_carries_the_rank_process_cpu_in_either_env(env):
    """The trainer's phase events (ftrun.train.wiring) carry the Env's CPU counter: a real rank's process CPU grows
    with work it does; an emulated rank's by the busy time the emulator charges its process (EmuClock.charge)."""
    from types import SimpleNamespace

    from ftrun.train.job_config import FTConfig
    from ftrun.train.wiring import _phase_hook

    events: list[dict] = []
    hook = _phase_hook(SimpleNamespace(config=FTConfig(phase_events=True), env=env, spec=SimpleNamespace(rank=0),
                                       emit=events.append), None)

    def body():
        hook("forward", 1)
        if hasattr(env.clock, "charge"):  # emulated: the modeled compute
            env.clock.charge(0.03)
            env.clock.sleep(0.03)
        else:  # real: burn CPU for 30 ms of it
            c0 = env.clock.cpu()
            while env.clock.cpu() - c0 < 0.03:
                sum(range(1000))
        hook("exchange", 1)

    env.run(body)
    a, b = events
    assert [e["phase"] for e in events] == ["forward", "exchange"] and all(isinstance(e["cpu"], float) for e in events)
    assert 0.03 <= b["cpu"] - a["cpu"] < 0.5


def test_emulated_cpu_is_per_process_and_charged_exactly():
    """Emulated, without CPU charging: a process's counter holds exactly what was charged to its tasks (a task
    spawned on its own host belongs to its process), and another process's stays apart."""
    from harness.engine import EmulatedWorld

    world = EmulatedWorld(seed=0, cpu_charging=False)
    a, b = world.host_env("a"), world.host_env("b")

    def other():
        b.clock.charge(0.5)
        return b.clock.cpu()

    def body():
        a.clock.charge(0.25)
        helper = a.spawn(lambda: a.clock.charge(0.125), name="helper")  # the same process
        elsewhere = b.spawn(other, name="other")  # another host: another process
        helper.join(1.0)
        elsewhere.join(1.0)
        with pytest.raises(ValueError, match="seconds >= 0"):
            a.clock.charge(-1.0)
        return a.clock.cpu(), elsewhere.result

    assert a.run(body) == (0.375, 0.5)
