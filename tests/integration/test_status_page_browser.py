"""The lighthouse status page in a real browser (headless Chromium, `make test-browser`; skips without one).

A lighthouse with three replicas in a quorum and a fourth waiting, and a diagnosis monitor beside it that
holds a real verdict: 3 replicas x 2 ranks of FTAR engines in threads, serving their telemetry to the
monitor's collector, and replica 1's rank 0 never joins its ring's all-reduce. The page is loaded with the
token in an Authorization header (over the DevTools protocol, tests/integration/chromium.py); the test checks
the screenshot (not blank; the culprit's red node drawn) and the DOM (replicas, phases, the verdict, the
graph). STATUS_PAGE_PNG=path keeps the screenshot (benchmarks/results/status_page.png in the closing note).
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.diagnose import graph
from ftrun.diagnose.analysis import AnalysisConfig
from ftrun.diagnose.collect import CollectorConfig, RankInfo, TelemetryServer
from ftrun.diagnose.monitor import Monitor, MonitorConfig
from ftrun.diagnose.telemetry import Recorder
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.quorum.client import LighthouseClient
from ftrun.quorum.http import StatusServer
from ftrun.quorum.service import Lighthouse
from tests.integration.chromium import find_chromium, load_page

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180),
              pytest.mark.skipif(find_chromium()[0] is None, reason=find_chromium()[1])]
TOKEN = "browser-test-token-5f1e"
REPLICAS, RANKS = 3, 2


def _wait(env, pred, timeout_s: float, what: str):
    for _ in range(int(timeout_s / 0.1)):
        if pred():
            return
        env.clock.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def live_job():
    """Lighthouse + status server + monitor holding a hang verdict (replica 1's rank 0 never joins)."""
    env = RealEnv()
    lh = Lighthouse(env=env, token=TOKEN, config=LighthouseConfig(  # the raw ask below sends no heartbeats
        min_replicas=3, timeouts=Timeouts(heartbeat_timeout_s=600.0)))
    lh.start()
    http = StatusServer(env=env, lighthouse=lh, token=TOKEN)
    url = http.start()
    monitor = Monitor(env=env, token=TOKEN, lighthouse=lh, on_evict=lambda e: None,
                      config=MonitorConfig(interval_s=0.3, late_interval_s=0.3),
                      collector=CollectorConfig(pull_timeout_s=1.0, analysis=AnalysisConfig(stall_s=0.3)))
    monitor.start()
    clients = [LighthouseClient(env=env, addr=lh.addr, token=TOKEN, replica_id=f"r{i}", timeouts=lh.config.timeouts)
               for i in range(REPLICAS)]
    engines = {(r, g): FtarEngine(env=env, kernels=CpuKernels(), token=TOKEN,
                                  config=FtarConfig(chunk_bytes=4096, num_chunks=2, timeout_s=30.0))
               for r in range(REPLICAS) for g in range(RANKS)}
    servers, tasks = [], []
    try:
        quorums = [env.spawn(lambda c=c: c.quorum(7), name="ask") for c in clients[:REPLICAS]]
        assert all(t.join(20.0) for t in quorums)
        for k, e in engines.items():
            e.telemetry = Recorder(env.clock)
        for r in range(REPLICAS):
            ranks = {RankInfo(f"r{r}/{g}", r, g, f"host{r}"): engines[(r, g)].telemetry for g in range(RANKS)}
            server = TelemetryServer(env=env, token=TOKEN, ranks=ranks)
            server.start()
            server.register(monitor.addr)
            servers.append(server)
        ring = [env.spawn(lambda k=k, e=e: e.reconfigure(
            epoch=1, ring=[engines[(r, k[1])].addr for r in range(REPLICAS)], index=k[0]), name="reconf")
            for k, e in engines.items()]
        assert all(t.join(20.0) for t in ring)
        done = [env.spawn(lambda e=e: e.all_reduce(np.ones(20_000, np.float32)), name="ar") for e in engines.values()]
        assert all(t.join(20.0) for t in done)
        tasks = [env.spawn(lambda e=e: e.all_reduce(np.ones(20_000, np.float32)), name="ar")  # ring 0 hangs
                 for k, e in engines.items() if k != (1, 0)]
        late = env.net.connect(lh.addr, timeout=5.0)  # r3 asks for step 8's quorum and waits (a raw ask: closing
        late.send({"type": "hello", "token": TOKEN, "replica_id": f"r{REPLICAS}"}, timeout=5.0)  # it ends it)
        assert late.recv(timeout=5.0)["type"] == "welcome"
        late.send({"type": "quorum", "step": 8, "commit_failed": False, "own_failures": 0, "fresh": False,
                   "last_quorum_id": 1, "data_addrs": []}, timeout=5.0)
        clients.append(late)
        _wait(env, lambda: (monitor.latest or {}).get("kind") == "hang", 30.0, "the monitor's hang verdict")
        yield env, lh, url, monitor
    finally:
        monitor.stop()
        for s in servers:
            s.stop()
        for e in engines.values():
            e.close()
        for c in clients:
            c.close()
        http.stop()
        lh.stop()
        for t in tasks:
            t.join(10.0)


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(np.int16)


def test_status_page_in_headless_chromium(live_job, tmp_path):  # the job is read only: one for the module
    env, lh, url, monitor = live_job
    out = os.environ.get("STATUS_PAGE_PNG") or str(tmp_path / "status_page.png")
    shot = load_page(url + "/", login_token=TOKEN, out_png=out)  # a person: the token typed into the form once

    dom = shot.dom
    assert TOKEN not in dom
    for rid in ("r0", "r1", "r2", "r3"):
        assert f"<td>{rid}</td>" in dom, rid
    assert "waiting for a quorum (step 8)" in dom and ">training<" in dom
    assert "never joined the all-reduce" in dom and "rank 0 of replica 1 (host1)" in dom
    assert 'class="node culprit"' in dom and 'class="node ring"' in dom and "ftar ring 0" in dom
    assert 'tr class="suspect"><td>r1</td>' in dom

    px = _pixels(shot.png)
    assert px.shape[0] >= 600 and px.shape[1] >= 1000
    assert len(np.unique(px.reshape(-1, 3), axis=0)) > 50, "the screenshot is blank"
    red = np.array([int(graph.CULPRIT_FILL[i:i + 2], 16) for i in (1, 3, 5)])
    culprit = (np.abs(px - red).sum(axis=2) <= 12).sum()
    assert culprit >= 0.5 * graph.NODE_W * graph.NODE_H, f"the culprit's node: {culprit} red pixels"


def test_the_page_with_the_token_in_a_header_and_without_any(live_job):
    env, lh, url, monitor = live_job
    assert "<td>r1</td>" in load_page(url + "/", headers={"Authorization": f"Bearer {TOKEN}"}).dom
    refused = load_page(url + "/").dom  # no token: the login form, nothing of the job
    assert 'action="/login"' in refused and "<td>r1</td>" not in refused and "never joined" not in refused
