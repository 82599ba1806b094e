"""The lighthouse's HTTP face: a status page at `/`, JSON at `/status`, Prometheus text at `/metrics`.

Runs aiohttp on its own event loop in one Env task. Every request must carry the job token, as
`Authorization: Bearer TOKEN` (a `?token=` in the URL is refused: URLs end up in logs and proxies).
Bounded like the catch-up server (`HttpLimits`: idle/header-read timeout, connection cap, 4xx and one
rate-limited WARNING line for a malformed request).
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ftrun.catchup.http_guard import ConnectionGuard, GuardedSite, HttpLimits, bearer_token
from ftrun.env.base import Env
from ftrun.quorum import page
from ftrun.quorum.service import Lighthouse

log = logging.getLogger("ftrun.quorum")
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


class StatusServer:
    def __init__(self, *, env: Env, lighthouse: Lighthouse, token: str, bind: str = "127.0.0.1:0",
                 limits: HttpLimits = HttpLimits(max_connections=64), advertise_host: str | None = None) -> None:
        self.env, self.lighthouse, self._token, self._advertise_host = env, lighthouse, token, advertise_host
        self.guard = ConnectionGuard(limits, log, name="lighthouse status server")
        host, _, port = bind.rpartition(":")
        self._host, self._port = host or "127.0.0.1", int(port)
        self.registry = CollectorRegistry()
        self.registry.register(_LighthouseCollector(lighthouse))
        self.url = ""

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
        app.add_routes([web.get("/", self._page), web.get("/status", self._status), web.get("/metrics", self._metrics)])
        runner = web.AppRunner(app, **self.guard.runner_kwargs())
        await runner.setup()
        site = GuardedSite(runner, self._host, self._port, guard=self.guard)
        await site.start()
        host, port = runner.addresses[0][:2]
        self.url = f"http://{self._advertise_host or host}:{port}"
        ready.set()
        await self._stopping.wait()
        await runner.cleanup()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if "token" in request.query:  # URLs end up in logs and proxies: the token never goes there
            return self.guard.reply(400, "the job token is refused in a URL; send Authorization: Bearer")
        if not hmac.compare_digest(bearer_token(request), self._token.encode()):
            return self.guard.reply(401, "missing or wrong job token")
        return await handler(request)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.lighthouse.status())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def _page(self, request: web.Request) -> web.Response:
        lh = self.lighthouse
        s = lh.status()
        report = lh.diagnosis_report() if lh.diagnosis_report is not None else None
        body = page.render(s, list(lh.history)[-PAGE_HISTORY:], report, lh.env.clock.now())
        return web.Response(text=body, content_type="text/html")
