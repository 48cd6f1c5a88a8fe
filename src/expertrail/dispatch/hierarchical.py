"""``hierarchical``: two-level dispatch, as Hybrid-EP and DeepEP internode.

Hop 1 sends one row per (token, destination domain) over the rail group, to the rank of that
domain with the sender's local index. Hop 2 forwards one row per (token, destination rank)
inside the domain. Combine reduces inside the domain before a row crosses domains again, so
the slow inter-domain link carries each token at most once per domain, both ways.
"""
from __future__ import annotations

import torch

from ..names import metadata_bytes
from .routing import token_membership
from .base import Dispatcher
from .planning import Outgoing, weight_bits
from .dedup import local_ids_for
from .route import AllToAllHop, SplitHop, Stage


class HierarchicalDispatcher(Dispatcher):
    name = "hierarchical"
    count_columns = 2

    def _outgoing(self, topk_idx):
        g = self.groups
        layout = self._layout(topk_idx)
        # Column 0, to every rank q: my tokens bound for q (q receives them in hop 2, via the
        # rank of its domain on my rail). Column 1, to my rail peer in each domain: my rows of hop 1.
        per_domain = layout.tokens_per_domain
        to_rail_peer = torch.zeros(g.ep_size, dtype=torch.int64, device=topk_idx.device)
        to_rail_peer[g.domain_rank::g.domain_size] = per_domain
        domain, token = torch.nonzero(layout.token_in_domain.t()).unbind(1)            # hop 1 rows
        return Outgoing(topk_idx, torch.stack([layout.tokens_per_rank, to_rail_peer], 1), token,
                          per_domain.tolist(), g.domain_index, domain)

    def _stages(self, topk_weights, outgoing, recv_counts, headers):
        topk_idx, domain, token = outgoing.topk_idx, outgoing.dest, outgoing.token
        g = self.groups
        n, topk = topk_idx.shape
        dev = topk_idx.device
        size, first = g.domain_size, g.domain_index * g.domain_size
        # Hop 1: over the rail group, one row per (token, domain). A row carries its source
        # (rank, token), the ids of its experts in the destination domain and its weights.
        hop1 = AllToAllHop.numbered(token, n, min(topk, g.num_domains), channel=g.rail_channel,
                                    send_splits=outgoing.send_splits,
                                    recv_splits=recv_counts[g.domain_rank::size, 1].tolist(),
                                    peers=[d * size + g.domain_rank for d in range(g.num_domains)],
                                    meta_bytes=metadata_bytes(self.name, topk), me=g.domain_index)
        ids = topk_idx[token]
        mask = (ids >= 0) & (self.rank_of_expert[ids.clamp(min=0)] // size == domain.unsqueeze(1))
        meta = yield Stage(hop1, torch.cat([torch.full_like(token, g.ep_rank).unsqueeze(1), token.unsqueeze(1),
                                            torch.where(mask, ids, torch.full_like(ids, -1)),
                                            weight_bits(topk_weights[token])], 1))

        # Hop 2: inside the domain, one row per (hop-1 row, rank of the domain holding one of its
        # experts). With several domains it is split (`SplitHop`): the rows this rank sent itself
        # in hop 1 are forwarded while the other domains' rows still cross the slow link.
        ids = meta[:, 2:2 + topk]
        member = token_membership(ids, self.rank_of_expert - first, size) if ids.numel() else \
            torch.zeros(0, size, dtype=torch.bool, device=dev)
        hop2_recv = recv_counts[:, 0].view(g.num_domains, size)   # rows I receive, by source domain
        rows = torch.arange(meta.shape[0], device=dev)

        def part(selected, start, num_src, recv_splits):
            """The hop-2 exchange of hop-1 rows ``selected`` of a level of ``num_src`` rows
            starting at hop-1 row ``start``, and the metadata it sends."""
            local_rank, row1 = torch.nonzero(member[selected].t()).unbind(1)
            row1 = selected.index_select(0, row1)
            hop = AllToAllHop.numbered(row1 - start, num_src, min(topk, size), channel=g.domain_channel,
                                       send_splits=torch.bincount(local_rank, minlength=size).tolist(),
                                       recv_splits=recv_splits, peers=[first + r for r in range(size)],
                                       meta_bytes=metadata_bytes(self.name, topk), me=g.domain_rank)
            local = local_ids_for(ids[row1], first + local_rank, self.rank_of_expert, self.local_of_expert)
            return hop, torch.cat([meta[row1, :2], local, meta[row1, 2 + topk:]], 1)

        if g.num_domains == 1 or size == 1:
            meta2 = yield Stage(*part(rows, 0, rows.numel(), hop2_recv.sum(0).tolist()))
        else:
            start, end = hop1.own_block_received()
            mine = (rows >= start) & (rows < end)
            early, early_meta = part(rows[mine], start, end - start, hop2_recv[g.domain_index].tolist())
            late, late_meta = part(rows[~mine], 0, rows.numel(),
                                   (hop2_recv.sum(0) - hop2_recv[g.domain_index]).tolist())
            meta2 = yield Stage(SplitHop(early, late, (start, end)), [early_meta, late_meta])

        # Rows arrive grouped by forwarding rank; sort each expert's rows by (source, token).
        most = max(1, int(headers.num_tokens.max()))
        last, expert_rows = self._expand(meta2[:, 2:2 + topk], meta2[:, 2 + topk:], headers, topk_weights.dtype,
                                         src_key=meta2[:, 0] * most + meta2[:, 1], bound=g.ep_size * most)
        yield last
        return expert_rows
