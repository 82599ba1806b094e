"""The lighthouse status page, JSON status and Prometheus metrics, all behind the job token."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def served(token: str):
    """A started lighthouse (min_replicas 1) and its StatusServer, both behind `token`: (env, lighthouse,
    server, url); both are stopped on exit."""
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1), token=token)
    lh.start()
    try:
        server = StatusServer(env=env, lighthouse=lh, token=token)
        url = server.start()
        try:
            yield env, lh, server, url
        finally:
            server.stop()
    finally:
        lh.stop()


def test_status_metrics_and_token():
    with served("t0k") as (env, lh, _, url):
        c = LighthouseClient(env=env, addr=lh.addr, token="t0k", replica_id="r0", timeouts=lh.config.timeouts)
        c.quorum(0)
        status = json.loads(get(url + "/status", "t0k"))
        assert status["quorum_id"] == 1 and status["participants"] == ["r0"] and status["live"] == ["r0"]
        metrics = get(url + "/metrics", "t0k")
        assert "ftrun_lighthouse_quorum_id 1.0" in metrics
        assert "ftrun_lighthouse_live_replicas 1.0" in metrics
        page = get(url + "/", "t0k")
        assert "<td>r0</td>" in page and "t0k" not in page and "training" in page
        with pytest.raises(urllib.error.HTTPError) as e:
            get(url + "/diagnosis", "t0k")
        assert e.value.code == 404 and b"no diagnosis monitor" in e.value.read()
        hang = {"kind": "hang", "reason": "stuck", "ranks": ["r0/1"], "rank_names": ["rank 1 of replica 0 (h)"],
                "collectives": ["ftar ring 1"], "t": 1.0}
        lh.diagnosis_report = lambda: {"rounds": 1, "latest": hang, "verdicts": [hang], "evictions": []}
        diagnosis = json.loads(get(url + "/diagnosis", "t0k"))
        assert diagnosis["shown"] == hang and ["ftar ring 1", "rank 1 of replica 0 (h)"] in diagnosis["graph"]["edges"]
        with pytest.raises(urllib.error.HTTPError) as e:  # never in a URL, even the right one
            get(url + "/status?token=t0k")
        assert e.value.code == 400 and b"refused in a URL" in e.value.read()
        with pytest.raises(urllib.error.HTTPError) as e:
            get(url + "/status", "wrong")
        assert e.value.code == 401
        c.close()


def test_an_address_that_cannot_be_listened_on_is_an_error_at_once():
    env = RealEnv()
    lh = Lighthouse(env=env, config=LighthouseConfig(min_replicas=1), token="t0k")
    with pytest.raises(OSError):
        StatusServer(env=env, lighthouse=lh, token="t0k", bind="192.0.2.1:0").start()  # TEST-NET: not ours


def test_a_browser_logs_in_once_with_a_form_and_gets_a_cookie_that_is_not_the_token():
    import urllib.parse
    from http.cookiejar import CookieJar

    jar = CookieJar()
    browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with served("t0k-long-enough") as (_, _, server, url):
        with pytest.raises(urllib.error.HTTPError) as e:  # no token: the login form, nothing of the job
            browser.open(url + "/", timeout=5)
        form = e.value.read().decode()
        assert e.value.code == 401 and '<form method=post action="/login">' in form and "quorum" not in form
        with pytest.raises(urllib.error.HTTPError) as e:
            browser.open(url + "/login", data=urllib.parse.urlencode({"token": "wrong"}).encode(), timeout=5)
        assert e.value.code == 401 and "wrong job token" in e.value.read().decode() and not list(jar)
        with browser.open(url + "/login", data=urllib.parse.urlencode({"token": "t0k-long-enough"}).encode(),
                          timeout=5) as r:  # 303 to the page, which the cookie now opens
            body = r.read().decode()
        assert r.url == url + "/" and "recent quorums" in body and "t0k-long-enough" not in body
        (cookie,) = list(jar)
        assert cookie.name == server.cookie_name and "t0k" not in cookie.value
        assert cookie.has_nonstandard_attr("HttpOnly")
        with browser.open(url + "/status", timeout=5) as r:
            assert json.loads(r.read())["quorum_id"] == 0
        with pytest.raises(urllib.error.HTTPError) as e:  # a forged cookie opens nothing
            get_with_cookie(url + "/", server.cookie_name, "0" * 64)
        assert e.value.code == 401


def get_with_cookie(url, name, value):
    req = urllib.request.Request(url, headers={"Cookie": f"{name}={value}", "Authorization": "Bearer x"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()
