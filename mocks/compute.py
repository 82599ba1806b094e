"""Shape-only compute: a Llama-shaped decoder's forward and backward on meta tensors, with modeled time.

No arithmetic runs and no memory is allocated for weights or activations: the model is built on
torch's "meta" device, one decoder block is run forward and backward there to propagate shapes, and
the step's duration comes from the profile (its step time) or from a FLOP model (6 x params x tokens
at a sustained rate). Every block of a dense decoder has the same shapes, so propagating through one
block and multiplying by the layer count is exact.

Shapes are propagated ONCE per replica layout (model shape, ranks per replica, micro-batch), not once
per rank: a `ShapeCache` owned by the emulated job holds the results and counts propagations, and
every rank's `ShapeOnlyCompute` reads from it.

This module is also the shadow of `ftrun.train.compute_cuda` (the GPU step driver's compute, not
written yet; see mocks/shadow_registry.toml).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from mocks.config import DTYPE_BYTES, ModelConfig
from mocks.shapes import ShapeOnly

__all__ = ["LayoutShapes", "ShapeCache", "ShapeOnlyCompute", "ShapeOnlyGrads", "ShapeOnlyState", "ShapeOnlyTrainCompute",
           "propagate_shapes"]


class ShapeOnlyGrads(ShapeOnly):
    """A rank's flat gradient buffer in shape-only mode: a size and a dtype, no bytes.

    Slices of its bytes (`grads[a:b]`) are `ShapeOnly` frames, so the emulated network sends and
    receives them as modeled transfers; `fill()` and numpy ufuncs applied to it (the gradient mean of
    ftrun.train.exchange) are accepted and do nothing. `ShapeOnlyGrads(nbytes)` of raw bytes is what
    the FTAR engine makes for staging.
    """

    __slots__ = ("dtype",)

    def __init__(self, nbytes: int, dtype: str = "uint8") -> None:
        super().__init__(nbytes)
        self.dtype = dtype

    def __getitem__(self, key: slice) -> ShapeOnly:
        if not isinstance(key, slice):
            raise TypeError("a shape-only buffer is sliced by bytes, e.g. buf[a:b]")
        start, stop, step = key.indices(self.nbytes)
        if step != 1:
            raise ValueError("shape-only slices are contiguous")
        return ShapeOnly(max(0, stop - start))

    def fill(self, value: Any) -> None:
        """Nothing to fill."""

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> "ShapeOnlyGrads":
        return self  # e.g. np.divide(grads, n, out=grads): no values to change

    def __repr__(self) -> str:
        return f"ShapeOnlyGrads({self.nbytes}, {self.dtype!r})"


@dataclass(frozen=True)
class LayoutShapes:
    """What shape propagation found for one replica layout."""

    num_params: int  # whole model
    params_per_rank: int  # fully sharded inside the replica (FSDP)
    grad_bytes_per_rank: int
    dtype: str
    block_params: int
    activation_shape: tuple[int, ...]  # (micro_batch, seq_len, hidden) between blocks
    logits_shape: tuple[int, ...]
    flops_per_step_per_rank: float  # 6 x params x tokens of the rank's micro-batch (forward + backward)


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}


def _block_shapes(model: ModelConfig, micro_batch: int) -> tuple[int, tuple[int, ...]]:
    """Run one decoder block forward and backward on meta tensors; (its parameter count, output shape)."""
    import torch
    import torch.nn.functional as F

    h, heads = model.hidden, model.heads
    kv_heads = model.kv_heads or heads
    head_dim, ffn = h // heads, model.ffn_hidden or 4 * h
    meta = dict(device="meta", dtype=getattr(torch, _TORCH_DTYPES[model.dtype]))
    weights = {
        "wq": torch.empty(h, h, **meta), "wk": torch.empty(h, kv_heads * head_dim, **meta),
        "wv": torch.empty(h, kv_heads * head_dim, **meta), "wo": torch.empty(h, h, **meta),
        "w_in": torch.empty(h, (model.mlp_matrices - 1) * ffn, **meta), "w_out": torch.empty(ffn, h, **meta),
    }
    for w in weights.values():
        w.requires_grad_(True)
    x = torch.empty(micro_batch, model.seq_len, h, **meta, requires_grad=True)
    b, s = micro_batch, model.seq_len
    y = F.rms_norm(x, (h,))
    q = (y @ weights["wq"]).view(b, s, heads, head_dim).transpose(1, 2)
    k = (y @ weights["wk"]).view(b, s, kv_heads, head_dim).transpose(1, 2)
    v = (y @ weights["wv"]).view(b, s, kv_heads, head_dim).transpose(1, 2)
    if kv_heads != heads:  # grouped-query attention: each kv head serves heads / kv_heads query heads
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
    x = x + attn @ weights["wo"]
    up = F.rms_norm(x, (h,)) @ weights["w_in"]
    if model.mlp_matrices >= 3:  # SwiGLU: gate and up projections in one matrix
        gate, up = up.split(ffn, dim=-1)
        up = F.silu(gate) * up
    else:
        up = F.gelu(up)
    out = x + up @ weights["w_out"]
    out.sum().backward()
    for name, w in weights.items():
        assert w.grad is not None and w.grad.shape == w.shape, f"meta backward lost the gradient of {name}"
    return sum(w.numel() for w in weights.values()), tuple(out.shape)


def propagate_shapes(model: ModelConfig, ranks_per_replica: int, micro_batch: int = 1) -> LayoutShapes:
    """Shapes and sizes of one rank's step for a replica layout (meta tensors; no memory, no compute)."""
    block_params, act_shape = _block_shapes(model, micro_batch)
    embed = model.vocab * model.hidden
    num_params = model.layers * block_params + 2 * embed  # untied input embedding and output head
    per_rank = -(-num_params // ranks_per_replica)
    tokens = micro_batch * model.seq_len
    return LayoutShapes(
        num_params=num_params, params_per_rank=per_rank, grad_bytes_per_rank=per_rank * DTYPE_BYTES[model.dtype],
        dtype=_TORCH_DTYPES[model.dtype], block_params=block_params, activation_shape=act_shape,
        logits_shape=(micro_batch, model.seq_len, model.vocab),
        flops_per_step_per_rank=6.0 * num_params * tokens,  # each rank runs the whole model on its own batch
    )


class ShapeCache:
    """Shape propagation results by replica layout; one per emulated job, shared by all its ranks.
    `preset`: the layout every `get` answers instead (a training script's own model, mocks.script),
    propagated once by its maker."""

    def __init__(self, preset: LayoutShapes | None = None) -> None:
        self._by_layout: dict[tuple, LayoutShapes] = {}
        self._preset = preset
        self.num_propagations = 0 if preset is None else 1

    def get(self, model: ModelConfig, ranks_per_replica: int, micro_batch: int = 1) -> LayoutShapes:
        if self._preset is not None:
            return self._preset
        key = (model, ranks_per_replica, micro_batch)
        shapes = self._by_layout.get(key)
        if shapes is None:
            shapes = self._by_layout[key] = propagate_shapes(model, ranks_per_replica, micro_batch)
            self.num_propagations += 1
        return shapes


class ShapeOnlyCompute:
    """One rank's forward + backward, shape-only: waits out the modeled step time on the Env's clock.

    Args:
        env: the rank's Env (its clock is slept on).
        model, ranks_per_replica: the layout; shapes come from `cache`.
        step_time_s: modeled seconds per step (the profile's train.step_compute_s); None -> FLOP model.
        flops_per_s: sustained FLOP/s per rank for the FLOP model (e.g. 450e12, paper §6.1).
        jitter: uniform +-fraction of the step time, drawn from `rng` (seeded by the caller).
    Raises ValueError if neither a step time nor a FLOP rate is given.
    """

    def __init__(self, *, env: Any, model: ModelConfig, ranks_per_replica: int, cache: ShapeCache,
                 step_time_s: float | None = None, flops_per_s: float | None = None, jitter: float = 0.0,
                 rng: random.Random | None = None) -> None:
        if step_time_s is None and not flops_per_s:
            raise ValueError("give step_time_s or flops_per_s")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self.env, self.shapes = env, cache.get(model, ranks_per_replica)
        self._base_s = step_time_s if step_time_s is not None else self.shapes.flops_per_step_per_rank / flops_per_s
        self._jitter, self._rng = jitter, rng or random.Random(0)
        self.num_steps = 0

    def grad_buffer(self) -> ShapeOnlyGrads:
        """This rank's flat gradient shard (what FTAR all-reduces across replicas)."""
        return ShapeOnlyGrads(self.shapes.grad_bytes_per_rank, self.shapes.dtype)

    def step_seconds(self) -> float:
        if not self._jitter:
            return self._base_s
        return self._base_s * (1.0 + self._rng.uniform(-self._jitter, self._jitter))

    def forward_backward(self, extra_s: float = 0.0) -> float:
        """Run one step's forward and backward (a modeled wait); returns the seconds it took."""
        seconds = self.step_seconds() + extra_s
        self.env.clock.sleep(seconds)
        self.num_steps += 1
        return seconds


class ShapeOnlyState:
    """A rank's trainable state in shape-only mode (ftrun.train.state.TrainState): its parameter shard
    and two fp32 Adam moments as meta tensors (sizes, no bytes). `load` checks that a peer's state has
    the same names, dtypes and shapes (ValueError otherwise) and changes nothing else."""

    def __init__(self, shapes: LayoutShapes) -> None:
        import torch

        n = shapes.params_per_rank
        self._tensors = {"model.params": torch.empty(n, dtype=getattr(torch, shapes.dtype), device="meta"),
                         "optim.exp_avg": torch.empty(n, dtype=torch.float32, device="meta"),
                         "optim.exp_avg_sq": torch.empty(n, dtype=torch.float32, device="meta")}
        self.num_loads = 0

    def tensors(self) -> dict[str, Any]:
        return dict(self._tensors)

    def stable(self) -> frozenset[str]:
        return frozenset(self._tensors)  # only the (modeled) optimizer step changes them

    def metadata(self) -> dict[str, Any]:
        return {"shape_only": True}

    def load(self, tensors: Any, metadata: Any) -> None:
        mine = {k: (t.dtype, tuple(t.shape)) for k, t in self._tensors.items()}
        theirs = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
        if mine != theirs:
            raise ValueError(f"shape-only state does not fit: have {mine}, got {theirs}")
        self.num_loads += 1


class ShapeOnlyTrainCompute(ShapeOnlyCompute):
    """The Compute seam (ftrun.train.compute) in shape-only mode: forward/backward waits out the modeled
    step time (plus `extra_s(step)`, e.g. a straggler or the first step's warm-up), the gradient buffer
    is a ShapeOnlyGrads, the state is a ShapeOnlyState, and `apply` records the LR factor it was given.
    Losses are 0.0 (nothing is computed)."""

    def __init__(self, *, extra_s: Any = None, state: ShapeOnlyState | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.grads = self.grad_buffer()
        self.state = state if state is not None else ShapeOnlyState(self.shapes)  # shareable: it holds no values
        self._extra_s = extra_s
        self.lr_factor: float | None = None
        self.num_applied = 0

    def forward_backward(self, step: int = 0, samples: Any = None, seed: int | None = None) -> float:  # type: ignore[override]
        extra = self._extra_s(step) if self._extra_s is not None else 0.0
        super().forward_backward(extra_s=extra)
        return 0.0

    def zero_grads(self) -> None:
        """Nothing to zero."""

    def gather(self) -> None:
        """Nothing to gather (the user's own loop is not emulated)."""

    def keep_grads(self) -> ShapeOnlyGrads:
        return self.grads

    def restore_grads(self, kept: Any) -> None:
        if getattr(kept, "nbytes", None) != self.grads.nbytes:
            raise ValueError(f"kept gradient of {getattr(kept, 'nbytes', None)} bytes, buffer {self.grads.nbytes}")

    def scatter(self) -> None:
        """No model gradients to fill."""

    def apply(self, lr_factor: float) -> None:
        if not lr_factor > 0:
            raise ValueError(f"lr_factor must be > 0, got {lr_factor}")
        self.lr_factor = lr_factor
        self.num_applied += 1

    def reset(self) -> None:
        """No per-iteration state."""
