"""``hierarchical``: two-level dispatch, as Hybrid-EP and DeepEP internode.

Hop 1 sends one row per (token, destination domain) over the rail group, to the rank of that
domain with the sender's local index. Hop 2 forwards one row per (token, destination rank)
inside the domain. Combine reduces inside the domain before a row crosses domains again, so
the slow inter-domain link carries each token at most once per domain, both ways.

The two hops are a pipeline (`route.SplitHop`): the rows a rank sent itself in hop 1 are
forwarded at once, and every other block of hop 1 travels in ``pipeline_chunks`` pieces, each
forwarded inside the domain as soon as it lands, while the next ones are still on the slow
link; each part of hop 2 is copied into expert order as it lands. Combine runs it backwards:
each part's expert-side sums go back inside the domain as soon as they are summed, and each
piece's partial sums start back across the slow link as soon as they are. The control exchange
carries, per destination rank, the rows of each piece, so a receiver knows what each forwarded
piece holds before it lands.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..names import metadata_bytes
from .routing import token_membership
from .base import Dispatcher
from .planning import Outgoing, weight_bits
from .dedup import local_ids_for
from ..comm.topology import guarded
from ..comm.transport import MIN_PIECE_ROWS, piece_bounds
from ..errors import ConfigError
from ..kernels.torch_ops import count_values
from .config import DispatchConfig
from .route import AllToAllHop, Forwarded, SplitHop, Stage

# Pieces per hop-1 block when the caller gives none: measured on the emulated cluster
# (docs/benchmarks.md, "The two-level pipeline").
DEFAULT_PIPELINE_CHUNKS = 4


@dataclass(frozen=True)
class HierarchicalConfig(DispatchConfig):
    """hierarchical's settings. pipeline_chunks: the most pieces a rail-hop block travels in, each
    forwarded inside the domain as it lands (1: the block at once; None: the default,
    `DEFAULT_PIPELINE_CHUNKS` where the EP group spans hosts, 1 on one host);
    pipeline_min_rows: the fewest rows of a piece (a smaller block is cut into fewer pieces)."""

    pipeline_chunks: int | None = None
    pipeline_min_rows: int = MIN_PIECE_ROWS

    @property
    def chunks(self) -> int:
        return DEFAULT_PIPELINE_CHUNKS if self.pipeline_chunks is None else int(self.pipeline_chunks)

    def check(self) -> None:
        super().check()
        c = self.pipeline_chunks
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 64):
            raise ConfigError(f"pipeline_chunks={c!r} must be an integer from 1 to 64 (or None for "
                              f"{DEFAULT_PIPELINE_CHUNKS})")
        m = self.pipeline_min_rows
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ConfigError(f"pipeline_min_rows={m!r} must be a positive integer (rows)")


def _host() -> str:
    """This process's host as the network sees it: the host name and, on Linux, the network
    namespace (the emulated cluster's nodes share a host name, not a namespace)."""
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = 0
    return f"{socket.gethostname()}/{namespace}"


def _ranks_on_other_hosts(groups) -> bool:
    """Whether any rank of the EP group runs on another host than this one (collective)."""
    hosts = [None] * groups.ep_size
    with guarded("hierarchical's host check", groups):
        dist.all_gather_object(hosts, _host(), group=groups.ep_group)
    return len(set(hosts)) > 1


class HierarchicalDispatcher(Dispatcher):
    name = "hierarchical"
    Config = HierarchicalConfig

    @property
    def count_columns(self) -> int:
        """Rows per destination rank in hop 2, rows to the rail peer in hop 1, then (pipelined)
        hop 2's rows per piece."""
        return 2 + self.config.chunks if self._pipelined() else 2

    def __init__(self, groups, num_experts: int, **options):
        self._rail_leaves_host = False          # known once the base has checked the settings
        super().__init__(groups, num_experts, **options)
        g = self.groups
        # By default the pipeline runs only where the rail hop leaves the host (a slower link
        # than the domain hop's): on one host its pieces cost more than they hide
        # (docs/decisions.md, "The two-level pipeline").
        self._rail_leaves_host = g.num_domains > 1 and g.domain_size > 1 and \
            (self.config.pipeline_chunks is not None or _ranks_on_other_hosts(g))
        self.agreement.count_columns = self.count_columns       # the per-piece counts only when pipelined

    def _pipelined(self) -> bool:
        return self.config.chunks > 1 and self._rail_leaves_host

    def _outgoing(self, topk_idx):
        g = self.groups
        layout = self._layout(topk_idx)
        # Column 0, to every rank q: my tokens bound for q (q receives them in hop 2, via the
        # rank of its domain on my rail). Column 1, to my rail peer in each domain: my rows of hop 1.
        per_domain = layout.tokens_per_domain
        to_rail_peer = torch.zeros(g.ep_size, dtype=torch.int64, device=topk_idx.device)
        to_rail_peer[g.domain_rank::g.domain_size] = per_domain
        domain, token = torch.nonzero(layout.token_in_domain.t()).unbind(1)            # hop 1 rows
        blocks = per_domain.tolist()
        counts = [layout.tokens_per_rank, to_rail_peer]
        if self._pipelined():
            counts += list(self._rows_per_piece(layout, domain, token, per_domain, blocks).unbind(1))
        return Outgoing(topk_idx, torch.stack(counts, 1), token, blocks, g.domain_index, domain)

    def _rows_per_piece(self, layout, domain, token, per_domain, blocks: list) -> torch.Tensor:
        """int64 [P, chunks]: for each EP rank q, the hop-1 rows of each piece of this rank's block
        to q's domain that q receives in hop 2 (the tokens with an expert on q). ``blocks``:
        ``per_domain`` as a list."""
        g, chunks = self.groups, self.config.chunks
        dev = token.device
        # The piece of each hop-1 row: its place in its domain's block against the pieces' ends.
        starts = torch.cumsum(per_domain, 0) - per_domain
        place = torch.arange(token.numel(), device=dev) - starts[domain]
        ends = torch.tensor([[b for _, b in piece_bounds(n, chunks, self.config.pipeline_min_rows)] for n in blocks],
                            dtype=torch.int64, device=dev).view(-1, chunks)                  # [D, chunks]
        piece = (ends[domain] <= place.unsqueeze(1)).sum(1)
        # Row (token t, domain d) goes on in hop 2 to the ranks of d holding one of t's experts.
        receivers = layout.token_in_rank.index_select(0, token).view(-1, g.num_domains, g.domain_size)
        receivers = receivers[torch.arange(token.numel(), device=dev), domain].to(torch.int64)      # [R, size]
        counts = torch.zeros(g.num_domains * chunks, g.domain_size, dtype=torch.int64, device=dev)
        counts.index_add_(0, domain * chunks + piece, receivers)
        return counts.view(g.num_domains, chunks, g.domain_size).transpose(1, 2).reshape(g.ep_size, chunks)

    def _stages(self, topk_weights, outgoing, recv_counts, headers):
        topk_idx, domain, token = outgoing.topk_idx, outgoing.dest, outgoing.token
        g = self.groups
        n, topk = topk_idx.shape
        dev = topk_idx.device
        size, first = g.domain_size, g.domain_index * g.domain_size
        # Hop 1: over the rail group, one row per (token, domain). A row carries its source
        # (rank, token), the ids of its experts in the destination domain and its weights.
        chunks = self.config.chunks if self._pipelined() else 1
        host_counts = headers.counts           # every split below read from the control row's host copy
        hop1 = AllToAllHop.numbered(token, n, min(topk, g.num_domains), channel=g.rail_channel,
                                    send_splits=outgoing.send_splits,
                                    recv_splits=host_counts[g.domain_rank::size, 1].tolist(),
                                    peers=[d * size + g.domain_rank for d in range(g.num_domains)],
                                    meta_bytes=metadata_bytes(self.name, topk), me=g.domain_index, pieces=chunks,
                                    piece_rows=self.config.pipeline_min_rows)
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
        hop2_recv = host_counts[:, 0].view(g.num_domains, size)   # rows I receive, by source domain
        rows = torch.arange(meta.shape[0], device=dev)

        def part(selected, start, num_src, recv_splits):
            """The hop-2 exchange of hop-1 rows ``selected`` of a level of ``num_src`` rows
            starting at hop-1 row ``start``, and the metadata it sends."""
            local_rank, row1 = torch.nonzero(member[selected].t()).unbind(1)
            row1 = selected.index_select(0, row1)
            hop = AllToAllHop.numbered(row1 - start, num_src, min(topk, size), channel=g.domain_channel,
                                       send_splits=count_values(local_rank, size).tolist(),
                                       recv_splits=recv_splits, peers=[first + r for r in range(size)],
                                       meta_bytes=metadata_bytes(self.name, topk), me=g.domain_rank)
            local = local_ids_for(ids[row1], first + local_rank, self.rank_of_expert, self.local_of_expert)
            return hop, torch.cat([meta[row1, :2], local, meta[row1, 2 + topk:]], 1)

        if g.num_domains == 1 or size == 1:
            meta2 = yield Stage(*part(rows, 0, rows.numel(), hop2_recv.sum(0).tolist()))
        else:
            # Early: the rows this rank sent itself in hop 1, forwarded at once. Late: each piece
            # of every other domain's block, piece by piece (all domains' first pieces first).
            start, end = hop1.own_block_received()
            early, early_meta = part(rows[start:end], start, end - start, hop2_recv[g.domain_index].tolist())
            blocks = hop1.recv_splits
            late, late_meta = [], []
            for j in range(chunks):
                for d in range(g.num_domains):
                    if d == g.domain_index:
                        continue
                    first_row = sum(blocks[:d])
                    a, b = (first_row + x for x in piece_bounds(blocks[d], chunks, hop1.piece_rows)[j])
                    column = 2 + j if chunks > 1 else 0
                    hop, meta_part = part(rows[a:b], a, b - a, host_counts[d * size:(d + 1) * size, column].tolist())
                    late.append(Forwarded(d, j, a, b, hop))
                    late_meta.append(meta_part)
            meta2 = yield Stage(SplitHop(early, late, (start, end), rows.numel(), streamed=chunks > 1),
                                [early_meta, *late_meta])

        # Rows arrive grouped by forwarding rank; sort each expert's rows by (source, token).
        most = max(1, int(headers.num_tokens.max()))
        last, expert_rows = self._expand(meta2[:, 2:2 + topk], meta2[:, 2 + topk:], headers, topk_weights.dtype,
                                         src_key=meta2[:, 0] * most + meta2[:, 1], bound=g.ep_size * most)
        yield last
        return expert_rows
