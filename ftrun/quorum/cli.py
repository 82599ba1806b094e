"""`ftrun lighthouse`: run the quorum service until interrupted.

The job token comes from FTRUN_TOKEN_FILE / --token-file (a 0600 file) or FTRUN_TOKEN; `--token` on the
command line is refused (argv is visible to every local user). Without a token the lighthouse makes one
and writes it to a new 0600 file (--token-file, or token in --state-dir, or a temporary folder) whose
path it prints; replicas read it through FTRUN_TOKEN_FILE. Addresses: --bind (default
$FTRUN_BIND_HOST:29510, loopback without it) and --advertise-host (default $FTRUN_ADVERTISE_HOST): the
address printed for replicas' FTRUN_LIGHTHOUSE. --max-connections / --max-pending / --max-hello-bytes cap its
listeners' connections as FTConfig.net_limits caps a rank's (ftrun.cli.add_listen_arguments).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile

from ftrun.cli import add_listen_arguments, listen_limits
from ftrun.config import LighthouseConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.net import NetConfig, TokenError, load_token, write_token_file
from ftrun.quorum.http import StatusServer
from ftrun.quorum.service import Lighthouse, LighthouseStateError
from ftrun.storage import FileStorage

DEFAULT_PORT = 29510


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default=None, help="address replicas connect to, host:port "
                   f"(default: $FTRUN_BIND_HOST or 127.0.0.1, port {DEFAULT_PORT})")
    p.add_argument("--advertise-host", default=None, help="host printed for replicas to connect to "
                   "(default: $FTRUN_ADVERTISE_HOST, else the bind host; required with a 0.0.0.0 bind)")
    p.add_argument("--http-bind", default=None, help="status page address host:port (default: the bind host, port 0)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--state-dir", default=None, help="folder for the persisted quorum state")
    p.add_argument("--token-file", default=None, help="job token file, mode 0600; created when missing (with "
                   "$FTRUN_TOKEN, else a new token). Default: $FTRUN_TOKEN_FILE, else $FTRUN_TOKEN, else a new "
                   "token in a new 0600 file")
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused with a clear error, see run()
    d = Timeouts()
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout_s)
    p.add_argument("--join-timeout", type=float, default=d.join_timeout_s)
    add_listen_arguments(p)


def resolve_token(args: argparse.Namespace, environ) -> tuple[str, str]:
    """(token, where it came from). Raises TokenError for --token, a bad file or an empty FTRUN_TOKEN."""
    if args.token is not None:
        raise TokenError("--token is refused: a token on the command line is visible to every local user; "
                         "set FTRUN_TOKEN_FILE (or --token-file) to a 0600 file, or FTRUN_TOKEN")
    if args.token_file and not os.path.exists(args.token_file):
        token = load_token({"FTRUN_TOKEN": environ["FTRUN_TOKEN"]} if "FTRUN_TOKEN" in environ else {})
        token = token or secrets.token_hex(16)
        write_token_file(args.token_file, token)
        return token, f"token written to {args.token_file}"
    token = load_token(environ, file=args.token_file)
    if token is not None:
        return token, "token from " + (args.token_file or environ.get("FTRUN_TOKEN_FILE") or "$FTRUN_TOKEN")
    folder = args.state_dir or tempfile.mkdtemp(prefix="ftrun-lighthouse-")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"token-{secrets.token_hex(4)}")
    token = secrets.token_hex(16)
    write_token_file(path, token)
    return token, f"token written to {path} (give replicas FTRUN_TOKEN_FILE={path})"


def resolve_net(args: argparse.Namespace, environ) -> tuple[NetConfig, str, str]:
    """(net, lighthouse bind, status bind) from the flags, else FTRUN_BIND_HOST / FTRUN_ADVERTISE_HOST."""
    env_net = NetConfig.from_environ(environ)
    bind = args.bind or env_net.bind(DEFAULT_PORT)
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--bind must be host:port, got {bind!r}")
    net = NetConfig(bind_host=host or env_net.bind_host, advertise_host=args.advertise_host or env_net.advertise_host)
    return net, net.bind(int(port)), args.http_bind or net.bind(0)


def run(args: argparse.Namespace) -> int:
    limits = listen_limits(args)
    try:
        token, token_note = resolve_token(args, os.environ)
        net, bind, http_bind = resolve_net(args, os.environ)
    except (TokenError, ValueError, OSError) as e:
        print(f"ftrun lighthouse: {e}", file=sys.stderr)
        return 2
    config = LighthouseConfig(
        min_replicas=args.min_replicas,
        timeouts=Timeouts(heartbeat_timeout_s=args.heartbeat_timeout, join_timeout_s=args.join_timeout),
    )
    env = RealEnv(net_limits=limits)
    storage = FileStorage(args.state_dir) if args.state_dir else None
    try:
        lighthouse = Lighthouse(env=env, config=config, token=token, storage=storage, bind=bind)
    except LighthouseStateError as e:
        print(f"ftrun lighthouse: {e} (in --state-dir {args.state_dir})", file=sys.stderr)
        return 2
    addr = net.advertise(lighthouse.start())
    http = StatusServer(env=env, lighthouse=lighthouse, token=token, bind=http_bind, advertise_host=net.advertise_host)
    url = http.start()
    stop = env.event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"lighthouse listening on {addr}; status {url}/ ({token_note})", flush=True)
    while not stop.wait(timeout=1.0) and lighthouse.failed is None:
        pass
    http.stop()
    lighthouse.stop()
    if lighthouse.failed is not None:
        print(f"ftrun lighthouse: the quorum service died: {lighthouse.failed}", file=sys.stderr)
        return 1
    return 0
