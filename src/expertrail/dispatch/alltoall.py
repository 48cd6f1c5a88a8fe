"""``alltoall``: one row per (token, expert) pair, one flat all-to-all over the EP group.

The Megatron-Core alltoall dispatcher and torchtitan move tokens this way. A token with two
experts on one rank crosses the link twice; the other backends avoid that.

The received rows must end up expert-major. Two layouts get them there, chosen per dispatch
from sizes every rank knows (the same choice on every rank):
- landing in place: the exchange is cut in one run per (peer, local expert), so received rows
  land directly in the expert-major output, and combine sends slices of the expert output
  straight back; the expert side permutes nothing, at the price of E_local messages per peer;
- blocks: one message per peer, as Megatron-Core's all-to-all, then a local permutation.
Runs pay off when they are large: from about `LANDING_MIN_RUN_BYTES` each, measured on gloo
(``benchmarks/layouts.py``, see docs/benchmarks.md); below that, messages cost more than the
permutation they save. The same rule applies on NCCL, where a permutation in GPU memory is
cheaper still; it keeps a layer with many local experts from posting hundreds of transfers.
"""
from __future__ import annotations

import torch

from ..kernels.torch_ops import CopyPositions, count_values, stable_argsort
from ..names import metadata_bytes
from ..comm.transport import LandingRuns
from .base import Dispatcher
from .planning import Outgoing, bits_weight, padded_positions, weight_bits
from .config import AllToAllConfig
from .route import AllToAllHop, ExpandHop, ExpertRows, InPlaceHop, LandingHop, Stage

# Smallest mean run (bytes of rows per (source, destination, local expert)) for which received
# rows land in place: where the two layouts break even in `benchmarks/layouts.py` on gloo (4
# ranks on 2 cores, bf16 dispatch + combine): runs of 1 MiB were 18-23% faster than blocks, of
# 256 KiB even (0.97-1.03), of 128 KiB 8-12% and of 64 KiB 29-32% slower.
LANDING_MIN_RUN_BYTES = 256 * 1024


def pair_copies(pairs: torch.Tensor, num_tokens: int, topk: int) -> CopyPositions | None:
    """Where the copies of each token sit among the sent rows: sent row j is the (token, k)
    pair ``pairs[j] = n * K + k`` (int64 [R], -1-free), so copy k of token n is row j (summed
    back in k order). None when K is 0."""
    if not topk:
        return None
    at = torch.full((num_tokens * topk,), -1, dtype=torch.int64, device=pairs.device)
    at.scatter_(0, pairs, torch.arange(pairs.numel(), device=pairs.device))
    return CopyPositions.from_dense(at.view(num_tokens, topk))


def expert_major_order(recv_counts: torch.Tensor, real_rows: int) -> torch.Tensor:
    """Rows received grouped by (source, local expert), ``recv_counts [P, E_local]`` of them per
    run, ``real_rows`` in all -> int64 [M_real]: the received row of each expert-major row (by
    expert, then source, then order of arrival)."""
    p, local = recv_counts.shape
    run_counts = recv_counts.t().reshape(-1)                                  # runs in (expert, source) order
    received_start = (torch.cumsum(recv_counts.reshape(-1), 0) - recv_counts.reshape(-1)).view(p, local).t()
    from_received = torch.repeat_interleave(received_start.reshape(-1) - (torch.cumsum(run_counts, 0) - run_counts),
                                            run_counts, output_size=real_rows)
    return from_received + torch.arange(real_rows, device=recv_counts.device)


def landing_pieces(send_counts: torch.Tensor, recv_counts: torch.Tensor, padding: torch.Tensor) -> dict:
    """The pieces of a `LandingRuns` exchange that lands rows expert-major with padding.

    send_counts [P, E_local]: rows this rank sends each peer's local experts; recv_counts [P,
    E_local]: rows it receives from each source for its experts; padding [E_local]: zero rows
    after each expert's. The sent rows are cut by (peer, expert), the landing buffer by (expert,
    source) plus each expert's padding, so the run (peer q, expert e) is piece q * E_local + e of
    one and e * (P + 1) + q of the other. Returns the fields send_sizes, recv_sizes, send, recv.
    """
    p, local = send_counts.shape
    return {"send_sizes": send_counts.reshape(-1).tolist(),
            "recv_sizes": torch.cat([recv_counts.t(), padding.unsqueeze(1)], 1).reshape(-1).tolist(),
            "send": torch.arange(p * local).view(p, local).tolist(),
            "recv": (torch.arange(local) * (p + 1) + torch.arange(p).unsqueeze(1)).tolist()}


class AllToAllDispatcher(Dispatcher):
    """Options as `Dispatcher`, plus ``land_in_place`` (`AllToAllConfig`): True / False forces
    the layout (see the module docstring); None (default) lands in place when the mean run is
    large enough, or when there is one run per peer anyway (one local expert)."""

    name = "alltoall"
    Config = AllToAllConfig
    weights_at_source = True       # one row per (token, expert): combine may weight on the source side

    def _lands_in_place(self, headers) -> bool:
        """Whether this dispatch lands rows in place; from every rank's header, so every rank
        decides the same."""
        if self.config.land_in_place is not None:
            return self.config.land_in_place
        if self.num_local_experts == 1:
            return True       # one run per peer: nothing to trade
        rows = int(headers.num_tokens.sum()) * headers.topk
        row_bytes = headers.hidden * headers.dtype.itemsize
        runs = self.groups.ep_size ** 2 * self.num_local_experts
        return rows * row_bytes >= LANDING_MIN_RUN_BYTES * runs

    @property
    def count_columns(self) -> int:
        return self.num_local_experts       # rows per (destination rank, its local expert)

    def _outgoing(self, topk_idx):
        k = topk_idx.shape[1]
        key = topk_idx.reshape(-1) + 1                            # 0: dropped top-k entry, e + 1: expert e
        per_key = count_values(key, self.num_experts + 1)
        counts = per_key[1:].view(self.groups.ep_size, -1)
        # What the host plans with (dropped entries, rows per peer and expert), copied at once:
        # one wait for the GPU.
        host_keys = per_key.cpu()
        host_counts = host_keys[1:].view(self.groups.ep_size, -1)
        pairs = stable_argsort(key)[int(host_keys[0]):]   # n * K + k of each sent row, by expert, then (n, k)
        return Outgoing(topk_idx, counts, pairs // max(k, 1), host_counts.sum(1).tolist(), self.groups.ep_rank,
                        pairs=pairs, host_counts=host_counts)

    def _stages(self, topk_weights, outgoing, recv_counts, headers):
        pairs, token, send_splits = outgoing.pairs, outgoing.token, outgoing.send_splits
        topk = outgoing.topk_idx.shape[1]
        g = self.groups
        n, p = topk_weights.shape[0], g.ep_size
        real = recv_counts.sum(0)                                 # [E_local] rows per local expert
        padded = self._padded_counts(real, headers)
        # The sizes the host plans with, from the control row's host copy.
        host_counts = headers.counts
        host_real = host_counts.sum(0)
        host_padding = self._padded_counts(host_real, headers) - host_real
        real_rows, out_rows = int(host_real.sum()), int(host_real.sum() + host_padding.sum())
        k = pairs % max(topk, 1)
        sent = dict(index=token, copy=k, num_src=n, max_copies=max(topk, 1),          # copies summed in k order
                    positions=pair_copies(pairs, n, topk), channel=g.ep_channel, send_splits=send_splits,
                    recv_splits=host_counts.sum(1).tolist(), peers=list(range(p)),
                    meta_bytes=metadata_bytes(self.name, topk))
        from_received = expert_major_order(recv_counts, real_rows)
        real_pos = None
        if out_rows != real_rows:                                 # padding: where the real rows go
            expert = torch.repeat_interleave(torch.arange(self.num_local_experts, device=real.device), real)
            real_pos = padded_positions(expert, real, padded)
        if self._lands_in_place(headers):
            runs = LandingRuns(**landing_pieces(outgoing.host_counts, host_counts, host_padding), channel=g.ep_channel,
                               out_rows=out_rows, zero_fill=out_rows != real_rows)
            hop = LandingHop(runs=runs, **sent)
            placed = real_pos if real_pos is not None else torch.arange(real_rows, device=real.device)
            last = InPlaceHop(index=placed, copy=torch.zeros_like(placed), num_src=out_rows, max_copies=1,
                              out_pos=real_pos, out_rows=out_rows)
        else:
            # One block per peer, then a local permutation into expert-major order (and padding).
            hop = AllToAllHop(me=g.ep_rank, **sent)
            output_row = torch.empty_like(from_received)
            output_row[from_received] = torch.arange(real_rows, device=real.device)
            last = ExpandHop(index=from_received, copy=torch.zeros_like(from_received), num_src=real_rows, max_copies=1,
                             positions=CopyPositions.from_dense(output_row.view(-1, 1)), out_pos=real_pos,
                             out_rows=out_rows if real_pos is not None else None)
        # A row carries its k and its weight (its expert follows from where it lands); nothing in
        # the plan depends on them.
        # Combine weights the exact expert outputs on this (source) side: see `Route.source_weights`.
        source_weights = topk_weights.reshape(-1).index_select(0, pairs)
        received = yield Stage(hop, torch.stack([k, weight_bits(source_weights)], 1))
        yield Stage(last)
        ordered = received.index_select(0, from_received)
        return ExpertRows(ordered[:, 0], bits_weight(ordered[:, 1], topk_weights.dtype), padded, real, source_weights)
