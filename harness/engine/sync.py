"""Event, Queue and Lock for emulated tasks (the Env's `event()`, `queue()`, `lock()`).

They are world-wide objects: tasks on any host may share them (the runtime only shares them inside a
process, but nothing here depends on that). Queue items and lock ownership are handed directly to the
woken waiter (FIFO, no barging); if that waiter is killed before it runs, the scheduler gives the
item or the lock back through `undo`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ftrun.env.base import EnvTimeout
from harness.engine.core import TIMEOUT, Scheduler


class EmuEvent:
    __slots__ = ("_sched", "_flag", "_waiters")

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._flag = False
        self._waiters: list = []

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        waiters, self._waiters = self._waiters, []
        for task, token in waiters:
            self._sched.wake(task, token, True)

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        if timeout is not None and timeout <= 0:
            return False
        return self._sched.wait(self._waiters, timeout, self) is not TIMEOUT

    def __repr__(self) -> str:
        return f"<event {'set' if self._flag else 'clear'}>"


class EmuQueue:
    __slots__ = ("_sched", "_items", "_waiters")

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._items: deque = deque()
        self._waiters: list = []

    def put(self, item: Any) -> None:
        if not (self._waiters and self._sched.wake_first(self._waiters, item, self)):
            self._items.append(item)

    def get(self, timeout: float | None = None) -> Any:
        if self._items:
            return self._items.popleft()
        if timeout is not None and timeout <= 0:
            raise EnvTimeout(f"queue.get timed out after {timeout}s")
        item = self._sched.wait(self._waiters, timeout, self)
        if item is TIMEOUT:
            raise EnvTimeout(f"queue.get timed out after {timeout}s")
        return item

    def qsize(self) -> int:
        return len(self._items)

    def undo(self, item: Any) -> None:
        """A getter that was handed `item` died first: give it to the next getter or keep it, in front."""
        if not (self._waiters and self._sched.wake_first(self._waiters, item, self)):
            self._items.appendleft(item)

    def __repr__(self) -> str:
        return f"<queue of {len(self._items)} items>"


class EmuLock:
    __slots__ = ("_sched", "_locked", "_waiters")

    def __init__(self, sched: Scheduler) -> None:
        self._sched = sched
        self._locked = False
        self._waiters: list = []

    def acquire(self, timeout: float | None = None) -> bool:
        if not self._locked:
            self._locked = True
            return True
        if timeout is not None and timeout <= 0:
            return False
        # release() hands the lock over while still locked, so being woken means owning it
        return self._sched.wait(self._waiters, timeout, self) is not TIMEOUT

    def release(self) -> None:
        if not self._locked:
            raise RuntimeError("release of an unlocked lock")
        if not (self._waiters and self._sched.wake_first(self._waiters, True, self)):
            self._locked = False

    def undo(self, _value: Any) -> None:
        self.release()  # the new owner died before it ran: pass the lock on

    def locked(self) -> bool:
        return self._locked

    def __enter__(self) -> "EmuLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<lock {'locked' if self._locked else 'unlocked'}, {len(self._waiters)} waiting>"
