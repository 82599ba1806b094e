"""The host agent of a multi-host `ftrun launch --hosts FILE`: starts, watches and kills rank processes on
its host for the launcher, and hands back what they wrote.

On every host but the first, `ftrun launch --hosts FILE --host-index I ...` (the same command line as on
host 0) runs an agent bound at that host's address and `--agent-port` (default 29511); host 0 runs the
job and talks to each agent over one connection (ftrun.env framed msgpack: no pickles). The first message
must be {"type": "hello", "token"}: the job token, from FTRUN_TOKEN_FILE (a 0600 file) or FTRUN_TOKEN on
every host; a wrong token closes the connection. Then one reply per request:

    start {id, job, argv, env, stdout, stderr} -> {pid}    `python ARGV` in its own session; its stdout and
                                                          stderr go to OUT/JOB/logs/NAME, FTRUN_RUN_DIR=OUT/JOB
    poll {ids}              -> {codes: [code or None]}     exit codes (negative: killed by that signal)
    kill {id}               -> {code}                      SIGKILL the process's session, wait for it
    read {job, where, name, offset} -> {data, size}       bytes of OUT/JOB/logs/NAME (where=logs) or
                                                          OUT/JOB/NAME (where=run) from offset (at most 1 MiB)
    list {job, prefix}      -> {names}                     files in OUT/JOB whose name starts with prefix
    prepare {argv}          -> {fork_server}               load the zygote for this script now (else: first start)
    store {replica}         -> {port}                      a fresh TCPStore on this host's address for the
                                                          replica's next incarnation (its previous one is dropped)
    bye {}                  -> {}                          kill every process, then the agent exits

Every request is checked by `parse_request` (pure, unit-tested): a bad one, or one that fails, gets
{"error": why} and the connection stays usable. Names are plain file names (no path separators, no ".."),
so a request can only reach files under the agent's --out folder.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ftrun.env.base import Env, EnvTimeout, NetError, PeerClosed, serve_connections
from ftrun.launch.procs import SpawnLauncher
from ftrun.net import require_token, token_matches

log = logging.getLogger("ftrun.launch")
AGENT_PORT = 29511
SHUTTING_DOWN = "the agent is shutting down (a bye was received): it starts no process or store"
MAX_READ = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")


class BadRequest(ValueError):
    """A request the agent refuses; the message says which field is wrong."""


def check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise BadRequest(f"{what} must be a plain file name (letters, digits, _ . -), got {value!r:.80}")
    return value


def _int(msg: dict, key: str, low: int = 0, high: int = 2**63 - 1) -> int:
    """An integer in [low, high]; the default high is the largest file offset (off_t)."""
    value = msg.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadRequest(f"{key} must be an integer in [{low}, {high}], got {value!r:.80}")
    return value


def _os_string(value: Any) -> bool:
    """A string the OS takes as an argument or environment value (no NUL byte)."""
    return isinstance(value, str) and "\0" not in value


def _strings(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(_os_string(v) for v in value):
        raise BadRequest(f"{what} must be a list of strings without NUL")
    return value


def _environment(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(_os_string(k) and k and "=" not in k and _os_string(v)
                                              for k, v in value.items()):
        raise BadRequest("env must map strings without NUL (names non-empty, without '=') to strings without NUL")
    return value


def parse_request(msg: Any) -> dict:
    """The request `msg` checked and normalized; BadRequest naming what is wrong."""
    if not isinstance(msg, dict):
        raise BadRequest("a request must be a map")
    kind = msg.get("type")
    if kind == "start":
        argv = _strings(msg.get("argv"), "argv")
        if not argv:
            raise BadRequest("argv must not be empty")
        env = _environment(msg.get("env"))
        return {"type": kind, "id": _int(msg, "id"), "job": check_name(msg.get("job"), "job"), "argv": argv,
                "env": env, "stdout": check_name(msg.get("stdout"), "stdout"),
                "stderr": check_name(msg.get("stderr"), "stderr")}
    if kind == "poll":
        ids = msg.get("ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadRequest("ids must be a list of integers")
        return {"type": kind, "ids": ids}
    if kind == "kill":
        return {"type": kind, "id": _int(msg, "id")}
    if kind == "read":
        where = msg.get("where")
        if where not in ("logs", "run"):
            raise BadRequest(f"where must be 'logs' or 'run', got {where!r:.80}")
        return {"type": kind, "job": check_name(msg.get("job"), "job"), "where": where,
                "name": check_name(msg.get("name"), "name"), "offset": _int(msg, "offset")}
    if kind == "list":
        prefix = msg.get("prefix", "")
        if prefix:
            check_name(prefix, "prefix")
        return {"type": kind, "job": check_name(msg.get("job"), "job"), "prefix": prefix}
    if kind == "prepare":
        argv = _strings(msg.get("argv"), "argv")
        if not argv:
            raise BadRequest("argv must not be empty")
        return {"type": kind, "argv": argv}
    if kind == "store":
        return {"type": kind, "replica": check_name(msg.get("replica"), "replica")}
    if kind == "bye":
        return {"type": kind}
    raise BadRequest(f"unknown request type {kind!r:.80}")


def check_hello(msg: Any, token: str) -> None:
    """BadRequest unless `msg` is a hello carrying `token` (compared in constant time)."""
    if not isinstance(msg, dict) or msg.get("type") != "hello" or not isinstance(msg.get("token"), str):
        raise BadRequest("the first message must be a hello with the job token")
    if not token_matches(msg["token"], token):
        raise BadRequest("wrong job token")


class Agent:
    """Serves launchers at `bind` ("host:port") until a bye. Threading: a task per connection; the
    process table is shared under a lock."""

    def __init__(self, *, env: Env, token: str, bind: str, out: str, fork_server: bool = False) -> None:
        self.env, self.out = env, os.path.abspath(out)
        self.token = require_token(token, "the launch agent")
        self.host = bind.rpartition(":")[0]
        self._listener = env.net.listen(bind)
        self.addr = self._listener.addr
        self._fork_server = fork_server  # fork ranks from a zygote preloaded for the first script started
        self._launcher: Any = SpawnLauncher()
        self._procs: dict[int, Any] = {}
        self._stores: dict[str, Any] = {}  # replica -> its running incarnation's store
        self._lock = env.lock()
        self._done = env.event()
        self._closing = False  # a bye came or shutdown() began: no process starts any more (under _lock)

    def serve(self) -> None:
        """Accept until a bye; then kill what runs and return."""
        serve_connections(self.env, self._listener, self._serve_conn, name="agent-accept", conn_name="agent-conn")
        self._done.wait()
        self.shutdown()

    def _serve_conn(self, conn) -> None:
        try:
            check_hello(conn.recv(timeout=30.0), self.token)
            conn.send({"ok": True})
            while True:
                msg = conn.recv(timeout=None)
                try:
                    reply = self.handle(parse_request(msg))
                except (BadRequest, OSError) as e:
                    reply = {"error": str(e)}
                except Exception as e:  # unexpected: named to the launcher and logged; the connection serves on
                    log.error("agent: %s failed", msg.get("type"), exc_info=True)
                    reply = {"error": f"{msg.get('type')!s:.20} failed: {type(e).__name__}: {e}"}
                conn.send(reply)
                if msg.get("type") == "bye":
                    self._done.set()
                    return
        except BadRequest as e:
            try:
                conn.send({"error": str(e)})
            except NetError:
                pass
        except (PeerClosed, NetError, EnvTimeout):
            pass
        finally:
            conn.close()

    def _job_dir(self, job: str) -> str:
        path = os.path.join(self.out, job)
        os.makedirs(os.path.join(path, "logs"), exist_ok=True)
        return path

    def handle(self, req: dict) -> dict:
        kind = req["type"]
        if kind in ("start", "prepare", "store"):
            with self._lock:
                if self._closing:  # a zygote (or a store) made now would outlive the agent too
                    return {"error": SHUTTING_DOWN}
        if kind == "start":
            run_dir = self._job_dir(req["job"])
            env = {**req["env"], "FTRUN_RUN_DIR": run_dir}
            handle = self._launcher_for(req["argv"]).start(req["argv"], env=env, cwd=os.getcwd(),
                                          stdout=os.path.join(run_dir, "logs", req["stdout"]),
                                          stderr=os.path.join(run_dir, "logs", req["stderr"]))
            with self._lock:
                self._procs[req["id"]] = handle
                closing = self._closing
            if closing:  # shutdown() began while it started, and may have missed it: killed like the others
                handle.kill()
                handle.wait(5.0)
                return {"error": SHUTTING_DOWN}
            return {"pid": handle.pid}
        if kind == "poll":
            with self._lock:
                procs = [self._procs.get(i) for i in req["ids"]]
            return {"codes": [None if p is None else p.poll() for p in procs]}
        if kind == "kill":
            with self._lock:
                proc = self._procs.get(req["id"])
            if proc is None:
                return {"error": f"no process {req['id']}"}
            proc.kill()
            return {"code": proc.wait()}
        if kind == "read":
            base = self._job_dir(req["job"])
            folder = os.path.join(base, "logs") if req["where"] == "logs" else base
            path = os.path.join(folder, req["name"])
            try:
                with open(path, "rb") as f:
                    f.seek(req["offset"])
                    data = f.read(MAX_READ)
                    size = os.fstat(f.fileno()).st_size
            except FileNotFoundError:
                data, size = b"", 0
            return {"data": data, "size": size}
        if kind == "list":
            base = self._job_dir(req["job"])
            return {"names": sorted(n for n in os.listdir(base) if n.startswith(req["prefix"])
                                    and os.path.isfile(os.path.join(base, n)))}
        if kind == "prepare":
            launcher = self._launcher_for(req["argv"])
            return {"fork_server": getattr(launcher, "fallback_reason", "spawn") is None}
        if kind == "store":
            from ftrun.env.real_store import bound_store

            store = bound_store(self.host, timeout_s=60)
            with self._lock:
                closing = self._closing
                if not closing:
                    self._stores[req["replica"]] = store  # the previous incarnation's (its ranks are gone) is dropped
            # closing: shutdown() began while it was made, and may have missed it; it is dropped with this frame
            return {"error": SHUTTING_DOWN} if closing else {"port": store.port}
        with self._lock:  # bye: from its answer on, no process starts (serve() then shuts down)
            self._closing = True
        return {}

    def _launcher_for(self, argv: list[str]):
        """The zygote (made on the first start, for that script: later starts of it are forks), or spawn."""
        if self._fork_server and isinstance(self._launcher, SpawnLauncher):
            from ftrun.launch.procs import ForkServer

            module = argv[0] == "-m" and len(argv) > 1
            self._launcher = ForkServer(env=self.env, script=argv[1] if module else argv[0], module=module,
                                        cwd=os.getcwd(), log_path=os.path.join(self.out, "zygote.log"),
                                        run_dir=self.out)
        return self._launcher

    def shutdown(self) -> None:
        self._listener.close()  # first: no new launcher connects while the running ones are killed
        with self._lock:
            self._closing = True  # nor does a connected one start a process (handle() refuses, see there)
            procs = list(self._procs.values())
            stores, self._stores = self._stores, {}
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(5.0)
        stores.clear()  # a TCPStore has no close(): dropping the last reference stops its server, freeing its port
        self._launcher.close()
