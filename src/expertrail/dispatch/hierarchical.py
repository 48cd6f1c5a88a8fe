"""``hierarchical``: two-level dispatch, as Hybrid-EP and DeepEP internode.

Hop 1 sends one row per (token, destination domain) over the rail group, to the rank of that
domain with the sender's local index. Hop 2 forwards one row per (token, destination rank)
inside the domain. Combine reduces inside the domain before a row crosses domains again, so
the slow inter-domain link carries each token at most once per domain, both ways.
"""
from __future__ import annotations

import torch

from ..plan.cost import metadata_bytes
from ..routing import token_membership
from .base import H_TOKENS, Dispatcher, bits_weight, expand_local, number_copies, weight_bits
from .dedup import local_ids_for
from .route import Hop, Route, own_block


class HierarchicalDispatcher(Dispatcher):
    name = "hierarchical"
    count_columns = 2

    def _plan_source(self, topk_idx):
        g = self.groups
        n = topk_idx.shape[0]
        member = token_membership(topk_idx, self.rank_of_expert, g.ep_size)           # [N, P]
        in_domain = member.view(n, g.num_domains, g.domain_size).any(2)               # [N, D_count]
        # Column 0, to every rank q: my tokens bound for q (q receives them in hop 2, via the
        # rank of its domain on my rail). Column 1, to my rail peer in each domain: my rows of hop 1.
        per_domain = in_domain.sum(0)
        to_rail_peer = torch.zeros(g.ep_size, dtype=torch.int64, device=topk_idx.device)
        to_rail_peer[g.domain_rank::g.domain_size] = per_domain
        domain, token = torch.nonzero(in_domain.t()).unbind(1)                         # hop 1 rows
        return torch.stack([member.sum(0), to_rail_peer], 1), (topk_idx, domain, token, per_domain.tolist())

    def _first_index(self, state):
        _, _, token, send_splits = state
        return token, own_block(send_splits, self.groups.domain_index)

    def _route(self, topk_weights, state, recv_counts, headers):
        topk_idx, domain, token, send_splits = state
        g = self.groups
        n, topk = topk_idx.shape
        dev = topk_idx.device
        size, me, first = g.domain_size, g.ep_rank, g.domain_index * g.domain_size
        # Hop 1: over the rail group, one row per (token, domain).
        slot, positions = number_copies(token, n, max(1, min(topk, g.num_domains)))
        hop1 = Hop(index=token, slot=slot, num_src=n, num_slots=positions.num_slots, positions=positions,
                   group=g.rail_group, send_splits=send_splits,
                   recv_splits=recv_counts[g.domain_rank::size, 1].tolist(),
                   peers=[d * size + g.domain_rank for d in range(g.num_domains)],
                   meta_bytes=metadata_bytes(self.name, topk), me=g.domain_index)
        route = Route(hops=[hop1], topk=topk)

        def plan_hop2(meta):
            # Hop 2: inside the domain, one row per (token, rank).
            ids = meta[:, 2:2 + topk]
            member = token_membership(ids, self.rank_of_expert - first, size) if ids.numel() else \
                torch.zeros(0, size, dtype=torch.bool, device=dev)
            local_rank, row1 = torch.nonzero(member.t()).unbind(1)
            slot2, positions2 = number_copies(row1, meta.shape[0], max(1, min(topk, size)))
            hop2 = Hop(index=row1, slot=slot2, num_src=meta.shape[0], num_slots=positions2.num_slots,
                       positions=positions2, group=g.domain_group, send_splits=member.sum(0).tolist(),
                       recv_splits=recv_counts[:, 0].view(g.num_domains, size).sum(0).tolist(),
                       peers=[first + r for r in range(size)], meta_bytes=metadata_bytes(self.name, topk),
                       me=g.domain_rank)
            route.hops.append(hop2)
            local = local_ids_for(ids[row1], first + local_rank, self.rank_of_expert, self.local_of_expert)
            self._send_meta(hop2, torch.cat([meta[row1, :2], local, meta[row1, 2 + topk:]], 1), expand)

        def expand(meta2):
            # Rows arrive grouped by forwarding rank; sort each expert's rows by (source, token).
            most = max(1, int(headers[:, H_TOKENS].max()))
            src_key = meta2[:, 0] * most + meta2[:, 1]
            row, k, expert = expand_local(meta2[:, 2:2 + topk], src_key, g.ep_size * most)
            self._finish_route(route, row, k, expert, meta2.shape[0], min(topk, self.num_local_experts), headers,
                               bits_weight(meta2[:, 2 + topk:][row, k], topk_weights.dtype))
        # A hop-1 row carries its source (rank, token), the ids of its experts in the destination
        # domain and its weights.
        ids = topk_idx[token]
        mask = (ids >= 0) & (self.rank_of_expert[ids.clamp(min=0)] // size == domain.unsqueeze(1))
        meta = torch.cat([torch.full_like(token, me).unsqueeze(1), token.unsqueeze(1),
                          torch.where(mask, ids, torch.full_like(ids, -1)), weight_bits(topk_weights[token])], 1)
        self._send_meta(hop1, meta, plan_hop2)
        return route
