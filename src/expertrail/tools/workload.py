"""Synthetic and recorded routing for benchmarks: the same inputs on every backend.

Each rank's tokens and routing come from a seed and the rank, so any rank can rebuild every
other rank's inputs (the benchmark checks against the single-process reference that way).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ConfigError

def make_routing(spec: str, num_tokens: int, num_experts: int, topk: int, rank: int, world: int,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx [N, K] int64, topk_weights [N, K] fp32) for one rank.

    uniform: K distinct experts uniformly at random per token (the Hybrid-EP test's routing).
    zipf:<alpha>: K distinct experts drawn with P(e) proportional to 1 / (e + 1) ** alpha
        (hot experts at low ids).
    balanced: forced load balancing: slot k of token t goes to expert (t*K + k + r*N*K) mod E,
        so every expert receives the same number of rows (within one) from every rank.
    a file: replays recorded ``topk_idx``: [world, N, K] (rank r takes [r]) or [N, K] (all ranks).
    Weights are random and sum to 1 over a token's used slots.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    if topk > num_experts:
        raise ConfigError(f"topk={topk} must not exceed num_experts={num_experts}")
    if spec == "uniform":
        idx = torch.rand(num_tokens, num_experts, generator=g).topk(topk, dim=1).indices
    elif spec.startswith("zipf:"):
        try:
            alpha = float(spec.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"--routing {spec!r}: write zipf:<alpha>, e.g. zipf:1.2") from None
        logp = -alpha * torch.log(torch.arange(1, num_experts + 1, dtype=torch.float64))
        gumbel = -torch.log(-torch.log(torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float64)))
        idx = (logp + gumbel).topk(topk, dim=1).indices          # K draws without replacement
    elif spec == "balanced":
        slots = torch.arange(num_tokens * topk).view(num_tokens, topk) + rank * num_tokens * topk
        idx = slots % num_experts
    else:
        idx = load_topk_file(spec, rank, world)
        if idx.shape[0] != num_tokens:
            num_tokens = idx.shape[0]
        if idx.shape[1] != topk:
            raise ConfigError(f"--routing file {spec} has top-k {idx.shape[1]}, but --topk is {topk}")
        if idx.numel() and int(idx.max()) >= num_experts:
            raise ConfigError(f"--routing file {spec} names expert {int(idx.max())} >= --experts {num_experts}")
    weights = torch.rand(idx.shape, generator=g) * (idx >= 0)
    weights = weights / weights.sum(1, keepdim=True).clamp(min=1e-9)
    return idx.long(), weights


def load_topk_file(path: str, rank: int, world: int) -> torch.Tensor:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--routing {path!r}: not uniform, zipf:<alpha>, balanced, nor an existing file")
    if p.suffix == ".npy":
        import numpy as np
        idx = torch.from_numpy(np.load(p))
    else:
        idx = torch.load(p, map_location="cpu")
    if idx.dim() == 3:
        if idx.shape[0] != world:
            raise ConfigError(f"--routing file {path} holds {idx.shape[0]} ranks, the run has {world}")
        idx = idx[rank]
    if idx.dim() != 2:
        raise ConfigError(f"--routing file {path} must hold topk_idx [world, N, K] or [N, K]")
    return idx.long()


def make_tokens(num_tokens: int, hidden: int, dtype: torch.dtype, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7919)
    return torch.randn(num_tokens, hidden, generator=g).to(dtype)
