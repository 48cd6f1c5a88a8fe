"""``alltoall``: one row per (token, expert) pair, one flat all-to-all over the EP group.

The Megatron-Core alltoall dispatcher and torchtitan move tokens this way. A token with two
experts on one rank crosses the link twice; the other backends avoid that.

The exchange is split in one run per (peer, local expert), so received rows land directly in
the expert-major output (and combine sends slices of the expert output straight back): the
expert side does no permutation in either direction.
"""
from __future__ import annotations

import torch

from ..kernels.reference import CopyPositions, stable_argsort
from .base import Dispatcher, bits_weight, padded_positions, weight_bits
from .route import Hop, LandingRuns, Route, own_block


class AllToAllDispatcher(Dispatcher):
    name = "alltoall"

    @property
    def count_columns(self) -> int:
        return self.num_local_experts       # rows per (destination rank, its local expert)

    def _plan_source(self, topk_idx):
        k = topk_idx.shape[1]
        key = topk_idx.reshape(-1) + 1                            # 0: dropped slot, e + 1: expert e
        per_key = torch.bincount(key, minlength=self.num_experts + 1)
        dropped = int(per_key[0])
        slots = stable_argsort(key)[dropped:]   # by expert, then (n, k)
        counts = per_key[1:].view(self.groups.ep_size, -1)
        return counts, (slots, slots // max(k, 1), counts, counts.sum(1).tolist(), k)

    def _first_index(self, state):
        _, token, _, send_splits, _ = state
        return token, own_block(send_splits, self.groups.ep_rank)

    def _route(self, topk_weights, state, recv_counts, headers):
        slots, token, send_counts, send_splits, topk = state
        g = self.groups
        n, p, local = topk_weights.shape[0], g.ep_size, self.num_local_experts
        real = recv_counts.sum(0)                                 # [E_local] rows per local expert
        real_rows = int(real.sum())
        padded = self._padded_counts(real, headers)
        # The sent rows are cut by (peer, expert); the landing buffer by (expert, source) plus each
        # expert's padding, so that rows from source s for expert e land after those of sources < s:
        # the run (peer q, expert e) is piece q * E_local + e of one and e * (P + 1) + q of the other.
        recv_sizes = torch.cat([recv_counts.t(), (padded - real).unsqueeze(1)], 1).reshape(-1).tolist()
        runs = LandingRuns(send_sizes=send_counts.reshape(-1).tolist(), recv_sizes=recv_sizes,
                           send=torch.arange(p * local).view(p, local).tolist(),
                           recv=(torch.arange(local) * (p + 1) + torch.arange(p).unsqueeze(1)).tolist(),
                           peer_ranks=list(g.ep_ranks), me=g.ep_rank, group=g.ep_group,
                           out_rows=sum(recv_sizes), zero_fill=sum(recv_sizes) != real_rows)
        k = slots % max(topk, 1)
        # Copy (n, k) of a token sits where the sort put slot n * K + k: the copies of the combine.
        at = torch.full((n * topk,), -1, dtype=torch.int64, device=slots.device)
        at.scatter_(0, slots, torch.arange(slots.numel(), device=slots.device))
        hop = Hop(index=token, slot=k, num_src=n, num_slots=max(topk, 1),          # copies summed in k order
                  group=g.ep_group, send_splits=send_splits, recv_splits=recv_counts.sum(1).tolist(),
                  peers=list(range(p)), meta_bytes=16, runs=runs,
                  positions=CopyPositions.from_dense(at.view(n, max(topk, 1))) if topk else None)
        if runs.zero_fill:
            expert = torch.repeat_interleave(torch.arange(local, device=real.device), real)
            real_pos = padded_positions(expert, real, padded)
        else:
            real_pos = torch.arange(real_rows, device=real.device)
        last = Hop(index=real_pos, slot=torch.zeros_like(real_pos), num_src=runs.out_rows, num_slots=1,
                   out_pos=real_pos if runs.zero_fill else None, out_rows=runs.out_rows, identity=True)
        route = Route(hops=[hop, last], topk=topk, tokens_per_expert=padded, real_tokens_per_expert=real,
                      source_weights=topk_weights.reshape(-1).index_select(0, slots))
        # Metadata arrives by (source, expert); the real rows are ordered by (expert, source): real
        # row i of run (e, s) is received row i of that run.
        run_counts = recv_counts.t().reshape(-1)
        received_start = (torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)).view(p, local).t()
        from_received = torch.repeat_interleave(received_start.reshape(-1) - (torch.cumsum(run_counts, 0) - run_counts),
                                                run_counts, output_size=real_rows)
        from_received += torch.arange(real_rows, device=real.device)

        def arrived(received):
            ordered = received.index_select(0, from_received)
            route.row_k, route.row_weights = ordered[:, 0], bits_weight(ordered[:, 1], topk_weights.dtype)
        # A row carries its k and its weight (its expert follows from where it lands); nothing in
        # the plan depends on them.
        self._send_meta(hop, torch.stack([k, weight_bits(route.source_weights)], 1), arrived)
        return route
