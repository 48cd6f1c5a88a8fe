"""Routing tensors, their layouts, converters and token dropping.

The routing of N tokens over E experts with top-K is ``topk_idx [N, K] int64`` (-1 means
no expert: a dropped or unused top-k entry) and ``topk_weights [N, K] float``. Megatron-Core uses
the dense form ``routing_map [N, E] bool`` + ``probs [N, E] float``; both convert losslessly
as long as a token does not name one expert twice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from ..kernels.torch_ops import count_values


def topk_to_routing_map(topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_idx [N, K]``, ``topk_weights [N, K]`` -> ``routing_map [N, E] bool``, ``probs [N, E]``.

    Slots with -1 are left out. A token naming an expert twice gets the sum of its weights.
    """
    n = topk_idx.shape[0]
    valid = topk_idx >= 0
    routing_map = torch.zeros(n, num_experts, dtype=torch.bool, device=topk_idx.device)
    probs = torch.zeros(n, num_experts, dtype=topk_weights.dtype, device=topk_weights.device)
    rows = torch.arange(n, device=topk_idx.device).unsqueeze(1).expand_as(topk_idx)[valid]
    cols = topk_idx[valid]
    routing_map[rows, cols] = True
    probs.index_put_((rows, cols), topk_weights[valid], accumulate=True)
    return routing_map, probs


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor,
                        topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``routing_map [N, E] bool``, ``probs [N, E]`` -> ``topk_idx [N, K]``, ``topk_weights [N, K]``.

    Each row lists its experts in ascending id order, padded with -1 (weight 0) up to K.
    K defaults to the largest number of experts of any token; a smaller ``topk`` raises.
    """
    if routing_map.dtype != torch.bool:
        raise InvalidInputError(f"routing_map must be bool, got {routing_map.dtype}")
    if probs.shape != routing_map.shape:
        raise InvalidInputError(f"probs {tuple(probs.shape)} must match routing_map {tuple(routing_map.shape)}")
    n, num_experts = routing_map.shape
    per_token = routing_map.sum(1)
    most = int(per_token.max()) if n else 0
    k = most if topk is None else int(topk)
    if k < most:
        raise InvalidInputError(f"topk={k} but a token of routing_map selects {most} experts; pass topk>={most}")
    # Sort selected experts first (stable keeps ascending id order), then take the first K.
    expert_ids = torch.arange(num_experts, device=routing_map.device).expand(n, num_experts)
    order = torch.sort((~routing_map).to(torch.int8), dim=1, stable=True).indices
    chosen = torch.gather(expert_ids, 1, order)[:, :k]
    selected = torch.gather(routing_map, 1, order)[:, :k]
    topk_idx = torch.where(selected, chosen, torch.full_like(chosen, -1))
    topk_weights = torch.where(selected, torch.gather(probs, 1, chosen), torch.zeros((), dtype=probs.dtype))
    return topk_idx, topk_weights


@dataclass
class TokenLayout:
    """Where the rows of one rank's tokens go.

    tokens_per_expert: int64 [E]  (token, expert) pairs per expert
    tokens_per_rank:   int64 [P]  tokens with at least one expert on each EP rank
    tokens_per_domain: int64 [P // domain_size]  tokens with at least one expert in each domain
    token_in_rank:     bool [N, P]
    token_in_domain:   bool [N, P // domain_size]
    """

    tokens_per_expert: torch.Tensor
    tokens_per_rank: torch.Tensor
    tokens_per_domain: torch.Tensor
    token_in_rank: torch.Tensor
    token_in_domain: torch.Tensor


def compute_layout(topk_idx: torch.Tensor, num_experts: int, ep_size: int,
                   domain_size: int | None = None, rank_of_expert: torch.Tensor | None = None) -> TokenLayout:
    """Counts of rows per expert, rank and domain for ``topk_idx [N, K]`` (contiguous placement
    unless ``rank_of_expert [E]`` is given)."""
    domain_size = ep_size if domain_size is None else domain_size
    from .. import kernels
    if rank_of_expert is None and kernels.use_triton(topk_idx):     # the Triton kernel (contiguous placement)
        per_expert, per_rank, per_domain, member = kernels.layout_counts(topk_idx, num_experts, ep_size, domain_size)
        return TokenLayout(per_expert, per_rank, per_domain, member,
                           member.view(-1, ep_size // domain_size, domain_size).any(2))
    if rank_of_expert is None:
        rank_of_expert = torch.arange(num_experts, device=topk_idx.device) // (num_experts // ep_size)
    token_in_rank = token_membership(topk_idx, rank_of_expert, ep_size)
    n = topk_idx.shape[0]
    token_in_domain = token_in_rank.view(n, ep_size // domain_size, domain_size).any(2)
    valid = topk_idx[topk_idx >= 0]
    return TokenLayout(tokens_per_expert=count_values(valid, num_experts),
                  tokens_per_rank=token_in_rank.sum(0), tokens_per_domain=token_in_domain.sum(0),
                  token_in_rank=token_in_rank, token_in_domain=token_in_domain)


def token_membership(topk_idx: torch.Tensor, group_of_expert: torch.Tensor, num_groups: int) -> torch.Tensor:
    """bool [N, num_groups]: whether each token has an expert in each group (rank or domain)."""
    n = topk_idx.shape[0]
    valid = topk_idx >= 0
    groups = torch.where(valid, group_of_expert[topk_idx.clamp(min=0)], torch.full_like(topk_idx, num_groups))
    member = torch.zeros(n, num_groups + 1, dtype=torch.bool, device=topk_idx.device)
    member.scatter_(1, groups, True)
    return member[:, :num_groups]


DROP_POLICIES = ("probs", "position")


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert accepts from one rank: ceil(N * K / E * capacity_factor)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_capacity(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   capacity_factor: float, drop_policy: str = "probs") -> torch.Tensor:
    """Drop (set to -1) the (token, expert) entries beyond each expert's capacity on this rank.

    ``drop_policy="probs"`` keeps each expert's highest-weight tokens (earlier token on ties);
    ``"position"`` keeps the earliest tokens. Returns the new ``topk_idx [N, K]``.
    """
    if drop_policy not in DROP_POLICIES:
        raise InvalidInputError(f"drop_policy={drop_policy!r}; choose one of {DROP_POLICIES}")
    n, k = topk_idx.shape
    capacity = expert_capacity(n, k, num_experts, capacity_factor)
    flat = topk_idx.reshape(-1)
    entries = torch.nonzero(flat >= 0).squeeze(1)          # (n, k) order
    experts = flat[entries]
    if drop_policy == "probs":
        by_weight = torch.sort(topk_weights.reshape(-1)[entries], descending=True, stable=True).indices
        entries, experts = entries[by_weight], experts[by_weight]
    order = torch.sort(experts, stable=True).indices
    entries, experts = entries[order], experts[order]
    counts = count_values(experts, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(experts.numel(), device=flat.device) - starts[experts]
    dropped = entries[position >= capacity]
    out = flat.clone()
    out[dropped] = -1
    return out.view(n, k)
