"""The launcher's side of a host agent (agent.py): a procs.Launcher whose rank processes run on another
host, and the copy of what they write into the launcher's output folder.

`RemoteLauncher.start` asks the agent to start `python ARGV` and returns a handle with Popen's `poll`,
`wait` and `kill`. A task follows the agent every POLL_S: it fetches the exit codes of the processes it
started, then the new bytes of their stdout/stderr (into the paths `start` was given, so the supervisor's
event pump reads them as if the ranks ran here) and of the job's audit files (into `run_dir`). A handle
reports an exit only after the bytes written before it were copied: no event is lost at the end.
Threading: requests are serialized on the one connection; handles may be polled from any thread.
"""

from __future__ import annotations

import os
from typing import Any

from ftrun.env.base import ConnectError, Env, NetError

POLL_S = 0.1
START_TIMEOUT_S = 180.0  # the agent's first start preloads its zygote (imports, warm-up)
RUN_FILES = "audit-"  # the run-dir files gathered from every host (the exactly-once audit's logs)


class AgentError(RuntimeError):
    """The agent refused a request or could not be reached; the message says which host and why."""


class AgentClient:
    def __init__(self, env: Env, addr: str, token: str, *, connect_timeout_s: float = 60.0) -> None:
        self.env, self.addr = env, addr
        deadline = env.clock.now() + connect_timeout_s
        while True:  # the agent may still be starting
            try:
                self._conn = env.net.connect(addr, timeout=min(5.0, connect_timeout_s))
                break
            except (ConnectError, NetError) as e:
                if env.clock.now() > deadline:
                    raise AgentError(f"no agent at {addr} after {connect_timeout_s:.0f}s ({e}): start `ftrun launch "
                                     f"--hosts FILE --host-index I` on that host first") from None
                env.clock.sleep(0.5)
        self._lock = env.lock()
        self._conn.send({"type": "hello", "token": token})
        reply = self._conn.recv(timeout=30.0)
        if "error" in reply:
            raise AgentError(f"agent at {addr}: {reply['error']}")

    def call(self, msg: dict, timeout: float = 60.0) -> dict:
        with self._lock:
            try:
                self._conn.send(msg)
                reply = self._conn.recv(timeout=timeout)
            except NetError as e:
                raise AgentError(f"agent at {self.addr}: {e}") from None
        if "error" in reply:
            raise AgentError(f"agent at {self.addr}: {reply['error']}")
        return reply

    def close(self) -> None:
        self._conn.close()


class RemoteHandle:
    def __init__(self, launcher: "RemoteLauncher", ident: int, pid: int) -> None:
        self._launcher, self.ident, self.pid = launcher, ident, pid

    def poll(self) -> int | None:
        return self._launcher.codes.get(self.ident)

    def wait(self, timeout: float | None = None) -> int | None:
        clock = self._launcher.env.clock
        deadline = None if timeout is None else clock.now() + timeout
        while (code := self.poll()) is None and (deadline is None or clock.now() < deadline):
            if self._launcher.failed:
                return -9  # the agent is gone: so is what it ran
            clock.sleep(POLL_S / 2)
        return code

    def kill(self) -> None:
        if self.poll() is None and not self._launcher.failed:
            try:
                self._launcher.client.call({"type": "kill", "id": self.ident})
            except AgentError:
                pass


class RemoteLauncher:
    """Rank processes on the host whose agent is at `addr`; `job` names the job's folder there."""

    def __init__(self, env: Env, addr: str, token: str, *, job: str, run_dir: str) -> None:
        self.env, self.job, self.run_dir = env, job, run_dir
        self.client = AgentClient(env, addr, token)
        self.codes: dict[int, int] = {}  # published only after the process's output was copied
        self.failed: str | None = None
        self._running: list[int] = []
        self._mirrors: dict[tuple[str, str], list[Any]] = {}  # (where, name) -> [local path, offset]
        self._next = 0
        self._lock = env.lock()
        self._stop = env.event()
        self._task = env.spawn(self._follow, name=f"agent-{addr}")

    def start(self, argv: list[str], *, env: dict[str, str], cwd: str, stdout: str, stderr: str,
              netns: str | None = None) -> RemoteHandle:
        with self._lock:
            self._next += 1
            ident = self._next
            for path in (stdout, stderr):
                self._mirrors[("logs", os.path.basename(path))] = [path, 0]
        reply = self.client.call({"type": "start", "id": ident, "job": self.job, "argv": list(argv), "env": env,
                                  "stdout": os.path.basename(stdout), "stderr": os.path.basename(stderr)},
                                 timeout=START_TIMEOUT_S)
        with self._lock:
            self._running.append(ident)
        return RemoteHandle(self, ident, reply["pid"])

    def prepare(self, argv: list[str]) -> None:
        """Have the agent load its zygote for `argv`'s script now, so that starting ranks is quick."""
        self.client.call({"type": "prepare", "argv": list(argv)}, timeout=START_TIMEOUT_S)

    def store_port(self, replica: str) -> int:
        """A fresh rendezvous store on the agent's host for the next incarnation of `replica`."""
        return self.client.call({"type": "store", "replica": replica})["port"]

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.sync()
            except AgentError as e:
                self.failed = str(e)
                return

    def sync(self) -> None:
        """Copy what is new; then publish the exit codes seen before the copy."""
        with self._lock:
            running = list(self._running)
        codes = self.client.call({"type": "poll", "ids": running})["codes"] if running else []
        for name in self.client.call({"type": "list", "job": self.job, "prefix": RUN_FILES})["names"]:
            with self._lock:
                self._mirrors.setdefault(("run", name), [os.path.join(self.run_dir, name), 0])
        with self._lock:
            mirrors = list(self._mirrors.items())
        for (where, name), entry in mirrors:
            while True:
                got = self.client.call({"type": "read", "job": self.job, "where": where, "name": name,
                                        "offset": entry[1]})
                if not got["data"]:
                    break
                with open(entry[0], "ab") as f:
                    f.write(got["data"])
                entry[1] += len(got["data"])
        with self._lock:
            for ident, code in zip(running, codes):
                if code is not None:
                    self.codes[ident] = code
                    self._running.remove(ident)

    def close(self) -> None:
        """Stop following (after one last copy); the agent keeps running (see bye)."""
        self._stop.set()
        self._task.join(5.0)
        if not self.failed:
            try:
                self.sync()
            except AgentError:
                pass

    def bye(self) -> None:
        """Tell the agent to kill what it runs and exit."""
        try:
            self.client.call({"type": "bye"}, timeout=30.0)
        except AgentError:
            pass
        self.client.close()
