"""The lighthouse status page, JSON status and Prometheus metrics, all behind the job token."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ftrun.config import LighthouseConfig
from ftrun.env.real import RealEnv
from ftrun.quorum.client import LighthouseClient
from ftrun.quorum.http import StatusServer
from ftrun.quorum.service import Lighthouse


def get(url, token=None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def test_status_metrics_and_token():
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1), token="t0k")
    lh.start()
    http = StatusServer(env=env, lighthouse=lh, token="t0k")
    url = http.start()
    try:
        c = LighthouseClient(env=env, addr=lh.addr, token="t0k", replica_id="r0", timeouts=lh.config.timeouts)
        c.quorum(0)
        status = json.loads(get(url + "/status", "t0k"))
        assert status["quorum_id"] == 1 and status["participants"] == ["r0"] and status["live"] == ["r0"]
        metrics = get(url + "/metrics", "t0k")
        assert "ftrun_lighthouse_quorum_id 1.0" in metrics
        assert "ftrun_lighthouse_live_replicas 1.0" in metrics
        page = get(url + "/", "t0k")
        assert "<td>r0</td>" in page and "t0k" not in page and "training" in page
        with pytest.raises(urllib.error.HTTPError) as e:  # never in a URL, even the right one
            get(url + "/status?token=t0k")
        assert e.value.code == 400 and b"refused in a URL" in e.value.read()
        with pytest.raises(urllib.error.HTTPError) as e:
            get(url + "/status", "wrong")
        assert e.value.code == 401
        c.close()
    finally:
        http.stop()
        lh.stop()


def test_an_address_that_cannot_be_listened_on_is_an_error_at_once():
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1), token="t0k")
    with pytest.raises(OSError):
        StatusServer(env=env, lighthouse=lh, token="t0k", bind="192.0.2.1:0").start()  # TEST-NET: not ours
