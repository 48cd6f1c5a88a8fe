"""The Dispatcher: the verbs every backend shares (dispatch, combine, moe) and its results.

A backend only says how rows travel (`_outgoing` and `_stages`, see `route.py`). The verbs
check inputs (`checks`), agree across ranks before anything can go wrong (`agreement`), drop
tokens over capacity (`routing.apply_capacity`), pad expert rows, and wire dispatch and combine
into autograd (`autograd`).
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from ..comm.schedule import wait_exchange
from ..comm.topology import EPGroups, guarded
from ..comm.transport import Transfer, TransferStats
from ..errors import ConfigError, InvalidInputError
from ..kernels import fp8
from ..kernels.torch_ops import cast, count_values, gather_rows
from ..kernels.workspace import Workspace
from .agreement import Agreement
from .autograd import CombineFunction, DispatchFunction
from .checks import dispatch_problem, expert_out_problem
from .config import DispatchConfig
from .header import Header, Headers
from .planning import Outgoing, bits_weight, expand_local, padded_positions
from .route import ExpandHop, ExpertRows, Route, Stage, own_block
from .routing import TokenLayout, apply_capacity, compute_layout, expert_capacity


@dataclass
class DispatchResult:
    """Rows for this rank's local experts.

    tokens: [M, H] x.dtype, expert-major; within an expert ordered by (source EP rank, source
        token index, k); each expert's block padded with zero rows to ``tokens_per_expert``
    tokens_per_expert: int64 [E_local] rows per local expert, padding included
    real_tokens_per_expert: int64 [E_local] rows per local expert without padding
    weights: [M] topk_weights.dtype, routing weight of each row (0 on padding rows); with
        ``weights_at="source"`` a copy, since combine applies the dispatched weights there
    stats: TransferStats of the dispatch; combine_stats: of the last combine of this result
    scales: with ``payload="fp8", dequantize=False``: fp32 [M, ceil(H / 128)], the scale of
        each 128-value block of ``tokens`` (then float8_e4m3fn); else None
    dtype: x's dtype: the dtype rows travel back in and combine returns

    Which tensors are fresh: ``tokens`` and combine's output may be views of buffers from the
    dispatcher's `Workspace` (combine's weighted sums are fresh tensors), which never hands a
    buffer out again while any tensor views it, so they stay valid as long as they are kept;
    the other fields are ordinary tensors. Nothing handed out is overwritten by a later call.
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    real_tokens_per_expert: torch.Tensor
    weights: torch.Tensor
    stats: TransferStats
    route: Route
    combine_stats: TransferStats | None = None
    scales: torch.Tensor | None = None
    dtype: torch.dtype | None = None
    routed_weights: torch.Tensor | None = None   # the weights as dispatched (what combine applies at the source)

    def __post_init__(self):
        if self.dtype is None:
            self.dtype = self.tokens.dtype


class Dispatcher:
    """Moves tokens to the ranks of their experts (dispatch) and the outputs back (combine).

    Args:
        groups: the EPGroups to run on.
        num_experts, options: the backend's `Config` (`DispatchConfig`: hidden,
            expert_alignment, capacity_factor, drop_policy, pad_to_capacity, and a backend's own).
    Construction is collective over the EP group: every setting is compared across ranks, then
    checked; the settings are ``self.config``.
    """

    name = "base"
    Config = DispatchConfig
    weights_at_source = False      # whether combine can weight on the source side (DispatchConfig.weights_at)

    def __init__(self, groups: EPGroups, num_experts: int, **options):
        config = self.Config.of(self.name, num_experts, options)
        groups.check_same({"backend": self.name, **config.shared_fields(), "domain_size": groups.domain_size,
                           "backend options": config.own_options()}, f"{type(self).__name__}")
        config.check()
        self.weights_at = config.weights_at or ("source" if self.weights_at_source else "expert")
        if self.weights_at == "source" and not self.weights_at_source:
            raise ConfigError(f"{self.name}: weights_at='source' needs a backend whose first hop sends one row per "
                              "(token, expert) pair (alltoall); use weights_at='expert' (or leave it None)")
        self.config, self.groups = config, groups
        self.num_experts = int(num_experts)
        self.num_local_experts = groups.num_local_experts(self.num_experts)
        self.rank_of_expert = groups.rank_of_expert(self.num_experts)
        self.local_of_expert = torch.arange(self.num_experts, device=groups.device) % self.num_local_experts
        self.workspace = Workspace()
        self.agreement = Agreement(self.name, groups, self.count_columns)

    # ---------------------------------------------------------------- public verbs
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 async_op: bool = False):
        """Send each token to the ranks of its experts.

        x: [N, H] float; topk_idx: [N, K] integer, -1 for no expert; topk_weights: [N, K] float.
        N may differ between ranks and be 0. Collective over the EP group. Returns a
        DispatchResult, or with ``async_op`` a handle whose ``wait()`` returns it: the routing
        metadata is exchanged before returning, the rows travel in the background.
        """
        with guarded(f"{self.name} dispatch", self.groups), self.workspace.active():
            return self._dispatch(x, topk_idx, topk_weights, async_op)

    def _dispatch(self, x, topk_idx, topk_weights, async_op):
        error, message = dispatch_problem(f"{self.name} dispatch on EP rank {self.groups.ep_rank}", x, topk_idx,
                                          topk_weights, self.config.hidden, self.groups.device, self.num_experts)
        topk_idx = topk_idx.long() if error == 0 else topk_idx
        if error == 0 and self.config.capacity_factor is not None:
            topk_idx = apply_capacity(topk_idx, topk_weights.detach(), self.num_experts,
                                      self.config.capacity_factor, self.config.drop_policy)
        outgoing = self._outgoing(topk_idx) if error == 0 else None
        control = self.agreement.start(outgoing.counts if outgoing else self.agreement.no_counts(),
                                       Header.of(x, topk_idx, topk_weights, error).pack())
        # While the counts travel, quantize (fp8) and gather the rows the first hop will send
        # (local work only: nothing is sent before every rank's input is known to be valid).
        wire = fp8.quantize(x.detach()) if outgoing and self.config.payload == "fp8" else x.detach()
        sent = self._gather_first(wire, outgoing) if outgoing else None
        # A few numbers: waited for without giving the turn to another micro-batch (`schedule`).
        recv_counts, headers = wait_exchange("dispatch counts", lambda: self.agreement.finish_dispatch(control, message),
                                             give_turn=False, watch=control)
        with torch.no_grad():
            route = self._route(topk_weights.detach(), outgoing, recv_counts, headers)
            route.groups, route.workspace = self.groups, self.workspace
            transfer = route.forward(wire, async_op=True, sent=sent)
        control_bytes = recv_counts.numel() * 8 + headers.nbytes
        wire_bytes = wire.shape[1] * wire.element_size()
        pending = _in_flight("dispatch", route, lambda: self._dispatch_result(
            x, topk_weights, route, transfer.wait(), wire_bytes, control_bytes, headers.needs_grad),   # agreed
            watch=transfer)
        return pending if async_op else pending.wait()

    def _dispatch_result(self, x, topk_weights, route: Route, rows, row_bytes: int, control_bytes: int,
                         attach_grad: bool) -> DispatchResult:
        """The DispatchResult once the rows have landed (the route is complete from here on).
        fp8 rows are dequantized (gradients pass straight through the quantization) or
        unpacked into values and scales."""
        tokens, scales = rows, None
        if self.config.payload == "fp8" and self.config.dequantize:
            tokens = fp8.dequantize(rows, x.shape[1], x.dtype)
        elif self.config.payload == "fp8":
            tokens, scales = fp8.unpack(rows, x.shape[1])
        weights = route.expert_weights()
        stats = route.stats(row_bytes, self.groups.ep_rank, self.groups.domain_size)
        stats.control_bytes = control_bytes
        if attach_grad:
            tokens, weights = DispatchFunction.apply(x, topk_weights, route, tokens, weights)
        shown = weights.clone() if self.weights_at == "source" else weights     # a copy to read: see weights_at
        return DispatchResult(tokens=tokens, tokens_per_expert=route.tokens_per_expert,
                              real_tokens_per_expert=route.real_tokens_per_expert, weights=shown, stats=stats,
                              route=route, scales=scales, dtype=x.dtype, routed_weights=weights)

    def combine(self, expert_out: torch.Tensor, res: DispatchResult, weighted: bool = True,
                async_op: bool = False):
        """Bring expert outputs back: y[n] = sum_k w[n,k] * out[n,k] (or the plain sum when
        ``weighted=False``, for weights already applied on the expert side).

        expert_out: [M, H] with M = res.tokens.shape[0] and H the dispatched hidden size;
        padding rows are ignored. Any float dtype: it is cast to x's dtype (``res.dtype``; with
        an fp8 payload too), the dtype rows travel back in, so y is [N, H] in that dtype, summed
        in fp32 in a fixed order. With ``async_op`` a handle whose ``wait()`` returns y.
        Where the weights are applied is the construction option ``weights_at`` (the same on
        every rank): "expert" weights each row by ``res.weights`` (as it is now) on the expert
        side; "source" (alltoall's default) weights the exact expert outputs on the source rank
        with the dispatched routing weights. Both are within the dtype's rounding of each other.
        Collective over the EP group: a rank whose expert_out is invalid (shape, dtype, device)
        or whose call differs (one rank needs gradients, another not) makes every rank raise
        `InvalidInputError` as soon as the first exchange lands, never a timeout (see
        `agreement.Agreement.start_combine`).
        """
        with res.route.running(f"{self.name} combine") if isinstance(res, DispatchResult) else \
                guarded(f"{self.name} combine", self.groups):
            return self._combine(expert_out, res, weighted, async_op)

    def _combine(self, expert_out, res, weighted, async_op):
        if not isinstance(res, DispatchResult):
            raise InvalidInputError(f"{self.name} combine: res must be the DispatchResult that dispatch returned, "
                                    f"got {type(res).__name__}")
        error, message = expert_out_problem(f"{self.name} combine on EP rank {self.groups.ep_rank}", expert_out,
                                            res.tokens.shape[0], res.tokens.shape[1], res.tokens.device)
        if error:   # take part with zero rows of the agreed shape, so that no peer waits; raise in agreement
            rows = res.tokens.new_zeros(res.tokens.shape, dtype=res.dtype)
        else:
            rows = cast(expert_out, res.dtype)
        at_source = weighted and self.weights_at == "source"
        weights = None if not weighted else res.routed_weights if at_source else res.weights
        needs_grad = torch.is_grad_enabled() and (rows.requires_grad or (weights is not None and weights.requires_grad))
        flags = self.agreement.start_combine(error, needs_grad)
        res.combine_stats = res.route.stats(rows.shape[1] * rows.element_size(), self.groups.ep_rank,
                                            self.groups.domain_size, backward=True)
        with torch.no_grad():
            transfer = res.route.transpose_async(rows, weights, at_source=at_source,
                                                 agree=lambda: self.agreement.finish_combine(flags, message))
        pending = _in_flight("combine", res.route, lambda: CombineFunction.apply(rows, weights, res.route, transfer),
                             watch=transfer)
        return pending if async_op else pending.wait()

    def moe(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts,
            num_chunks: int = 1, weighted: bool = True) -> torch.Tensor:
        """dispatch -> ``experts(tokens, tokens_per_expert)`` -> combine, in ``num_chunks``
        chunks whose communication overlaps the expert compute (see `overlap.pipelined_moe`)."""
        from .overlap import pipelined_moe
        return pipelined_moe(self, x, topk_idx, topk_weights, experts, num_chunks, weighted)

    # ---------------------------------------------------------------- backend hooks
    def _outgoing(self, topk_idx: torch.Tensor) -> Outgoing:
        """Local work before any exchange: the counts to send each peer, and what `_route` needs."""
        raise NotImplementedError

    def _stages(self, topk_weights, outgoing: Outgoing, recv_counts, headers: Headers) -> Generator:
        """The backend's route, planned top to bottom from the exchanged counts (see `Route`):
        yield a `Stage` per hop; a stage that sends metadata beside its rows resumes with the
        metadata this rank received (to plan the next hop from it); end with the last, local
        hop (`_expand` or `_expansion` give it) and return its `ExpertRows`."""
        raise NotImplementedError

    def _route(self, topk_weights, outgoing: Outgoing, recv_counts, headers: Headers) -> Route:
        """This dispatch's route, to be planned by its first forward as the metadata lands."""
        return Route(topk=outgoing.topk_idx.shape[1], stages=self._stages(topk_weights, outgoing, recv_counts, headers))

    def _layout(self, topk_idx: torch.Tensor) -> TokenLayout:
        """Where this rank's tokens go: rows per expert, rank and domain (`routing.compute_layout`;
        the Triton kernel on CUDA)."""
        return compute_layout(topk_idx, self.num_experts, self.groups.ep_size, self.groups.domain_size)

    def _gather_first(self, x: torch.Tensor, outgoing: Outgoing) -> torch.Tensor | None:
        """The first hop's sent rows [R, H] (None when ``outgoing`` does not list them); rows that
        stay on this rank are left unfilled, the hop puts them in place directly."""
        return None if outgoing.token is None else gather_rows(x, outgoing.token, own_block(outgoing.send_splits, outgoing.me))

    count_columns = 1

    def _padded_counts(self, real: torch.Tensor, headers: Headers) -> torch.Tensor:
        rows = real
        if self.config.pad_to_capacity:
            cap = sum(expert_capacity(int(n), headers.topk, self.num_experts, self.config.capacity_factor)
                      for n in headers.num_tokens.tolist())
            rows = torch.full_like(real, cap)
        a = int(self.config.expert_alignment)
        return rows if a == 1 else (rows + a - 1) // a * a

    def _expand(self, local_ids: torch.Tensor, bits: torch.Tensor, headers: Headers, dtype: torch.dtype,
                src_key: torch.Tensor | None = None, bound: int = 1) -> tuple[Stage, ExpertRows]:
        """The last stage of a route whose rows arrive with their metadata (dedup, hierarchical,
        allgather): expand the R received rows into expert rows (`expand_local`, same
        ``src_key`` / ``bound``), see `_expansion`. local_ids: int64 [R, K] local expert of
        each top-k entry (-1: elsewhere); bits: the entries' weights as fp64 bits [R, K]; dtype: the
        routing weights' dtype."""
        row, k, expert = expand_local(local_ids, src_key, bound)
        return self._expansion(row, k, expert, local_ids.shape[0], min(local_ids.shape[1], self.num_local_experts),
                               headers, bits_weight(bits[row, k], dtype))

    def _expansion(self, row, k, expert, num_src: int, max_copies: int, headers: Headers,
                   row_weights) -> tuple[Stage, ExpertRows]:
        """The last stage: the local hop that expands the ``num_src`` received rows into
        padded, expert-major output rows, and what it says of them. row, k, expert: int64
        [M_real] in output order; row_weights [M_real]: the routing weight of each."""
        real = count_values(expert, self.num_local_experts)
        padded = self._padded_counts(real, headers)
        last = ExpandHop.numbered(row, num_src, max_copies)
        if not torch.equal(padded, real):
            last.out_pos = padded_positions(expert, real, padded)
            last.out_rows = int(padded.sum())
        return Stage(last), ExpertRows(k, row_weights, padded, real)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ep_size={self.groups.ep_size}, domain_size={self.groups.domain_size}, "
                f"num_experts={self.num_experts}, expert_alignment={self.config.expert_alignment}, "
                f"capacity_factor={self.config.capacity_factor})")


def _in_flight(verb: str, route: Route, finish, watch: Transfer) -> Transfer:
    """A dispatch or combine whose rows (``watch``) are in flight: ``wait()`` runs ``finish``
    (once) on the route's group, where another micro-batch may run while the rows travel
    (`schedule`)."""
    def rest(_):
        with route.running(f"{verb} (wait)"):
            return wait_exchange(verb, finish, watch=watch)
    return Transfer(then=rest)
