"""``dedup``: one row per (token, destination rank), as DeepEP's intranode normal mode.

The receiver expands each row to its local experts; combine sums a token's local experts on
the expert side before the single row goes back.
"""
from __future__ import annotations

import torch

from ..names import metadata_bytes
from .base import Dispatcher
from .planning import Outgoing, weight_bits
from .route import AllToAllHop, Stage


def local_ids_for(topk_idx, dest_rank, rank_of_expert, local_of_expert):
    """int64 [R, K]: local expert id on ``dest_rank [R]`` of each top-k entry of ``topk_idx [R, K]``,
    -1 where the entry's expert lives elsewhere (or the entry is empty)."""
    safe = topk_idx.clamp(min=0)
    mine = (topk_idx >= 0) & (rank_of_expert[safe] == dest_rank.unsqueeze(1))
    return torch.where(mine, local_of_expert[safe], torch.full_like(topk_idx, -1))


class DedupDispatcher(Dispatcher):
    name = "dedup"

    def _outgoing(self, topk_idx):
        layout = self._layout(topk_idx)
        dest, token = torch.nonzero(layout.token_in_rank.t()).unbind(1)      # (rank, token) order
        counts = layout.tokens_per_rank
        return Outgoing(topk_idx, counts.unsqueeze(1), token, counts.tolist(), self.groups.ep_rank, dest)

    def _stages(self, topk_weights, outgoing, recv_counts, headers):
        topk_idx, dest, token = outgoing.topk_idx, outgoing.dest, outgoing.token
        g = self.groups
        n, topk = topk_idx.shape
        hop = AllToAllHop.numbered(token, n, min(topk, g.ep_size), channel=g.ep_channel, send_splits=outgoing.send_splits,
                                   recv_splits=headers.counts[:, 0].tolist(), peers=list(range(g.ep_size)),
                                   meta_bytes=metadata_bytes(self.name, topk), me=g.ep_rank)
        # Each row carries the local expert ids (on its destination) and weights of its top-k entries.
        local = local_ids_for(topk_idx[token], dest, self.rank_of_expert, self.local_of_expert)
        meta = yield Stage(hop, torch.cat([local, weight_bits(topk_weights[token])], 1))
        # Rows arrive in (source, token) order: expand each to its local experts.
        last, rows = self._expand(meta[:, :topk], meta[:, topk:], headers, topk_weights.dtype)
        yield last
        return rows
