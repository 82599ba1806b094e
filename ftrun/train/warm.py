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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ftrun.train.compute import TorchCompute
from ftrun.train.shard import shard_model

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


def warm_sharding() -> None:
    """One FSDP2 training step and a catch-up save/load over a fake 2-rank group (see the module
    docstring). Raises RuntimeError when this process already has a default process group."""
    if dist.is_initialized():
        raise RuntimeError("warm_sharding needs a process without a default process group")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", rank=0, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
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
