"""The same catch-up job as `benchmarks/catchup_launch.py`, run with torchft 0.2.0: the baseline of issue 15 item 1.

    VENV/bin/python benchmarks/catchup_torchft.py [--steps 170] [--kill-at 10,60,110] [--json]
    VENV/bin/python benchmarks/catchup_torchft.py --isolated 10 [--json]     # the transfer alone

VENV is a separate virtual environment holding torch==2.13.0 and torchft==0.2.0 (`make torchft-venv` makes
/tmp/ftrun-torchft-venv); ftrun itself is not imported. Three replicas x 1 rank train the same 4.2M-parameter MLP
under AdamW (a 50.4 MB state: parameters and both Adam moments) on the same random regression data, with
torchft's Manager (async quorum, its Rust lighthouse and manager servers on loopback), its gloo process group,
its optimizer wrapper and its default HTTP checkpoint transport. r1 is SIGKILLed after r0 commits each
--kill-at step (or, if the previous restart has not rejoined yet, once it has) and restarted 0.5 s later, as
`ftrun launch` does; the restarted replica heals from one healthy peer (torchft recovers from one source).

Per rejoin it reports the joiner's `recv_checkpoint` (torchft's whole transfer of the state: the HTTP GET and
the deserialisation into tensors: `fetch_s`, the figure catchup_launch.py reports as the joiner's fetch) and r0's
step around the rejoin against its median step, under catchup_launch.py's keys. That step can still hold the
kill's own stall when the restart rejoins before the survivors' quorum has dropped the killed replica, so
`max_stall_steps` here is an upper bound. torchft's servers bind as torchft binds them (every interface); all
traffic goes to this host's own addresses. A kill with no rejoin after it exits 1.

`--isolated ITERS`: no job, the transfer alone, as `ftrun bench catchup --fresh-buffer` measures ftrun's: one
source process holding the MLP's state (after two AdamW steps), this process fetching it ITERS times
(`isolated_best_s`, `isolated_median_s`, `isolated_best_gbps`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

WIDTH = 1024
RESTART_DELAY_S = 0.5


def worker(replica: int, lighthouse: str, width: int, batch_size: int, seed: int) -> None:
    """One replica's rank: trains until killed or told to stop (stdin closes), one JSON line per event."""
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.optim import OptimizerWrapper

    def emit(kind: str, **fields: object) -> None:
        print(json.dumps({"event": kind, "replica": replica, "t": time.time(), **fields}), flush=True)

    class TimedTransport(HTTPTransport):
        def recv_checkpoint(self, src_rank, metadata, step, timeout):  # noqa: ANN001, ANN201
            start = time.perf_counter()
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
            emit("recv_checkpoint", seconds=time.perf_counter() - start, nbytes=nbytes, step=step)
            return state

    torch.manual_seed(seed)  # every replica starts from the same weights, as ftrun's do
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = torch.randn(4096, 2 * width, generator=torch.Generator().manual_seed(seed))

    def load_state(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=30)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state, state_dict=save_state,
                      min_replica_size=1, replica_id=f"r{replica}", lighthouse_addr=lighthouse,
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1, hostname="localhost",
                      timeout=timeout, checkpoint_transport=TimedTransport(timeout=timeout, num_chunks=0))
    optim = OptimizerWrapper(manager, inner)
    params = list(model.parameters())
    emit("ready")
    rows = data.shape[0]
    while True:
        step = manager.current_step()
        start = (step * 3 + replica) * batch_size % rows
        batch = data[start:start + batch_size]
        optim.zero_grad()  # starts the quorum
        loss = torch.nn.functional.mse_loss(model(batch[:, :width]), batch[:, width:])
        loss.backward()
        works = [manager.allreduce(p.grad) for p in params]
        for work in works:
            work.wait()
        optim.step()  # should_commit, then the optimizer step when committed
        emit("step", step=manager.current_step(), participants=manager.num_participants(),
             healing=bool(manager._healing))


def serve(width: int) -> None:
    """A source alone: the MLP's state after two AdamW steps, served by torchft's HTTP transport until stdin
    closes; prints the address a joiner fetches from."""
    from datetime import timedelta

    import torch
    from torchft.checkpointing.http_transport import HTTPTransport

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(2):
        model(torch.randn(8, width)).square().mean().backward()
        optim.step()
    transport = HTTPTransport(timedelta(seconds=60), num_chunks=0)
    transport.send_checkpoint(dst_ranks=[1], step=1, state_dict={"model": model.state_dict(), "optim": optim.state_dict()},
                              timeout=timedelta(seconds=60))
    print(json.dumps({"address": transport.metadata()}), flush=True)
    sys.stdin.read()
    transport.shutdown()


def isolated(iters: int, width: int) -> dict:
    """The transfer alone: a joiner process (this one) fetches the state `iters` times from a source
    process with nothing else running, as `ftrun bench catchup` measures ftrun's."""
    from datetime import timedelta

    from torchft.checkpointing.http_transport import HTTPTransport

    source = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--width", str(width)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        address = json.loads(source.stdout.readline())["address"]
        joiner = HTTPTransport(timedelta(seconds=60), num_chunks=0)
        seconds, nbytes = [], 0
        for _ in range(iters):
            start = time.perf_counter()
            state = joiner.recv_checkpoint(src_rank=0, metadata=address, step=1, timeout=timedelta(seconds=60))
            seconds.append(time.perf_counter() - start)
            nbytes = sum(t.numel() * t.element_size() for t in _tensors(state))
            del state
        joiner.shutdown()
    finally:
        source.stdin.close()
        source.wait(timeout=30)
    return {"isolated_bytes": nbytes, "isolated_best_s": min(seconds), "isolated_median_s": statistics.median(seconds),
            "isolated_best_gbps": nbytes / min(seconds) / 1e9}


def _tensors(obj: object):  # noqa: ANN202
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


progress = {"r0_step": 0, "r1_healed_at": 0.0}  # the newest of each, kept by the readers under the lock


class Replica:
    """A worker process and the events it printed."""

    def __init__(self, index: int, lighthouse: str, args: argparse.Namespace, sink: list, lock: threading.Lock):
        self.index = index
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        log = open(os.path.join(args.logs, f"r{index}.log"), "a") if args.logs else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(index), "--lighthouse", lighthouse,
             "--width", str(args.width)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        if args.logs:
            log.close()
        self.started = time.time()
        self.reader = threading.Thread(target=self._read, args=(sink, lock), daemon=True)
        self.reader.start()

    def _read(self, sink: list, lock: threading.Lock) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                with lock:
                    sink.append(event)
                    if event["event"] == "step" and event["replica"] == 0:
                        progress["r0_step"] = max(progress["r0_step"], event["step"])
                    elif event["event"] == "recv_checkpoint" and event["replica"] == 1:
                        progress["r1_healed_at"] = event["t"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def run(args: argparse.Namespace) -> dict:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    events: list[dict] = []
    lock = threading.Lock()
    kills = [int(s) for s in args.kill_at.split(",") if s]
    replicas = {i: Replica(i, lighthouse.address(), args, events, lock) for i in range(3)}
    kill_times: list[tuple[int, float]] = []
    deadline = time.time() + args.timeout
    try:
        while True:
            with lock:
                done, healed_at = progress["r0_step"], progress["r1_healed_at"]
            if done >= args.steps:
                break
            if kill_times and healed_at < kill_times[-1][1]:
                pass  # the restarted replica has not rejoined yet: a kill now would measure nothing
            elif kills and done >= kills[0]:
                kills.pop(0)
                replicas[1].kill()
                kill_times.append((done, time.time()))
                print(f"killed r1 after r0's step {done}", file=sys.stderr, flush=True)
                time.sleep(RESTART_DELAY_S)
                replicas[1] = Replica(1, lighthouse.address(), args, events, lock)
            for index, rep in replicas.items():
                if rep.proc.poll() is not None and rep.proc.returncode != -signal.SIGKILL:
                    raise SystemExit(f"r{index} exited with {rep.proc.returncode}")
            if time.time() > deadline:
                raise SystemExit(f"timed out at r0's step {done}")
            time.sleep(0.02)
    finally:
        for rep in replicas.values():
            rep.kill()
        lighthouse.shutdown()
    return analyse(events, kill_times)


def analyse(events: list[dict], kill_times: list[tuple[int, float]]) -> dict:
    """The figures under catchup_launch.py's keys: per rejoin the joiner's transfer and r0's step around it."""
    r0 = sorted((e for e in events if e["event"] == "step" and e["replica"] == 0), key=lambda e: e["t"])
    step_lengths = {b["step"]: b["t"] - a["t"] for a, b in zip(r0, r0[1:]) if b["step"] == a["step"] + 1}
    heals = sorted((e for e in events if e["event"] == "recv_checkpoint" and e["replica"] == 1), key=lambda e: e["t"])
    rejoins, missing, heal_steps = [], [], set()
    for step, killed_at in kill_times:
        after = [h for h in heals if h["t"] > killed_at]
        if not after:
            missing.append(step)
            continue
        heal = after[0]
        # r0's first commit after the joiner's transfer ends is of the step it waited in, if it waited
        later = [e for e in r0 if e["t"] >= heal["t"]]
        waited_step = later[0]["step"] if later else None
        heal_steps.add(waited_step)
        rejoins.append({"killed_after_step": step, "fetch_s": heal["seconds"], "bytes": heal["nbytes"],
                        "gbps": heal["nbytes"] / heal["seconds"] / 1e9, "step_s": step_lengths.get(waited_step)})
    plain = [length for step, length in step_lengths.items() if step not in heal_steps and step > 2]
    median = statistics.median(plain) if plain else float("nan")
    stalls = [r["step_s"] - median for r in rejoins if r["step_s"] is not None]
    return {"median_step_s": median, "rejoins": rejoins, "kills_without_rejoin": missing,
            "median_rejoin_fetch_s": statistics.median(r["fetch_s"] for r in rejoins) if rejoins else float("nan"),
            "max_stall_steps": max(stalls) / median if stalls else float("nan")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=170)
    p.add_argument("--kill-at", default="10,60,110", help="r0's steps after which r1 is killed, comma separated")
    p.add_argument("--width", type=int, default=WIDTH)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    p.add_argument("--json", action="store_true")
    p.add_argument("--logs", help="append each replica's stderr to DIR/rN.log")
    p.add_argument("--isolated", type=int, metavar="ITERS",
                   help="instead of the job: the transfer alone, ITERS fetches from one source process")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.lighthouse, args.width, batch_size=64, seed=0)
        return 0
    if args.serve:
        serve(args.width)
        return 0
    if args.isolated:
        figures = isolated(args.isolated, args.width)
        print(f"{figures['isolated_bytes'] / 1e6:.1f} MB from one source: best {figures['isolated_best_s'] * 1e3:.1f} ms "
              f"({figures['isolated_best_gbps']:.2f} GB/s), median {figures['isolated_median_s'] * 1e3:.1f} ms "
              f"of {args.isolated}")
        if args.json:
            print(json.dumps(figures, sort_keys=True))
        return 0
    figures = run(args)
    print(f"median step {figures['median_step_s'] * 1e3:.1f} ms (r0, steps without a joiner)")
    for r in figures["rejoins"]:
        step = "-" if r["step_s"] is None else f"{r['step_s'] * 1e3:.1f} ms"
        print(f"rejoin after step {r['killed_after_step']}: recv_checkpoint {r['bytes'] / 1e6:.1f} MB in "
              f"{r['fetch_s'] * 1e3:.1f} ms ({r['gbps']:.2f} GB/s); r0's step around it took {step}")
    if figures["rejoins"]:
        print(f"rejoins: median fetch {figures['median_rejoin_fetch_s'] * 1e3:.1f} ms; "
              f"max stall {figures['max_stall_steps']:.2f} steps (r0's step around a rejoin less the median step)")
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    if figures["kills_without_rejoin"]:
        print(f"no rejoin after the kill at step(s) {figures['kills_without_rejoin']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
