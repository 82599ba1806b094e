"""Config types shared by the mocks and the emulator, below both: the model's shape and dtype sizes
(mocks.compute), the scheduler's delays (mocks.scheduler), and the field checks every section of a
scale profile uses. harness.profile nests these in its Profile; mocks import them from here, so
mocks/ never imports harness/.

Each section checks itself in __post_init__ and raises ValueError naming the bad field, e.g.
"layers must be > 0, got 0"; the profile loader prefixes the section ("[model] layers ...").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DTYPE_BYTES", "ModelConfig", "SchedulerConfig", "non_negative", "one_of", "positive", "require"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def require(ok: bool, name: str, want: str, got: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {want}, got {got!r}")


def positive(obj: object, *names: str) -> None:
    for n in names:
        require(getattr(obj, n) > 0, n, "> 0", getattr(obj, n))


def non_negative(obj: object, *names: str) -> None:
    for n in names:
        require(getattr(obj, n) >= 0, n, ">= 0", getattr(obj, n))


def one_of(obj: object, name: str, allowed: tuple[str, ...]) -> None:
    require(getattr(obj, name) in allowed, name, f"one of {allowed}", getattr(obj, name))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape for meta-device compute and for gradient sizes. num_params is the usual dense estimate:
    layers x (attention 2h^2 (1 + kv_heads/heads) + mlp_matrices x h x ffn) + 2 x vocab x h (untied
    embeddings)."""

    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 0  # 0: heads (no grouped-query attention)
    vocab: int = 32000
    seq_len: int = 512
    ffn_hidden: int = 0  # 0: 4 x hidden
    mlp_matrices: int = 2  # 3 for SwiGLU
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "bf16"

    def __post_init__(self) -> None:
        positive(self, "layers", "hidden", "heads", "vocab", "seq_len", "mlp_matrices")
        non_negative(self, "ffn_hidden", "kv_heads")
        one_of(self, "dtype", tuple(DTYPE_BYTES))
        require(self.hidden % self.heads == 0, "hidden", f"a multiple of heads={self.heads}", self.hidden)
        require(self.kv_heads <= self.heads and (self.kv_heads == 0 or self.heads % self.kv_heads == 0),
               "kv_heads", f"0 or a divisor of heads={self.heads}", self.kv_heads)

    @property
    def num_params(self) -> int:
        h, ffn = self.hidden, self.ffn_hidden or 4 * self.hidden
        attention = 2 * h * h + 2 * h * (h * (self.kv_heads or self.heads) // self.heads)
        return self.layers * (attention + self.mlp_matrices * h * ffn) + 2 * self.vocab * h

    def grad_bytes_per_rank(self, ranks_per_replica: int) -> int:
        """Bytes of gradient one rank all-reduces across replicas (fully sharded inside a replica)."""
        return -(-self.num_params * DTYPE_BYTES[self.dtype] // ranks_per_replica)


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    alloc_delay_cold_s: float = 300.0
    alloc_delay_warm_s: float = 30.0
    process_start_s: float = 30.0  # launch, imports, state init before a restarted replica checks in
    poll_interval_s: float = 5.0  # how often the supervisor looks for missing replicas
    # Seconds from a crash to the supervisor noticing it (a process supervisor sees its child exit at
    # once; `ftrun calibrate` measures it). None: at the supervisor's next poll_interval_s tick.
    crash_detect_s: float | None = None
    # Per replica, seconds from the job's start to its first incarnation's ranks starting (a real launcher
    # forks the rank processes one after another: the first replica can train alone while the others start,
    # and they join behind and heal; `ftrun fidelity` takes them from its real runs). (): all at once.
    first_start_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        non_negative(self, "alloc_delay_cold_s", "alloc_delay_warm_s", "process_start_s")
        bad = [s for s in self.first_start_s if not s >= 0]
        require(not bad, "first_start_s", "seconds >= 0", bad)
        positive(self, "poll_interval_s")
        require(self.crash_detect_s is None or self.crash_detect_s >= 0, "crash_detect_s", ">= 0",
                self.crash_detect_s)
