"""The host agent and its launcher-side client over loopback (no root needed): start a process on the
"remote" host, copy its output and audit file back, kill, refuse a wrong token and a path outside the
agent's folder, and exit on bye leaving nothing behind."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from ftrun.env.real import RealEnv
from ftrun.launch.agent import Agent
from ftrun.launch.remote import AgentClient, AgentError, RemoteLauncher

pytestmark = pytest.mark.timeout(120)

WRITE = ("import os, sys; print('{\"event\": \"hello\"}', flush=True); "
         "open(os.path.join(os.environ['FTRUN_RUN_DIR'], 'audit-r0.jsonl'), 'w').write('x' * 3000000)")


@pytest.fixture
def agent(tmp_path):
    env = RealEnv()
    a = Agent(env=env, token="tok", bind="127.0.0.1:0", out=str(tmp_path / "agent"))
    task = env.spawn(a.serve, name="agent")
    yield env, a
    if not task.join(3.0):  # a test that said no bye
        AgentClient(env, a.addr, "tok").call({"type": "bye"})
    assert task.join(10.0)


def test_start_copy_back_kill_and_bye(agent, tmp_path):
    env, a = agent
    local = tmp_path / "launcher"
    (local / "logs").mkdir(parents=True)
    remote = RemoteLauncher(env, a.addr, "tok", job="job1", run_dir=str(local))
    h = remote.start(["-c", WRITE], env={"PATH": "/usr/bin:/bin"}, cwd="/", stdout=str(local / "logs" / "r0.0.0.out"),
                     stderr=str(local / "logs" / "r0.0.0.log"))
    assert h.wait(60) == 0
    assert (local / "logs" / "r0.0.0.out").read_text() == '{"event": "hello"}\n'  # there before the exit is seen
    remote.close()  # one more copy: the audit file in full (several 1 MiB reads)
    assert (local / "audit-r0.jsonl").read_text() == "x" * 3000000
    assert (tmp_path / "agent" / "job1" / "logs" / "r0.0.0.out").exists()

    remote = RemoteLauncher(env, a.addr, "tok", job="job1", run_dir=str(local))
    h = remote.start(["-c", "import time; time.sleep(60)"], env={}, cwd="/", stdout=str(local / "logs" / "s.out"),
                     stderr=str(local / "logs" / "s.log"))
    h.kill()
    assert h.wait(30) == -9
    remote.bye()


def test_wrong_token_and_paths_outside_are_refused(agent):
    env, a = agent
    with pytest.raises(AgentError, match="wrong job token"):
        AgentClient(env, a.addr, "guess")
    client = AgentClient(env, a.addr, "tok")
    with pytest.raises(AgentError, match="name must be a plain file name"):
        client.call({"type": "read", "job": "j", "where": "run", "name": "../../etc/passwd", "offset": 0})
    with pytest.raises(AgentError, match="no process 42"):
        client.call({"type": "kill", "id": 42})
    assert client.call({"type": "poll", "ids": [42]}) == {"codes": [None]}  # still usable after errors
    client.close()


@pytest.mark.parametrize("msg, message", [
    ({"type": "read", "job": "j", "where": "run", "name": "a", "offset": 2**63}, "offset must be an integer"),
    ({"type": "start", "id": 1, "job": "j", "argv": ["-c", "pass"], "env": {"A": "x\0y"}, "stdout": "o",
      "stderr": "e"}, "env must map strings without NUL"),
    ({"type": "start", "id": 1, "job": "j", "argv": ["-c", "pass\0"], "env": {}, "stdout": "o", "stderr": "e"},
     "argv must be a list of strings without NUL"),
])
def test_a_request_the_os_cannot_take_is_an_error_reply_and_the_connection_serves_on(agent, tmp_path, msg, message):
    """Values that pass a type check but that the OS refuses (an offset past 2^63, a NUL byte in an argument)
    are refused by name; they used to end the connection's task with a traceback and the launcher saw only
    the connection close."""
    env, a = agent
    (tmp_path / "agent" / "j").mkdir(parents=True)
    (tmp_path / "agent" / "j" / "a").write_bytes(b"abc")  # read reaches its seek
    client = AgentClient(env, a.addr, "tok")
    with pytest.raises(AgentError, match=message):
        client.call(msg)
    assert client.call({"type": "poll", "ids": [42]}) == {"codes": [None]}
    client.close()


def test_no_agent_is_a_clear_error():
    with pytest.raises(AgentError, match="no agent at 127.0.0.1:9 .*--host-index"):
        AgentClient(RealEnv(), "127.0.0.1:9", "tok", connect_timeout_s=0.5)


def test_a_start_on_a_connection_open_at_bye_is_refused(agent, tmp_path):
    """After a bye the agent kills what it runs and exits: a launcher still connected then cannot start a
    process (or a zygote, or a store) that nobody would release (its start, prepare or store is refused, naming
    the shutdown)."""
    env, a = agent
    local = tmp_path / "launcher"
    (local / "logs").mkdir(parents=True)
    remote = RemoteLauncher(env, a.addr, "tok", job="job1", run_dir=str(local))
    AgentClient(env, a.addr, "tok").call({"type": "bye"})
    try:
        with pytest.raises(AgentError, match="shutting down"):
            remote.prepare(["-c", "pass"])
        with pytest.raises(AgentError, match="shutting down"):
            remote.store_port("r0")
        with pytest.raises(AgentError, match="shutting down"):
            h = remote.start(["-c", "import time; time.sleep(60)"], env={}, cwd="/",
                             stdout=str(local / "logs" / "s.out"), stderr=str(local / "logs" / "s.log"))
            h.kill()  # before the fix: the process started; it must not outlive the test
            h.wait(30)
    finally:
        remote.client.close()


def _stops_serving(port: int, deadline: float) -> None:
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5.0).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < deadline, f"the store at port {port} still serves"
        time.sleep(0.05)


def test_shutdown_releases_the_rendezvous_stores(agent):
    """The stores the agent made for its launchers stop at its shutdown (their ports then refuse), not when
    the agent's process ends; a replica's next store (its next incarnation's) replaces its previous one."""
    env, a = agent
    remote = RemoteLauncher(env, a.addr, "tok", job="job1", run_dir="/nonexistent")
    first = remote.store_port("r0")
    ports = [remote.store_port("r0"), remote.store_port("r1")]
    for port in ports:
        socket.create_connection(("127.0.0.1", port), timeout=5.0).close()  # serving
    _stops_serving(first, time.monotonic() + 10.0)  # r0's first incarnation's store is gone
    remote.bye()
    deadline = time.monotonic() + 10.0
    for port in ports:
        _stops_serving(port, deadline)


def test_a_request_that_fails_unexpectedly_is_an_error_reply_naming_it(agent, monkeypatch):
    """An exception handle() does not expect (here: the rendezvous store cannot be made, as torch raises when
    no port can be bound) is answered with its type and text, and the connection serves on: it used to end
    the connection's task, recorded on a task nobody joins, so neither log nor launcher said what failed."""
    from ftrun.env import real_store

    env, a = agent

    def no_store(host, *, timeout_s):
        raise RuntimeError("the server socket has failed to bind")

    monkeypatch.setattr(real_store, "bound_store", no_store)
    client = AgentClient(env, a.addr, "tok")
    with pytest.raises(AgentError, match="store failed: RuntimeError: the server socket has failed to bind"):
        client.call({"type": "store", "replica": "r0"})
    assert client.call({"type": "poll", "ids": [42]}) == {"codes": [None]}
    client.close()
