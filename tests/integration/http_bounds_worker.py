"""A catch-up server in its own process under a small file-descriptor budget, serving step 3.

Usage: python http_bounds_worker.py FD_HEADROOM MAX_CONNECTIONS BACKLOG. The descriptor limit is set to
the ones open once serving plus FD_HEADROOM. Prints the URL, serves until stdin closes.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

from ftrun.catchup.http_guard import HttpLimits
from ftrun.catchup.server import CatchupServer
from ftrun.env.real import RealEnv


def main() -> None:
    headroom, cap, backlog = (int(a) for a in sys.argv[1:4])
    server = CatchupServer(env=RealEnv(), token="job-token",
                           limits=HttpLimits(max_connections=cap, backlog=backlog, idle_timeout_s=60.0))
    url = server.start()
    server.publish(3, {"w": torch.arange(1000, dtype=torch.float32)})
    server.wait_ready(10.0)
    nofile = len(os.listdir("/proc/self/fd")) + headroom
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    print(url, flush=True)
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    main()
