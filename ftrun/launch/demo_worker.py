"""One rank of the `ftrun demo` job: a stepping loop under the replica manager.

The step's compute is a sleep and its gradient exchange a collective inside the replica; quorum and
two-phase commit are the real ones. Rank 0 prints one JSON event per line (quorum, heal, commit, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch.distributed as dist

from ftrun.config import ManagerConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.client import LighthouseClient
from ftrun.replica.comm import GlooComm
from ftrun.replica.manager import Manager


def emit(event: dict) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-time", type=float, default=0.1)
    args = p.parse_args(argv)
    spec = WorkerSpec.from_environ()
    env, timeouts = RealEnv(), Timeouts()
    store = dist.TCPStore(spec.store_addr, spec.store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeouts.connect_timeout_s))
    comm = GlooComm(store=store, prefix=f"{spec.replica_id}/{spec.incarnation}/", rank=spec.rank,
                    world_size=spec.ranks_per_replica, timeout_s=timeouts.commit_timeout_s)
    leader = spec.rank == 0
    client = LighthouseClient(env=env, addr=spec.lighthouse, token=spec.token, replica_id=spec.replica_id,
                              timeouts=timeouts) if leader else None
    manager = Manager(config=ManagerConfig(timeouts=timeouts), env=env, comm=comm, replica_id=spec.replica_id,
                      lighthouse=client, on_event=emit if leader else None)
    if leader:
        emit({"event": "ready", "t": env.clock.now()})
    while manager.step < args.steps:
        manager.start_step()
        env.clock.sleep(args.step_time)  # stands in for forward and backward
        comm.all_reduce_int([1], "sum")  # stands in for the gradient exchange
        manager.should_commit()
    manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
