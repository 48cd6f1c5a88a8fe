"""``allgather``: every token to every EP rank; combine by reduce-scatter.

As Megatron-Core's allgather dispatcher. The reduce-scatter is an all-to-all of partial sums
followed by a sum in rank order in fp32, so it is deterministic on every backend.
"""
from __future__ import annotations

import torch

from ..names import metadata_bytes
from .base import Dispatcher
from .planning import Outgoing, weight_bits
from .dedup import local_ids_for
from .route import AllGatherHop, Stage


class AllGatherDispatcher(Dispatcher):
    name = "allgather"
    count_columns = 0

    def _outgoing(self, topk_idx):
        return Outgoing(topk_idx, self.agreement.no_counts())

    def _stages(self, topk_weights, outgoing, recv_counts, headers):
        topk_idx, g = outgoing.topk_idx, self.groups
        n, topk = topk_idx.shape
        counts = headers.num_tokens.tolist()
        dev = topk_idx.device
        hop = AllGatherHop(index=torch.arange(n, device=dev).repeat(g.ep_size),
                           copy=torch.arange(g.ep_size, device=dev).repeat_interleave(n),
                           num_src=n, max_copies=g.ep_size, channel=g.ep_channel, send_splits=[n] * g.ep_size,
                           recv_splits=counts, peers=list(range(g.ep_size)), meta_bytes=metadata_bytes(self.name, topk))
        meta = yield Stage(hop, torch.cat([topk_idx, weight_bits(topk_weights)], 1))
        # Every rank's tokens arrived with their expert ids and weights: pick this rank's.
        me = torch.full((meta.shape[0],), g.ep_rank, device=dev)
        local = local_ids_for(meta[:, :topk], me, self.rank_of_expert, self.local_of_expert)
        last, rows = self._expand(local, meta[:, topk:], headers, topk_weights.dtype)
        yield last
        return rows
