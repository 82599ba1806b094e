"""`ftrun lighthouse`: run the quorum service until interrupted."""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys

from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.quorum.http import StatusServer
from ftrun.quorum.service import Lighthouse, LighthouseStateError
from ftrun.storage import FileStorage


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default="127.0.0.1:29510", help="address replicas connect to (host:port)")
    p.add_argument("--http-bind", default="127.0.0.1:0", help="status page address (host:port)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--state-dir", default=None, help="folder for the persisted quorum state")
    p.add_argument("--token", default=None, help="job token (default: $FTRUN_TOKEN, else a new random one)")
    d = Timeouts()
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s)
    p.add_argument("--join-timeout", type=float, default=d.join_timeout_s)


def run(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("FTRUN_TOKEN") or secrets.token_hex(16)
    config = LighthouseConfig(
        min_replicas=args.min_replicas,
        timeouts=Timeouts(heartbeat_timeout_s=args.heartbeat_timeout, join_timeout_s=args.join_timeout),
    )
    env = RealEnv()
    storage = FileStorage(args.state_dir) if args.state_dir else None
    try:
        lighthouse = Lighthouse(env=env, config=config, token=token, storage=storage, bind=args.bind)
    except LighthouseStateError as e:
        print(f"ftrun lighthouse: {e} (in --state-dir {args.state_dir})", file=sys.stderr)
        return 2
    addr = lighthouse.start()
    http = StatusServer(env=env, lighthouse=lighthouse, token=token, bind=args.http_bind)
    url = http.start()
    stop = env.event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"lighthouse listening on {addr}; status {url}/ (token {'from $FTRUN_TOKEN' if not args.token and os.environ.get('FTRUN_TOKEN') else token})",
          flush=True)
    while not stop.wait(timeout=1.0) and lighthouse.failed is None:
        pass
    http.stop()
    lighthouse.stop()
    if lighthouse.failed is not None:
        print(f"ftrun lighthouse: the quorum service died: {lighthouse.failed}", file=sys.stderr)
        return 1
    return 0
