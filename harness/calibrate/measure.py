"""In-process measurements of this machine for `ftrun calibrate`: each returns a `Figure` saying what it
measured and how.

- `step_compute`: forward + backward + AdamW step of the toy LM that `ftrun.train.ft_worker` trains
  (the model `ftrun launch -m ftrun.train.ft_worker` and `ftrun fidelity` run for real), median step.
- `stream_pair`: one-way latency (half the median round trip of a 1-byte ping-pong) and bandwidth (one
  direction, MiB-sized sendall / recv_into) over a connected TCP (127.0.0.1) or Unix socket pair, the
  peer a thread of this process (both ends release the GIL in the kernel calls).
- `shm_bandwidth`: memcpy into and out of a shared-memory file under /dev/shm (what a same-host FTAR
  transfer over SharedSlots costs per byte), one direction's bytes per second.
- `catchup_costs`: the real catch-up client fetching the real CatchupServer's snapshot (served, unless --quick,
  by another process that trains meanwhile, as a healthy replica does) over HTTP on
  127.0.0.1 (manifest, shards, CRC) for several state sizes; a least-squares line gives the cost per
  fetch (intercept) and per byte (slope).
- `ftar_kernels`: the CPU FTAR kernels a real run uses (ftrun.ftar.cpu_kernels, float32) on chunk-sized
  buffers: reduce and copy throughput in GB/s of payload.
- `ftar_rebuild`: the CPU a rank's all-reduce costs more when it first builds a new ring (a retry after a peer
  died), two processes of FtarEngine on 127.0.0.1.

Timing uses time.perf_counter; every figure is the median of its repetitions (robust to the other work
on a shared machine), with the sample count.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    from ftrun.config import FtarConfig


@dataclass(frozen=True)
class Figure:
    """One measured figure: `value` in `unit`, how it was measured, from how many samples."""

    name: str
    value: float
    unit: str
    method: str
    samples: int


def _median_time(fn: Callable[[], object], reps: int, min_seconds: float = 0.0,
                 mean: bool = False) -> tuple[float, int]:
    """The median time of `fn` over `reps` calls, or more until `min_seconds` have passed; (median, calls).
    mean: the calls' wall time over their number instead (a throughput: the time the process spent off the CPU
    between calls counts, where a median of calls shorter than a scheduler time slice leaves it out)."""
    times = []
    start = time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if mean:
        return (time.perf_counter() - start) / len(times), len(times)
    return statistics.median(times), len(times)


# -- compute ----------------------------------------------------------------------------------------

def step_compute(*, reps: int = 30, warmup: int = 5, batch_size: int = 8) -> Figure:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a rank of `ftrun launch` (its zygote and ranks run single-threaded)
    try:
        return _step_compute(reps=reps, warmup=warmup, batch_size=batch_size)
    finally:
        torch.set_num_threads(threads)


def _step_compute(*, reps: int, warmup: int, batch_size: int, min_seconds: float = 0.0, mean: bool = False) -> Figure:
    import torch

    from ftrun.train.toy import ToyConfig, lm_loss, make_model, make_tokens

    cfg = ToyConfig()
    model = make_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    tokens = make_tokens(cfg)
    i = 0

    def step() -> None:
        nonlocal i
        batch = tokens[(i * batch_size) % (len(tokens) - batch_size):][:batch_size]
        i += 1
        opt.zero_grad(set_to_none=False)
        lm_loss(model, batch).backward()
        opt.step()

    for _ in range(warmup):
        step()
    t, n = _median_time(step, reps, min_seconds, mean)
    return Figure("step_s", t, "s", f"{'mean' if mean else 'median'} wall time of forward + backward + AdamW step of ftrun.train.toy "
                  f"TinyLM ({sum(p.numel() for p in model.parameters())} params, batch {batch_size}, "
                  f"torch {torch.__version__}, {torch.get_num_threads()} threads) after {warmup} warm-up steps", n)


def concurrent_steps(*, max_procs: int = 8, reps: int = 20, warmup: int = 3, seconds: float = 1.0) -> list[Figure]:
    """How the toy LM's step slows down when N rank processes compute at once on this machine (as the
    ranks of an `ftrun launch` job do): for N = 1..max_procs, N processes forked from this one (torch
    loaded, one thread each, as a zygote child) start together and each runs `warmup` steps, then steps for
    `seconds` (at least `reps` steps: the N overlap for all of it, where a fixed count of millisecond steps
    would let them finish before the others start); the figure is the median over the N processes of each
    one's mean step (its steps' wall time over their number: a throughput). Not the median of its steps: a toy
    step (~1 ms) is shorter than a scheduler time slice, so most steps run unpreempted and the median left the
    time sharing out (4 processes on this 2-core box stepped at the 1-process median, and the fit gave 3.0-3.4
    cores). Then the machine's effective cores
    for rank processes: c in slowdown(N) = max(1, N / c), least squares over N >= 2 of t_N / t_1 = N / c
    (with the other work on the machine counted, as a real job meets it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _step_compute(reps=1, warmup=1, batch_size=8)  # the first step's lazy imports (~10 s), once, before forking
        times = [_concurrent_step(n, reps=reps, warmup=warmup, seconds=seconds) for n in range(1, max_procs + 1)]
    finally:
        torch.set_num_threads(threads)
    out = [Figure(f"concurrent_step_s_{n}", t, "s", f"median step of the toy LM (forward + backward + AdamW, one "
                  f"thread) over {n} forked processes computing at once, each the mean of its steps (wall time "
                  f"over their number) over "
                  f"{seconds:g} s (at least {reps}) after {warmup}", n * reps) for n, t in enumerate(times, start=1)]
    out.append(Figure("cpu_cores_effective", effective_cores(times), "cores",
                      "c in slowdown(N) = N / c, least squares through 0 of t_N / t_1 over N = 2.."
                      f"{max_procs} concurrent processes (measured.concurrent_step_s_N)", max_procs - 1))
    return out


def effective_cores(times: list[float]) -> float:
    """c in slowdown(N) = N / c, least squares through 0 of t_N / t_1 over N >= 2, from `times` (t_1, t_2, ...:
    the step with N processes computing at once). Pure."""
    if len(times) < 2 or times[0] <= 0:
        raise ValueError(f"effective_cores needs the step of 1 process (> 0) and of 2 or more, got {times}")
    ratios = [(n, t / times[0]) for n, t in enumerate(times, start=1) if n >= 2]
    return sum(n * n for n, _ in ratios) / sum(n * r for n, r in ratios)  # r = n x (1 / c)


def _concurrent_step(n: int, *, reps: int, warmup: int, seconds: float) -> float:
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pids = []
    try:
        for _ in range(n):
            pid = os.fork()
            if pid == 0:  # child: wait for the start, step, report, exit without running the parent's cleanup
                code = 1
                try:
                    os.close(go_w)
                    os.read(go_r, 1)
                    f = _step_compute(reps=reps, warmup=warmup, batch_size=8, min_seconds=seconds, mean=True)
                    os.write(res_w, f"{f.value!r}\n".encode())
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        os.write(go_w, b"g" * n)
        os.close(res_w)
        res_w = -1
        data = b""
        with os.fdopen(res_r, "rb") as f:
            res_r = -1
            data = f.read()
    finally:
        for fd in (go_r, go_w, res_r, res_w):
            if fd >= 0:
                os.close(fd)
        for pid in pids:
            os.waitpid(pid, 0)
    values = [float(line) for line in data.split()]
    if len(values) != n:
        raise RuntimeError(f"{n - len(values)} of {n} concurrent step processes failed")
    return statistics.median(values)


# -- loopback transports ----------------------------------------------------------------------------

def _pair(kind: str) -> tuple[socket.socket, socket.socket]:
    if kind == "unix":
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    finally:
        listener.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def _recv_exact(s: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = s.recv_into(view[got:])
        if not n:
            raise ConnectionError("peer closed during calibration")
        got += n


def stream_pair(kind: str, *, pings: int = 2000, nbytes: int = 64 << 20, reps: int = 5) -> tuple[Figure, Figure]:
    """(one-way latency in us, bandwidth in GB/s) over a `kind` ('tcp' | 'unix') socket pair."""
    a, b = _pair(kind)
    stop = threading.Event()
    payload = bytearray(nbytes)

    def echo() -> None:  # answers pings, then sinks bulk transfers and acks each one
        one = bytearray(1)
        for _ in range(pings):
            _recv_exact(b, memoryview(one))
            b.sendall(one)
        sink = memoryview(bytearray(nbytes))
        while not stop.is_set():
            try:
                _recv_exact(b, sink)
            except (ConnectionError, OSError):
                return
            b.sendall(b"k")

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    try:
        one = bytearray(1)
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            a.sendall(one)
            _recv_exact(a, memoryview(one))
            rtts.append(time.perf_counter() - t0)
        ack = memoryview(bytearray(1))
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            a.sendall(payload)
            _recv_exact(a, ack)
            times.append(time.perf_counter() - t0)
        stop.set()
    finally:
        a.close()
        t.join(timeout=10)
        b.close()
    where = "127.0.0.1 TCP (TCP_NODELAY)" if kind == "tcp" else "Unix stream socket pair"
    bulk = statistics.median(times[1:])
    return (Figure(f"{kind}_one_way_us", statistics.median(rtts) / 2 * 1e6, "us",
                   f"half the median round trip of a 1-byte ping-pong over a {where}", pings),
            Figure(f"{kind}_gb_s", nbytes / bulk / 1e9, "GB/s",
                   f"{nbytes >> 20} MiB sendall + 1-byte ack over a {where}, median of {reps} after one warm-up",
                   reps))


def shm_bandwidth(*, nbytes: int = 64 << 20, reps: int = 5) -> Figure:
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=directory, prefix="ftrun-calibrate-") as f:
        f.truncate(nbytes)
        mem = np.memmap(f.name, dtype=np.uint8, mode="r+", shape=(nbytes,))
        src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

        def through() -> None:
            np.copyto(mem, src)  # the sender writes the staging area ...
            np.copyto(dst, mem)  # ... the receiver copies it out

        through()
        t, n = _median_time(through, reps)
        del mem
    return Figure("shm_gb_s", nbytes / t / 1e9, "GB/s",
                  f"{nbytes >> 20} MiB copied into and back out of a {directory or 'temp'} shared-memory file "
                  f"(np.copyto both ways), median of {reps}", n)


# -- catch-up ---------------------------------------------------------------------------------------

def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points. Pure."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"need >= 2 distinct x values, got {xs}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def fetch_costs(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(seconds per fetch, seconds per byte) from timed fetches of several sizes (bytes xs, seconds ys): the
    slope of the least-squares line, and the median fetch of the smallest size less its bytes at that slope
    (the line's intercept, extrapolated from MiB-sized fetches, is noisy where a small state's fetch is
    mostly this cost). Pure."""
    _, slope = linear_fit(xs, ys)
    slope = max(slope, 0.0)
    small = min(xs)
    return max(statistics.median(y for x, y in zip(xs, ys) if x == small) - small * slope, 0.0), slope


def busy_source_main() -> None:
    """A catch-up source (a process `catchup_costs(busy_source=True)` starts) that trains while it serves, as
    a healthy replica does. Token on stdin's first line; then "STEP NBYTES" lines publish a state of that
    size ("ready" answers); it trains the toy LM in a thread until stdin closes."""
    import sys

    import torch

    from ftrun.catchup.config import CatchupConfig
    from ftrun.catchup.server import CatchupServer
    from ftrun.env.real import RealEnv

    torch.set_num_threads(1)
    token = sys.stdin.readline().strip()
    server = CatchupServer(env=RealEnv(), token=token, config=CatchupConfig(max_shard_bytes=8 << 20))
    print(server.start(), flush=True)
    stop = threading.Event()
    t = threading.Thread(target=lambda: [step_compute(reps=1, warmup=0) for _ in iter(stop.is_set, True)],
                         daemon=True)
    t.start()
    for line in sys.stdin:
        step, nbytes = (int(x) for x in line.split())
        server.publish(step, {"w": torch.arange(nbytes // 4, dtype=torch.float32)}, {"calibrate": True})
        server.wait_ready(timeout=60.0)
        print("ready", flush=True)
    stop.set()
    server.stop()


def catchup_costs(*, sizes_mb: tuple[float, ...] = (0.0625, 4, 16, 32), reps: int = 5,
                  shard_mb: int = 8, busy_source: bool = False) -> tuple[Figure, Figure]:
    """(seconds per fetch, ns per byte) of the real HTTP catch-up on 127.0.0.1. busy_source: the source is
    another process training the toy LM meanwhile (a healthy replica serving a joiner); else a server
    in this process, idle."""
    if busy_source:
        return _catchup_costs_busy(sizes_mb=sizes_mb, reps=reps)
    import secrets

    import torch

    from ftrun.catchup.client import fetch
    from ftrun.catchup.config import CatchupConfig
    from ftrun.catchup.server import CatchupServer
    from ftrun.config import Timeouts
    from ftrun.env.real import RealEnv

    env, token = RealEnv(), secrets.token_hex(16)
    config = CatchupConfig(max_shard_bytes=shard_mb << 20)
    server = CatchupServer(env=env, token=token, config=config)
    url = server.start()
    xs, ys = [], []
    try:
        buffer = torch.zeros(int(max(sizes_mb) * (1 << 20)), dtype=torch.uint8)
        for step, mb in enumerate(sizes_mb, start=1):
            n = int(mb * (1 << 20)) // 4
            state = {"w": torch.arange(n, dtype=torch.float32)}
            server.publish(step, state, {"calibrate": True})
            server.wait_ready(timeout=30.0)
            fetch(step, [url], token, Timeouts(catchup_timeout_s=60.0), config=config, buffer=buffer)  # warm up
            _time_fetches(step, url, token, config, buffer, reps, xs, ys)
    finally:
        server.stop()
    per_fetch, per_byte = fetch_costs(xs, ys)
    sizes = ", ".join(f"{m:g}" for m in sizes_mb)
    method = (f"least-squares line through {len(xs)} fetches ({reps} each of {sizes} MiB states, {shard_mb} MiB "
              f"shards) by ftrun.catchup.client.fetch from a CatchupServer on 127.0.0.1 in this process")
    return (Figure("catchup_per_fetch_s", per_fetch, "s", "the median smallest fetch less its bytes at the slope of "
                   "the " + method, len(xs)),
            Figure("catchup_ns_per_byte", per_byte * 1e9, "ns/B", "slope of the " + method, len(xs)))


def _catchup_costs_busy(*, sizes_mb: tuple[float, ...], reps: int) -> tuple[Figure, Figure]:
    import secrets
    import subprocess
    import sys

    import torch

    from ftrun.catchup.config import CatchupConfig

    token = secrets.token_hex(16)
    source = "from harness.calibrate.measure import busy_source_main; busy_source_main()"
    proc = subprocess.Popen([sys.executable, "-c", source],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    xs, ys = [], []
    try:
        proc.stdin.write(token + "\n")
        proc.stdin.flush()
        url = proc.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the busy catch-up source did not start (exit {proc.poll()})")
        config = CatchupConfig(max_shard_bytes=8 << 20)
        buffer = torch.zeros(int(max(sizes_mb) * (1 << 20)), dtype=torch.uint8)
        for step, mb in enumerate(sizes_mb, start=1):
            proc.stdin.write(f"{step} {int(mb * (1 << 20)) // 4 * 4}\n")
            proc.stdin.flush()
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the busy catch-up source did not publish")
            _time_fetches(step, url, token, config, buffer, reps, xs, ys)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    per_fetch, per_byte = fetch_costs(xs, ys)
    sizes = ", ".join(f"{m:g}" for m in sizes_mb)
    method = (f"least-squares line through {len(xs)} cold fetches ({reps} each of {sizes} MiB states, 8 MiB shards) by "
              "ftrun.catchup.client.fetch from a CatchupServer in another process that trains the toy LM meanwhile "
              "(a healthy replica serving a joiner), on 127.0.0.1")
    return (Figure("catchup_per_fetch_s", per_fetch, "s", "the median smallest fetch less its bytes at the slope of "
                   "the " + method, len(xs)),
            Figure("catchup_ns_per_byte", per_byte * 1e9, "ns/B", "slope of the " + method, len(xs)))


def storage_write(*, reps: int = 30, nbytes: int = 1024) -> Figure:
    """One ftrun.storage.FileStorage.write_atomic of a loader_state-sized file in the temp folder."""
    from ftrun.storage import FileStorage

    with tempfile.TemporaryDirectory(prefix="ftrun-calibrate-") as d:
        storage, blob, i = FileStorage(d), b"x" * nbytes, 0

        def write() -> None:
            nonlocal i
            storage.write_atomic(f"loader_state-{i % 3}.json", blob)
            i += 1

        write()
        t, n = _median_time(write, reps)
    return Figure("storage_write_s", t, "s", f"median ftrun.storage.FileStorage.write_atomic (write, fsync, rename, "
                  f"fsync the folder) of a {nbytes} B file under {tempfile.gettempdir()}, {reps} writes", n)


def storage_read(*, reps: int = 200, nbytes: int = 1024) -> Figure:
    """One ftrun.storage.FileStorage.read of a loader_state-sized file (a loader_state save reads both slots
    before it writes: ftrun.data.loader_state)."""
    from ftrun.storage import FileStorage

    with tempfile.TemporaryDirectory(prefix="ftrun-calibrate-") as d:
        storage = FileStorage(d)
        storage.write_atomic("loader_state.json", b"x" * nbytes)
        t, n = _median_time(lambda: storage.read("loader_state.json"), reps)
    return Figure("storage_read_s", t, "s", f"median ftrun.storage.FileStorage.read of a {nbytes} B file under "
                  f"{tempfile.gettempdir()}, {reps} reads", n)


class WriteSampler:
    """The loader_state write (as `storage_write`) timed every `period_s` in a thread while something else
    runs: the disk of a shared machine swings (fsync 0.5 ms to 16 ms minutes apart on this one), so the write
    a real run met is measured while it runs. `start()`, `stop()`, then `figure()`."""

    def __init__(self, *, period_s: float = 0.25, nbytes: int = 1024) -> None:
        from ftrun.storage import FileStorage

        self.period_s, self.nbytes = period_s, nbytes
        self._dir = tempfile.TemporaryDirectory(prefix="ftrun-calibrate-")
        self._storage = FileStorage(self._dir.name)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="write-sampler", daemon=True)
        self.times: list[float] = []

    def _run(self) -> None:
        blob, i = b"x" * self.nbytes, 0
        while not self._stop.wait(self.period_s):
            t0 = time.perf_counter()
            self._storage.write_atomic(f"loader_state-{i % 2}.json", blob)
            self.times.append(time.perf_counter() - t0)
            i += 1

    def start(self) -> "WriteSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._dir.cleanup()

    def figure(self, name: str = "storage_write_s", during: str = "the real runs") -> Figure | None:
        """The median write while it ran (None: no sample), as figure `name`; `during`: what ran meanwhile."""
        if not self.times:
            return None
        return Figure(name, statistics.median(self.times), "s", f"median ftrun.storage.FileStorage."
                      f"write_atomic of a {self.nbytes} B file under {tempfile.gettempdir()}, one every "
                      f"{self.period_s:g} s while {during} ran", len(self.times))


def storage_append(*, reps: int = 200, nbytes: int = 256) -> Figure:
    """One ftrun.data.audit.FileAuditSink append (O_APPEND write(2), no fsync) of an audit-record-sized line."""
    from ftrun.data.audit import FileAuditSink

    with tempfile.TemporaryDirectory(prefix="ftrun-calibrate-") as d:
        sink = FileAuditSink(os.path.join(d, "audit.jsonl"))
        line = b"x" * (nbytes - 1) + b"\n"
        try:
            sink(line)
            t, n = _median_time(lambda: sink(line), reps)
        finally:
            sink.close()
    return Figure("storage_append_s", t, "s", f"median ftrun.data.audit.FileAuditSink append (O_APPEND write, no "
                  f"fsync) of a {nbytes} B line under {tempfile.gettempdir()}, {reps} appends", n)


# -- FTAR kernels -----------------------------------------------------------------------------------

def ftar_kernels(*, nbytes: int = 8 << 20, reps: int = 20) -> tuple[Figure, Figure]:
    """(reduce GB/s, copy GB/s) of the CPU FTAR kernels on float32 chunks."""
    from ftrun.ftar.cpu_kernels import CpuKernels
    from ftrun.ftar.kernels import DType

    k = CpuKernels()
    rng = np.random.default_rng(0)
    dst = rng.standard_normal(nbytes // 4, dtype=np.float32).view(np.uint8)
    src = rng.standard_normal(nbytes // 4, dtype=np.float32).view(np.uint8)
    k.reduce(dst, 0, src, 0, nbytes, DType.FLOAT32)  # compile / page in
    k.copy(dst, 0, src, 0, nbytes)
    tr, n = _median_time(lambda: k.reduce(dst, 0, src, 0, nbytes, DType.FLOAT32), reps)
    tc, _ = _median_time(lambda: k.copy(dst, 0, src, 0, nbytes), reps)
    how = f"ftrun.ftar.cpu_kernels.CpuKernels on {nbytes >> 20} MiB float32 chunks, median of {reps}"
    return (Figure("ftar_reduce_gb_s", nbytes / tr / 1e9, "GB/s", "reduce (dst += src) with " + how, n),
            Figure("ftar_copy_gb_s", nbytes / tc / 1e9, "GB/s", "copy with " + how, n))


def ftar_rebuild(*, config: FtarConfig | None = None, nbytes: int = 20 << 10, reps: int = 15) -> Figure:
    """What a rank's process CPU rises by in an all-reduce that first builds a new ring (FtarEngine.reconfigure to a
    new epoch: its connections, the transport negotiation, the shared staging mapped, then the all-reduce) over an
    all-reduce on a ring built already: two processes (spawned), each an FtarEngine with `config` (FtarConfig();
    default: the engine's defaults) on `nbytes` of float32, per rank the median over `reps` rebuilds less the median
    of the steady all-reduces between them; the mean of the 2 ranks, floored at 0."""
    import multiprocessing

    from ftrun.config import FtarConfig

    config = config or FtarConfig()
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or torch state
    addrs, results = ctx.Queue(), ctx.Queue()
    rings = [ctx.Queue() for _ in range(2)]
    procs = [ctx.Process(target=_rebuild_worker, args=(rank, config, nbytes, reps, addrs, rings[rank], results),
                         daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = dict(addrs.get(timeout=60) for _ in procs)
        for q in rings:
            q.put([got[0], got[1]])
        extra = [results.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return Figure("ftar_rebuild_cpu_s", max(sum(extra) / len(extra), 0.0), "s", f"a rank's process CPU in "
                  f"FtarEngine.reconfigure to a new epoch plus its first all-reduce, less a steady all-reduce's "
                  f"(2 spawned processes on 127.0.0.1, {nbytes} bytes of float32, chunk_bytes {config.chunk_bytes}, "
                  f"num_chunks {config.num_chunks}, transport {config.transport}; per rank the median of {reps} "
                  f"rebuilds less the median steady all-reduce, the mean of the 2 ranks, floored at 0)", 2 * reps)


def _rebuild_worker(rank: int, config, nbytes: int, reps: int, addrs, ring_q, results) -> None:
    """One rank of `ftar_rebuild` (a spawned process): its engine's address out, the ring in, its CPU rise out."""
    from ftrun.env.real import RealEnv
    from ftrun.ftar.cpu_kernels import CpuKernels
    from ftrun.ftar.engine import FtarEngine

    engine = FtarEngine(env=RealEnv(), kernels=CpuKernels(), token="calibrate", config=config)
    addrs.put((rank, engine.addr))
    ring = ring_q.get(timeout=60)
    grads = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
    fresh, steady = [], []
    try:
        for epoch in range(1, reps + 2):
            c0 = time.process_time()
            engine.reconfigure(epoch=epoch, ring=ring, index=rank)
            engine.all_reduce(grads)
            c1 = time.process_time()
            if epoch > 1:  # the first builds the process's first ring: its imports and threads start
                fresh.append(c1 - c0)
            for _ in range(3):
                c0 = time.process_time()
                engine.all_reduce(grads)
                steady.append(time.process_time() - c0)
    finally:
        engine.close()
    results.put(statistics.median(fresh) - statistics.median(steady))


def _time_fetches(step: int, url: str, token: str, config, buffer, reps: int, xs: list, ys: list) -> None:
    """`reps` timed catch-up fetches of `step` from `url`: bytes into xs, seconds into ys."""
    from ftrun.catchup.client import fetch
    from ftrun.config import Timeouts

    timeouts = Timeouts(catchup_timeout_s=60.0)
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fetch(step, [url], token, timeouts, config=config, buffer=buffer)
        ys.append(time.perf_counter() - t0)
        xs.append(float(result.num_bytes))
