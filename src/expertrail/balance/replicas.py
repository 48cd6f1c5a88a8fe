"""Replica routing: logical top-k expert ids -> physical slots of a `Placement`.

Each (token, k) picks one of its expert's replicas by a hash of the token's position and k,
so an expert's tokens spread evenly over its replicas (the plan gives replicas equal shares),
deterministically: the same token gets the same replica on every rank that computes it, and
no rank draws random numbers.
"""
from __future__ import annotations

import zlib

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

    @property
    def slot_experts(self) -> torch.Tensor:
        """int64 [S]: the logical expert each physical slot holds."""
        valid = self.log_to_phys >= 0
        experts = torch.arange(self.log_to_phys.shape[0], device=self.log_to_phys.device)
        out = torch.empty(self.num_slots, dtype=torch.int64, device=self.log_to_phys.device)
        out[self.log_to_phys[valid]] = experts.unsqueeze(1).expand_as(valid)[valid]
        return out

    def digest(self) -> int:
        """A crc32 of the slot map: equal on two ranks when they place experts alike."""
        return zlib.crc32(self.log_to_phys.cpu().numpy().tobytes()) & 0x7FFFFFFF

    def agree(self, groups, what: str) -> None:
        """Raise ConfigMismatchError on every rank of ``groups``' EP group unless every rank
        holds this same map (collective)."""
        from ..topology import check_same_on_all_ranks
        check_same_on_all_ranks({"placement_crc32": self.digest(), "slots": self.num_slots}, groups.ep_group,
                                groups.device, what)

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
