"""Process supervision: start the ranks of each replica, kill a replica, restart it.

A replica is the unit of failure: killing it SIGKILLs every rank process it has; restarting it starts
all of them again with a higher incarnation, on a fresh rendezvous store (`new_store`, called before every
start: a torchrun-style script's own init_process_group needs a store no earlier incarnation wrote to). Each rank
writes stdout to `{replica}.{incarnation}.{rank}.out` and stderr to `{replica}.{incarnation}.{rank}.log`
in `log_dir`; a pump thread per incarnation follows the .out files and delivers every JSON object line
on `events`, tagged with replica_id, incarnation and rank (unless the line has them), in order per rank.
Rank processes are started by a Launcher (procs.py): spawned, or forked from the zygote.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Callable

from ftrun.env.base import Env
from ftrun.launch.procs import Handle, Launcher, SpawnLauncher
from ftrun.launch.worker_env import WorkerSpec

POLL_S = 0.02  # how often the pump looks for new output


class ReplicaProcesses:
    def __init__(self, *, env: Env, spec: WorkerSpec, argv: list[str], events, log_dir: str,
                 launcher: Launcher | None = None, new_store: Callable[[], tuple[str, int]] | None = None) -> None:
        self.env, self.spec, self.argv, self._events, self._log_dir = env, spec, argv, events, log_dir
        self._new_store = new_store  # () -> (addr, port) of a fresh store for the next incarnation; None: the spec's
        self._launcher = launcher or SpawnLauncher()
        self.procs: list[Handle] = []
        self._pump_handle = None

    def start(self) -> None:
        if self._new_store is not None:
            addr, port = self._new_store()
            self.spec = replace(self.spec, store_addr=addr, store_port=port)
        self.procs, outs = [], []
        for rank in range(self.spec.ranks_per_replica):
            spec = self.spec.for_rank(rank)
            base = os.path.join(self._log_dir, f"{spec.replica_id}.{spec.incarnation}.{rank}")
            outs.append(base + ".out")
            self.procs.append(self._launcher.start(self.argv, env={**os.environ, **spec.to_environ()},
                                                   cwd=os.getcwd(), stdout=base + ".out", stderr=base + ".log"))
        self._pump_handle = self.env.spawn(self._pump, list(self.procs), outs, self.spec.incarnation,
                                           name=f"pump-{self.spec.replica_id}-{self.spec.incarnation}")

    def drain(self, timeout: float = 2.0) -> None:
        """Wait until every event the current ranks wrote before exiting is on `events` (they must have exited)."""
        if self._pump_handle is not None:
            self._pump_handle.join(timeout)

    def _pump(self, procs: list[Handle], paths: list[str], incarnation: int) -> None:
        offsets, tails = [0] * len(paths), [b""] * len(paths)
        while True:
            ended = all(p.poll() is not None for p in procs)  # read once more after the last exit
            for rank, path in enumerate(paths):
                try:
                    with open(path, "rb") as f:
                        f.seek(offsets[rank])
                        data = f.read()
                except FileNotFoundError:
                    continue
                offsets[rank] += len(data)
                *lines, tails[rank] = (tails[rank] + data).split(b"\n")
                for line in lines:
                    self._deliver(line, rank, incarnation)
            if ended:
                return
            self.env.clock.sleep(POLL_S)

    def _deliver(self, line: bytes, rank: int, incarnation: int) -> None:
        if not line.startswith(b"{"):
            return  # not an event line
        try:
            event = json.loads(line)
        except ValueError:
            return
        if isinstance(event, dict):
            self._events.put({"rank": rank, **event, "replica_id": self.spec.replica_id, "incarnation": incarnation})

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()

    def restart(self) -> None:
        self.kill()
        self.spec = replace(self.spec, incarnation=self.spec.incarnation + 1)
        self.start()

    def stderr_tail(self, rank: int, max_bytes: int = 32768) -> str:
        """The last `max_bytes` of the running (or last) incarnation's rank `rank` stderr ("" if none)."""
        path = os.path.join(self._log_dir, f"{self.spec.replica_id}.{self.spec.incarnation}.{rank}.log")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - max_bytes))
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def exited(self) -> list[int | None]:
        return [p.poll() for p in self.procs]
