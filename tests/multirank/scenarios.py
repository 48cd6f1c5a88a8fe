"""Inputs shared by all ranks of a multi-rank test: every rank builds every rank's inputs from
one seed, so each can compute the single-process reference for itself."""
from __future__ import annotations

import torch

import expertrail as er

SCENARIOS = ("random", "one_expert", "one_rank", "duplicates_free_full")


def make_inputs(scenario: str, world: int, hidden: int, num_experts: int, topk: int, seed: int,
                dtype=torch.float32, zero_rank: int | None = 1):
    """Per-rank (x [N_r, H], topk_idx [N_r, K], topk_weights [N_r, K] fp32), uneven N_r.

    random: distinct random experts per token, ~20% of slots -1, rank ``zero_rank`` has no tokens.
    one_expert: every token of every rank goes to expert E-1 (slot 0), the other slots are -1.
    one_rank: every slot names an expert of EP rank 0.
    duplicates_free_full: every slot used, no -1.
    """
    g = torch.Generator().manual_seed(seed)
    xs, idxs, ws = [], [], []
    for r in range(world):
        n = 0 if r == zero_rank and scenario == "random" else 3 + (5 * r + seed) % 9
        x = torch.randn(n, hidden, generator=g).to(dtype)
        scores = torch.rand(n, num_experts, generator=g)
        if scenario == "one_rank":
            scores[:, num_experts // world:] = -1
        idx = torch.topk(scores, topk, dim=1).indices
        if scenario == "one_rank" and topk > num_experts // world:
            idx[:, num_experts // world:] = -1
        if scenario == "random":
            idx[torch.rand(n, topk, generator=g) < 0.2] = -1
        if scenario == "one_expert":
            idx[:] = -1
            idx[:, 0] = num_experts - 1
        w = torch.rand(n, topk, generator=g)
        xs.append(x), idxs.append(idx), ws.append(w)
    return xs, idxs, ws


def expert_fn(rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """A cheap expert that differs per expert and is not linear: tanh(x) * (1 + e / 8) + x."""
    scale = 1 + experts.to(rows.dtype).unsqueeze(1) / 8
    return torch.tanh(rows) * scale + rows


def row_experts(res: er.DispatchResult, ep_rank: int, num_local: int) -> torch.Tensor:
    """Global expert id of each row of ``res.tokens`` (padding rows included)."""
    local = torch.repeat_interleave(torch.arange(num_local), res.tokens_per_expert)
    return local + ep_rank * num_local
