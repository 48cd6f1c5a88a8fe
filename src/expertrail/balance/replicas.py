"""Replica routing: logical top-k expert ids -> physical slots of a `Placement`.

Each (token, k) picks one of its expert's replicas by a hash of the token's position and k,
so an expert's tokens spread evenly over its replicas (the plan gives replicas equal shares),
deterministically: the same token gets the same replica on every rank that computes it, and
no rank draws random numbers.
"""
from __future__ import annotations

import numpy as np
import torch

_GOLDEN = 2654435761          # Knuth's multiplicative hash constant (< 2^32)


class ReplicaRouter:
    """One layer's map. ``log_to_phys`` int64 [E, max_replicas] (-1 padded), ``replicas`` [E]."""

    def __init__(self, log_to_phys, replicas, device=None):
        self.log_to_phys = torch.as_tensor(np.asarray(log_to_phys), dtype=torch.int64, device=device)
        self.replicas = torch.as_tensor(np.asarray(replicas), dtype=torch.int64, device=device)
        self.num_slots = int((self.log_to_phys >= 0).sum())

    @classmethod
    def from_placement(cls, placement, layer: int = 0, device=None) -> "ReplicaRouter":
        return cls(placement.log_to_phys[layer], placement.replicas[layer], device)

    def __call__(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """int64 [N, K] logical ids (-1 kept) -> physical slot ids."""
        n, k = topk_idx.shape
        valid = topk_idx >= 0
        expert = topk_idx.clamp(min=0)
        key = torch.arange(n * k, device=topk_idx.device).view(n, k) % (1 << 31)
        mixed = (key * _GOLDEN) >> 7                                   # < 2^56: no overflow
        choice = mixed % self.replicas[expert]
        slot = self.log_to_phys[expert, choice]
        return torch.where(valid, slot, topk_idx)
