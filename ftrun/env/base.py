"""The Env seam: everything in ftrun/ that waits, spawns or talks goes through these interfaces.

Two implementations pass one contract suite (tests/unit/test_env_contract.py):
- `ftrun.env.real.RealEnv`: OS threads, TCP/Unix sockets, `time.monotonic`.
- `harness.engine` (emulated): greenlets on a discrete-event loop with a virtual clock and a modeled network.

Code written against this seam is plain blocking code. Rules it follows so that it runs under both:
per-rank state lives in objects (never module globals or thread-locals) and nothing blocks except
through the Env.

Errors: every receive has a timeout and raises `NetTimeout` when it passes; a peer that dies or closes
surfaces as `PeerClosed` at once (also raised for a connection this side closed); a frame that does not
match what the receiver asked for raises `ProtocolError`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")

# A control message is a msgpack-able dict: str keys; values are None, bool, int, float, str, bytes,
# lists and dicts of those. Nothing is ever pickled.
Message = dict[str, Any]

_log = logging.getLogger("ftrun.env")


class EnvTimeout(TimeoutError):
    """A wait on a queue, lock, event or accept passed its timeout."""


class NetError(Exception):
    """Base of every network error raised by an Env's `net`."""


class PeerClosed(NetError):
    """The connection is gone: the peer closed it or died, or this side closed it."""


class NetTimeout(NetError, TimeoutError):
    """A receive (or a bounded send) passed its timeout.

    If the timeout struck in the middle of a frame the connection is closed, since its byte stream
    can no longer be trusted; otherwise the connection stays usable.
    """


class AcceptFailed(NetError):
    """accept() failed on a listener that is still open (e.g. the process ran out of descriptors): a later
    accept may succeed, unlike after PeerClosed (the listener was closed)."""


class ConnectError(NetError):
    """connect() could not reach a listener at the address within its timeout, or was cancelled."""


ACCEPT_RETRY_S = 0.05  # serve_connections() tries again this long after an AcceptFailed
CONNECT_RETRY_S = 0.02  # connect() retries a refused attempt this often until its deadline (the listener
# may not be up yet)
CANCEL_CHECK_S = 0.5  # a cancellable connect() waits at most this long for one attempt's answer, so it checks
# `cancelled` at least this often even when the address answers nothing (a silent host, a dropped SYN)


def connect_cancelled(addr: str, waited_s: float) -> ConnectError:
    """The error a connect() whose `cancelled()` turned true raises (both Envs say it alike)."""
    return ConnectError(f"connect to {addr} cancelled after {waited_s:.3g}s")


class ProtocolError(NetError):
    """The peer sent something that breaks the framing: a bad header, an oversized or undecodable
    message, or a bulk frame of another size than the receiver expects."""


class TaskKilled(BaseException):
    """Raised inside a task by `Task.kill()`. A BaseException so `except Exception` does not eat it."""


def log_unread_exception(name: str, error: BaseException) -> None:
    """Log, with its traceback, what task `name` raised when the task is collected and nobody read it (through
    `exception`, or a `join` that saw the task end), as asyncio does for a task whose exception was never
    retrieved: a task has nowhere to raise to, so it would be lost. Both Envs' tasks call this. TaskKilled is not
    logged: whoever killed the task asked for it."""
    if not isinstance(error, TaskKilled):
        _log.error("task %s raised %s, and nobody read it", name, type(error).__name__,
                   exc_info=(type(error), error, error.__traceback__))


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic clock (virtual in emulation)."""

    def sleep(self, seconds: float) -> None:
        """Block the calling task for `seconds`."""

    def cpu(self) -> float:
        """Seconds of CPU the calling task's process has used so far (a counter: take differences). Real: the
        process's CPU time, every thread of it (`time.process_time`); emulated: the busy time modeled for its
        process (the compute and bookkeeping the emulator charges, and with CPU charging its slices)."""


class Task(Protocol):
    name: str

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the task to end; True if it ended within `timeout`."""

    def is_alive(self) -> bool: ...

    def kill(self) -> None:
        """Raise `TaskKilled` inside the task (real threads: when it next runs Python code)."""

    @property
    def exception(self) -> BaseException | None:
        """What the task raised, if it ended with an exception (TaskKilled included). A task collected with an
        exception nobody read (here or through a `join` that saw it end) logs it (log_unread_exception)."""


class Event(Protocol):
    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False if `timeout` passed first."""


class Queue(Protocol):
    def put(self, item: Any) -> None:
        """Never blocks (queues are unbounded)."""

    def get(self, timeout: float | None = None) -> Any:
        """Next item; raises EnvTimeout if none arrives within `timeout`."""

    def qsize(self) -> int: ...


class Lock(Protocol):
    def acquire(self, timeout: float | None = None) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self) -> "Lock": ...
    def __exit__(self, *exc: object) -> None: ...


class Connection(Protocol):
    """A full-duplex framed byte stream to one peer.

    Threading: one task may send while another receives. Concurrent senders are serialized by the
    connection; concurrent receivers are not allowed.
    """

    local_addr: str
    peer_addr: str

    def send(self, msg: Message, timeout: float | None = None) -> None:
        """Send one control message (msgpack)."""

    def recv(self, timeout: float | None) -> Message:
        """Receive the next frame, which must be a control message."""

    def send_bytes(self, buf: memoryview | bytes, timeout: float | None = None) -> None:
        """Send one bulk frame of raw bytes (no copy where the implementation allows)."""

    def recv_into(self, buf: memoryview, timeout: float | None) -> None:
        """Receive the next frame, which must be a bulk frame of exactly len(buf) bytes, into buf."""

    def close(self) -> None:
        """Idempotent. Blocked receives on either side end with PeerClosed."""

    @property
    def closed(self) -> bool: ...


class Listener(Protocol):
    """Accepted connections may be bounded: an implementation may close, at accept, connections beyond
    its caps (ftrun.env.admission.ListenLimits: the real one always, the emulated one when given them); accept()
    then keeps waiting. Every accept loop (serve_connections) goes through these caps, so a flood of connections
    that never send their first message holds at most max_pending of them, and their handlers' tasks."""

    addr: str

    def accept(self, timeout: float | None = None) -> Connection:
        """Next incoming connection; EnvTimeout if none within `timeout`, PeerClosed once closed."""

    def close(self) -> None: ...


def split_host_port(addr: str) -> tuple[str, int]:
    """("host", port) of a "host:port" address (host may be empty); ValueError naming the address otherwise.
    Both Envs' address parsing, after they took "unix:/path" addresses aside."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {addr!r} is not 'host:port' or 'unix:/path'")
    return host, int(port)


class Network(Protocol):
    def listen(self, addr: str) -> Listener:
        """Listen at "host:port" (port 0 picks a free one) or "unix:/path". `Listener.addr` is the
        address to connect to."""

    def connect(self, addr: str, timeout: float, cancelled: Callable[[], bool] | None = None) -> Connection:
        """Connect to a listener; ConnectError if it cannot within `timeout`. A refused attempt is retried
        every CONNECT_RETRY_S until then. `cancelled`: checked after every failed attempt (an attempt then
        waits at most CANCEL_CHECK_S for an answer); once it returns True, ConnectError at once, saying
        the connect was cancelled (e.g. a ring build whose epoch was aborted while the next rank is dead)."""


@runtime_checkable
class Env(Protocol):
    clock: Clock
    net: Network

    def spawn(self, fn: Callable[..., Any], *args: Any, name: str) -> Task:
        """Start `fn(*args)` as a concurrent task."""

    def event(self) -> Event: ...
    def queue(self) -> Queue: ...
    def lock(self) -> Lock: ...

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` as this env's main task and return its result (re-raising its exception).

        Real env: a plain call. Emulated env: drives the event loop until `fn` returns.
        """


def serve_connections(env: Env, listener: Listener, handle: Callable[[Connection], Any], *, name: str,
                      conn_name: str, on_accept: Callable[[Connection], Any] | None = None,
                      give_up_after_s: float | None = None, on_end: Callable[[str], Any] | None = None) -> Task:
    """Spawn task `name`, which accepts on `listener` until it is closed and starts `handle(conn)` as task
    `conn_name` for every connection; `on_accept(conn)` runs first, in the accepting task (e.g. to note the
    connection where a stop() closes it even before its handler runs). Handlers own their connections.
    Returns the accepting task; it ends when the listener is closed. An accept that failed on the open
    listener (AcceptFailed, e.g. out of descriptors) is logged once per run of failures and tried again every
    ACCEPT_RETRY_S: connections wait in the backlog meanwhile instead of the listener going deaf for good.
    A connection whose handler cannot be started (env.spawn raised, e.g. no thread left) is closed, logged once
    per run of such failures, and the next one accepted. A handler that raises an Exception is logged with its
    traceback and its connection closed (nobody joins a handler's task to see what it raised).
    `give_up_after_s`: accepts failing that long in a row end the task instead (None: retried for good).
    `on_end(why)` runs in the accepting task as it ends, saying why: the listener is closed or gone (an
    owner that closed it tells its own close apart), every accept failed for give_up_after_s, or the loop itself
    raised (logged with its traceback)."""

    def serve(conn: Connection) -> None:
        try:
            handle(conn)
        except Exception:
            _log.error("%s: the handler of a connection from %s failed; connection closed", conn_name,
                       conn.peer_addr, exc_info=True)
            conn.close()

    def accept_loop() -> None:
        try:
            why = accept_until_ended()
        except Exception as e:  # a listener or on_accept that raised what no branch expects: say so, then end
            _log.error("%s: the accept loop failed; no more connections are accepted", name, exc_info=True)
            why = f"the accept loop failed: {type(e).__name__}: {e}"
        if on_end is not None:
            on_end(why)

    def accept_until_ended() -> str:
        failing = ""  # what failed last: "accepting a connection" or "starting a handler"; "" once one is served
        accepts_failing_since = None  # when the accepts failing now began to

        def failed(what: str, error: Exception, then: str) -> None:
            nonlocal failing
            if failing != what:
                _log.error("%s: %s failed: %s; %s", name, what, error, then)
            failing = what

        while True:
            try:
                conn = listener.accept()
            except AcceptFailed as e:
                now = env.clock.now()
                accepts_failing_since = now if accepts_failing_since is None else accepts_failing_since
                if give_up_after_s is not None and now - accepts_failing_since > give_up_after_s:
                    return f"every accept failed for {give_up_after_s}s: {e}"
                failed("accepting a connection", e, f"retrying every {ACCEPT_RETRY_S}s")
                env.clock.sleep(ACCEPT_RETRY_S)
                continue
            except NetError as e:
                return f"the listener is closed: {e}"
            accepts_failing_since = None
            if on_accept is not None:
                on_accept(conn)
            try:
                env.spawn(serve, conn, name=conn_name)
            except Exception as e:  # e.g. RuntimeError: can't start new thread
                conn.close()
                failed("starting a handler", e, "closing each connection until one starts")
                continue
            if failing:
                _log.warning("%s: serving connections again", name)
                failing = ""

    return env.spawn(accept_loop, name=name)
