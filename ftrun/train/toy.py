"""A tiny next-token model on synthetic token data, for the FT-HSDP worker and tests.

The data is a deterministic function of the seed: sequences drawn from a random (peaked) Markov chain
over `vocab` tokens, so the loss has something to learn and falls visibly in a few dozen steps. Sample
i is row i of the token tensor; a batch is a (batch, seq_len + 1) slice whose first seq_len tokens are
the input and last seq_len the targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class ToyConfig:
    vocab: int = 32
    seq_len: int = 16
    d_model: int = 32
    hidden: int = 64
    num_samples: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "d_model", "hidden", "num_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"ToyConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"ToyConfig.seed must be >= 0, got {self.seed}")


def make_tokens(cfg: ToyConfig) -> torch.Tensor:
    """(num_samples, seq_len + 1) int64 token ids, the same for the same config on every machine."""
    g = torch.Generator().manual_seed(cfg.seed)
    cdf = torch.softmax(3.0 * torch.randn(cfg.vocab, cfg.vocab, generator=g), dim=-1).cumsum(-1)
    uniform = torch.rand(cfg.seq_len, cfg.num_samples, 1, generator=g)
    tokens = torch.empty(cfg.num_samples, cfg.seq_len + 1, dtype=torch.int64)
    tokens[:, 0] = torch.randint(cfg.vocab, (cfg.num_samples,), generator=g)
    for t in range(cfg.seq_len):  # inverse-CDF sampling of each next token (multinomial is 20x slower)
        nxt = torch.searchsorted(cdf[tokens[:, t]], uniform[t]).squeeze(1)
        tokens[:, t + 1] = nxt.clamp_max(cfg.vocab - 1)
    return tokens


class TinyLM(torch.nn.Module):
    """Embedding -> MLP -> logits, per position (a learned bigram model)."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.d_model)
        self.up = torch.nn.Linear(cfg.d_model, cfg.hidden)
        self.down = torch.nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.embed(tokens))))


def make_model(cfg: ToyConfig) -> TinyLM:
    """The model with weights drawn from the config's seed (identical in every replica)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return TinyLM(cfg)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a (batch, seq_len + 1) slice of token ids."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
