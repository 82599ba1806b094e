"""Lighthouse service + client over real sockets (threads in one process)."""

from __future__ import annotations

import pytest

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.quorum.client import LighthouseClient, LighthouseRejected
from ftrun.quorum.service import Lighthouse, LighthouseStateError, STATE_KEY
from ftrun.storage import FileStorage

TOKEN = "job-token"
TIMEOUTS = Timeouts(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5, join_timeout_s=0.3, quorum_timeout_s=5.0)


@pytest.fixture
def env():
    return RealEnv()


def start(env, min_replicas=2, storage=None):
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=min_replicas, timeouts=TIMEOUTS),
                    token=TOKEN, storage=storage)
    lh.start()
    return lh


def client(env, lh, rid, token=TOKEN, connect=True):
    """A replica leader's client, registered with the lighthouse at once (so it counts as live before
    anyone asks: otherwise the first quorum may form without it, and it would wait alone)."""
    c = LighthouseClient(env=env, addr=lh.addr, token=token, replica_id=rid, timeouts=TIMEOUTS)
    if connect:
        c.connect()
    return c


def ask_all(env, clients, steps):
    out = {}

    def ask(c, s):
        out[c.replica_id] = c.quorum(s)

    tasks = [env.spawn(ask, c, s, name=c.replica_id) for c, s in zip(clients, steps)]
    for t in tasks:
        assert t.join(10.0) and t.exception is None, t.exception
    return out


def test_replicas_agree_and_behind_is_marked(env):
    lh = start(env)
    clients = [client(env, lh, f"r{i}") for i in range(3)]
    got = ask_all(env, clients, [5, 5, 0])
    decisions = set(got.values())
    assert len(decisions) == 1
    d = decisions.pop()
    assert d.replica_ids == ("r0", "r1", "r2") and d.max_step == 5 and d.behind == ("r2",) and d.quorum_id == 1
    again = ask_all(env, clients, [6, 6, 6])
    assert again["r0"].quorum_id == 1 and "fast path" in again["r0"].reason
    for c in clients:
        c.close()
    lh.stop()


def test_dead_replica_is_removed_at_once(env):
    lh = start(env)
    clients = [client(env, lh, f"r{i}") for i in range(3)]
    ask_all(env, clients, [1, 1, 1])
    clients[2].close()  # the connection drops, as when the process is killed
    got = ask_all(env, clients[:2], [2, 2])
    assert got["r0"].replica_ids == ("r0", "r1") and got["r0"].quorum_id == 2
    # seen through the closed connection ("lost"), not a heartbeat timeout ("hung"); the time it takes is
    # measured by benchmarks/detection.py (a wall-clock bound here would break under load)
    assert [h["why"] for h in lh.history if h["event"] == "member_lost" and h["replica_id"] == "r2"] == ["lost"]
    for c in clients[:2]:
        c.close()
    lh.stop()


def test_a_dead_participant_is_a_notice_to_the_others_until_the_job_finished(env):
    """A replica whose connection drops (killed) is reported to the other participants of the quorum at once,
    as a hung one is: a joiner killed while it heals has no ring connection whose close its peers would
    see, and they waited the whole catch-up wait limit for it. After the job finished, a replica that
    leaves is no news."""
    lh = start(env)
    heard = {rid: [] for rid in ("r0", "r1", "r2")}
    clients = []
    for rid in heard:
        c = LighthouseClient(env=env, addr=lh.addr, token=TOKEN, replica_id=rid, timeouts=TIMEOUTS,
                             on_peer_hung=lambda dead, qid, rid=rid: heard[rid].append((dead, qid)))
        c.connect()
        clients.append(c)
    d = ask_all(env, clients, [4, 4, 0])["r0"]  # r2 is behind: it heals before it joins the ring
    assert d.behind == ("r2",)
    clients[2].close()  # killed while healing
    deadline = env.clock.now() + 10.0
    while not (heard["r0"] and heard["r1"]) and env.clock.now() < deadline:
        env.clock.sleep(0.01)
    assert heard == {"r0": [("r2", d.quorum_id)], "r1": [("r2", d.quorum_id)], "r2": []}
    assert clients[0].report_finished(5)
    clients[0].close()  # leaves after the job finished: no notice
    env.clock.sleep(3 * TIMEOUTS.heartbeat_interval_s)
    assert heard["r1"] == [("r2", d.quorum_id)]
    clients[1].close()
    lh.stop()


def test_hung_replica_is_removed_after_heartbeat_timeout(env):
    lh = start(env)
    clients = [client(env, lh, f"r{i}") for i in range(2)]
    ask_all(env, clients, [1, 1])
    hung = env.net.connect(lh.addr, timeout=2.0)
    hung.send({"type": "hello", "token": TOKEN, "replica_id": "r9"})
    assert hung.recv(timeout=2.0)["type"] == "welcome"
    env.clock.sleep(TIMEOUTS.heartbeat_timeout_s + 0.3)  # sends nothing: no heartbeats
    lost = [h for h in lh.history if h["event"] == "member_lost" and h["replica_id"] == "r9"]
    assert lost and lost[0]["why"] == "hung"
    for c in clients:
        c.close()
    lh.stop()


def test_wrong_token_and_malformed_requests_get_clear_errors(env):
    lh = start(env, min_replicas=1)
    with pytest.raises(LighthouseRejected, match="wrong job token"):
        client(env, lh, "r0", token="nope", connect=False).quorum(0)
    conn = env.net.connect(lh.addr, timeout=2.0)
    conn.send({"type": "hello", "token": TOKEN, "replica_id": "r0"})
    assert conn.recv(timeout=2.0)["type"] == "welcome"
    conn.send({"type": "quorum", "step": "seven", "commit_failed": False, "last_quorum_id": 0})
    assert "'step'" in conn.recv(timeout=2.0)["error"]
    conn.send({"type": "quorum", "step": 1, "commit_failed": False, "last_quorum_id": -3})
    assert "non-negative" in conn.recv(timeout=2.0)["error"]
    conn.send({"type": "launch-missiles"})
    assert "unknown message type" in conn.recv(timeout=2.0)["error"]
    conn.send({"type": "quorum", "step": 1, "commit_failed": False, "last_quorum_id": 0})
    assert conn.recv(timeout=2.0)["type"] == "quorum"  # the connection stayed usable
    conn.close()
    lh.stop()


def test_restart_keeps_quorum_id_monotonic(env, tmp_path):
    storage = FileStorage(tmp_path)
    lh = start(env, storage=storage)
    clients = [client(env, lh, f"r{i}") for i in range(2)]
    ask_all(env, clients, [1, 1])
    clients[1].close()
    clients[1] = client(env, lh, "r1")
    first = ask_all(env, clients, [2, 2])["r0"].quorum_id
    lh.stop()  # the clients' connections drop, as after kill -9
    lh2 = Lighthouse(env=env, config=lh.config, token=TOKEN, storage=FileStorage(tmp_path), bind=lh.addr)
    lh2.start()
    after = ask_all(env, clients, [3, 3])["r0"]
    assert after.quorum_id >= first and "fast path" in after.reason
    for c in clients:
        c.close()
    lh2.stop()


def test_corrupt_state_is_a_clear_error(env, tmp_path):
    FileStorage(tmp_path).write_atomic(STATE_KEY, b'{"quorum_id": 3, "particip')
    with pytest.raises(LighthouseStateError, match="unreadable"):
        Lighthouse(env=env, config=LighthouseConfig(), token=TOKEN, storage=FileStorage(tmp_path))


def test_a_replica_asking_after_the_job_finished_is_told_so_across_a_restart(env, tmp_path):
    """Rule 0 (ftrun.quorum.decide): r0 reports the job finished at step 40; r1, stale at step 11, is told
    `job_finished` (JobFinished, not a refusal), also by a lighthouse restarted on the same state; a
    request at the finished step (the job extended) still gets a quorum; a malformed report is answered."""
    from ftrun.quorum.client import JobFinished

    lh = start(env, min_replicas=1, storage=FileStorage(tmp_path))
    r0 = client(env, lh, "r0")
    assert r0.report_finished(40)
    r1 = client(env, lh, "r1")
    with pytest.raises(JobFinished, match="job finished at step 40") as e:
        r1.quorum(11)
    assert e.value.step == 40 and lh.status()["finished_step"] == 40
    assert any(h["event"] == "told_finished" and h["replica_id"] == "r1" for h in lh.history)
    with r0._receiving:  # read the answer here, not the heartbeat task
        r0._conn.send({"type": "finished", "step": -1})
        assert "non-negative integer" in r0._conn.recv(timeout=5.0)["error"]
    for c in (r0, r1):
        c.close()
    lh.stop()
    lh = start(env, min_replicas=1, storage=FileStorage(tmp_path))
    r1 = client(env, lh, "r1")
    with pytest.raises(JobFinished):
        r1.quorum(11)
    assert r1.quorum(40).replica_ids == ("r1",)
    r1.close()
    lh.stop()


def test_a_round_with_a_silent_member_forms_at_the_join_timeout(env):
    """Readers handle requests; the timer (main task) forms a round whose join timeout passed."""
    lh = start(env, min_replicas=2)
    clients = [client(env, lh, rid) for rid in ("r0", "r1", "r2")]  # r2 heartbeats but never asks
    out = ask_all(env, clients[:2], [3, 3])
    assert {d.replica_ids for d in out.values()} == {("r0", "r1")}
    assert any(h["event"] == "quorum" and "join timeout" in h["reason"] for h in lh.history)
    for c in clients:
        c.close()
    lh.stop()


def _fake_lighthouse(env, script):
    """A listener that welcomes one client, then runs script(conn); returns (address, task)."""
    listener = env.net.listen("127.0.0.1:0")

    def serve():
        conn = listener.accept(timeout=10.0)
        assert conn.recv(timeout=10.0)["type"] == "hello"
        conn.send({"type": "welcome", "quorum_id": 0})
        script(conn)
        conn.recv(timeout=10.0)  # until the client goes away (or a heartbeat)

    return listener, env.spawn(serve, name="fake-lighthouse")


def test_a_notice_between_requests_reaches_the_callback(env):
    """No request is waiting: the heartbeat task takes the notice."""
    got, heard = [], env.event()
    listener, task = _fake_lighthouse(env, lambda conn: conn.send({"type": "hung", "replica_id": "r7", "quorum_id": 3}))
    c = LighthouseClient(env=env, addr=listener.addr, token=TOKEN, replica_id="r0", timeouts=TIMEOUTS,
                         on_peer_hung=lambda rid, qid: (got.append((rid, qid)), heard.set()))
    c.connect()
    assert heard.wait(timeout=10.0) and got == [("r7", 3)]
    c.close()
    task.join(timeout=10.0)
    listener.close()


def test_a_notice_before_the_reply_goes_to_the_callback_and_the_reply_to_the_request(env):
    """The asking task reads its own reply; a notice that comes first is handed on, not taken as the reply."""
    got = []

    def script(conn):
        while (msg := conn.recv(timeout=10.0))["type"] != "quorum":
            pass  # heartbeats
        conn.send({"type": "hung", "replica_id": "r7", "quorum_id": 3})
        conn.send({"type": "quorum", "quorum_id": 4, "max_step": msg["step"], "reason": "fake", "behind": [],
                   "participants": [["r0", msg["step"], []]]})

    listener, task = _fake_lighthouse(env, script)
    c = LighthouseClient(env=env, addr=listener.addr, token=TOKEN, replica_id="r0", timeouts=TIMEOUTS,
                         on_peer_hung=lambda rid, qid: got.append((rid, qid)))
    d = c.quorum(5)
    assert (d.quorum_id, d.max_step, d.replica_ids) == (4, 5, ("r0",)) and got == [("r7", 3)]
    c.close()
    task.join(timeout=10.0)
    listener.close()


def test_waiting_since_is_the_oldest_pending_request_and_clears_when_the_quorum_forms(env):
    """The diagnosis monitor reads it (a held round makes it pull at once)."""
    lh = start(env, min_replicas=2)
    r0, r1 = client(env, lh, "r0"), client(env, lh, "r1")
    assert lh.waiting_since() is None
    before = env.clock.now()
    out = {}
    task = env.spawn(lambda: out.setdefault("r0", r0.quorum(5)), name="r0")
    deadline = env.clock.now() + 10.0
    while lh.waiting_since() is None and env.clock.now() < deadline:  # r0 waits for r1 (min_replicas=2)
        env.clock.sleep(0.01)
    assert lh.waiting_since() is not None and before <= lh.waiting_since() <= env.clock.now()
    out["r1"] = r1.quorum(5)
    assert task.join(10.0) and task.exception is None, task.exception
    assert out["r0"].replica_ids == ("r0", "r1")
    deadline = env.clock.now() + 10.0  # the view is updated right after the replies go out
    while lh.waiting_since() is not None and env.clock.now() < deadline:
        env.clock.sleep(0.01)
    assert lh.waiting_since() is None
    for c in (r0, r1):
        c.close()
    lh.stop()


def test_stop_closes_a_connection_that_has_not_sent_its_hello(env):
    """A peer connected but silent (its hello not read yet) is closed by stop(), not left open until the
    lighthouse's connect timeout; so is one a replica holds after its hello."""
    import time
    from ftrun.env.base import PeerClosed
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1, timeouts=Timeouts(
        heartbeat_interval_s=0.05, heartbeat_timeout_s=30.0, connect_timeout_s=30.0)), token=TOKEN)
    lh.start()
    silent = env.net.connect(lh.addr, timeout=2.0)
    greeted = env.net.connect(lh.addr, timeout=2.0)
    greeted.send({"type": "hello", "token": TOKEN, "replica_id": "r0"})
    assert greeted.recv(timeout=2.0)["type"] == "welcome"
    deadline = time.monotonic() + 5.0
    while not lh._greeting and time.monotonic() < deadline:  # the silent one accepted, its reader waiting
        time.sleep(0.01)
    t0 = time.monotonic()
    lh.stop()
    for conn in (silent, greeted):
        with pytest.raises(PeerClosed):
            while True:  # anything the lighthouse sent first, then the close
                conn.recv(timeout=5.0)
        conn.close()
    assert time.monotonic() - t0 < 10.0
