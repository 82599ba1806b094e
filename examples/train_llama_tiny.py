"""A tiny Llama-style decoder trained fault-tolerantly with ftrun: FSDP2 inside each replica, FTAR across.

    ftrun launch --replicas 3 --ranks-per-replica 2 --steps 200 examples/train_llama_tiny.py
    python examples/train_llama_tiny.py --steps 50          # standalone: one replica of one rank
    ftrun launch --replicas 3 --steps 200 examples/train_llama_tiny.py --device cuda   # one GPU per rank

The model: token embedding, N blocks of (RMSNorm -> causal self-attention with rotary position
embeddings via F.scaled_dot_product_attention -> RMSNorm -> SwiGLU MLP), final RMSNorm and an output
head. The data: an English-like corpus made with Faker (people, companies, places, lorem sentences)
from a seed, tokenized byte-level (vocabulary 256: no tokenizer to train or ship), cut into windows of
seq_len + 1 tokens and cached on disk keyed by (seed, size), so the ranks of a job (and reruns) read
one file. The training loop is an ordinary PyTorch one; `ftrun.train` runs it on every rank: quorum,
catch-up of restarted replicas, per-rank FTAR, 2PC commit, exactly-once data order. Rank 0 of every
replica prints the JSON event lines `ftrun launch` reads; add --verbose for a loss line every 10 steps
on stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ftrun.train


# -- the model ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden: int = 172  # ~8/3 * dim, SwiGLU's usual width
    max_seq_len: int = 64
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab", "dim", "num_layers", "num_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.num_heads or (self.dim // self.num_heads) % 2:
            raise ValueError(f"dim {self.dim} must split into {self.num_heads} heads of an even size")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq_len, head_dim / 2) each."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the (even, odd) feature pairs of x (batch, heads, seq, head_dim) by the position's angle."""
    even, odd = x[..., 0::2], x[..., 1::2]
    seq = x.shape[-2]
    c, s = cos[:seq], sin[:seq]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.dim // cfg.num_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim), Attention(cfg)
        self.mlp_norm, self.mlp = RMSNorm(cfg.dim), SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class LlamaTiny(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))  # FSDP2 shards one unit each
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.num_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # derived, not state: never shipped
        self.register_buffer("rope_sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 style init; residual projections scaled down by depth
                scale = 0.02 / math.sqrt(2 * cfg.num_layers) if name.endswith(("out.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens, the model takes at most {self.cfg.max_seq_len}")
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a (batch, seq_len + 1) window of token ids."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# -- the data -----------------------------------------------------------------------------------
def make_corpus(seed: int, num_chars: int) -> str:
    """English-like text from Faker, the same for the same (seed, num_chars) (faker is pinned)."""
    from faker import Faker

    fake = Faker("en_US")
    fake.seed_instance(seed)
    parts, size = [], 0
    while size < num_chars:
        doc = (f"{fake.name()} works as a {fake.job().lower()} at {fake.company()} in {fake.city()}. "
               f"{fake.paragraph(nb_sentences=4)}\n")
        parts.append(doc)
        size += len(doc)
    return "".join(parts)[:num_chars]


def encode(text: str) -> np.ndarray:
    """Byte-level tokenizer: UTF-8 bytes are the token ids (vocabulary 256)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def load_tokens(cache_dir: str | os.PathLike, *, seed: int, num_chars: int) -> np.ndarray:
    """The tokenized corpus, from the cache or made and cached (atomically: every rank may race here,
    and all of them write the same bytes)."""
    path = Path(cache_dir) / f"faker-corpus-seed{seed}-chars{num_chars}.u8"
    if path.exists():
        return np.fromfile(path, dtype=np.uint8)
    tokens = encode(make_corpus(seed, num_chars))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tokens.tofile(tmp)
    os.replace(tmp, path)
    return tokens


def windows(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    """Non-overlapping (num_samples, seq_len + 1) int64 windows: sample i is row i."""
    n = len(tokens) // (seq_len + 1)
    if n < 1:
        raise ValueError(f"a corpus of {len(tokens)} tokens holds no window of {seq_len + 1}")
    return torch.from_numpy(tokens[: n * (seq_len + 1)].astype(np.int64)).view(n, seq_len + 1)


# -- the entry point ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="default: the launcher's --steps (standalone: 100)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, cuda (this rank's GPU: cuda:{host slot %% GPUs}) or cuda:N; "
                   "a GPU takes one rank per replica")
    p.add_argument("--corpus-chars", type=int, default=400_000)
    p.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "ftrun"))
    p.add_argument("--verbose", action="store_true", help="a loss line every 10 steps on stderr (rank 0)")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = LlamaConfig(dim=args.dim, num_layers=args.layers, num_heads=args.heads,
                      ffn_hidden=(8 * args.dim // 3 + 3) // 4 * 4, max_seq_len=args.seq_len)
    dataset = windows(load_tokens(args.cache_dir, seed=args.seed, num_chars=args.corpus_chars), args.seq_len)
    config = ftrun.train.FTConfig(batch_size=args.batch_size, seed=args.seed, log_level=args.log_level,
                                  device=args.device)
    with ftrun.train.init_from_env(config) as ft:
        def report(r) -> None:
            if args.verbose and ft.rank == 0 and r.committed and r.loss is not None and r.step % 10 == 0:
                print(f"[{ft.replica_id}] step {r.step} loss {r.loss:.3f} ({len(r.participants)} replicas)",
                      file=sys.stderr, flush=True)

        steps = args.steps if args.steps is not None else (None if ft.spec.max_steps is not None else 100)
        result = ft.train(
            model_fn=lambda: LlamaTiny(cfg), loss_fn=lm_loss, dataset=dataset, steps=steps,
            optimizer_fn=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, foreach=True),
            hooks=ftrun.train.Hooks(on_step=report))
    return result.exit_code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: torch's finalizers cost about a second per rank
