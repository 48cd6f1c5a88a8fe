"""``alltoall``: one row per (token, expert) pair, one flat all-to-all over the EP group.

The Megatron-Core alltoall dispatcher and torchtitan move tokens this way. A token with two
experts on one rank crosses the link twice; the other backends avoid that.

The exchange is split in one run per (peer, local expert), so received rows land directly in
the expert-major output (and combine sends slices of the expert output straight back): the
expert side does no permutation in either direction.
"""
from __future__ import annotations

import torch

from .base import Dispatcher, bits_weight, padded_positions, weight_bits
from .route import Hop, LandingRuns, Route


class AllToAllDispatcher(Dispatcher):
    name = "alltoall"

    @property
    def count_columns(self) -> int:
        return self.num_local_experts       # rows per (destination rank, its local expert)

    def _plan_source(self, topk_idx):
        n, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        slots = torch.nonzero(flat >= 0).squeeze(1)               # (n, k) order
        experts = flat[slots]
        order = torch.sort(experts, stable=True).indices          # expert, then n, then k
        slots, experts = slots[order], experts[order]
        counts = torch.bincount(experts, minlength=self.num_experts).view(self.groups.ep_size, -1)
        return counts, (slots, slots // max(k, 1), counts, k)

    def _first_index(self, state):
        _, token, send_counts, _ = state
        per_peer = send_counts.sum(1).tolist()
        start = sum(per_peer[:self.groups.ep_rank])
        return token, (start, start + per_peer[self.groups.ep_rank])

    def _route(self, topk_weights, state, recv_counts, headers):
        slots, token, send_counts, topk = state
        g = self.groups
        n = topk_weights.shape[0]
        real = recv_counts.sum(0)                                 # [E_local] rows per local expert
        padded = self._padded_counts(real, headers)
        # Rows from source s for expert e land after those of sources < s, inside e's block.
        land = (torch.cumsum(padded, 0) - padded).unsqueeze(0) + torch.cumsum(recv_counts, 0) - recv_counts
        send_start = (torch.cumsum(send_counts.reshape(-1), 0) - send_counts.reshape(-1)).view_as(send_counts)
        runs = LandingRuns(send=_runs(send_start, send_counts), recv=_runs(land, recv_counts),
                           peer_ranks=list(g.ep_ranks), me=g.ep_rank, group=g.ep_group,
                           out_rows=int(padded.sum()), zero_fill=not torch.equal(padded, real))
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        k = slots % topk
        hop = Hop(index=token, slot=k, num_src=n, num_slots=max(topk, 1),         # copies summed in k order
                  group=g.ep_group, send_splits=send_splits, recv_splits=recv_splits,
                  peers=list(range(g.ep_size)), meta_bytes=16, runs=runs)
        expert = torch.repeat_interleave(torch.arange(self.num_local_experts, device=real.device), real)
        real_pos = padded_positions(expert, real, padded)
        last = Hop(index=real_pos, slot=torch.zeros_like(real_pos), num_src=runs.out_rows, num_slots=1,
                   out_pos=real_pos, out_rows=runs.out_rows, identity=True)
        route = Route(hops=[hop, last], topk=topk, row_expert=expert, tokens_per_expert=padded,
                      real_tokens_per_expert=real, source_weights=topk_weights.reshape(-1)[slots])
        # Metadata arrives by (source, expert); the real rows are ordered by (expert, source).
        run_counts = recv_counts.reshape(-1)
        real_start = ((torch.cumsum(real, 0) - real).unsqueeze(0) + torch.cumsum(recv_counts, 0) - recv_counts)
        to_real = torch.repeat_interleave(real_start.reshape(-1) - (torch.cumsum(run_counts, 0) - run_counts),
                                          run_counts) + torch.arange(int(run_counts.sum()), device=real.device)

        def arrived(received):
            ordered = torch.empty_like(received)
            ordered[to_real] = received
            route.row_k, route.row_weights = ordered[:, 0], bits_weight(ordered[:, 1], topk_weights.dtype)
        # A row carries its k and its weight (its expert follows from where it lands); nothing in
        # the plan depends on them.
        self._send_meta(hop, torch.stack([k, weight_bits(topk_weights.reshape(-1)[slots])], 1), arrived)
        return route


def _runs(start: torch.Tensor, counts: torch.Tensor) -> list:
    """Per peer, the (offset, count) run of each local expert: [P, E_local] -> P lists."""
    return [list(zip(s, c)) for s, c in zip(start.tolist(), counts.tolist())]
