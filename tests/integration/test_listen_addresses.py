"""Listeners bind the configured interface and hand peers the advertised address; the job token is
refused in URLs; the launcher's rendezvous store listens on loopback only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import psutil
import pytest
import torch

from ftrun.catchup.client import fetch_state
from ftrun.catchup.config import CatchupConfig
from ftrun.catchup.server import CatchupServer
from ftrun.config import Timeouts
from ftrun.env.real import RealEnv
from ftrun.env.real_store import bound_store
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarEngine
from ftrun.net import NetConfig

pytestmark = pytest.mark.timeout(60)
TOKEN = "t0k"
# Bind every interface, advertise loopback: the published address must be the advertised one, and work.
NET = NetConfig(bind_host="0.0.0.0", advertise_host="127.0.0.1")


def _listening(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port}


def test_catchup_server_binds_the_wildcard_and_advertises_the_configured_host():
    env = RealEnv()
    server = CatchupServer(env=env, token=TOKEN, config=CatchupConfig(bind=NET.bind(), advertise_host=NET.advertised))
    url = server.start()
    try:
        port = int(url.rpartition(":")[2])
        assert url == f"http://127.0.0.1:{port}" and _listening(port) == {"0.0.0.0"}
        state = {"w": torch.arange(10, dtype=torch.float32)}
        server.publish(3, state)
        assert server.wait_ready(10)
        got = fetch_state(3, [url], TOKEN, Timeouts())
        assert torch.equal(got["w"], state["w"])
        with pytest.raises(urllib.error.HTTPError) as e:  # the right token, but in the URL
            urllib.request.urlopen(f"{url}/catchup/status?token={TOKEN}", timeout=5)
        assert e.value.code == 400 and "refused in a URL" in json.loads(e.value.read())["error"]
    finally:
        server.stop()


def test_ftar_ring_listener_advertises_and_a_two_rank_ring_reduces_through_it():
    env = RealEnv()
    engines = [FtarEngine(env=env, kernels=CpuKernels(), token=TOKEN, bind=NET.bind(), advertise_host=NET.advertised)
               for _ in range(2)]
    try:
        ring = [e.addr for e in engines]
        assert all(a.startswith("127.0.0.1:") for a in ring)
        assert all(_listening(int(a.rpartition(":")[2])) == {"0.0.0.0"} for a in ring)
        bufs = [np.full(1000, i + 1, dtype=np.float32) for i in range(2)]
        tasks = [env.spawn(lambda i=i: (engines[i].reconfigure(epoch=1, ring=ring, index=i, timeout=10),
                                        engines[i].all_reduce(bufs[i])), name=f"r{i}") for i in range(2)]
        for t in tasks:
            t.join(timeout=30)
        assert all(np.all(b == 3.0) for b in bufs)
    finally:
        for e in engines:
            e.close()


def test_launch_store_listens_on_loopback_only():
    store = bound_store("127.0.0.1", timeout_s=5)
    try:
        assert _listening(store.port) == {"127.0.0.1"}
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
    with pytest.raises(ValueError, match="cannot bind the rendezvous store on '203.0.113.1'"):
        bound_store("203.0.113.1", timeout_s=5)


def test_lighthouse_cli_refuses_a_token_on_argv_and_never_prints_a_new_one(tmp_path):
    cli = [sys.executable, "-m", "ftrun.cli", "lighthouse", "--bind", "127.0.0.1:0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}
    done = subprocess.run([*cli, "--token", "T"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--token is refused" in done.stderr
    loose = tmp_path / "loose.token"
    loose.write_text("x\n")
    os.chmod(loose, 0o644)
    done = subprocess.run(cli, env={**env, "FTRUN_TOKEN_FILE": str(loose)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "chmod 600" in done.stderr
    fresh = tmp_path / "job.token"
    proc = subprocess.Popen([*cli, "--token-file", str(fresh)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    token = fresh.read_text().strip()
    assert os.stat(fresh).st_mode & 0o777 == 0o600
    assert f"token written to {fresh}" in line and token not in line and line.startswith("lighthouse listening on 127.0.0.1:")
