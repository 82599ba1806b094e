"""The service commands apply the listener caps given on their command line (ftrun.cli.add_listen_arguments):
`ftrun lighthouse` and `ftrun diagnose --serve` started with --max-pending 2 close the oldest of three silent
connections, as a rank's listener under FTConfig.net_limits does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.unit.test_real_net_limits import raw_client

pytestmark = pytest.mark.timeout(60)

COMMANDS = {"lighthouse": (["lighthouse", "--bind", "127.0.0.1:0"], "lighthouse listening on "),
            "diagnose": (["diagnose", "--serve", "--bind", "127.0.0.1:0"], "diagnosis collector listening on ")}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_service_started_with_max_pending_closes_the_oldest_silent_connection(command):
    argv, banner = COMMANDS[command]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FTRUN_")}, "FTRUN_TOKEN": "job-token"}
    proc = subprocess.Popen([sys.executable, "-m", "ftrun.cli", *argv, "--max-pending", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    silent = []
    try:
        line = proc.stdout.readline()
        assert line.startswith(banner), line
        addr = line[len(banner):].split(";")[0].strip()
        silent = [raw_client(addr) for _ in range(3)]
        assert silent[0].recv(16) == b""  # the third closed the oldest pending one (end of stream)
        for c in silent[1:]:  # the two newest stay open: nothing to read yet, no end of stream
            c.setblocking(False)
            with pytest.raises(BlockingIOError):
                c.recv(16)
    finally:
        for c in silent:
            c.close()
        proc.terminate()
        proc.wait(timeout=30)
