"""Collection over real sockets: FTAR engines with telemetry, telemetry servers, the collector, a rank
that never joins its all-reduce, a server that stops answering, and the token check."""

from __future__ import annotations

import numpy as np
import pytest

from ftrun.diagnose.analysis import AnalysisConfig
from ftrun.diagnose.collect import Collector, CollectorConfig, DiagnoseError, RankInfo, TelemetryServer, request
from ftrun.diagnose.telemetry import Recorder
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine

pytestmark = pytest.mark.timeout(60)
REPLICAS, RANKS = 3, 2
TOKEN = "job-token"


class Job:
    """3 replicas x 2 ranks in threads: rank g of every replica forms FTAR ring g."""

    def __init__(self) -> None:
        self.env = RealEnv()
        cfg = FtarConfig(chunk_bytes=4096, num_chunks=2, timeout_s=4.0)
        self.engines = {(r, g): FtarEngine(env=self.env, kernels=CpuKernels(), token=TOKEN, config=cfg)
                        for r in range(REPLICAS) for g in range(RANKS)}
        self.recorders = {k: Recorder(self.env.clock) for k in self.engines}
        for k, e in self.engines.items():
            e.telemetry = self.recorders[k]
        self.collector = Collector(env=self.env, token=TOKEN, config=CollectorConfig(
            pull_timeout_s=1.0, analysis=AnalysisConfig(stall_s=0.3)))
        self.collector.start()
        self.servers, self.pending = [], []
        for r in range(REPLICAS):  # one server per replica, as one per host would be
            ranks = {RankInfo(f"r{r}/{g}", r, g, f"host{r}"): self.recorders[(r, g)] for g in range(RANKS)}
            server = TelemetryServer(env=self.env, token=TOKEN, ranks=ranks)
            server.start()
            server.register(self.collector.addr)
            self.servers.append(server)
        self._parallel([lambda k=k, e=e: e.reconfigure(
            epoch=1, ring=[self.engines[(r, k[1])].addr for r in range(REPLICAS)], index=k[0])
            for k, e in self.engines.items()])

    def _parallel(self, fns, timeout=20.0):
        tasks = [self.env.spawn(fn, name=f"t{i}") for i, fn in enumerate(fns)]
        return tasks if timeout == 0 else [t.join(timeout) and t.exception for t in tasks]

    def all_reduce(self, skip=(), wait=True):
        bufs = {k: np.ones(20_000, np.float32) for k in self.engines}
        fns = [lambda k=k: self.engines[k].all_reduce(bufs[k]) for k in self.engines if k not in skip]
        if wait:
            return self._parallel(fns)
        self.pending = self._parallel(fns, timeout=0)

    def close(self):
        for s in self.servers:
            s.stop()
        self.collector.stop()
        for e in self.engines.values():
            e.close()  # a ring still waiting on a missing rank aborts at once
        assert all(t.join(10.0) for t in self.pending)


@pytest.fixture
def job():
    j = Job()
    yield j
    j.close()


def test_healthy_job_has_no_hang_and_every_rank_answers(job):
    assert job.all_reduce() == [None] * 6
    assert job.all_reduce() == [None] * 6
    v = job.collector.diagnose()
    assert v["kind"] == "no_hang" and v["num_ranks"] == v["num_answered"] == 6, v
    assert v["eviction"]["replicas"] == []


def test_a_rank_that_never_joins_is_named_but_alive_so_not_evicted_before_the_wait_limit(job):
    assert job.all_reduce() == [None] * 6
    job.all_reduce(skip={(1, 0)}, wait=False)  # ring 0 waits on replica 1's rank 0
    job.env.clock.sleep(0.8)
    v = job.collector.diagnose()
    assert v["kind"] == "hang" and v["ranks"] == ["r1/0"], v
    assert "never joined the all-reduce" in v["reason"] and v["hosts"] == ["host1"]
    assert v["eviction"]["replicas"] == [] and "confirming" in v["eviction"]["reason"]
    job.env.clock.sleep(1.0)
    v = job.collector.diagnose()  # it answers the collector: alive, maybe only slow (act.silent_culprits)
    assert v["ranks"] == ["r1/0"] and v["silent"] == [] and v["eviction"]["replicas"] == [], v
    assert "alive, maybe slow" in v["eviction"]["reason"]
    reply = request(job.env, job.collector.addr, {"type": "verdict", "token": TOKEN}, 5.0)
    assert reply["type"] == "verdict" and reply["ranks"] == ["r1/0"]


def test_a_server_that_stops_answering_is_named(job):
    assert job.all_reduce() == [None] * 6
    job.collector.diagnose()  # the collector learns every rank's ring place while all answer
    job.servers[2].stop()  # replica 2's process no longer answers ...
    job.all_reduce(skip={(2, 1)}, wait=False)  # ... and its rank 1 is stuck before the ring
    job.env.clock.sleep(0.8)
    v = job.collector.diagnose()
    assert v["kind"] == "hang" and v["ranks"] == ["r2/1"] and v["num_answered"] == 4, v
    assert "did not answer the collector" in v["reason"] and v["silent"] == ["r2/1"]
    job.env.clock.sleep(1.0)
    v = job.collector.diagnose()  # silent and confirmed: its replica is evicted, with its incarnation
    assert v["eviction"]["replicas"] == [2] and v["eviction"]["replica_ids"] == ["r2"], v
    assert v["eviction"]["incarnations"] == [0] and "culprit silent" in v["eviction"]["reason"]


def test_wrong_token_and_bad_requests_are_refused(job):
    with pytest.raises(DiagnoseError, match="wrong job token"):
        request(job.env, job.collector.addr, {"type": "verdict", "token": "nope"}, 5.0)
    with pytest.raises(DiagnoseError, match="wrong job token"):
        request(job.env, job.servers[0].addr, {"type": "pull"}, 5.0)
    with pytest.raises(DiagnoseError, match="unknown request 'what'"):
        request(job.env, job.collector.addr, {"type": "what", "token": TOKEN}, 5.0)


def test_tree_collectives_and_their_summary_from_real_tree_comm():
    from ftrun.diagnose.summary import summarize
    from ftrun.diagnose.telemetry import Ev
    from ftrun.replica.tree_comm import TreeComm

    env, n = RealEnv(), 5
    listeners = [env.net.listen("127.0.0.1:0") for _ in range(n)]
    addrs = [lst.addr for lst in listeners]
    comms: dict[int, TreeComm] = {}

    def build(rank):
        comms[rank] = TreeComm.build(env=env, rank=rank, world_size=n, listener=listeners[rank], addrs=addrs,
                                     token="t", fanout=2, timeout_s=10.0)
    tasks = [env.spawn(build, r, name="tree") for r in range(n)]
    assert all(t.join(20.0) for t in tasks)
    recs = {r: Recorder(env.clock) for r in range(n)}
    for r, c in comms.items():
        c.telemetry = recs[r]
    results = {}
    tasks = [env.spawn(lambda r=r: results.__setitem__(r, comms[r].all_reduce_int([r], "sum")), name="ar")
             for r in range(n)]
    assert all(t.join(20.0) for t in tasks)
    assert all(v == [10] for v in results.values())
    for r in range(n):
        got = recs[r].records()
        assert list(got["ev"]) == [Ev.ENTER, Ev.SEND, Ev.DONE] and set(got["cid"]) == {1}
        s, _ = summarize(got, env.clock.now())
        assert (s["t_cid"][0], s["t_ev"][0]) == (1, Ev.DONE)
    for c in comms.values():
        c.close()
    for lst in listeners:
        lst.close()


def test_a_malformed_register_is_refused_whole_at_once_and_diagnosis_goes_on():
    """A register whose rank entry has a float replica index used to go unanswered (the client waited out its
    timeout) after the entries before it were registered; one with a huge index made every later diagnosis fail."""
    env = RealEnv()
    collector = Collector(env=env, token=TOKEN)
    collector.start()
    try:
        good = {"key": "r0/0", "replica": 0, "rank": 0, "host": "h0"}
        for bad in (float("inf"), 10**12, -3):
            t0 = env.clock.now()
            with pytest.raises(DiagnoseError, match=f"ranks\\[1\\] needs an integer .* in 'replica', got {bad}"):
                request(env, collector.addr, {"type": "register", "token": TOKEN, "addr": "127.0.0.1:9",
                                              "ranks": [good, {**good, "key": "r1/0", "replica": bad}]}, 5.0)
            assert env.clock.now() - t0 < 2.0  # answered, not timed out
        v = collector.diagnose()
        assert v["num_ranks"] == 0 and v["kind"] == "no_hang", v  # nothing of them registered
        request(env, collector.addr, {"type": "register", "token": TOKEN, "addr": "127.0.0.1:9", "ranks": [good]}, 5.0)
        assert collector.diagnose()["num_ranks"] == 1
    finally:
        collector.stop()


@pytest.mark.parametrize("malformed", [{"now": "late"}, {"now": None}, {"now": float("nan")}, {"serve_s": None},
                                       {"ranks": 3}, {"ranks": [7]}])
def test_a_malformed_pull_reply_drops_that_servers_ranks_only(malformed):
    """One telemetry server answering a malformed reply (another version, a bug) leaves its ranks unanswered,
    logged; it made every diagnosis fail (ValueError, TypeError, AttributeError from the reply's fields)."""
    class Malformed(TelemetryServer):
        def answer(self, msg):
            return {**super().answer(msg), **malformed}

    env = RealEnv()
    collector = Collector(env=env, token=TOKEN, config=CollectorConfig(pull_timeout_s=1.0))
    collector.start()
    servers = [kind(env=env, token=TOKEN, ranks={RankInfo(f"r{r}/0", r, 0, f"host{r}"): Recorder(env.clock)})
               for r, kind in enumerate((TelemetryServer, Malformed))]
    try:
        for server in servers:
            server.start()
            server.register(collector.addr)
        v = collector.diagnose()
        assert v["num_ranks"] == 2 and v["num_answered"] == 1, v
    finally:
        for server in servers:
            server.stop()
        collector.stop()
