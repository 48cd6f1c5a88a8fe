"""``alltoall``: one row per (token, expert) pair, one flat all-to-all over the EP group.

The Megatron-Core alltoall dispatcher and torchtitan move tokens this way. A token with two
experts on one rank crosses the link twice; the other backends avoid that.
"""
from __future__ import annotations

import torch

from .base import Dispatcher, bits_weight, copy_slots, weight_bits
from .route import Hop


class AllToAllDispatcher(Dispatcher):
    name = "alltoall"

    def _plan_source(self, topk_idx):
        n, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        slots = torch.nonzero(flat >= 0).squeeze(1)               # (n, k) order
        experts = flat[slots]
        order = torch.sort(experts, stable=True).indices          # expert, then n, then k
        slots, experts = slots[order], experts[order]
        ranks = self.rank_of_expert[experts]
        counts = torch.bincount(ranks, minlength=self.groups.ep_size).unsqueeze(1)
        return counts, (slots, experts, counts.squeeze(1).tolist(), k)

    def _route(self, topk_weights, state, recv_counts, headers):
        slots, experts, send_splits, topk = state
        g = self.groups
        n = topk_weights.shape[0]
        token = slots // topk
        hop = Hop(index=token, slot=copy_slots(token, n), num_src=n, num_slots=max(topk, 1),
                  group=g.ep_group, send_splits=send_splits, recv_splits=recv_counts[:, 0].tolist(),
                  peers=list(range(g.ep_size)), meta_bytes=16)
        # A row carries (local expert * K + k) and its weight.
        meta = torch.stack([self.local_of_expert[experts] * topk + slots % topk,
                            weight_bits(topk_weights.reshape(-1)[slots])], 1)
        meta = hop.exchange(meta)
        expert, k = meta[:, 0] // topk, meta[:, 0] % topk
        order = torch.sort(expert, stable=True).indices           # rows came (source, expert, n, k)
        route = self._finish_route([hop], order, k[order], expert[order], meta.shape[0], 1, headers)
        route.source_weights = topk_weights.reshape(-1)[slots]
        return route, bits_weight(meta[order, 1], topk_weights.dtype)
