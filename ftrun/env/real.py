"""The real Env: OS threads, `time.monotonic`, and TCP/Unix sockets (ftrun.env.real_net).

This module and real_net.py are the only ones under ftrun/ allowed to import time, threading or
socket (tests/unit/test_import_lint.py).
"""

from __future__ import annotations

import ctypes
import os
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
    """fn(*args) on a daemon thread of this process's pool (`_Worker`); remembers what it raised.

    What it raised is read through `exception` (or a `join` that sees the task ended). A task collected
    with an exception nobody read logs it once (ftrun.env.base.log_unread_exception), and so does the thread of
    a task dropped while it ran, when it raises."""

    def __init__(self, fn: Callable[..., Any], args: tuple, name: str) -> None:
        self.name = name
        self._outcome: list[BaseException] = []  # what fn raised; the thread holds this list, not the task,
        # so a task dropped after it ended is collected (and logs) at once
        self._retrieved = False
        self._unlogged = [True]  # popped by whoever logs an unread exception (here or _Job.run), so it logs once
        self._job = _Job(fn, args, name, self._outcome, weakref.ref(self), self._unlogged)
        _Worker.start(self._job)

    def join(self, timeout: float | None = None) -> bool:
        ended = self._job.done.wait(timeout)
        self._retrieved = self._retrieved or ended
        return ended

    def is_alive(self) -> bool:
        return not self._job.done.is_set()

    def kill(self) -> None:
        # Takes effect the next time the thread runs Python bytecode; a thread blocked in a socket
        # call sees it when the call returns (close its connection to make that happen at once).
        self._job.kill()

    @property
    def exception(self) -> BaseException | None:
        self._retrieved = True
        return self._outcome[0] if self._outcome else None

    def __del__(self) -> None:
        if self._outcome and not self._retrieved:
            _log_once(self._unlogged, self.name, self._outcome[0])


IDLE_THREAD_NAME = "ftrun-idle"  # a pool thread between tasks (`threading.enumerate` shows it while it waits)


class _Job:
    """One task's run on a pool thread. `done` is set once fn has returned or raised."""

    def __init__(self, fn: Callable[..., Any], args: tuple, name: str, outcome: list[BaseException],
                 task: "weakref.ref[RealTask]", unlogged: list[bool]) -> None:
        self.fn, self.args, self.name, self.outcome, self.task, self.unlogged = fn, args, name, outcome, task, unlogged
        self.done = threading.Event()
        self.worker: _Worker | None = None  # the thread running it, while it runs (under _Worker.lock)

    def run(self, worker: "_Worker") -> None:
        threading.current_thread().name = self.name
        try:
            self.fn(*self.args)
        except BaseException as e:  # recorded for the joiner; a thread has nowhere to raise to
            self.outcome.append(e)
            if self.task() is None:  # dropped while it ran (fire and forget): nobody can read it now
                _log_once(self.unlogged, self.name, e)
        finally:
            self.fn = self.args = None  # type: ignore[assignment]  # nothing of the task outlives it
            try:
                with worker.lock:
                    self.worker = None  # from here on kill() reaches no thread
                threading.current_thread().name = IDLE_THREAD_NAME
            finally:
                self.done.set()

    def kill(self) -> None:
        worker = self.worker
        if worker is None:
            return
        with worker.lock:
            if self.worker is worker and worker.ident is not None:  # still running: its thread is not reused
                worker.retire = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker.ident), ctypes.py_object(TaskKilled))


class _Worker:
    """A pooled daemon thread: it runs tasks one after another and waits idle between them, so a task costs a
    wake-up, not a thread's start and end (~135 us on the 2-core box: a third of a small FTAR all-reduce, which
    starts a sender task each time). An idle thread ends after IDLE_S; at most MAX_IDLE wait. A thread whose task
    was killed is not reused (the kill may land after the task ended). After fork the child's pool is empty (the
    parent's threads are not in it)."""

    IDLE_S = 30.0
    MAX_IDLE = 16
    _pool_lock = threading.Lock()
    _idle: list["_Worker"] = []

    def __init__(self, job: _Job) -> None:
        self.lock = threading.Lock()
        self.retire = False
        self.ident: int | None = None
        self._job: _Job | None = job
        self._wake = threading.Semaphore(0)
        job.worker = self
        thread = threading.Thread(target=self._serve, name=job.name, daemon=True)
        thread.start()
        self.ident = thread.ident

    @classmethod
    def start(cls, job: _Job) -> None:
        with cls._pool_lock:
            worker = cls._idle.pop() if cls._idle else None
        if worker is None:
            cls(job)
            return
        with worker.lock:
            job.worker, worker._job = worker, job
        worker._wake.release()

    def _serve(self) -> None:
        job = None
        try:
            while True:
                job, self._job = self._job, None
                if job is None:
                    return
                job.run(self)
                job = None
                with self.lock:
                    if self.retire:
                        return
                with _Worker._pool_lock:
                    if len(_Worker._idle) >= _Worker.MAX_IDLE:
                        return
                    _Worker._idle.append(self)
                if not self._wake.acquire(timeout=_Worker.IDLE_S):
                    with _Worker._pool_lock:
                        if self in _Worker._idle:  # nobody took it meanwhile: end
                            _Worker._idle.remove(self)
                            return
                    self._wake.acquire()  # taken just now: its task is on the way
        except TaskKilled as e:  # a kill that landed outside its task's fn (before it ran, or as it ended):
            for j in (job, self._job):  # the task ends killed; this thread ends (it is not reused)
                if j is not None and not j.done.is_set():
                    j.outcome.append(e)
                    j.worker = None
                    j.done.set()

    @classmethod
    def _after_fork(cls) -> None:
        cls._pool_lock = threading.Lock()
        cls._idle = []


os.register_at_fork(after_in_child=_Worker._after_fork)


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
