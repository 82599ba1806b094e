"""The lighthouse's HTTP face: a status page at `/`, JSON at `/status` (and the diagnosis monitor's report with
its drawn graph at `/diagnosis`), Prometheus text at `/metrics`.

Runs aiohttp on its own event loop in one Env task. Every request must carry the job token, as
`Authorization: Bearer TOKEN` (a `?token=` in the URL is refused: URLs end up in logs and proxies), or, for a
person with a browser, the session cookie that the token typed once into the page's login form sets
(POST /login; the cookie is an HMAC of the token, HttpOnly and SameSite=Strict).
Bounded like the catch-up server (`HttpLimits`: idle/header-read timeout, connection cap, 4xx and one
rate-limited WARNING line for a malformed request).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ftrun.catchup.http_guard import ConnectionGuard, GuardedSite, HttpLimits, bearer_token
from ftrun.diagnose import graph
from ftrun.env.base import Env
from ftrun.quorum import page
from ftrun.net import require_token
from ftrun.quorum.service import Lighthouse

log = logging.getLogger("ftrun.quorum")
SESSION_COOKIE = "ftrun_status"
PAGE_HISTORY = 2000  # the recent events the page reads (its quorum history and replica phases)


class _LighthouseCollector:
    def __init__(self, lighthouse: Lighthouse) -> None:
        self._lh = lighthouse

    def collect(self):
        s = self._lh.status()
        yield GaugeMetricFamily("ftrun_lighthouse_quorum_id", "Current quorum id", value=s["quorum_id"])
        yield GaugeMetricFamily("ftrun_lighthouse_live_replicas", "Replicas connected and heard from",
                                value=len(s["live"]))
        yield GaugeMetricFamily("ftrun_lighthouse_participants", "Replicas in the current quorum",
                                value=len(s["participants"]))
        yield GaugeMetricFamily("ftrun_lighthouse_pending_requests", "Quorum requests waiting",
                                value=len(s["pending"]))
        lost = sum(1 for h in list(self._lh.history) if h["event"] == "member_lost")
        yield GaugeMetricFamily("ftrun_lighthouse_members_lost", "Replica failures seen", value=lost)


def session_value(token: str) -> str:
    """The status page's session cookie: derived from the job token, which it does not reveal."""
    return hmac.new(token.encode(), b"ftrun lighthouse status page session", hashlib.sha256).hexdigest()


class StatusServer:
    def __init__(self, *, env: Env, lighthouse: Lighthouse, token: str, bind: str = "127.0.0.1:0",
                 limits: HttpLimits = HttpLimits(max_connections=64), advertise_host: str | None = None) -> None:
        self.env, self.lighthouse, self._advertise_host = env, lighthouse, advertise_host
        self._token = require_token(token, "StatusServer")
        self.guard = ConnectionGuard(limits, log, name="lighthouse status server")
        host, _, port = bind.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self.registry = CollectorRegistry()
        self.registry.register(_LighthouseCollector(lighthouse))
        self.url = ""
        self._session = session_value(token)
        self.cookie_name = SESSION_COOKIE  # + its port once listening: cookies do not tell ports apart

    def start(self) -> str:
        """Serve; the URL. Raises OSError when the address cannot be listened on."""
        ready = self.env.event()
        self._failed: BaseException | None = None
        self._task = self.env.spawn(self._serve, ready, name="lighthouse-http")
        if not ready.wait(timeout=10.0):
            raise RuntimeError("lighthouse status server did not start")
        if self._failed is not None:
            raise self._failed
        return self.url

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._task.join(timeout=5.0)

    def _serve(self, ready) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._run(ready))
        except OSError as e:  # cannot listen there: start() raises it
            self._failed = e
            ready.set()
        finally:
            self._loop.close()

    async def _run(self, ready) -> None:
        self._stopping = asyncio.Event()
        app = web.Application(middlewares=[self.guard.middleware, self._auth])
        app.add_routes([web.get("/", self._page), web.get("/status", self._status), web.get("/metrics", self._metrics),
                        web.get("/diagnosis", self._diagnosis), web.post("/login", self._login)])
        runner = web.AppRunner(app, **self.guard.runner_kwargs())
        await runner.setup()
        site = GuardedSite(runner, self._host, self._port, guard=self.guard)
        await site.start()
        host, port = runner.addresses[0][:2]
        self.cookie_name = f"{SESSION_COOKIE}_{port}"
        self.url = f"http://{self._advertise_host or host}:{port}"
        ready.set()
        await self._stopping.wait()
        await runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if "token" in request.query:  # URLs end up in logs and proxies: the token never goes there
            return self.guard.reply(400, "the job token is refused in a URL; send Authorization: Bearer")
        if request.path == "/login" and request.method == "POST":
            return await handler(request)
        cookie = request.cookies.get(self.cookie_name, "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(bearer_token(request), self._token.encode()) or \
                hmac.compare_digest(cookie, self._session.encode()):
            return await handler(request)
        if request.path == "/" and request.method == "GET" and "Authorization" not in request.headers:
            return self._login_form(401, "")  # a person with a browser: the token goes in a form, once
        return self.guard.reply(401, "missing or wrong job token")

    async def _login(self, request: web.Request) -> web.Response:
        """The form's POST: the right token sets the session cookie (HMAC of the token, HttpOnly, SameSite
        Strict: the token itself is never stored in the browser) and goes to the page."""
        form = await request.post()
        given = form.get("token")
        if not isinstance(given, str) or not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                                 self._token.encode()):
            self.guard.warn("401 wrong job token in the status page's login form")
            return self._login_form(401, "wrong job token")
        reply = web.Response(status=303, headers={"Location": "/"})
        reply.set_cookie(self.cookie_name, self._session, httponly=True, samesite="Strict", path="/")
        return reply

    def _login_form(self, status: int, error: str) -> web.Response:
        return web.Response(text=page.login_form(error), status=status, content_type="text/html")

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.lighthouse.status())

    async def _diagnosis(self, request: web.Request) -> web.Response:
        """The monitor's report as JSON, with the graph the page draws (404 without a monitor)."""
        report = self.lighthouse.diagnosis_report() if self.lighthouse.diagnosis_report is not None else None
        if report is None:
            return web.json_response({"error": "no diagnosis monitor runs beside this lighthouse"}, status=404)
        shown = graph.shown_verdict(report)
        return web.json_response({**report, "shown": shown, "graph": graph.as_json(shown)},
                                 dumps=lambda x: json.dumps(x, default=str))

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _page(self, request: web.Request) -> web.Response:
        lh = self.lighthouse
        s = lh.status()
        report = lh.diagnosis_report() if lh.diagnosis_report is not None else None
        body = page.render(s, list(lh.history)[-PAGE_HISTORY:], report, lh.env.clock.now())
        return web.Response(text=body, content_type="text/html")
