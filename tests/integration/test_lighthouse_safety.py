"""The lighthouse under hostile input and stale replicas (threads and real sockets in one process):
out-of-range ids are refused to that client only, an oversized decision is refused to its largest
contributor, a bad persisted state stops the start with a clear error, a dead main task is never
silent, and a quorum never regresses below the step already handed out (the fork of issue 12)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.base import PeerClosed
from ftrun.env.real import RealEnv
from ftrun.quorum import service
from ftrun.quorum.client import LighthouseClient, LighthouseRejected
from ftrun.quorum.http import StatusServer
from ftrun.quorum.service import STATE_KEY, Lighthouse, LighthouseDown, LighthouseStateError
from ftrun.storage import FileStorage, MemoryStorage

TOKEN = "job-token"
T = Timeouts(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0, join_timeout_s=0.2, quorum_timeout_s=5.0)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def env():
    return RealEnv()


def start(env, min_replicas=1, storage=None, bind="127.0.0.1:0"):
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=min_replicas, timeouts=T), token=TOKEN,
                    storage=storage, bind=bind)
    lh.start()
    return lh


def client(env, lh, rid):
    c = LighthouseClient(env=env, addr=lh.addr, token=TOKEN, replica_id=rid, timeouts=T)
    c.connect()
    return c


def raw(env, lh, rid):
    conn = env.net.connect(lh.addr, timeout=2.0)
    conn.send({"type": "hello", "token": TOKEN, "replica_id": rid})
    assert conn.recv(timeout=2.0)["type"] == "welcome"
    return conn


def ask(conn, step, **fields):
    conn.send({"type": "quorum", "step": step, "commit_failed": False, "last_quorum_id": 0, **fields})
    return conn.recv(timeout=5.0)


def test_an_out_of_range_quorum_id_is_refused_to_that_client_only(env, tmp_path):
    lh = start(env, storage=FileStorage(tmp_path))
    hostile = raw(env, lh, "evil")
    reply = ask(hostile, 1, last_quorum_id=2**64 - 1)
    assert reply["type"] == "error" and "'last_quorum_id'" in reply["error"]
    hostile.close()
    good = client(env, lh, "r0")
    d = good.quorum(1)
    assert d.replica_ids == ("r0",) and d.quorum_id < 2**53 and lh.status()["quorum_id"] == d.quorum_id
    good.close()
    lh.stop()
    lh2 = start(env, storage=FileStorage(tmp_path), bind=lh.addr)  # nothing bad was persisted
    assert lh2.status()["quorum_id"] == d.quorum_id
    lh2.stop()


def test_a_decision_too_large_for_one_frame_is_refused_to_the_largest_contributor(env):
    lh = start(env)
    big, bigger = raw(env, lh, "r0"), raw(env, lh, "r1")
    addrs = ["x" * 1000] * 9000  # 9 MB each: legal alone, 18 MB together > the 16 MiB frame limit
    big.send({"type": "quorum", "step": 0, "commit_failed": False, "last_quorum_id": 0, "data_addrs": addrs})
    reply = ask(bigger, 0, data_addrs=addrs + ["y" * 1000])
    assert reply["type"] == "error" and "would not fit one message" in reply["error"] and "r1" in reply["error"]
    bigger.close()  # the refused replica ends; the other one's quorum forms
    d = big.recv(timeout=5.0)
    assert d["type"] == "quorum" and [p[0] for p in d["participants"]] == ["r0"]
    big.close()
    assert lh.failed is None
    lh.stop()


@pytest.mark.parametrize("doc,field", [
    ({"quorum_id": 2**64 - 1, "participants": []}, "quorum_id"),
    ({"quorum_id": 3, "participants": ["a"], "max_step": -1}, "max_step"),
    ({"quorum_id": 3, "participants": ["a\n"]}, "replica id"),
    ([1, 2], "JSON object"),
])
def test_a_bad_persisted_state_is_refused_at_start(env, doc, field):
    storage = MemoryStorage()
    storage.write_atomic(STATE_KEY, json.dumps(doc).encode())
    with pytest.raises(LighthouseStateError, match=field):
        start(env, storage=storage)


def test_a_dead_main_task_is_never_silent(env, monkeypatch):
    lh = start(env)
    http = StatusServer(env=env, lighthouse=lh, token=TOKEN)
    url = http.start()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in decide")

    monkeypatch.setattr(service, "decide", broken)
    conn = raw(env, lh, "r0")
    conn.send({"type": "quorum", "step": 0, "commit_failed": False, "last_quorum_id": 0})
    with pytest.raises(Exception):  # the lighthouse closes every connection as its main task dies
        conn.recv(timeout=5.0)
    assert "a bug in decide" in lh.failed
    with pytest.raises(LighthouseDown):
        lh.status()
    request = urllib.request.Request(url + "/status", headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5.0)
    assert err.value.code != 200
    conn.close()
    http.stop()
    lh.stop()


def test_a_stale_replica_is_refused_instead_of_forking_the_job(env, tmp_path):
    lh = start(env, storage=FileStorage(tmp_path))
    r0, r1, r2 = (client(env, lh, f"r{i}") for i in range(3))
    for step in (10, 11):
        decisions = [None] * 3
        tasks = [env.spawn(lambda i=i, c=c: decisions.__setitem__(i, c.quorum(step)), name=f"q{i}")
                 for i, c in enumerate((r0, r1, r2))]
        assert all(t.join(5.0) and t.exception is None for t in tasks)
    r2.close()  # r2 freezes at step 11; r0 and r1 go on to step 40 and leave
    for step in range(12, 41):
        tasks = [env.spawn(lambda c=c: c.quorum(step), name="q") for c in (r0, r1)]
        assert all(t.join(5.0) and t.exception is None for t in tasks)
    r0.close()
    r1.close()
    stale = client(env, lh, "r2")
    with pytest.raises(LighthouseRejected, match="step 40 was already handed out"):
        stale.quorum(11)
    stale.close()
    lh.stop()
    lh2 = start(env, storage=FileStorage(tmp_path), bind=lh.addr)  # the floor survives a restart
    assert lh2.status()["max_step"] == 40
    holder, stale = client(env, lh2, "r0"), client(env, lh2, "r2")
    out = {}
    tasks = [env.spawn(lambda c=c, s=s: out.__setitem__(c.replica_id, c.quorum(s)), name="q")
             for c, s in ((holder, 40), (stale, 11))]
    assert all(t.join(5.0) and t.exception is None for t in tasks)
    assert out["r2"].behind == ("r2",) and out["r2"].max_step == 40  # with a holder it heals instead
    holder.close()
    stale.close()
    lh2.stop()


def test_a_replica_that_keeps_failing_by_its_own_fault_sits_out_one_quorum(env):
    lh = start(env)
    good, bad = raw(env, lh, "a"), raw(env, lh, "b")
    for conn in (good, bad):
        conn.send({"type": "quorum", "step": 5, "commit_failed": False, "last_quorum_id": 0})
    assert good.recv(timeout=5.0)["type"] == bad.recv(timeout=5.0)["type"] == "quorum"
    bad.send({"type": "quorum", "step": 5, "commit_failed": True, "last_quorum_id": 1, "own_failures": 2})
    reply = ask(good, 5, commit_failed=True, last_quorum_id=1)
    assert [p[0] for p in reply["participants"]] == ["a"] and "left out b" in reply["reason"]
    reply = ask(good, 6, last_quorum_id=reply["quorum_id"])  # b joins the next quorum, behind
    assert [p[0] for p in reply["participants"]] == ["a", "b"] and reply["behind"] == ["b"]
    assert bad.recv(timeout=5.0)["behind"] == ["b"]
    good.close()
    bad.close()
    lh.stop()


def test_ftrun_lighthouse_refuses_a_bad_state_dir_with_a_clear_error(tmp_path):
    FileStorage(tmp_path).write_atomic(STATE_KEY, json.dumps({"quorum_id": 2**64 - 1, "participants": []}).encode())
    done = subprocess.run([sys.executable, "-m", "ftrun.cli", "lighthouse", "--bind", "127.0.0.1:0",
                           "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "FTRUN_TOKEN": "t"})
    assert done.returncode == 2
    assert "'quorum_id' must be an integer" in done.stderr and "Traceback" not in done.stderr


def test_a_lighthouse_that_cannot_accept_any_more_is_marked_failed_not_deaf(env, monkeypatch):
    monkeypatch.setattr(service, "ACCEPT_FAIL_AFTER_S", 0.3)
    lh = start(env)
    lh._listener.close()  # every accept fails from now on, as when the process is out of descriptors
    deadline = env.clock.now() + 10.0
    while lh.failed is None and env.clock.now() < deadline:
        env.clock.sleep(0.05)
    assert lh.failed is not None and "accepting connections failed" in lh.failed
    with pytest.raises(LighthouseDown):
        lh.status()
    lh.stop()


def test_a_connection_whose_reader_cannot_start_is_closed_and_the_lighthouse_accepts_on(env, monkeypatch, caplog):
    """env.spawn failing for one connection's reader (no thread can be started, e.g. many connections at once)
    loses that connection only: the accept task used to end with the exception, and the lighthouse went deaf
    for good while `failed` stayed None and /status answered."""
    lh = start(env)
    spawn, failures = env.spawn, [RuntimeError("can't start new thread")] * 2

    def failing_spawn(fn, *args, name):
        if name == "lighthouse-reader" and failures:
            raise failures.pop()
        return spawn(fn, *args, name=name)

    monkeypatch.setattr(env, "spawn", failing_spawn)
    for _ in range(2):
        lost = env.net.connect(lh.addr, timeout=2.0)
        lost.send({"type": "hello", "token": TOKEN, "replica_id": "r0"})
        with pytest.raises(PeerClosed):
            lost.recv(timeout=5.0)
        lost.close()
    c = client(env, lh, "r0")
    assert c.quorum(0).quorum_id == 1 and lh.failed is None
    assert caplog.text.count("can't start new thread") == 1  # once per run of failures
    c.close()
    lh.stop()
