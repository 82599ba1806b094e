"""RealTask: a thread nobody joins does not lose what it raised (logged once when the task is collected)."""

from __future__ import annotations

import gc
import logging
import time

import pytest

from ftrun.env.real import RealEnv

pytestmark = pytest.mark.timeout(30)


def _fail() -> None:
    raise ValueError("nobody is waiting for this")


def _ended(task) -> None:
    """Wait until the task's thread ended, without join (which counts as reading its outcome)."""
    deadline = time.monotonic() + 10.0
    while task.is_alive():
        assert time.monotonic() < deadline, f"task {task.name} did not end"
        time.sleep(0.01)


def _unread_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ftrun.env" and "nobody read it" in r.getMessage()]


def test_a_dropped_task_that_raised_logs_it_once_with_its_traceback(caplog):
    caplog.set_level(logging.ERROR, logger="ftrun.env")
    task = RealEnv().spawn(_fail, name="dropped")
    _ended(task)
    del task
    gc.collect()
    records = _unread_records(caplog)
    assert len(records) == 1 and "task dropped raised ValueError" in records[0].getMessage()
    assert records[0].exc_info[1].args == ("nobody is waiting for this",)
    assert "in _fail" in caplog.text  # the traceback is in the record


@pytest.mark.parametrize("read", ["exception", "join"])
def test_a_task_whose_exception_was_read_logs_nothing(caplog, read):
    caplog.set_level(logging.ERROR, logger="ftrun.env")
    task = RealEnv().spawn(_fail, name="read")
    if read == "exception":
        _ended(task)
        assert isinstance(task.exception, ValueError)
    else:
        assert task.join(timeout=10.0)
    del task
    gc.collect()
    assert _unread_records(caplog) == []


def test_a_killed_task_or_one_that_returned_logs_nothing(caplog):
    caplog.set_level(logging.ERROR, logger="ftrun.env")
    env = RealEnv()
    killed = env.spawn(lambda: [time.sleep(0.01) for _ in range(1000)], name="killed")
    killed.kill()
    returned = env.spawn(lambda: None, name="returned")
    _ended(killed)
    _ended(returned)
    del killed, returned
    gc.collect()
    assert _unread_records(caplog) == []


def test_a_task_dropped_while_it_ran_logs_what_it_raised_later_once(caplog):
    """Fire and forget: the handle is gone before the thread raises, so the thread itself logs it."""
    import threading
    caplog.set_level(logging.ERROR, logger="ftrun.env")
    go, done = threading.Event(), threading.Event()

    def fail_later() -> None:
        go.wait(10.0)
        try:
            _fail()
        finally:
            done.set()

    task = RealEnv().spawn(fail_later, name="forgotten")
    del task
    gc.collect()
    go.set()
    assert done.wait(10.0)
    deadline = time.monotonic() + 10.0
    while not _unread_records(caplog):
        assert time.monotonic() < deadline, "the dropped task's exception was not logged"
        time.sleep(0.01)
    time.sleep(0.05)
    records = _unread_records(caplog)
    assert len(records) == 1 and "task forgotten raised ValueError" in records[0].getMessage()


def test_tasks_reuse_idle_threads_and_run_concurrently():
    """A task's thread goes back to the pool when the task ends: the next task runs on it (no thread start);
    tasks alive together each have a thread of their own."""
    import threading
    env = RealEnv()
    threads = []  # Thread objects: an ended thread's ident may be given to a new one
    for _ in range(20):
        t = env.spawn(lambda: threads.append(threading.current_thread()), name="short")
        assert t.join(10.0) and not t.is_alive()
    assert len(set(map(id, threads))) <= 2, threads  # one thread, or two where a returning one was not back yet
    barrier = threading.Barrier(5)
    tasks = [env.spawn(barrier.wait, 10.0, name=f"together-{i}") for i in range(5)]
    assert all(t.join(10.0) for t in tasks) and all(t.exception is None for t in tasks)


def test_a_killed_task_ends_and_its_thread_is_not_reused():
    import threading
    env = RealEnv()
    where = []

    def spin() -> None:
        where.append(threading.current_thread())  # the Thread object: an ended thread's ident may be reused
        while True:
            time.sleep(0.001)

    killed = env.spawn(spin, name="spin")
    while not where:
        time.sleep(0.001)
    killed.kill()
    assert killed.join(10.0)
    assert type(killed.exception).__name__ == "TaskKilled"
    seen = []
    for _ in range(5):
        t = env.spawn(lambda: seen.append(threading.current_thread()), name="after")
        assert t.join(10.0)
    assert all(x is not where[0] for x in seen)
    where[0].join(10.0)
    assert not where[0].is_alive()  # it ended instead of waiting in the pool


def test_a_forked_child_starts_tasks_on_threads_of_its_own():
    """The parent's idle pool threads do not exist in a forked child: its tasks start threads."""
    import os
    env = RealEnv()
    assert env.spawn(lambda: None, name="warm").join(10.0)  # leaves an idle pool thread in the parent
    pid = os.fork()
    if pid == 0:
        ok = RealEnv().spawn(lambda: None, name="child").join(5.0)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
