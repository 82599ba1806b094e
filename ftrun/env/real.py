"""The real Env: OS threads, `time.monotonic`, and TCP/Unix sockets (ftrun.env.real_net).

This module and real_net.py are the only ones under ftrun/ allowed to import time, threading or
socket (tests/unit/test_import_lint.py).
"""

from __future__ import annotations

import ctypes
import queue as _queue
import threading
import time
import weakref
from typing import Any, Callable, TypeVar

from ftrun.env.base import EnvTimeout, TaskKilled, log_unread_exception
from ftrun.env.admission import ListenLimits
from ftrun.env.real_net import RealNetwork

T = TypeVar("T")


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def cpu(self) -> float:
        # The whole process's CPU, not the calling thread's (time.thread_time): a rank's demand on the cores it
        # shares with the job's other ranks is its trainer thread's and its FTAR engine, catch-up server and
        # heartbeat threads' together, and what queues for a core is the process's runnable work.
        return time.process_time()


class RealTask:
    """A daemon thread running fn(*args); remembers what it raised.

    What it raised is read through `exception` (or a `join` that sees the task ended). A task collected
    with an exception nobody read logs it once (ftrun.env.base.log_unread_exception), and so does the thread of
    a task dropped while it ran, when it raises."""

    def __init__(self, fn: Callable[..., Any], args: tuple, name: str) -> None:
        self.name = name
        self._outcome: list[BaseException] = []  # what fn raised; the thread holds this list, not the task,
        # so a task dropped after its thread ended is collected (and logs) at once
        self._retrieved = False
        self._unlogged = [True]  # popped by whoever logs an unread exception (here or _run), so it logs once
        self._thread = threading.Thread(target=_run, name=name, daemon=True,
                                        args=(fn, args, self._outcome, weakref.ref(self), self._unlogged))
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        self._retrieved = self._retrieved or ended
        return ended

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def kill(self) -> None:
        # Takes effect the next time the thread runs Python bytecode; a thread blocked in a socket
        # call sees it when the call returns (close its connection to make that happen at once).
        ident = self._thread.ident
        if ident is not None and self._thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(TaskKilled))

    @property
    def exception(self) -> BaseException | None:
        self._retrieved = True
        return self._outcome[0] if self._outcome else None

    def __del__(self) -> None:
        if self._outcome and not self._retrieved:
            _log_once(self._unlogged, self.name, self._outcome[0])


def _run(fn: Callable[..., Any], args: tuple, outcome: list[BaseException], task: "weakref.ref[RealTask]",
         unlogged: list[bool]) -> None:
    try:
        fn(*args)
    except BaseException as e:  # recorded for the joiner; a thread has nowhere to raise to
        outcome.append(e)
        if task() is None:  # dropped while it ran (fire and forget): nobody can read it now
            _log_once(unlogged, threading.current_thread().name, e)


def _log_once(unlogged: list[bool], name: str, error: BaseException) -> None:
    try:
        unlogged.pop()  # atomic: of the task's finalizer and its thread, only the first gets here
    except IndexError:
        return
    log_unread_exception(name, error)


class RealQueue:
    def __init__(self) -> None:
        self._q: _queue.SimpleQueue = _queue.SimpleQueue()

    def put(self, item: Any) -> None:
        self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        try:
            return self._q.get(timeout=timeout)
        except _queue.Empty:
            raise EnvTimeout(f"queue.get timed out after {timeout}s") from None

    def qsize(self) -> int:
        return self._q.qsize()


class RealLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, timeout: float | None = None) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "RealLock":
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class RealEnv:
    """Env backed by the operating system. Cheap to create; holds no resources itself."""

    def __init__(self, *, net_limits: ListenLimits = ListenLimits()) -> None:
        """net_limits: caps on every listener's connections (ftrun.env.admission)."""
        self.clock = RealClock()
        self.net = RealNetwork(net_limits)

    def spawn(self, fn: Callable[..., Any], *args: Any, name: str) -> RealTask:
        return RealTask(fn, args, name)

    def event(self) -> threading.Event:
        return threading.Event()

    def queue(self) -> RealQueue:
        return RealQueue()

    def lock(self) -> RealLock:
        return RealLock()

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)
