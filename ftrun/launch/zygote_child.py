"""The child side of the zygote (ftrun.launch.zygote): a forked rank, a spare, and a prepared spare.

A spare waits for its request, then becomes that rank and runs the script as `__main__`. A prepared
spare (`zygote --prepare`) runs the script before any request, as the job's ranks run it (the argv, cwd
and environment of the job's first request, less the variables that are a rank's identity,
`worker_env.IDENTITY_VARS`), until the script calls `claim()` (`ftrun.train.init_from_env` does, first
thing). Everything the script does before that (arguments, data, an unsharded model) is then off a
restart's critical path. `claim()` blocks until the zygote hands the spare a request, applies it (the
identity variables, stdio, network namespace; FTRUN_FORKED_AT: the claim's time) and returns. The zygote
hands a prepared spare only a request whose argv, cwd and non-identity environment equal what it was
prepared with (`template_of`), so what ran before the claim is what the rank would have run itself.
A script must therefore read nothing of its identity before `claim()`.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import runpy
import signal
import sys
import traceback
import types
from typing import Any, Callable

from ftrun.env.real import RealClock
from ftrun.launch.worker_env import IDENTITY_VARS

REQUEST_FD = 0
_pending_claim: Callable[[], None] | None = None  # set in a prepared spare until the script claims
_claimed = False  # this process is a prepared spare that was claimed


def template_of(req: dict) -> dict[str, Any]:
    """What a prepared spare runs before its claim: the request's argv, cwd and environment less the
    identity variables. A request is handed to a prepared spare only when its template is the spare's. Pure."""
    return {"argv": list(req["argv"]), "cwd": req["cwd"],
            "env": {k: v for k, v in req["env"].items() if k not in IDENTITY_VARS}}


def claim() -> bool:
    """In a prepared spare: wait until the zygote hands this process a rank, become it (it exits, code 0,
    when the zygote lets it go unclaimed). Returns whether this process is a claimed prepared spare (a
    second call returns at once). Call it before reading anything rank-specific (identity variables, stdio)."""
    global _pending_claim, _claimed
    become, _pending_claim = _pending_claim, None
    if become is not None:
        become()
        _claimed = True
    return _claimed


def _run_main(target: Any) -> None:
    """Run the preloaded code as the __main__ module, as `python [-m] TARGET` would."""
    main = types.ModuleType("__main__")
    main.__file__ = target.path
    main.__builtins__ = __builtins__
    if target.module:
        main.__package__ = target.name.rpartition(".")[0]
        main.__spec__ = importlib.util.find_spec(target.name)
        sys.argv[0] = target.path
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target.path))
    sys.modules["__main__"] = main
    exec(target.code, main.__dict__)


def _leave_zygote(started_fd: int, reply_fd: int | None, others: list[int]) -> None:
    """In a fresh spare: lead a session, tell the zygote (started_fd), let go of the zygote's pipes."""
    os.setsid()
    os.close(started_fd)
    for fd in ([] if reply_fd is None else [reply_fd]) + others:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, REQUEST_FD)  # the zygote's request pipe: not held by a spare
    os.close(null)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def _read_request(request_fd: int) -> dict | None:
    """The one request line the zygote writes to a spare's pipe; None at EOF (let go unused)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(request_fd, 65536)
        if not chunk:
            return None
        data += chunk
    os.close(request_fd)
    return json.loads(data)


def _spare(target: Any, reply_fd: int, started_fd: int, request_fd: int, others: list[int],
           warm_fd: int = -1) -> None:
    """In a spare: wait for a request and become its rank process (_child); exit at EOF (the zygote
    ended or let it go). Never returns."""
    try:
        _leave_zygote(started_fd, reply_fd, others)
        req = _read_request(request_fd)
        if req is None:
            os._exit(0)
    except BaseException:
        os._exit(1)
    _child(req, target, None, None, [], warm_fd)


def _prepared_spare(template: dict, target: Any, reply_fd: int, started_fd: int, request_fd: int,
                    others: list[int], warm_fd: int = -1) -> None:
    """In a prepared spare: run the script with `template` (argv, cwd, environment without identity)
    until it calls claim(), which takes the request from `request_fd`. Never returns."""
    global _pending_claim
    try:
        _leave_zygote(started_fd, reply_fd, others)
        os.chdir(template["cwd"])
        os.environ.clear()
        os.environ.update(template["env"])
        gc.unfreeze()
        sys.argv = list(template["argv"])
    except BaseException:
        os._exit(1)

    def become() -> None:
        sys.stdout.flush()  # what the script printed before its claim, to where it ran until now
        sys.stderr.flush()
        req = _read_request(request_fd)
        if req is None:  # let go unclaimed: the zygote ended or retired it
            os._exit(0)
        _apply(req, RealClock().now(), warm_fd)

    _pending_claim = become
    _run_script(target)


def _apply(req: dict, forked_at: float, warm_fd: int) -> None:
    """Become the rank process of `req`: network namespace, stdio, cwd, environment, argv."""
    if req.get("netns"):  # a host of `ftrun launch --netns-hosts`: the rank lives in its network
        from ftrun.launch.netns import netns_path, setns

        fd = os.open(netns_path(req["netns"]), os.O_RDONLY)
        setns(fd)
        os.close(fd)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT),
                            (2, req["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)):
        new = os.open(path, flags, 0o644)
        os.dup2(new, fd)
        os.close(new)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ["FTRUN_FORKED_AT"] = repr(forked_at)
    if warm_fd >= 0:  # where the training API tells the zygote the job's shapes (ftrun.train.warm)
        os.environ["FTRUN_ZYGOTE_WARM_FD"] = str(warm_fd)
    if "numpy" in sys.modules:  # spawned processes seed numpy's global RNG from the OS: so do forked ones
        sys.modules["numpy"].random.seed()
    sys.argv = list(req["argv"])


def _child(req: dict, target: Any, reply_fd: int | None, started_fd: int | None, others: list[int],
           warm_fd: int = -1) -> None:
    """In the forked child (or a spare given its request: no fds to close, already leading its session):
    become the rank process and run the script as __main__; never returns."""
    try:
        forked_at = RealClock().now()  # the clock a rank's events use
        if started_fd is not None:
            os.setsid()  # its own process group: the supervisor kills a rank with killpg, as for spawned ones
            os.close(started_fd)  # tells the zygote (which only then hands out the pid)
        for fd in others:
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        if reply_fd is not None:
            os.close(reply_fd)
        _apply(req, forked_at, warm_fd)
        gc.unfreeze()
    except BaseException as e:
        _print_script_traceback(e)
        os._exit(1)
    _run_script(target)


def _run_script(target: Any) -> None:
    """Run the script as __main__ and exit with its code, as `python SCRIPT` would. Never returns."""
    code = 1
    try:
        if target.code is None:  # no source read at preload: run what is there now
            if target.module:
                runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            _run_main(target)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        _print_script_traceback(e)
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _print_script_traceback(e: BaseException) -> None:
    """Print the traceback as `python SCRIPT` would: without the zygote's own frames on top."""
    tb = e.__traceback__
    own = (__file__, __file__.replace("zygote_child", "zygote"))
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in own:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)
