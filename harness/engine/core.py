"""The discrete-event core: greenlet tasks, a virtual clock, timers, waits, and CPU charging.

One scheduler drives every task of an emulated world from the greenlet that called `run`. Work waits
in three places: `_ready` (tasks to resume at the current virtual time, FIFO), `_events` (a heap of
(time, seq, fn, a, b): "call fn(a, b) at time"; never cancelled) and `_timers` (a heap of
(deadline, seq, task, token) for waits with a timeout). One sequence counter orders both heaps, so
the order of events depends only on the program and the seed. A task blocks by switching back to
the loop greenlet; whoever wakes it appends it to `_ready` with a value.

Waits: `wait(waiters, timeout, what)` registers (task, token) in a resource's list and pushes a timer.
A wake or the timer, whichever comes first, clears the task's token; the other finds a stale token and
does nothing. Timers are not removed when a wait ends early (a push of a far deadline is O(1) on
average); the timer heap is compacted once stale entries outnumber the live tasks, so it stays
O(tasks).

CPU charging (on by default): the real time of each greenlet slice (thread_time, or perf_counter) times
`cpu_scale` is charged to the task and to its host, which has `cores` slice lanes (a min-heap of the
times they are busy until). A task resumes no earlier than the end of its own previous slice and the
earliest free lane of its host, and while a slice runs `vnow()` moves with the real clock, so messages
sent late in a long slice leave late, and a task woken or spawned by a slice starts no earlier than
the end of that slice. The charge includes the engine work done inside the slice (message encoding, the link
model: about a microsecond per message), as a real host pays for its network stack. With charging off,
the event order and all results are a pure function of the program and the seed; with it on,
timings vary slightly from run to run (and grow if other processes compete for the CPU).

Python's cyclic GC is disabled (after a gc.freeze) while the loop runs, so no collection pause is ever
charged to a task; the loop itself collects the young generations between slices.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
from collections import deque
from typing import Any, Callable

import greenlet

from ftrun.env.base import TaskKilled, log_unread_exception

TIMEOUT = object()  # the value a wait returns when its timer fired first
FROZEN_ALL = object()  # Host.frozen: every task of the host is stopped
_INF = float("inf")
_GC_CHECK_EVERY = 4096  # loop iterations between looks at the GC counters
_GC_YOUNG_THRESHOLD = 1_000_000
_COMPACT_SLACK = 65536


class DeadlockError(RuntimeError):
    """The main task is blocked and nothing else can ever run: no runnable task, no pending event."""


class Host:
    """A host's CPU lanes and live tasks. The network keeps its own per-host state in `net`."""

    __slots__ = ("name", "core_free", "tasks", "net", "frozen")

    def __init__(self, name: str, cores: int) -> None:
        self.name = name
        self.frozen: Any = None  # None, FROZEN_ALL (a stopped host), or a set of frozen processes (see freeze)
        self.core_free = [0.0] * cores  # min-heap: virtual time each CPU lane is busy until
        self.tasks: dict[Task, None] = {}  # insertion-ordered set: deterministic kill order
        self.net: Any = None


class _Unread:
    """What a task raised, until someone reads it: logged when collected unread (as a RealTask logs it). Made only
    for a task that raised something other than TaskKilled, so the other tasks pay no finalizer."""

    __slots__ = ("name", "error")

    def __init__(self, name: str, error: BaseException) -> None:
        self.name, self.error = name, error

    def __del__(self) -> None:
        if self.error is not None:
            log_unread_exception(self.name, self.error)


class Task:
    """A greenlet running fn(*args) on one host; the Env's Task handle."""

    __slots__ = ("name", "host", "_sched", "_glet", "_fn", "_args", "_result", "_exception", "_done",
                 "_kill_pending", "_token", "_joiners", "_waiting_on", "_handoff", "_busy_until", "proc",
                 "cpu_s", "_unread", "__weakref__")

    def __init__(self, sched: "Scheduler", host: Host, fn: Callable[..., Any], args: tuple, name: str) -> None:
        self.name = name
        self.host = host
        self._sched = sched
        self._fn, self._args = fn, args
        self._result: Any = None
        self._exception: BaseException | None = None
        self._unread: _Unread | None = None  # what it raised, while nobody has read it
        self._done = False
        self._kill_pending = False
        self._token = 0  # non-zero while blocked in a wait
        self._joiners: list | None = None
        self._waiting_on: Any = None
        self._handoff: Any = None  # resource that handed this task something it must give back if killed
        self._busy_until = 0.0  # CPU charging: virtual end of this task's last slice
        self.proc: Any = self  # the emulated process: the root task (see Scheduler.spawn)
        self.cpu_s = 0.0  # on a root task: its process's modeled CPU seconds (Scheduler.charge_cpu, charged slices)
        self._glet = greenlet.greenlet(sched._task_main, sched._loop_glet)

    def join(self, timeout: float | None = None) -> bool:
        if not self._done:
            if self._joiners is None:
                self._joiners = []
            if self._sched.wait(self._joiners, timeout, self) is TIMEOUT:
                return False
        if self._unread is not None:
            self._read()
        return True

    def is_alive(self) -> bool:
        return not self._done

    def kill(self) -> None:
        self._sched.kill(self)

    @property
    def exception(self) -> BaseException | None:
        if self._unread is not None:
            self._read()
        return self._exception

    def _read(self) -> None:
        self._unread.error = None  # type: ignore[union-attr]
        self._unread = None

    @property
    def result(self) -> Any:
        return self._result

    def __repr__(self) -> str:
        state = "done" if self._done else ("blocked on %r" % (self._waiting_on,) if self._token else "runnable")
        return f"<task {self.name!r} on {self.host.name} {state}>"


class Scheduler:
    """Event loop + virtual clock. Not thread-safe: everything runs in one OS thread."""

    compact_slack = _COMPACT_SLACK  # stale timers tolerated beyond 4 per live task

    def __init__(self, *, cpu_charging: bool = True, cpu_scale: float = 1.0, cpu_clock: str = "thread",
                 trace: bool = False) -> None:
        if cpu_scale <= 0:
            raise ValueError(f"cpu_scale must be > 0, got {cpu_scale}")
        if cpu_clock not in ("perf", "thread"):
            raise ValueError(f"cpu_clock must be 'perf' or 'thread', got {cpu_clock!r}")
        self.now = 0.0
        self.current: Task | None = None
        self.charging = cpu_charging
        self.scale = cpu_scale
        self._timer_fn = time.perf_counter if cpu_clock == "perf" else time.thread_time
        self._slice_t0 = 0.0
        self._slice_woken: list[Task] = []  # tasks woken or spawned by the running slice (charging)
        self._ready: deque = deque()
        self._events: list[tuple] = []
        self._timers: list[tuple] = []
        self._seq = itertools.count()
        self._tokens = itertools.count(1)
        self._live: dict[Task, None] = {}
        self._parked: list[tuple[Task, Any]] = []  # (task, wake value) of frozen tasks, resumed on thaw
        self._loop_glet: greenlet.greenlet = greenlet.getcurrent()
        self.running = False
        self.trace: list | None = [] if trace else None
        self.num_resumes = 0
        self.num_events = 0
        self.num_spawned = 0

    # -- time ---------------------------------------------------------------------------------------
    def vnow(self) -> float:
        """Virtual now as seen by the running task: loop time plus its slice so far (if charging)."""
        if self.charging and self.current is not None:
            return self.now + (self._timer_fn() - self._slice_t0) * self.scale
        return self.now

    def call_at(self, when: float, fn: Callable[[Any, Any], None], a: Any = None, b: Any = None) -> None:
        """Schedule fn(a, b) in the loop at virtual time `when` (clamped to now). fn must not block."""
        heapq.heappush(self._events, (when if when > self.now else self.now, next(self._seq), fn, a, b))

    def charge_cpu(self, seconds: float) -> None:
        """Count `seconds` of modeled CPU to the running task's process (what `cpu` reads; no wait)."""
        if seconds < 0:
            raise ValueError(f"charge_cpu needs seconds >= 0, got {seconds}")
        self.current_task().proc.cpu_s += seconds

    def cpu(self) -> float:
        """The running task's process's modeled CPU seconds so far: `charge_cpu`'s, and with CPU charging its tasks'
        slices (the current one so far included)."""
        task = self.current_task()
        return task.proc.cpu_s + (self.vnow() - self.now if self.charging else 0.0)

    # -- tasks --------------------------------------------------------------------------------------
    def spawn(self, host: Host, fn: Callable[..., Any], args: tuple, name: str) -> Task:
        task = Task(self, host, fn, args, name)
        parent = self.current
        if parent is not None and parent.host is host:  # a task spawned on its own host: the same process
            task.proc = parent.proc
        if self.charging and self.current is not None:
            self._slice_woken.append(task)  # spawned mid-slice: starts after its parent's slice
        host.tasks[task] = None
        self._live[task] = None
        self.num_spawned += 1
        self._ready.append((task, task))  # the first switch passes the task to _task_main
        return task

    def _task_main(self, task: Task) -> None:
        """Body of every task greenlet; returns to the loop greenlet (its parent) when done."""
        try:
            if task._kill_pending:
                task._kill_pending = False
                raise TaskKilled(f"task {task.name} killed before it started")
            task._result = task._fn(*task._args)
        except BaseException as e:  # recorded for joiners, like a thread; never propagates to the loop
            task._exception = e
            if not isinstance(e, TaskKilled):
                task._unread = _Unread(task.name, e)
        finally:
            task._done = True
            task._fn = task._args = None
            task.host.tasks.pop(task, None)
            self._live.pop(task, None)
            if task._joiners:
                for waiter, token in task._joiners:
                    self.wake(waiter, token, True)
                task._joiners = None
            del task  # this frame lives on in the traceback of what the task raised: it must not hold the task, or
            # the two would form a cycle, collected (and logged if unread) only by a full GC, not when dropped

    def current_task(self) -> Task:
        task = self.current
        if task is None:
            raise RuntimeError("blocking Env call outside a task: run it inside env.run(...)")
        return task

    def wait(self, waiters: list | None, timeout: float | None, what: Any = None,
             deadline: float | None = None) -> Any:
        """Block the current task until woken (returns the wake value) or `timeout` passes (TIMEOUT).

        `deadline`: the virtual time the timeout ends at, when the caller has it already (it then
        saves a read of the thread clock, the engine's most frequent syscall at 98K ranks)."""
        task = self.current
        if task is None or not self.running:
            if task is None:
                raise RuntimeError("blocking Env call outside a task: run it inside env.run(...)")
            raise TaskKilled("the emulator is not running (world torn down)")
        token = next(self._tokens)
        task._token = token
        task._waiting_on = what
        entry = (task, token)
        if waiters is not None:
            waiters.append(entry)
        if timeout is not None and timeout != _INF:  # an infinite timeout is no timeout
            if deadline is None:
                deadline = self.vnow() + timeout if timeout > 0 else self.now
            heapq.heappush(self._timers, (deadline, next(self._seq), task, token))
        try:
            value = self._loop_glet.switch()
        except BaseException:
            self._forget(waiters, entry)
            raise
        task._handoff = None
        if value is TIMEOUT:
            self._forget(waiters, entry)
        return value

    @staticmethod
    def _forget(waiters: list | None, entry: tuple) -> None:
        if waiters:
            try:
                waiters.remove(entry)
            except ValueError:
                pass  # a waker already took it

    def yield_now(self) -> None:
        """Let every other runnable task run once (sleep(0))."""
        task = self.current_task()
        self._ready.append((task, None))
        self._loop_glet.switch()

    def wake(self, task: Task, token: int, value: Any = None, handoff: Any = None) -> bool:
        """Make a task blocked in wait() with this token runnable; False if that wait is already over.

        handoff: a resource that gave the task something (a queue item, a lock); if the task is killed
        before it runs, `handoff.undo(value)` gives it back.
        """
        if task._token != token:
            return False
        task._token = 0
        task._handoff = handoff
        if self.charging and self.current is not None:
            self._slice_woken.append(task)  # woken mid-slice: starts after the waker's slice
        self._ready.append((task, value))
        return True

    def wake_first(self, waiters: list, value: Any = None, handoff: Any = None) -> bool:
        """Wake the oldest live waiter in the list; False if there is none."""
        while waiters:
            task, token = waiters.pop(0)
            if self.wake(task, token, value, handoff):
                return True
        return False

    def kill(self, task: Task) -> None:
        """Raise TaskKilled in the task: at once if it is the caller, else when it next runs."""
        if task._done:
            return
        if task is self.current:
            raise TaskKilled(f"task {task.name} killed")
        task._kill_pending = True
        if task._token:
            task._token = 0
            self._ready.append((task, None))
        elif any(t is task for t, _ in self._parked):  # SIGKILL ends a stopped process too
            self._parked = [(t, v) for t, v in self._parked if t is not task]
            self._ready.append((task, None))

    # -- freezing (a hung process or host: SIGSTOP / SIGCONT) -------------------------------------------
    def freeze(self, host: Host, proc: Any = None) -> None:
        """Stop the tasks of process `proc` on `host` (every task of the host if None): they are not
        resumed, whatever wakes them (a frame, a timer), until `thaw`; then each resumes with what woke
        it, in order, as a SIGCONTed process sees its timers expired. The network still delivers to the
        host (the kernel buffers), and accepts its connections."""
        if proc is None:
            host.frozen = FROZEN_ALL
        elif host.frozen is not FROZEN_ALL:
            host.frozen = (host.frozen or set()) | {proc}

    def thaw(self, host: Host, proc: Any = None) -> None:
        """Undo `freeze(host, proc)` (proc None: the whole host, and every process frozen on it)."""
        if proc is None or host.frozen is FROZEN_ALL:
            host.frozen = None
        elif host.frozen is not None:
            host.frozen = (host.frozen - {proc}) or None
        keep = []
        for task, value in self._parked:
            f = task.host.frozen
            if f is not None and (f is FROZEN_ALL or task.proc in f):
                keep.append((task, value))
            else:
                self._ready.append((task, value))
        self._parked = keep

    def _ready_later(self, task: Task, value: Any) -> None:
        self._ready.append((task, value))

    # -- the loop -----------------------------------------------------------------------------------
    def run_until_done(self, main: Task) -> None:
        """Drive the loop until `main` has finished. Raises DeadlockError if nothing can run."""
        loop_glet = greenlet.getcurrent()
        if loop_glet is not self._loop_glet:
            self._loop_glet = loop_glet
            for task in self._live:
                task._glet.parent = loop_glet
        gc_was_enabled = gc.isenabled()
        gc.disable()
        gc.freeze()
        self.running = True
        try:
            self._loop(main)
        finally:
            self.running = False
            self.current = None
            gc.unfreeze()
            if gc_was_enabled:
                gc.enable()

    def _loop(self, main: Task) -> None:
        ready, events, timers, heappop = self._ready, self._events, self._timers, heapq.heappop
        clock, charging, trace, scale = self._timer_fn, self.charging, self.trace, self.scale
        countdown = _GC_CHECK_EVERY
        while not main._done:
            countdown -= 1
            if countdown == 0:
                countdown = _GC_CHECK_EVERY
                self._housekeeping()
            if not ready:
                if timers and (not events or timers[0][0] < events[0][0]
                               or (timers[0][0] == events[0][0] and timers[0][1] < events[0][1])):
                    when, _, task, token = heappop(timers)
                    if task._token == token:  # the wait is still on: it timed out
                        self.now = when
                        task._token = 0
                        ready.append((task, TIMEOUT))
                    continue
                if not events:
                    raise DeadlockError(self._deadlock_report(main))
                self.now, _, fn, a, b = heappop(events)
                self.num_events += 1
                fn(a, b)
                continue
            task, value = ready.popleft()
            if task._done:
                continue
            frozen = task.host.frozen
            if frozen is not None and not task._kill_pending and (frozen is FROZEN_ALL or task.proc in frozen):
                self._parked.append((task, value))  # stopped (SIGSTOP): resumes with this value on thaw
                continue
            if charging:  # a task runs once its previous slice is paid for and a CPU lane is free
                lanes = task.host.core_free
                start = lanes[0] if lanes[0] > task._busy_until else task._busy_until
                if start > self.now:
                    self.call_at(start, self._ready_later, task, value)
                    continue
            if trace is not None:
                trace.append((self.now, task.name))
            self.num_resumes += 1
            self.current = task
            if charging:
                t0 = self._slice_t0 = clock()
            if task._kill_pending and task._glet:
                self._throw_kill(task, value)
            else:
                task._glet.switch(value)
            if charging:
                end = task._busy_until = self.now + (clock() - t0) * scale
                task.proc.cpu_s += end - self.now
                heapq.heapreplace(lanes, end)
                if self._slice_woken:
                    self._after_slice(end)
            self.current = None

    def _after_slice(self, end: float) -> None:
        """Tasks the slice woke or spawned start no earlier than its end (a cheap, slightly late
        stand-in for reading the clock at each wake)."""
        for woken in self._slice_woken:
            if end > woken._busy_until:
                woken._busy_until = end
        self._slice_woken.clear()

    @staticmethod
    def _throw_kill(task: Task, value: Any) -> None:
        task._kill_pending = False
        if task._handoff is not None:  # it was handed a queue item or a lock: give it back
            handoff, task._handoff = task._handoff, None
            handoff.undo(value)
        task._glet.throw(TaskKilled(f"task {task.name} killed"))

    def _housekeeping(self) -> None:
        """Between slices: collect young garbage (never charged to a task) and compact the heap.

        Survivors of a young collection are frozen (moved out of the collector's view) rather than
        promoted: at 98K ranks the older generations hold millions of live objects, and scanning them
        took 14% of the run. Short-lived cycles (exceptions and their frames) die young and are still
        collected; a cycle that dies after surviving once (e.g. the tasks of a killed replica) waits for
        the full collection after the run (run_until_done unfreezes)."""
        if gc.get_count()[0] > _GC_YOUNG_THRESHOLD:
            gc.collect(0)
            gc.freeze()
        if len(self._timers) > 4 * len(self._live) + self.compact_slack:  # most are stale: drop them
            self._timers[:] = [e for e in self._timers if e[2]._token == e[3]]
            heapq.heapify(self._timers)

    def _deadlock_report(self, main: Task) -> str:
        blocked = [t for t in self._live if t._token]
        lines = [f"deadlock at virtual t={self.now:.6f}s: main task {main.name!r} is blocked and no task "
                 f"is runnable and no event is pending; {len(blocked)} blocked task(s):"]
        lines += [f"  {t!r}" for t in blocked[:50]]
        if len(blocked) > 50:
            lines.append(f"  ... and {len(blocked) - 50} more")
        return "\n".join(lines)

    @property
    def live_tasks(self) -> list[Task]:
        return list(self._live)
