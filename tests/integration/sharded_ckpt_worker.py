"""One rank of a K-rank FSDP2 replica for test_sharded_checkpoint.py:

    python sharded_ckpt_worker.py save|async|load RANK WORLD PORT ROOT [FAULT]

save: train two steps, checkpoint step 2 (every rank its own shards, with a user state), train a third
step and try to checkpoint step 3 with FAULT (none | error: the last rank's write fails | die: the last
rank is SIGKILLed after its DCP write, before the vote). async: train two steps, stage the checkpoint of
step 2 (DcpCheckpointer.stage) and write it in a background task while training four more steps.
load: restore the latest checkpoint into this world size (1 = a plain, unsharded model), report, then
train one more step on it. Prints one JSON line of findings (digests of the FULL parameters and
optimizer moments, so different world sizes compare).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from ftrun.checkpoint import store
from ftrun.checkpoint.manifest import checkpoint_key
from ftrun.data.loader_state import LoaderState
from ftrun.data.sampler import DataLayout
from ftrun.replica.comm import GlooComm
from ftrun.env.real import RealEnv
from ftrun.train.checkpointer import DcpCheckpointer
from ftrun.train.grads import FlatGrads
from ftrun.train.shard import init_replica_group, is_dtensor
from sharded_state_worker import make, step

KEY = checkpoint_key("job-token")


class Counter:
    """A registered user state (e.g. a scheduler's or EMA's): saved as "user.counter"."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_dtensor(t) else t


def digests(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    h, m = hashlib.sha256(), hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(full(p.detach()).contiguous().view(torch.uint8).numpy().tobytes())
        st = opt.state.get(p, {})
        if "exp_avg" in st:
            m.update(full(st["exp_avg"]).contiguous().view(torch.uint8).numpy().tobytes())
    return {"params": h.hexdigest(), "moments": m.hexdigest()}


def ledger(n: int) -> LoaderState:
    layout = DataLayout(dataset_size=64, num_replicas=1, ranks_per_replica=2, batch_size_per_rank=4)
    state = LoaderState.initial(layout, ["r0"])
    for s in range(n):
        state = state.advance(step=s, contributors=["r0"])
    return state


def main() -> None:
    mode, rank, world, port, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    fault = sys.argv[6] if len(sys.argv) > 6 else "none"
    torch.set_num_threads(1)
    comm = mesh = None
    if world > 1:
        tcp = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
        comm = GlooComm(store=tcp, prefix=f"{mode}/ctl/", rank=rank, world_size=world, timeout_s=20)
        mesh = init_replica_group(store=tcp, replica_id=mode, incarnation=0, rank=rank, world_size=world,
                                  timeout_s=20)
    model, opt = make(world > 1, mesh)
    grads, counter, out = FlatGrads(model.parameters()), Counter(), {}
    if mode == "save":
        for n in range(2):
            step(model, opt, grads, rank, n)
            counter.n += 1
        info = store.save(root, step=2, model=model, optimizer=opt, loader_state=ledger(2), key=KEY,
                          extra={"counter": counter}, comm=comm)
        out.update(digests(model, opt), info=info is not None)
        step(model, opt, grads, rank, 2)
        counter.n += 1
        if fault == "die" and rank == world - 1:
            real_save = store.dcp.save

            def save_then_die(*args, **kwargs):
                real_save(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGKILL)

            store.dcp.save = save_then_die
        elif fault == "error" and rank == world - 1:
            store._own_files = lambda path, rank: (_ for _ in ()).throw(OSError("injected: disk full"))
        try:
            store.save(root, step=3, model=model, optimizer=opt, loader_state=ledger(3), key=KEY,
                       extra={"counter": counter}, comm=comm)
            out["second"] = "ok"
        except Exception as e:  # noqa: BLE001 (reported to the test)
            out["second"] = type(e).__name__
    elif mode == "async":
        for n in range(2):
            step(model, opt, grads, rank, n)
            counter.n += 1
        out.update(digests(model, opt))  # the state the checkpoint of step 2 must hold
        ckpt = DcpCheckpointer(root=root, model=model, optimizer=opt, keep=3, key=KEY, extra={"counter": counter},
                               comm=comm, timeout_s=20)
        env = RealEnv()
        started = env.event()
        write = ckpt.stage(2, ledger(2))
        task = env.spawn(lambda: (started.set(), write()), name="checkpoint-write")
        started.wait(10.0)
        for n in range(2, 6):  # FSDP collectives on the default group, check-ins on the control group meanwhile
            step(model, opt, grads, rank, n)
            counter.n += 1
            comm.all_reduce_int([n], "max")
        out.update(joined=task.join(60.0), error=repr(task.exception) if task.exception else None)
    else:
        step_, state = store.restore(root, model, opt, key=KEY, extra={"counter": counter}, comm=comm)
        out.update(digests(model, opt), step=step_, ledger_step=state.step, counter=counter.n,
                   dtensor=all(is_dtensor(p) for p in model.parameters()))
        step(model, opt, grads, rank, 2)  # the restored optimizer state steps on (a different batch per size)
        out["stepped"] = True
    if world > 1:
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
    sys.stderr.flush()
    # Skip the interpreter's teardown, as sharded_state_worker.py does: torch's C++ teardown at exit sometimes aborts
    # after the work is done and reported (a rank that had reported CheckpointError exited -6, SIGABRT, failing a CI
    # run at f9a7f27), which is not what the test checks.
    os._exit(0)
