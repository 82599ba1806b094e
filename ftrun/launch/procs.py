"""How `ftrun launch` starts rank processes: spawn a fresh interpreter, or fork one from the zygote.

Both launchers take the same request (argv after `python`, environment, working directory, stdout and
stderr file paths) and return a handle with Popen's `pid`, `poll()`, `wait(timeout)` and `kill()`.
Every rank process leads its own session, so `kill()` SIGKILLs the rank and anything it started.

`ForkServer` talks to `python -m ftrun.launch.zygote` over its stdin/stdout (see zygote.py for the
protocol): one reader thread files pids and exit codes; requests are serialized. If the zygote
reports that forking is unsafe, or dies, `ForkServer.start` falls back to spawning (and says why in
`fallback_reason`); ranks it forked before keep running.

Threading: `start` may be called from any thread; handles are polled from any thread.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from typing import Protocol

from ftrun.env.base import Env, EnvTimeout

log = logging.getLogger("ftrun.launch")
ZYGOTE_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class Handle(Protocol):
    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int | None: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, stdout: str, stderr: str,
              netns: str | None = None) -> Handle: ...
    def close(self) -> None: ...


def _killpg(pid: int) -> bool:
    """SIGKILL the process group `pid` leads; False if there is none (the process is gone)."""
    try:
        os.killpg(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class _Spawned:
    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.pid = proc, proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            _killpg(self.pid)


class SpawnLauncher:
    """`python ARGV` as a new process per rank."""

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, stdout: str, stderr: str,
              netns: str | None = None) -> Handle:
        """netns: run it in that network namespace (`ip netns exec` execs it: the pid is the program's)."""
        prefix = ["ip", "netns", "exec", netns] if netns else []
        with open(stdout, "ab") as out, open(stderr, "ab") as err:
            proc = subprocess.Popen([*prefix, sys.executable, *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True)
        return _Spawned(proc)

    def close(self) -> None:
        pass


class _Forked:
    def __init__(self, server: "ForkServer", pid: int) -> None:
        self._server, self.pid = server, pid

    def poll(self) -> int | None:
        return self._server.exit_codes.get(self.pid)

    def wait(self, timeout: float | None = None) -> int | None:
        clock = self._server.env.clock
        deadline = None if timeout is None else clock.now() + timeout
        while (code := self.poll()) is None and (deadline is None or clock.now() < deadline):
            if not self._server.alive():
                return -signal.SIGKILL  # the zygote died, and took its children with it
            clock.sleep(0.005)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            if not _killpg(self.pid):  # cannot happen (the zygote hands out a pid after setsid); belt and braces
                try:
                    os.kill(self.pid, signal.SIGKILL)  # not reaped yet (no exit seen), so the pid is still its
                except (ProcessLookupError, PermissionError):
                    pass


class ForkServer:
    """Client of a zygote preloaded for one script; falls back to spawning when it cannot fork."""

    def __init__(self, *, env: Env, script: str, module: bool, cwd: str, log_path: str,
                 run_dir: str | None = None, start_timeout_s: float = 120.0, sharded: bool = False,
                 spares: int = 0, prepared_spares: bool = False) -> None:
        """sharded: the job's replicas have more than one rank (the zygote warms FSDP2 too). spares:
        children the zygote keeps forked ahead of requests (a replica's ranks: its restart forks nothing).
        prepared_spares: the spares run the script up to its claim (ftrun.launch.zygote_child) first."""
        self.env, self.cwd = env, cwd
        self._target = ["-m", script] if module else [script]
        self.exit_codes: dict[int, int] = {}
        self.fallback_reason: str | None = None
        self.preload_s: float | None = None
        self._spawn = SpawnLauncher()
        self._replies = env.queue()
        self._lock = env.lock()
        self._next_id = 0
        cmd = [sys.executable, "-m", "ftrun.launch.zygote"] + (["--run-dir", run_dir] if run_dir else [])
        cmd += (["--sharded"] if sharded else []) + (["--spares", str(spares)] if spares else [])
        cmd += ["--prepare"] if prepared_spares and spares else []
        cmd += (["-m"] if module else []) + [script]
        with open(log_path, "ab") as err:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=cwd,
                                          env={**os.environ, **ZYGOTE_ENV}, start_new_session=True)
        env.spawn(self._read, name="zygote-reader")
        try:
            hello = self._replies.get(timeout=start_timeout_s)
        except EnvTimeout:
            hello = {"ready": False, "reason": f"the zygote did not start in {start_timeout_s:.0f}s"}
        self.preload_s = hello.get("seconds")
        if not hello.get("ready"):
            self._give_up(hello.get("reason", "the zygote exited while loading"))
            self._shutdown()  # it has no children yet

    def _read(self) -> None:
        for line in self._proc.stdout:  # type: ignore[union-attr]
            msg = json.loads(line)
            if "exit" in msg:
                self.exit_codes[msg["exit"]] = msg["code"]
            else:
                if "pid" in msg:  # a new child may reuse an old one's pid: forget that one's exit code
                    self.exit_codes.pop(msg["pid"], None)  # (here: the zygote sends a pid before its exit)
                self._replies.put(msg)
        self._replies.put({"ready": False, "reason": "the zygote exited"})  # wakes a waiting start()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _give_up(self, reason: str) -> None:
        """Spawn from now on. The zygote stays until close(): it is the parent of the ranks it forked."""
        if self.fallback_reason is None:
            self.fallback_reason = reason
            log.warning("fork server unavailable (%s): starting rank processes with spawn", reason)

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, stdout: str, stderr: str,
              netns: str | None = None) -> Handle:
        """netns: the forked child enters that network namespace (setns) before it runs the script."""
        with self._lock:
            if argv[:len(self._target)] != self._target:
                pass  # not the script the zygote preloaded: spawn it
            elif self.fallback_reason is None and self.alive():
                self._next_id += 1
                child_argv = argv[1:] if self._target[0] == "-m" else argv  # sys.argv as `python ARGV` sets it
                req = {"id": self._next_id, "argv": child_argv, "env": env, "cwd": cwd, "stdout": stdout, "stderr": stderr,
                       **({"netns": netns} if netns else {})}
                try:
                    self._proc.stdin.write((json.dumps(req) + "\n").encode())  # type: ignore[union-attr]
                    self._proc.stdin.flush()  # type: ignore[union-attr]
                    reply = self._replies.get(timeout=30.0)
                except (OSError, EnvTimeout) as e:
                    reply = {"reason": f"request failed: {e}"}
                if reply.get("id") == self._next_id:
                    return _Forked(self, reply["pid"])
                self._give_up(reply.get("reason", f"bad reply {reply}"))
            elif self.fallback_reason is None:
                self._give_up("the zygote exited")
        return self._spawn.start(argv, env=env, cwd=cwd, stdout=stdout, stderr=stderr, netns=netns)

    def _shutdown(self) -> None:
        if self._proc.stdin and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()  # the zygote kills its children and exits
            except OSError:
                pass
        try:
            self._proc.wait(10.0)
        except subprocess.TimeoutExpired:
            _killpg(self._proc.pid)
            self._proc.wait()

    def close(self) -> None:
        with self._lock:
            self._shutdown()
