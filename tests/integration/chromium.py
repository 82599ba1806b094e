"""Headless Chromium driven over the DevTools protocol (aiohttp's websocket client; no other dependency).

    shot = load_page(url, headers={"Authorization": "Bearer TOKEN"}, out_png=path)  # -> Shot(png, dom)
    shot = load_page(url, login_token="TOKEN")  # through the page's login form (a session cookie)

Why the protocol and not `chromium --headless --screenshot URL`: the status page wants the job token in
an Authorization header or typed into its login form (never in the URL); only the protocol sets request
headers (Network.setExtraHTTPHeaders) or fills a form. The browser runs with a private profile in a temp
dir, on a DevTools port it picks itself (--remote-debugging-port=0, read back from DevToolsActivePort), and
its process group is killed on the way out. `find_chromium()` says why there is none (the test skips with that).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

import aiohttp


@dataclass
class Shot:
    png: bytes
    dom: str


def find_chromium() -> tuple[str | None, str]:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path, ""
    return None, "no chromium on PATH (ci/install_chromium.sh installs Debian's, as root)"


def _flags(profile: str, width: int, height: int) -> list[str]:
    flags = ["--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
             "--hide-scrollbars", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
    if os.geteuid() == 0:
        flags.insert(0, "--no-sandbox")  # Chromium refuses to run its sandbox as root
    return flags


def _devtools_port(profile: str, proc: subprocess.Popen, timeout_s: float) -> int:
    path = os.path.join(profile, "DevToolsActivePort")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode} before opening its DevTools port")
        try:
            with open(path) as f:
                first = f.readline().strip()
            if first:
                return int(first)
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"chromium wrote no DevToolsActivePort within {timeout_s}s")


class _Cdp:
    def __init__(self, ws) -> None:
        self.ws, self.next_id, self.events = ws, 0, []

    async def call(self, method: str, session: str | None = None, **params) -> dict:
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        await self.ws.send_json(msg)
        while True:
            reply = await self.ws.receive_json()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    async def wait_event(self, method: str) -> dict:
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        while True:
            e = await self.ws.receive_json()
            if e.get("method") == method:
                return e
            self.events.append(e)


_LOGIN_JS = ("(() => {{ const f = document.querySelector('form[action=\"/login\"]'); if (!f) return false; "
             "f.querySelector('input[name=token]').value = {token}; f.submit(); return true; }})()")


async def _drive(port: int, url: str, headers: dict[str, str], width: int, height: int,
                 login_token: str | None) -> Shot:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/version") as r:
            ws_url = (await r.json())["webSocketDebuggerUrl"]
        async with http.ws_connect(ws_url, max_msg_size=64 << 20) as ws:
            cdp = _Cdp(ws)
            target = (await cdp.call("Target.createTarget", url="about:blank"))["targetId"]
            session = (await cdp.call("Target.attachToTarget", targetId=target, flatten=True))["sessionId"]
            await cdp.call("Network.enable", session)
            await cdp.call("Network.setExtraHTTPHeaders", session, headers=headers)
            await cdp.call("Emulation.setDeviceMetricsOverride", session, width=width, height=height,
                           deviceScaleFactor=1, mobile=False)
            await cdp.call("Page.enable", session)
            nav = await cdp.call("Page.navigate", session, url=url)
            if nav.get("errorText"):
                raise RuntimeError(f"navigating to {url}: {nav['errorText']}")
            await cdp.wait_event("Page.loadEventFired")
            if login_token is not None:  # type the token into the page's login form, as a person would
                typed = await cdp.call("Runtime.evaluate", session, returnByValue=True,
                                       expression=_LOGIN_JS.format(token=json.dumps(login_token)))
                if not typed["result"].get("value"):
                    raise RuntimeError(f"{url} showed no login form")
                await cdp.wait_event("Page.loadEventFired")
            png = base64.b64decode((await cdp.call("Page.captureScreenshot", session, format="png"))["data"])
            dom = (await cdp.call("Runtime.evaluate", session, expression="document.documentElement.outerHTML",
                                  returnByValue=True))["result"]["value"]
            return Shot(png, dom)


def load_page(url: str, *, headers: dict[str, str] | None = None, login_token: str | None = None,
              out_png: str | None = None, width: int = 1280, height: int = 1100, timeout_s: float = 60.0) -> Shot:
    """Load `url` with `headers` in a fresh headless Chromium, logging in through its form with `login_token`
    when given; its screenshot and DOM once it loaded."""
    exe, why = find_chromium()
    if exe is None:
        raise RuntimeError(why)
    profile = tempfile.mkdtemp(prefix="ftrun-chromium-")
    proc = subprocess.Popen([exe, *_flags(profile, width, height)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port = _devtools_port(profile, proc, timeout_s)
        shot = asyncio.run(asyncio.wait_for(_drive(port, url, headers or {}, width, height, login_token), timeout_s))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the browser and its helper processes
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
    if out_png:
        with open(out_png, "wb") as f:
            f.write(shot.png)
    return shot
