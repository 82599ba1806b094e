"""Process supervision: start the ranks of each replica, kill a replica, restart it.

A replica is the unit of failure: killing it SIGKILLs every rank process it has; restarting it starts
all of them again with a higher incarnation (they rendezvous under a fresh store prefix). Rank 0 of each
replica writes JSON event lines on stdout; `events` delivers them, tagged with the replica, in order of
arrival.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace

from ftrun.env.base import Env
from ftrun.launch.worker_env import WorkerSpec


class ReplicaProcesses:
    def __init__(self, *, env: Env, spec: WorkerSpec, argv: list[str], events, log_dir: str) -> None:
        self.env, self.spec, self.argv, self._events, self._log_dir = env, spec, argv, events, log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        self.procs = []
        for rank in range(self.spec.ranks_per_replica):
            spec = replace(self.spec, rank=rank)
            log = open(os.path.join(self._log_dir, f"{spec.replica_id}.{spec.incarnation}.{rank}.log"), "wb")
            proc = subprocess.Popen(
                [sys.executable, *self.argv], env={**os.environ, **spec.to_environ()},
                stdout=subprocess.PIPE if rank == 0 else log, stderr=log, start_new_session=True,
            )
            self.procs.append(proc)
        self.env.spawn(self._pump, self.procs[0], self.spec.incarnation, name=f"pump-{self.spec.replica_id}")

    def _pump(self, proc: subprocess.Popen, incarnation: int) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not an event line
            if isinstance(event, dict):
                self._events.put({**event, "replica_id": self.spec.replica_id, "incarnation": incarnation})

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def restart(self) -> None:
        self.kill()
        self.spec = replace(self.spec, incarnation=self.spec.incarnation + 1)
        self.start()

    def exited(self) -> list[int | None]:
        return [p.poll() for p in self.procs]
