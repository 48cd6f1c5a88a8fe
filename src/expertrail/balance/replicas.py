"""Replica routing: logical top-k expert ids -> physical slots of a `Placement`.

Each (token, k) picks one of its expert's replicas by a hash of the token's position and k:
deterministic (the same token gets the same replica on every rank that computes it, and no
rank draws random numbers). By default an expert's tokens spread evenly over its replicas
(the plan gives replicas equal shares); with ``shares`` (`balanced_shares`: load-weighted,
more tokens to replicas on lightly loaded ranks) the hash is read as a number in [0, 1) and
the replica is the one whose slice of the expert's cumulative shares contains it.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

_GOLDEN = 2654435761          # Knuth's multiplicative hash constant (< 2^32)


def _rank_loads(load: np.ndarray, log_to_phys: np.ndarray, shares: np.ndarray, num_ranks: int) -> np.ndarray:
    """float64 [P]: tokens per rank when expert e's load [E] splits over its replicas by ``shares``."""
    valid = log_to_phys >= 0
    per_rank = int(valid.sum()) // num_ranks
    return np.bincount(log_to_phys[valid] // per_rank, weights=(load[:, None] * shares)[valid], minlength=num_ranks)


def balanced_shares(load: np.ndarray, log_to_phys: np.ndarray, replicas: np.ndarray, num_ranks: int,
                    iterations: int = 32) -> np.ndarray:
    """Each replica's share of its expert's tokens, float64 [E, max_replicas] (0 on padding,
    rows summing to 1), weighted so that the busiest rank carries as little as it can.

    load [E]: tokens per expert (the window the placement was planned from); log_to_phys
    [E, max_replicas] and replicas [E]: one layer of a `Placement` on ``num_ranks`` ranks.
    Starting from equal shares, each round scales every replica's share by
    sqrt(mean rank load / its rank's load) and renormalises per expert (a damped
    multiplicative step towards even ranks); the shares with the lightest busiest rank seen
    are kept, so the result is never worse than the plan's equal split."""
    log_to_phys = np.asarray(log_to_phys)
    load = np.asarray(load, dtype=np.float64)
    valid = log_to_phys >= 0
    rank_of = np.where(valid, log_to_phys, 0) // (int(valid.sum()) // num_ranks)          # [E, R]
    shares = valid / np.asarray(replicas, dtype=np.float64)[:, None]
    best, best_top = shares, np.inf
    for _ in range(iterations):
        on_rank = _rank_loads(load, log_to_phys, shares, num_ranks)
        if on_rank.max() < best_top * (1 - 1e-9):
            best, best_top = shares, on_rank.max()
        scale = np.sqrt(on_rank.mean() / np.maximum(on_rank, 1e-12))[rank_of] * valid
        shares = shares * scale
        shares = shares / np.maximum(shares.sum(1, keepdims=True), 1e-300)
    return best


class ReplicaRouter:
    """One layer's map. ``log_to_phys`` int64 [E, max_replicas] (-1 padded), ``replicas`` [E];
    ``shares`` (optional) float [E, max_replicas]: each replica's share of its expert's
    tokens (rows sum to 1, 0 on padding); None: equal shares."""

    def __init__(self, log_to_phys, replicas, device=None, shares=None):
        self.log_to_phys = torch.as_tensor(np.asarray(log_to_phys), dtype=torch.int64, device=device)
        self.replicas = torch.as_tensor(np.asarray(replicas), dtype=torch.int64, device=device)
        self.num_slots = int((self.log_to_phys >= 0).sum())
        self.shares = None if shares is None else torch.as_tensor(np.asarray(shares), dtype=torch.float64, device=device)
        if self.shares is not None and self.shares.shape != self.log_to_phys.shape:
            raise ValueError(f"shares has shape {tuple(self.shares.shape)}; give one per entry of log_to_phys "
                             f"{tuple(self.log_to_phys.shape)}")
        self._bounds = None if self.shares is None else self.shares.cumsum(1)

    @classmethod
    def from_placement(cls, placement, layer: int = 0, device=None, load=None) -> "ReplicaRouter":
        """The map of ``placement``'s ``layer``; with ``load`` [E] (the tokens per expert it was
        planned from), replicas weighted by `balanced_shares`."""
        l2p, reps = placement.log_to_phys[layer], placement.replicas[layer]
        shares = None if load is None else balanced_shares(load, l2p, reps, placement.num_ranks)
        return cls(l2p, reps, device, shares)

    def reweighted(self, load, num_ranks: int) -> "ReplicaRouter":
        """The same placement with its replicas weighted for ``load`` [E] (`balanced_shares`)."""
        l2p, reps = self.log_to_phys.cpu().numpy(), self.replicas.cpu().numpy()
        return ReplicaRouter(l2p, reps, self.log_to_phys.device, balanced_shares(load, l2p, reps, num_ranks))

    def rank_loads(self, load, num_ranks: int) -> np.ndarray:
        """float64 [P]: the tokens each of ``num_ranks`` ranks receives when expert e gets
        ``load[e]`` tokens, split over its replicas by the shares (evenly without)."""
        l2p = self.log_to_phys.cpu().numpy()
        shares = ((l2p >= 0) / self.replicas.cpu().numpy()[:, None] if self.shares is None
                  else self.shares.cpu().numpy())
        return _rank_loads(np.asarray(load, dtype=np.float64), l2p, shares, num_ranks)

    @property
    def slot_experts(self) -> torch.Tensor:
        """int64 [S]: the logical expert each physical slot holds."""
        valid = self.log_to_phys >= 0
        experts = torch.arange(self.log_to_phys.shape[0], device=self.log_to_phys.device)
        out = torch.empty(self.num_slots, dtype=torch.int64, device=self.log_to_phys.device)
        out[self.log_to_phys[valid]] = experts.unsqueeze(1).expand_as(valid)[valid]
        return out

    def digest(self) -> int:
        """A crc32 of the slot map (and shares): equal on two ranks when they route alike."""
        crc = zlib.crc32(self.log_to_phys.cpu().numpy().tobytes())
        if self.shares is not None:
            crc = zlib.crc32(self.shares.cpu().numpy().tobytes(), crc)
        return crc & 0x7FFFFFFF

    def agree(self, groups, what: str) -> None:
        """Raise ConfigMismatchError on every rank of ``groups``' EP group unless every rank
        holds this same map (collective)."""
        groups.check_same({"placement_crc32": self.digest(), "slots": self.num_slots}, what)

    def __call__(self, topk_idx: torch.Tensor, first_position: int = 0) -> torch.Tensor:
        """int64 [N, K] logical ids (-1 kept) -> physical slot ids. Token i's position is
        ``first_position + i`` (give distinct positions to distinct tokens, e.g. from the step
        and the source rank, so that equal local indices do not pick alike)."""
        n, k = topk_idx.shape
        valid = topk_idx >= 0
        expert = topk_idx.clamp(min=0)
        key = (first_position * k + torch.arange(n * k, device=topk_idx.device).view(n, k)) % (1 << 31)
        if self.shares is None:
            mixed = (key * _GOLDEN) >> 7                               # < 2^56: no overflow
            choice = mixed % self.replicas[expert]
        else:
            unit = ((key * _GOLDEN) & 0xFFFFFFFF).double() / 2.0 ** 32           # [N, K] in [0, 1)
            choice = (unit.unsqueeze(-1) >= self._bounds[expert]).sum(-1)
            choice = torch.minimum(choice, self.replicas[expert] - 1)            # rounding of the last bound
        slot = self.log_to_phys[expert, choice]
        return torch.where(valid, slot, topk_idx)
