"""Warm FSDP2's lazily built parts before a fork server (ftrun.launch.zygote) forks rank processes.

A sharded replica's rank pays, the first time in a process, for what torch builds lazily on first use:
`fully_shard` (~0.1-0.3 s), DTensor dispatch and sharding propagation in forward/backward, and the
first optimizer step over DTensor parameters (~0.5 s of one CPU here). A restarted replica pays it on the
rejoin's critical path: before it checks in, and again on its first committed step (late for the next
quorum, it fell behind and healed a second time). `warm_sharding` runs the same code path once (shard,
forward/backward, gradients through FlatGrads, the catch-up state's save and load, an optimizer step,
the failed-step reset) on a tiny model over torch's "fake" process group: no peers, no communication,
no threads (the zygote stays fork-safe), and the group is destroyed afterwards, so a forked child
starts with no default group and makes its own. Values are meaningless (fake collectives); only the
code paths get warm.

DTensor caches its sharding propagation per operator and tensor shape, so a restarted rank still pays
for its own model's shapes (~10 ms per shape and operator under load: `fully_shard`, and ~0.4 s for
its first optimizer step, which made the survivors wait for a joiner at the quorum after its first
commit). So the job tells the zygote its shapes: the first rank of a sharded job to build its trainer
writes `shapes_spec` (parameter shapes and dtypes, the optimizer's class and hyperparameters, the
replica's size) to a file and its path down the zygote's warm pipe (FTRUN_ZYGOTE_WARM_FD; `announce`),
and the zygote runs `warm_sharding(spec)` with those exact shapes, long before any restart.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from ftrun.train.compute import TorchCompute
from ftrun.train.shard import shard_model
from ftrun.train.state import ReplicaState

WORLD = 2  # a real split: every parameter is sharded, as in any K > 1 replica


class _Tiny(torch.nn.Module):
    """Embedding, a ModuleList of blocks (the default sharding units) and a head: the shapes of TinyLM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.head = torch.nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.nn.functional.gelu(block(x))
        return self.head(x)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def warm_sharding(spec: dict | None = None) -> None:
    """One FSDP2 training step and a catch-up save/load over a fake group (see the module docstring):
    on a tiny model over 2 ranks, or with `spec` (from `shapes_spec`) on the job's own parameter shapes,
    optimizer and replica size. Raises RuntimeError when this process already has a default process
    group, ValueError for a spec it cannot use."""
    if dist.is_initialized():
        raise RuntimeError("warm_sharding needs a process without a default process group")
    from torch.distributed.device_mesh import init_device_mesh

    world = WORLD if spec is None else _check(spec)
    dist.init_process_group("fake", rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        if spec is not None:
            _warm_shapes(spec, mesh)
            return
        model = _Tiny()
        shard_model(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        data = torch.zeros(4, 5, dtype=torch.int64)
        compute = TorchCompute(model=model, optimizer=optimizer, loss_fn=_loss, dataset=data)
        for _ in range(2):  # the second step runs with optimizer state, as every step after the first
            compute.forward_backward(0, lambda: torch.arange(2).numpy(), seed=0)
            compute.scatter()
            compute.apply(1.0)
        compute.state.load(compute.state.tensors(), compute.state.metadata())  # a joiner's heal
        compute.zero_grads()
        compute.scatter()  # a healed step: gradients allocated from the averaged buffer
        compute.reset()
        compute.forward_backward(0, lambda: torch.arange(2).numpy(), seed=0)
        compute.reset()  # a failed step: FSDP2's per-iteration state dropped
    finally:
        dist.destroy_process_group()


OPTIMIZER_MODULES = ("torch.optim.",)  # the only optimizer classes a spec may name (it is read from a file)


def shapes_spec(model: torch.nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> dict[str, Any]:
    """What `warm_sharding` needs to warm a sharded replica's own shapes: the parameters' global shapes
    and dtypes, the optimizer's class and JSON-able hyperparameters, the replica's size. Pure."""
    cls = type(optimizer)
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in optimizer.defaults.items()
                if isinstance(v, (bool, int, float, str, type(None))) or
                (isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v))}
    return {"world": world_size,
            "params": [[list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad]
                       for p in model.parameters()],
            "optimizer": [cls.__module__, cls.__qualname__, defaults]}


def announce(spec: dict[str, Any], run_dir: str, environ: dict | None = None) -> bool:
    """Tell this process's zygote (FTRUN_ZYGOTE_WARM_FD) the job's shapes, once per job: the first rank
    to create the spec file (written whole, then linked: exclusive) sends its path. False when there is
    no zygote to tell, or another rank already did."""
    environ = os.environ if environ is None else environ
    fd = environ.get("FTRUN_ZYGOTE_WARM_FD")
    if not fd:
        return False
    path = os.path.join(run_dir, f"zygote-warm-{spec['world']}.json")
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    try:
        os.write(int(fd), (path + "\n").encode())  # one short line: atomic on a pipe
    except OSError:
        return False  # the zygote is gone: it has nothing left to warm
    return True


def _check(spec: dict) -> int:
    """The spec's replica size; ValueError naming what is wrong with it (before any group exists)."""
    world = spec.get("world")
    if not isinstance(world, int) or world < 2:
        raise ValueError(f"warm spec: 'world' must be an integer >= 2, got {world!r}")
    optimizer = spec.get("optimizer")
    if not (isinstance(optimizer, list) and len(optimizer) == 3 and str(optimizer[0]).startswith(OPTIMIZER_MODULES)):
        raise ValueError(f"warm spec: 'optimizer' must name a torch.optim class, got {optimizer!r:.100}")
    if not isinstance(spec.get("params"), list):
        raise ValueError("warm spec: 'params' must be a list of [shape, dtype, requires_grad]")
    return world


def _warm_shapes(spec: dict, mesh: Any) -> None:
    params = []
    for shape, dtype, requires_grad in spec["params"]:
        dt = getattr(torch, str(dtype), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"warm spec: unknown dtype {dtype!r}")
        params.append(torch.nn.Parameter(torch.zeros([int(n) for n in shape], dtype=dt),
                                         requires_grad=bool(requires_grad) and dt.is_floating_point))
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(params)
    shard_model(model, mesh, units=[])  # one root unit: every parameter sharded on dim 0, as in any unit
    module, name, defaults = spec["optimizer"]
    cls = getattr(importlib.import_module(module), name)
    accepted = inspect.signature(cls.__init__).parameters  # defaults may hold more (AdamW: decoupled_weight_decay)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(defaults).items() if k in accepted}
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return
    optimizer = cls(trainable, **kwargs)
    compute = TorchCompute(model=model, optimizer=optimizer, loss_fn=None, dataset=None,
                           state=ReplicaState(model=model, optimizer=optimizer))
    for _ in range(2):  # a healed step (scatter of the averaged buffer), then a step with optimizer state
        compute.zero_grads()
        compute.scatter()
        compute.apply(1.0)
    compute.state.load(compute.state.tensors(), compute.state.metadata())
