"""A training script's model as the emulator sees it: built on meta, sharded as FSDP2 shards it, its FLOPs.

    model = meta_model(model_fn, seed=0)                           # shapes and dtypes, no memory
    shapes = script_shapes(model, flops, ranks_per_replica=8)      # a mocks.compute.LayoutShapes
    flops = step_flops(lambda: loss_fn(model, to_meta(batch)))     # forward + backward of one micro-batch

- `meta_model` builds the script's module under `torch.device("meta")`: a 2T-parameter model costs
  nothing, and its parameters are the ones the script would train.
- FSDP2 (torch.distributed.fsdp.fully_shard) shards every parameter on dim 0 over the replica's ranks:
  dim 0 is padded to a multiple of the world size and each rank holds one equal chunk, so a rank's
  shard of a (d0, *rest) parameter has ceil(d0 / world) x prod(rest) elements (a 0-d one counts as (1,)).
  That shard is what the rank all-reduces across replicas (FTAR) and what a catch-up moves.
- `step_flops` counts the FLOPs torch's FlopCounterMode sees (matmuls, attention, convolutions) in one
  forward and backward; on meta tensors nothing is computed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch

from mocks.compute import LayoutShapes

__all__ = ["ScriptModel", "meta_model", "script_shapes", "shard_elements", "step_flops", "to_meta"]


def meta_model(model_fn: Callable[[], torch.nn.Module], *, seed: int = 0) -> torch.nn.Module:
    """`model_fn()` built on the meta device (under the seed, as the real API builds it).
    Raises ValueError when it does not return a torch.nn.Module."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("meta"):
            model = model_fn()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model_fn must return a torch.nn.Module, got {type(model).__name__}")
    return model


def shard_elements(shape: tuple[int, ...] | torch.Size, world_size: int) -> int:
    """Elements of one rank's FSDP2 dim-0 shard of a parameter of `shape` (see the module docstring)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    dims = tuple(shape) or (1,)
    rest = 1
    for d in dims[1:]:
        rest *= d
    return -(-dims[0] // world_size) * rest


def to_meta(obj: Any) -> Any:
    """The same structure with every tensor replaced by a meta tensor of its shape and dtype."""
    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_meta(x) for x in obj)
    if isinstance(obj, dict):
        return {k: to_meta(v) for k, v in obj.items()}
    return obj


def step_flops(forward_backward: Callable[[], Any]) -> float:
    """FLOPs FlopCounterMode counts while `forward_backward()` runs. If it returns a tensor that needs a
    gradient (a loss), its backward runs inside the count too."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = forward_backward()
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.backward()
    return float(counter.get_total_flops())


class ScriptModel:
    """What the emulator takes from a script: its model's per-rank shapes and FLOPs per step.

    Args:
        shapes: the rank's layout (mocks.compute.LayoutShapes).
        batch_size: samples per rank per step (the script's FTConfig.batch_size).
        seed: the script's FTConfig.seed.
        api: which part of the train API the script used ("train" or "wrap", its own loop).
    """

    def __init__(self, *, shapes: LayoutShapes, batch_size: int, seed: int, api: str) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.shapes, self.batch_size, self.seed, self.api = shapes, batch_size, seed, api

    def describe(self) -> dict[str, Any]:
        s = self.shapes
        return {"api": self.api, "num_params": s.num_params, "params_per_rank": s.params_per_rank,
                "grad_bytes_per_rank": s.grad_bytes_per_rank, "dtype": s.dtype, "batch_size": self.batch_size,
                "flops_per_step_per_rank": s.flops_per_step_per_rank}


def script_shapes(model: torch.nn.Module, flops_per_step: float, *, ranks_per_replica: int) -> LayoutShapes:
    """One rank's layout of `model` (meta or real) under FSDP2 over `ranks_per_replica` ranks, with
    `flops_per_step` (one rank's forward + backward). Raises ValueError for a model without parameters."""
    params = [p for p in model.parameters()]
    if not params:
        raise ValueError("the model has no parameters: nothing to train or all-reduce")
    per_rank = [(shard_elements(p.shape, ranks_per_replica), p.element_size(), p.dtype) for p in params]
    by_dtype = Counter()
    for n, _, dtype in per_rank:
        by_dtype[dtype] += n
    dtype = str(by_dtype.most_common(1)[0][0]).removeprefix("torch.")
    largest = max((sum(p.numel() for p in m.parameters()) for m in model.children()), default=0)
    return LayoutShapes(
        num_params=sum(p.numel() for p in params), params_per_rank=sum(n for n, _, _ in per_rank),
        grad_bytes_per_rank=sum(n * size for n, size, _ in per_rank), dtype=dtype, block_params=largest,
        activation_shape=(), logits_shape=(), flops_per_step_per_rank=float(flops_per_step))
