"""One rank of the `ftrun demo` job: a stepping loop under the replica manager.

The step's compute is a sleep; the gradient exchange across replicas is the real FTAR among the quorum's
participants (a 1 MiB buffer per rank), and so are quorum and two-phase commit. A peer dying mid-exchange
becomes a failed commit and the step is retried under the next quorum. Rank 0 prints one JSON event per line (quorum, heal, commit, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import numpy as np
import torch.distributed as dist

from ftrun.config import ManagerConfig, Timeouts
from ftrun.env.real import RealEnv
from ftrun.ftar.cpu_kernels import CpuKernels
from ftrun.ftar.engine import FtarConfig, FtarEngine
from ftrun.ftar.ring import RecoverableError
from ftrun.launch.worker_env import WorkerSpec
from ftrun.quorum.client import LighthouseClient
from ftrun.replica.comm import GlooComm
from ftrun.replica.endpoints import encode_endpoints
from ftrun.replica.manager import Manager
from ftrun.train.exchange import GradientExchange


def emit(event: dict) -> None:
    print(json.dumps(event), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=None, help="default: FTRUN_MAX_STEPS from the launcher")
    p.add_argument("--step-time", type=float, default=0.1)
    args = p.parse_args(argv)
    spec = WorkerSpec.from_environ()
    steps = args.steps if args.steps is not None else spec.max_steps
    if steps is None:
        p.error("--steps is required when FTRUN_MAX_STEPS is not set")
    env, timeouts = RealEnv(), Timeouts()
    store = dist.TCPStore(spec.store_addr, spec.store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeouts.connect_timeout_s))
    comm = GlooComm(store=store, prefix=f"{spec.replica_id}/{spec.incarnation}/", rank=spec.rank,
                    world_size=spec.ranks_per_replica, timeout_s=timeouts.replica_comm_s)
    leader = spec.rank == 0
    client = LighthouseClient(env=env, addr=spec.lighthouse, token=spec.token, replica_id=spec.replica_id,
                              timeouts=timeouts) if leader else None
    engine = FtarEngine(env=env, kernels=CpuKernels(), token=spec.token,
                        config=FtarConfig(chunk_bytes=256 << 10, num_chunks=2, timeout_s=timeouts.ftar_timeout_s))
    exchange = GradientExchange(engine=engine, rank=spec.rank)
    manager = Manager(config=ManagerConfig(timeouts=timeouts), env=env, comm=comm, replica_id=spec.replica_id,
                      lighthouse=client, data_addr=encode_endpoints({"ftar": engine.addr}),
                      on_event=emit if leader else None)
    if leader:
        emit({"event": "ready", "t": env.clock.now()})
    grads = np.empty(1 << 18, np.float32)
    while manager.step < steps:
        quorum = manager.start_step()
        env.clock.sleep(args.step_time)  # stands in for forward and backward
        grads.fill(1.0)
        try:
            exchange.average(quorum, grads)
        except RecoverableError as e:
            manager.report_error(e, peer=True)  # a peer died or stalled: not this replica's own failure
        manager.should_commit()
    manager.close()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
