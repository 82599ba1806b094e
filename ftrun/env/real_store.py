"""A torch.distributed TCPStore server that listens only where it is told.

`TCPStore(host, port, is_master=True)` ignores `host` for the server and listens on every interface,
and the store has no authentication: anyone who reaches the port can read and write a job's
rendezvous. So the launcher binds the socket itself (loopback by default) and hands it to the store
through `master_listen_fd`.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


def bound_store(host: str = "127.0.0.1", *, timeout_s: float = 60.0) -> dist.TCPStore:
    """A master TCPStore listening on `host` only (a free port; read it from `.port`).
    Raises ValueError when `host` is not an address of this machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind the rendezvous store on {host!r}: {e.strerror}") from None
    port, fd = sock.getsockname()[1], sock.detach()  # the store owns the fd from here (closes it when dropped)
    try:
        return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=fd)
    except BaseException:
        socket.socket(fileno=fd).close()
        raise
