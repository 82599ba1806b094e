"""The FTAR ring's connections: one to the next rank, one from the previous, rebuilt per configuration.

Each rank listens once (its "ftar" endpoint). `connect_ring` makes the connection to the next rank
(the connector says hello with the job token and the configuration's epoch) and takes the previous
rank's from the listener. Connections from another epoch (a stale attempt after a failure) are closed
on arrival, so a rebuilt ring never mixes with the old one.

The listener also takes abort requests, `{token, abort: epoch}` (`abort_request`): the replica's leader
sends one to each of its ranks when the lighthouse says a participant of that epoch's quorum hung, so
every rank of the replica, not just the leader, gives up on that ring within the heartbeat timeout.
The token is checked; the connection is closed without a reply.

And liveness pings, `{token, ping: n}` (`ping_request`): the leader's rank watch (ftrun.replica.rank_watch)
keeps one connection to each other rank of its replica and expects `{pong: n}` for every ping, answered
by the rank's greeter task. A rank frozen (SIGSTOP) or wedged stops answering; its leader then stops
heartbeating, so the lighthouse evicts the replica and tells its peers, whose every rank gives up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ftrun.env.base import Connection, Env, EnvTimeout, NetError, PeerClosed, serve_connections
from ftrun.net import token_matches

MAX_EPOCH = 2**63 - 1


class FtarError(Exception):
    """Base of FTAR's errors."""


class RecoverableError(FtarError):
    """A peer died, closed or went silent: rebuild the ring (reconfigure) and retry the step."""


class FatalError(FtarError):
    """Bad arguments or a local fault: this rank cannot take part as it is."""


@dataclass(frozen=True)
class RingLinks:
    epoch: int
    next: Connection | None
    prev: Connection | None

    def close(self) -> None:
        for c in (self.next, self.prev):
            if c is not None:
                c.close()


def abort_request(token: str, epoch: int) -> dict:
    """The message that makes a rank's FTAR give up on ring `epoch` (sent to its listener)."""
    return {"token": token, "abort": epoch}


def ping_request(token: str, n: int) -> dict:
    """A liveness ping (the first one on a connection is its greeting); the rank answers {"pong": n}."""
    return {"token": token, "ping": n}


def parse_greeting(msg: Any, token: str) -> tuple[str, int] | None:
    """("ring", epoch) for a ring connection's hello, ("abort", epoch) for an abort request, ("ping", n)
    for a liveness ping, None for anything else (wrong token, malformed). Pure."""
    if not isinstance(msg, dict):
        return None
    got = msg.get("token")
    if not token_matches(got, token):
        return None
    for kind, key in (("abort", "abort"), ("ping", "ping"), ("ring", "epoch")):
        value = msg.get(key)
        if key in msg:
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_EPOCH:
                return kind, value
            return None
    return None


class RingListener:
    """Accepts ring connections and sorts them by epoch. One accept task for the engine's life.
    `on_abort(epoch)` is called (on a greeter task) for every abort request with the job token."""

    def __init__(self, env: Env, token: str, bind: str, advertise_host: str | None = None,
                 on_abort: Callable[[int], Any] | None = None) -> None:
        """Listen on `bind` ("host:port"); `addr` is what peers connect to: the bound port on
        `advertise_host` (default: the bound host)."""
        self.env, self._token, self.on_abort = env, token, on_abort
        self._listener = env.net.listen(bind)
        self.addr = self._listener.addr
        if advertise_host is not None and not self.addr.startswith("unix:"):
            self.addr = f"{advertise_host}:{self.addr.rpartition(':')[2]}"
        self._arrivals = env.queue()
        self._task = serve_connections(env, self._listener, self._greet, name="ftar-accept",
                                       conn_name="ftar-greet")

    def _greet(self, conn: Connection) -> None:
        try:
            hello = conn.recv(timeout=10.0)
        except NetError:
            conn.close()
            return
        greeting = parse_greeting(hello, self._token)
        if greeting is not None and greeting[0] == "ping":
            self._answer_pings(conn, greeting[1])
            return
        if greeting is None or greeting[0] == "abort":
            conn.close()  # wrong job or malformed hello: nothing to say to it; an abort needs no reply
            if greeting is not None and self.on_abort is not None:
                self.on_abort(greeting[1])
            return
        self._arrivals.put((greeting[1], conn))

    def _answer_pings(self, conn: Connection, n: int) -> None:
        """Answer the leader's liveness pings on this connection until it closes."""
        try:
            while True:
                conn.send({"pong": n}, timeout=10.0)
                greeting = parse_greeting(conn.recv(timeout=None), self._token)
                if greeting is None or greeting[0] != "ping":
                    break
                n = greeting[1]
        except NetError:
            pass
        conn.close()

    def wake(self, epoch: int) -> None:
        """Make a `take` waiting for `epoch` give up now (the epoch was aborted)."""
        self._arrivals.put((epoch, None))

    def take(self, epoch: int, timeout: float) -> Connection:
        """The previous rank's connection for `epoch`; older epochs' connections are closed."""
        deadline = self.env.clock.now() + timeout
        while True:
            remaining = deadline - self.env.clock.now()
            try:
                got_epoch, conn = self._arrivals.get(timeout=max(remaining, 0.0))
            except EnvTimeout:
                raise RecoverableError(f"previous ring rank did not connect within {timeout}s (epoch {epoch})") from None
            if conn is None:  # wake(): an abort of this epoch (or a stale one of an older epoch)
                if got_epoch >= epoch:
                    raise RecoverableError(f"ring epoch {epoch} was aborted while it was being built")
                continue
            if got_epoch == epoch:
                return conn
            conn.close()
            if got_epoch > epoch:
                raise RecoverableError(f"a peer is already at ring epoch {got_epoch}, ahead of {epoch}")

    def close(self) -> None:
        self._listener.close()
        self._task.join(timeout=2.0)


def connect_ring(env: Env, listener: RingListener, token: str, *, epoch: int, ring: list[str], index: int,
                 timeout: float, building: list[Connection] | None = None,
                 aborted: Callable[[], bool] | None = None) -> RingLinks:
    """Connections of rank `index` in a ring of listener addresses `ring`. Raises RecoverableError.
    `building`: every connection is appended as soon as it exists, so an abort can close it; `aborted`:
    whether the epoch was given up, the connect's `cancelled` check (a dead next rank, e.g. a joiner killed
    while it healed, refuses until the timeout: an abort there has no connection to close)."""
    n = len(ring)
    if n == 1:
        return RingLinks(epoch, None, None)
    nxt = None
    try:
        nxt = env.net.connect(ring[(index + 1) % n], timeout=timeout, cancelled=aborted)
        if building is not None:
            building.append(nxt)
        nxt.send({"token": token, "epoch": epoch})
        prev = listener.take(epoch, timeout)
        if building is not None:
            building.append(prev)
    except (NetError, PeerClosed) as e:
        if nxt is not None:
            nxt.close()
        if aborted is not None and aborted():
            raise RecoverableError(f"cannot build ring epoch {epoch}: the epoch was aborted ({e})") from e
        raise RecoverableError(f"cannot build ring epoch {epoch}: {e}") from e
    except RecoverableError:
        if nxt is not None:
            nxt.close()
        raise
    return RingLinks(epoch, nxt, prev)
