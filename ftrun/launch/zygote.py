"""The fork server ("zygote") behind `ftrun launch`: cheap replica restarts.

Starting a python + torch rank process costs 2-4 CPU-seconds (imports, torch._dynamo on the first optimizer
step, numba compiles), which on a small box is most of a restarted replica's downtime and slows the
survivors. The zygote pays that once: it imports what the training script imports (its top-level imports,
read from its source without running it), warms the lazily loaded parts (an optimizer step, the CPU FTAR
kernels; on a GPU host only what starts no CUDA, see `cuda_could_start`), checks that it runs a single
thread, and then forks one child per rank process on request. A
child sets its own session, stdio, working directory, environment and argv and runs the script as
`__main__`, exactly like `python [-m] SCRIPT ARGS` would, only without the start-up cost. The code it runs
is the script as compiled at preload, so every restart runs the same version even if the file changes.

    python -m ftrun.launch.zygote [--run-dir DIR] [--sharded] [--spares N [--prepare]] (-m MODULE | SCRIPT)

--sharded (the job's replicas have more than one rank): also warm FSDP2 (ftrun.train.warm), whose
first shard, optimizer step and state load otherwise cost a restarted rank ~1 s of CPU on its rejoin;
and later, once, with the job's own parameter shapes: children inherit the write end of a warm pipe
(FTRUN_ZYGOTE_WARM_FD), the first rank to build its trainer sends the path of its shapes there, and the
zygote warms them between requests (its spares are then replaced by children forked after the warm).

Protocol, JSON lines: requests on stdin `{"id", "argv", "env", "cwd", "stdout", "stderr"[, "netns"]}`
(argv[0] is the module name for -m, else the script path; stdout/stderr are file paths, appended to;
netns: a network namespace the child enters first, for `ftrun launch --netns-hosts`);
replies on stdout: first `{"ready": bool, "reason", "threads", "seconds"}`, then `{"id", "pid"}` per
request and `{"exit": pid, "code": returncode}` (negative: killed by that signal, as with Popen) when
a child ends. `ready: false` means forking is unsafe (e.g. a library started a thread while
loading) and the client falls back to starting processes itself. When stdin closes (the supervisor
ended or died) the zygote SIGKILLs its children's sessions and exits.

Forked ranks inherit single-threaded BLAS/OpenMP pools (the client starts the zygote with
OPENBLAS_NUM_THREADS=OMP_NUM_THREADS=1, required for a fork-safe zygote): right for many rank
processes on few cores; pass `--start-method spawn` to `ftrun launch` otherwise.

Spares (--spares N): the zygote keeps N children forked ahead of any request, each leading its own
session and blocked on a pipe of its own; a request goes to a spare (the pid is handed out at once,
without a fork on the restart's critical path), and spares are replaced once no request came for
REFILL_IDLE_S (a replica's ranks are requested back to back: none of them waits for a refill fork).
A spare holds none of the zygote's pipes, so it ends (EOF) when the zygote does; an unused spare's
exit is not reported. With --prepare, the spares forked after the first request are prepared spares
(ftrun.launch.zygote_child): they run the script up to its `claim()` (ftrun.train.init_from_env) with that
request's argv, cwd and environment less the identity variables, and take a later request whose
argv, cwd and non-identity environment are the same (other requests go to a plain spare or a fork).
A prepared spare that ends before its claim (a script that never claims) turns preparing off. A rank finds in FTRUN_FORKED_AT the monotonic time at which it started being this rank (its
fork, or its spare's request); the training API's `ready` event reports it (`ftrun demo`'s rejoin
breakdown).
"""

from __future__ import annotations

import argparse
import ast
import gc
import glob
import importlib
import importlib.util
import json
import os
import select
import signal
import sys
import types
from typing import Callable

from ftrun.launch.zygote_child import REQUEST_FD, _child, _prepared_spare, _spare, template_of

REFILL_IDLE_S = 0.2  # spares are forked again once requests have paused this long
# Modules a preloaded module imports on first use (inside a function): a forked rank would import them
# after the fork, on a restart's critical path, so the zygote imports them with the script's imports.
LAZY_IMPORTS = {"ftrun.train.api": ("ftrun.train.wiring",)}


def source_of(target: str, *, module: bool) -> str | None:
    """Path of the target's source file, or None when it has none we can read."""
    if not module:
        return target if os.path.isfile(target) else None
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") and os.path.isfile(origin) else None


def top_level_imports(source: str) -> list[str]:
    """Modules a script imports at its top level (not inside functions or classes), in order. Pure."""
    names: list[str] = []
    todo = list(ast.parse(source).body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, (ast.If, ast.Try)):  # `if TYPE_CHECKING:` / `try: import x` blocks
            todo[:0] = [n for block in (node.body, getattr(node, "handlers", []), node.orelse) for n in block]
        elif isinstance(node, ast.ExceptHandler):
            todo[:0] = node.body
    return list(dict.fromkeys(names))


def preload(target: str, *, module: bool,
            sharded: bool = False) -> tuple[types.CodeType | None, str | None, list[str]]:
    """Import the target's top-level imports and warm lazily loaded parts.

    Returns the target's compiled code (None without a readable source), its path, and the imports that
    failed. Children run this code, not the file as it is when they start: a restarted replica runs the
    same version of the script as the others and as the modules loaded here, even if the file changed."""
    failed = []
    path = source_of(target, module=module)
    if path is None:
        _warm(sharded)
        return None, None, failed
    with open(path, encoding="utf-8") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    for name in top_level_imports(source):
        try:
            importlib.import_module(name)
        except Exception:  # the script would fail the same way in the child: report it there
            failed.append(name)
    for loaded, names in LAZY_IMPORTS.items():
        if loaded in sys.modules:
            for name in names:
                importlib.import_module(name)
    _warm(sharded)
    return code, path, failed


def cuda_could_start() -> bool:
    """Whether torch could start the GPU driver in this process: a CUDA (or ROCm, which torch presents as
    CUDA) build of torch on a machine with an NVIDIA (or AMD: /dev/kfd) device. There autograd's first backward
    (it asks every device type for its device count to start a thread per device) and an optimizer's first
    step (it looks for the current accelerator) initialise the driver, which starts driver threads and leaves
    the GPU unusable in every forked child. Looked up without calling CUDA, HIP or NVML."""
    import torch

    if not torch.backends.cuda.is_built():
        return False
    if torch.version.hip:
        return os.path.exists("/dev/kfd")
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.isdir("/proc/driver/nvidia/gpus")


def _warm(sharded: bool = False) -> None:
    """Run what each child would otherwise pay for on its first step (all of it single-threaded).
    sharded: FSDP2's first use too (a fake process group: no threads, destroyed before any fork).
    Where CUDA could start (`cuda_could_start`) nothing that would start it runs: only the first optimizer
    step's import of torch._dynamo is done, each child pays its first backward and step itself."""
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(1)
        if cuda_could_start():
            import torch._dynamo  # noqa: F401  (what the first optimizer step imports, ~1 s)

            sharded = False
        else:
            p = torch.nn.Parameter(torch.zeros(4))
            opt = torch.optim.AdamW([p], lr=1e-3)  # the first step imports torch._dynamo (~1 s)
            torch.nn.functional.cross_entropy(p.view(1, 4), torch.zeros(1, dtype=torch.long)).backward()
            opt.step()
    if "ftrun.ftar.cpu_kernels" in sys.modules:
        import numpy as np

        from ftrun.ftar.cpu_kernels import CpuKernels
        from ftrun.ftar.kernels import DType

        a = np.zeros(16, np.uint8)
        kernels = CpuKernels()
        kernels.reduce(a, 0, a.copy(), 0, 8, DType.FLOAT32)  # numba compiles on the first call
        kernels.reduce_copy(a, 0, a.copy(), 0, a, 8, 8, DType.FLOAT32)
    if sharded and "torch" in sys.modules:
        from ftrun.train.warm import warm_sharding

        warm_sharding()


def num_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1  # no procfs: nothing to count with; the client's fork is then on trust


class _Target:
    def __init__(self, name: str, module: bool, code: types.CodeType | None, path: str | None) -> None:
        self.name, self.module, self.code, self.path = name, module, code, path


class _Server:
    def __init__(self, reply_fd: int, target: _Target, spares: int = 0, warm_pipe: bool = False,
                 prepare: bool = False) -> None:
        self.reply_fd, self.target, self.num_spares, self.prepare = reply_fd, target, spares, prepare
        self.template: dict | None = None  # what prepared spares run before their claim (the first request's)
        self.children: set[int] = set()
        # (pid, the write end of its request pipe, its template: None for a plain spare), oldest first
        self.spares: list[tuple[int, int, dict | None]] = []
        self.retired: set[int] = set()  # spares let go unused (their exits are not reported)
        self.warm_r, self.warm_w = os.pipe() if warm_pipe else (-1, -1)
        self.warmed = False

    def reply(self, obj: dict) -> None:
        os.write(self.reply_fd, (json.dumps(obj) + "\n").encode())  # < PIPE_BUF: one atomic write

    def reap(self, *_: object) -> None:
        """SIGCHLD: report every ended child (a spare that ended unused is only forgotten)."""
        while self.children or self.spares or self.retired:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            spare = next((s for s in self.spares if s[0] == pid), None)
            if spare is not None:
                self.spares.remove(spare)
                os.close(spare[1])
                if spare[2] is not None and self.prepare:  # a prepared spare ended before its claim
                    self.prepare, self.template = False, None
                    print(f"zygote: a prepared spare ended before its claim (code "
                          f"{os.waitstatus_to_exitcode(status)}): plain spares from now on", file=sys.stderr)
                continue
            if pid in self.retired:
                self.retired.discard(pid)
                continue
            self.children.discard(pid)
            self.reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def serve(self) -> None:
        """Requests (and warm notices) until stdin closes; spares refilled when requests pause."""
        signal.signal(signal.SIGCHLD, self.reap)
        self._refill()
        for fd, line in _lines(REQUEST_FD, self.warm_r, idle=self._idle):
            if fd == self.warm_r:
                self._warm_shapes(line.decode())
                continue
            req = json.loads(line)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # the pid goes in before its exit
            pid = self._hand_out(req)
            self.children.add(pid)
            self.reply({"id": req["id"], "pid": pid})
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        self.shutdown()

    def _idle(self, timed_out: bool) -> float | None:
        """Before waiting for input: refill the spares once requests paused (the last wait timed out);
        returns how long to wait before asking again (None: until input comes)."""
        if len(self.spares) >= self.num_spares:
            return None
        if timed_out:
            self._refill()
            return None
        return REFILL_IDLE_S

    def _hand_out(self, req: dict) -> int:
        """The pid now running `req`: the oldest live prepared spare's whose template is the request's,
        else the oldest plain spare's, else a fresh fork's. SIGCHLD is blocked."""
        data = (json.dumps(req) + "\n").encode()
        wanted = template_of(req)
        if self.prepare and self.template is None:
            self.template = wanted  # the job's first request: the spares forked from now on are prepared
        while True:
            spare = next((s for s in self.spares if s[2] is not None and s[2] == wanted), None) or \
                next((s for s in self.spares if s[2] is None), None)
            if spare is None:
                break
            self.spares.remove(spare)
            pid, fd, _ = spare
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                return pid
            except BrokenPipeError:  # it died unused (its exit is reaped, unreported)
                continue
            finally:
                os.close(fd)
        return self._fork(req)

    def _warm_shapes(self, path: str) -> None:
        """A rank sent the job's shapes (ftrun.train.warm.announce): warm them once, then replace the
        spares (forked before the warm) with fresh ones. A spec that fails is logged and ignored."""
        if self.warmed:
            return
        self.warmed = True
        if cuda_could_start():  # its backward would start CUDA here (see _warm)
            return
        try:
            from ftrun.train.warm import warm_sharding

            with open(path, encoding="utf-8") as f:
                warm_sharding(json.load(f))
        except Exception as e:  # a warm-up is an optimisation: never a reason to stop forking
            print(f"zygote: warming the job's shapes from {path} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            old, self.spares = self.spares, []
            for pid, fd, _ in old:
                os.close(fd)  # EOF: the spare exits
                self.retired.add(pid)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        self._refill()

    def _refill(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            while len(self.spares) < self.num_spares:
                self._fork(None)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})

    def _fork(self, req: dict | None) -> int:
        """Fork a child for `req`, or a spare (None); returns once it leads its session. SIGCHLD is blocked."""
        sys.stdout.flush()
        sys.stderr.flush()
        others = [fd for _, fd, _ in self.spares]  # the spares' pipes: never held by another child
        if self.warm_r >= 0:
            others.append(self.warm_r)
        template = self.template if req is None and self.prepare else None
        started_r, started_w = os.pipe()
        request_r, request_w = os.pipe() if req is None else (-1, -1)
        pid = os.fork()
        if pid == 0:
            os.close(started_r)
            if req is None:
                os.close(request_w)
                if template is not None:
                    _prepared_spare(template, self.target, self.reply_fd, started_w, request_r, others,
                                    self.warm_w)  # never returns
                _spare(self.target, self.reply_fd, started_w, request_r, others, self.warm_w)  # never returns
            _child(req, self.target, self.reply_fd, started_w, others, self.warm_w)  # never returns
        os.close(started_w)
        os.read(started_r, 1)  # the child leads its session (or died): killpg(pid) reaches it from now on
        os.close(started_r)
        if req is None:
            os.close(request_r)
            self.spares.append((pid, request_w, template))
        return pid

    def shutdown(self) -> None:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid, fd, _ in self.spares:
            os.close(fd)  # EOF: the spare exits
        for pid in list(self.children) + [pid for pid, _, _ in self.spares]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(self.children) + [pid for pid, _, _ in self.spares]:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _lines(fd: int, other: int = -1, idle: Callable[[bool], float | None] = lambda timed_out: None):
    """(fd, line) for every complete line from `fd` and from `other` (when >= 0), as they come; ends
    when `fd` closes (`other` closing only stops reading it). Before every wait for input,
    `idle(the last wait timed out)` says how long to wait at most (None: until input comes)."""
    bufs = {fd: b"", other: b""}
    open_fds = [f for f in (fd, other) if f >= 0]
    timed_out = False
    while True:
        readable = select.select(open_fds, [], [], idle(timed_out))[0]
        timed_out = not readable
        for f in readable:
            chunk = os.read(f, 65536)
            if not chunk:
                if f == fd:
                    return
                open_fds.remove(f)
                continue
            bufs[f] += chunk
            *complete, bufs[f] = bufs[f].split(b"\n")
            yield from ((f, c) for c in complete if c.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ftrun.launch.zygote", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default=None, help="the job's folder (only so that ps shows whose zygote it is)")
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("--sharded", action="store_true", help="also warm FSDP2 (replicas of more than one rank)")
    p.add_argument("--spares", type=int, default=0, help="children kept forked ahead of requests")
    p.add_argument("--prepare", action="store_true",
                   help="spares run the script up to its claim() (ftrun.launch.zygote_child) before a request")
    p.add_argument("target")
    args = p.parse_args(argv)
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # anything the preloaded libraries print must not corrupt the reply stream
    sys.path.insert(0, os.getcwd() if args.module else os.path.dirname(os.path.abspath(args.target)))
    started = _now()
    code, path, failed = preload(args.target, module=args.module, sharded=args.sharded)
    gc.collect()
    gc.freeze()  # keep the preloaded objects' pages shared with the children (no refcount/GC writes)
    threads = num_threads()
    server = _Server(reply_fd, _Target(args.target, args.module, code, path), spares=max(args.spares, 0),
                     warm_pipe=args.sharded, prepare=args.prepare)
    ready = threads == 1
    reason = "ok" if ready else f"{threads} threads after loading the script's imports: fork is unsafe"
    server.reply({"ready": ready, "reason": reason, "threads": threads, "seconds": _now() - started,
                  "failed_imports": failed})
    if ready:
        server.serve()
    return 0


def _now() -> float:
    return os.times().elapsed


if __name__ == "__main__":
    sys.exit(main())
