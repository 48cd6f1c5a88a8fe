"""The Dispatcher API shared by every backend: validation, agreement, autograd, results.

A backend only says how rows travel (`_plan_source` and `_route`, see `route.py`); this module
checks inputs, agrees on errors across ranks, drops tokens over capacity, pads expert rows,
and wires dispatch and combine into autograd.
"""
from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch

from ..kernels import fp8
from ..errors import ConfigError, InvalidInputError
from ..kernels.torch_ops import cast, gather_rows, stable_argsort
from .routing import TokenLayout, apply_capacity, compute_layout, expert_capacity
from ..comm.schedule import wait_exchange
from ..comm.topology import EPGroups, guarded
from ..comm.transport import Transfer, TransferStats
from ..kernels.workspace import Workspace
from .config import DispatchConfig
from .header import DTYPE_CODES, ERROR_KINDS, FIELDS, Header, Headers
from .route import ExpandHop, ExpertRows, Route, Stage, own_block


def weight_bits(weights: torch.Tensor) -> torch.Tensor:
    """Float weights -> int64 bit patterns of their fp64 value (travel with int metadata)."""
    return weights.to(torch.float64).contiguous().view(torch.int64)


def bits_weight(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.contiguous().view(torch.float64).to(dtype)


def expand_local(local_ids: torch.Tensor, src_key: torch.Tensor | None = None, bound: int = 1):
    """Expand received rows into (row, k, local expert) triples in expert-major order.

    local_ids: int64 [R, K] local expert of each slot, -1 where the slot is not for this rank.
    Rows must arrive in (source rank, source token) order, or give ``src_key [R] < bound`` that
    sorts them so. Returns row, k, expert: int64 [M] each.
    """
    row, k = torch.nonzero(local_ids >= 0).unbind(1)
    expert = local_ids[row, k]
    key = expert if src_key is None else expert * bound + src_key.index_select(0, row)
    order = stable_argsort(key)
    return row.index_select(0, order), k.index_select(0, order), expert.index_select(0, order)


def padded_positions(expert: torch.Tensor, real: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    """Row of each real output row in the padded expert-major output.

    expert: int64 [M_real] local expert of each row, in output order; real / padded: int64
    [E_local] rows per expert without / with padding.
    """
    position = torch.arange(expert.numel(), device=expert.device) - (torch.cumsum(real, 0) - real)[expert]
    return (torch.cumsum(padded, 0) - padded)[expert] + position


@dataclass
class SourcePlan:
    """What a backend plans on the source rank before any exchange (`Dispatcher._plan_source`).

    topk_idx: int64 [N, K], after capacity drops
    counts: int64 [P, C] sent to every EP peer in the control exchange (``count_columns``)
    token: int64 [R] the token each row of the first hop copies, grouped by destination member
        (None when the first hop sends the tokens as they are: allgather)
    send_splits: rows per member of the first hop's channel; me: this rank's index in it
    dest: int64 [R] destination member of each sent row (dedup: EP rank, hierarchical: domain)
    pairs: alltoall: the (token, k) pair ``n * K + k`` of each sent row
    """

    topk_idx: torch.Tensor
    counts: torch.Tensor
    token: torch.Tensor | None = None
    send_splits: list | None = None
    me: int | None = None
    dest: torch.Tensor | None = None
    pairs: torch.Tensor | None = None


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
        error, message = self._check_inputs(x, topk_idx, topk_weights)
        topk_idx = topk_idx.long() if error == 0 else topk_idx
        if error == 0 and self.config.capacity_factor is not None:
            topk_idx = apply_capacity(topk_idx, topk_weights.detach(), self.num_experts,
                                      self.config.capacity_factor, self.config.drop_policy)
        plan = self._plan_source(topk_idx) if error == 0 else None
        control = self._start_control(plan.counts if plan else self._no_counts(),
                                      Header.of(x, topk_idx, topk_weights, error).pack())
        # While the counts travel, quantize (fp8) and gather the rows the first hop will send
        # (local work only: nothing is sent before every rank's input is known to be valid).
        wire = fp8.quantize(x.detach()) if plan and self.config.payload == "fp8" else x.detach()
        sent = self._gather_first(wire, plan) if plan else None
        # A few numbers: waited for without giving the turn to another micro-batch (`schedule`).
        recv_counts, headers = wait_exchange("dispatch counts", lambda: self._finish_control(control, message),
                                             give_turn=False)
        with torch.no_grad():
            route = self._route(topk_weights.detach(), plan, recv_counts, headers)
            route.groups, route.workspace = self.groups, self.workspace
            transfer = route.forward(wire, async_op=True, sent=sent)
        control_bytes = recv_counts.numel() * 8 + headers.nbytes
        wire_bytes = wire.shape[1] * wire.element_size()
        pending = Pending("dispatch", route, lambda: self._dispatch_result(
            x, topk_weights, route, transfer.wait(), wire_bytes, control_bytes, headers.needs_grad))   # agreed
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
            tokens, weights = _DispatchFunction.apply(x, topk_weights, route, tokens, weights)
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
        `_start_combine_flags`).
        """
        with res.route.running(f"{self.name} combine") if isinstance(res, DispatchResult) else \
                guarded(f"{self.name} combine", self.groups):
            return self._combine(expert_out, res, weighted, async_op)

    def _combine(self, expert_out, res, weighted, async_op):
        if not isinstance(res, DispatchResult):
            raise InvalidInputError(f"{self.name} combine: res must be the DispatchResult that dispatch returned, "
                                    f"got {type(res).__name__}")
        error, message = self._check_expert_out(expert_out, res)
        if error:   # take part with zero rows of the agreed shape, so that no peer waits; raise in agreement
            rows = res.tokens.new_zeros(res.tokens.shape, dtype=res.dtype)
        else:
            rows = cast(expert_out, res.dtype)
        at_source = weighted and self.weights_at == "source"
        weights = None if not weighted else res.routed_weights if at_source else res.weights
        needs_grad = torch.is_grad_enabled() and (rows.requires_grad or (weights is not None and weights.requires_grad))
        flags = self._start_combine_flags(error, needs_grad)
        res.combine_stats = res.route.stats(rows.shape[1] * rows.element_size(), self.groups.ep_rank,
                                            self.groups.domain_size, backward=True)
        with torch.no_grad():
            transfer = res.route.transpose_async(rows, weights, at_source=at_source,
                                                 agree=lambda: self._finish_combine_flags(flags, message))
        pending = Pending("combine", res.route, lambda: _CombineFunction.apply(rows, weights, res.route, transfer))
        return pending if async_op else pending.wait()

    def _check_expert_out(self, expert_out, res: DispatchResult) -> tuple[int, str | None]:
        """(error kind, message) for this rank's ``expert_out``; (0, None) when valid."""
        where = f"{self.name} combine on EP rank {self.groups.ep_rank}"
        rows, hidden = res.tokens.shape
        if not isinstance(expert_out, torch.Tensor):
            return 1, f"{where}: expert_out must be a tensor [{rows}, {hidden}], got {type(expert_out).__name__}"
        if expert_out.dim() != 2 or expert_out.shape[0] != rows:
            return 1, (f"{where}: expert_out must be [{rows}, {hidden}] (one row per res.tokens row), "
                       f"got {tuple(expert_out.shape)}")
        if expert_out.shape[1] != hidden:
            return 1, (f"{where}: expert_out has width {expert_out.shape[1]} but dispatch moved rows of hidden "
                       f"size {hidden}; the experts must return rows of the dispatched hidden size")
        if not expert_out.is_floating_point():
            return 2, f"{where}: expert_out must be floating point, got {expert_out.dtype}"
        if expert_out.device != res.tokens.device:
            return 3, (f"{where}: expert_out is on {expert_out.device} but res.tokens is on {res.tokens.device}; "
                       f"move it with .to('{res.tokens.device}')")
        return 0, None

    def _start_combine_flags(self, error: int, needs_grad: bool) -> Transfer:
        """Send every EP peer this rank's combine flags (error kind, needs gradients): one int64
        row per peer, posted just before the rows.

        The rows themselves cannot carry them: a rank in error still sends rows of the agreed
        shape (zeros), and every rank reads the flags when the first reverse exchange has landed,
        before anything else is sent, so all ranks stop at the same point. Cost: one small
        message per peer beside the rows, no extra round trip (benchmarks/combine_flags.py).
        """
        no_counts = torch.empty(self.groups.ep_size, 0, dtype=torch.int64, device=self.groups.device)
        return self._start_control(no_counts, [error, int(needs_grad)])

    def _finish_combine_flags(self, flags: Transfer, message: str | None) -> None:
        """Wait for the peers' combine flags; raise on every rank if any rank is in error or
        the ranks disagree on gradients."""
        received = flags.wait()
        self._raise_agreed_error(received[:, 0].tolist(), message, "combine", "expert_out")
        grads = received[:, 1].tolist()
        if len(set(grads)) > 1:
            shown = ", ".join(f"rank {r}={bool(g)}" for r, g in enumerate(grads))
            raise InvalidInputError(
                f"{self.name} combine: whether gradients are needed differs across EP ranks ({shown}); "
                "combine's backward is collective, so every rank must combine with expert outputs (or weights) "
                "that require grad alike, under the same torch.no_grad() setting")

    def moe(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts,
            num_chunks: int = 1, weighted: bool = True) -> torch.Tensor:
        """dispatch -> ``experts(tokens, tokens_per_expert)`` -> combine, in ``num_chunks``
        chunks whose communication overlaps the expert compute (see `overlap.pipelined_moe`)."""
        from .overlap import pipelined_moe
        return pipelined_moe(self, x, topk_idx, topk_weights, experts, num_chunks, weighted)

    # ---------------------------------------------------------------- backend hooks
    def _plan_source(self, topk_idx: torch.Tensor) -> SourcePlan:
        """Local work before any exchange: the counts to send each peer, and what `_route` needs."""
        raise NotImplementedError

    def _stages(self, topk_weights, plan: SourcePlan, recv_counts, headers: Headers) -> Generator:
        """The backend's route, planned top to bottom from the exchanged counts (see `Route`):
        yield a `Stage` per hop; a stage that sends metadata beside its rows resumes with the
        metadata this rank received (to plan the next hop from it); end with the last, local
        hop (`_expand` or `_expansion` give it) and return its `ExpertRows`."""
        raise NotImplementedError

    def _route(self, topk_weights, plan: SourcePlan, recv_counts, headers: Headers) -> Route:
        """This dispatch's route, to be planned by its first forward as the metadata lands."""
        return Route(topk=plan.topk_idx.shape[1], plan=self._stages(topk_weights, plan, recv_counts, headers))

    def _layout(self, topk_idx: torch.Tensor) -> TokenLayout:
        """Where this rank's tokens go: rows per expert, rank and domain (`routing.compute_layout`;
        the Triton kernel on CUDA)."""
        return compute_layout(topk_idx, self.num_experts, self.groups.ep_size, self.groups.domain_size)

    def _gather_first(self, x: torch.Tensor, plan: SourcePlan) -> torch.Tensor | None:
        """The first hop's sent rows [R, H] (None when the plan does not list them); rows that
        stay on this rank are left unfilled, the hop puts them in place directly."""
        return None if plan.token is None else gather_rows(x, plan.token, own_block(plan.send_splits, plan.me))

    count_columns = 1

    # ---------------------------------------------------------------- shared machinery
    def _no_counts(self) -> torch.Tensor:
        return torch.zeros(self.groups.ep_size, self.count_columns, dtype=torch.int64, device=self.groups.device)

    def _start_control(self, counts: torch.Tensor, header: list) -> Transfer:
        """Start the all-to-all of counts [P, C] plus ``header`` (int64 values, the same to
        every peer: a packed `Header`, or combine's flags)."""
        p = self.groups.ep_size
        head = torch.tensor(header, dtype=torch.int64, device=counts.device).expand(p, -1)
        return self.groups.ep_channel.all_to_all(torch.cat([counts, head], 1), [1] * p, [1] * p)

    def _finish_control(self, transfer: Transfer, message: str | None) -> tuple[torch.Tensor, Headers]:
        """Wait for the control exchange -> (recv_counts [P, C], every rank's `Headers`);
        raise on every rank if any rank is in error or the calls do not match."""
        recv = transfer.wait()
        recv_counts, headers = recv[:, :-len(FIELDS)], Headers(recv[:, -len(FIELDS):])
        self._raise_agreed_error(headers.column("error").tolist(), message, "dispatch", "input")
        headers.check(self.name)
        return recv_counts, headers

    def _raise_agreed_error(self, errors: list, message: str | None, verb: str, subject: str) -> None:
        """Raise on every rank if any EP rank reported an error kind (``errors``, one per EP
        rank): this rank's own ``message`` where it is the one in error, else the ranks to look at."""
        if any(errors):
            if message:
                raise InvalidInputError(message)
            bad = ", ".join(f"EP rank {r} ({ERROR_KINDS.get(c, c)})" for r, c in enumerate(errors) if c)
            raise InvalidInputError(f"{self.name} {verb} aborted on EP rank {self.groups.ep_rank}: invalid {subject} "
                                    f"on {bad}; see the error raised on that rank")

    def _check_inputs(self, x, topk_idx, topk_weights) -> tuple[int, str | None]:
        """(error kind, message) for this rank's inputs; (0, None) when valid."""
        where = f"{self.name} dispatch on EP rank {self.groups.ep_rank}"
        if x.dim() != 2:
            return 1, f"{where}: x must be [N, H], got shape {tuple(x.shape)}"
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            return 1, f"{where}: topk_idx must be [N={x.shape[0]}, K], got {tuple(topk_idx.shape)}"
        if topk_weights.shape != topk_idx.shape:
            return 1, (f"{where}: topk_weights {tuple(topk_weights.shape)} must have the shape of topk_idx "
                       f"{tuple(topk_idx.shape)} (same N and K)")
        if self.config.hidden is not None and x.shape[1] != self.config.hidden:
            return 1, f"{where}: x has hidden size {x.shape[1]} but the dispatcher was built with hidden={self.config.hidden}"
        if x.dtype not in DTYPE_CODES:
            return 2, f"{where}: x must be float32, bfloat16, float16 or float64, got {x.dtype}"
        if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool or topk_idx.is_complex():
            return 2, f"{where}: topk_idx must be an integer tensor (int64), got {topk_idx.dtype}"
        if not topk_weights.is_floating_point():
            return 2, f"{where}: topk_weights must be floating point, got {topk_weights.dtype}"
        for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if t.device != self.groups.device:
                return 3, (f"{where}: {name} is on {t.device} but this EP group communicates on "
                           f"{self.groups.device}; move it with .to('{self.groups.device}')")
        if topk_idx.numel():
            low, high = (int(v) for v in torch.aminmax(topk_idx))
            if low < -1 or high >= self.num_experts:
                return 4, (f"{where}: topk_idx values must be in [-1, {self.num_experts}) (num_experts="
                           f"{self.num_experts}, -1 = no expert), found {low if low < -1 else high}")
        if not bool(torch.isfinite(topk_weights).all()):
            return 5, f"{where}: topk_weights holds NaN or Inf; check the router output"
        return 0, None

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
        each slot (-1: elsewhere); bits: the slots' weights as fp64 bits [R, K]; dtype: the
        routing weights' dtype."""
        row, k, expert = expand_local(local_ids, src_key, bound)
        return self._expansion(row, k, expert, local_ids.shape[0], min(local_ids.shape[1], self.num_local_experts),
                               headers, bits_weight(bits[row, k], dtype))

    def _expansion(self, row, k, expert, num_src: int, num_slots: int, headers: Headers,
                   row_weights) -> tuple[Stage, ExpertRows]:
        """The last stage: the local hop that expands the ``num_src`` received rows into
        padded, expert-major output rows, and what it says of them. row, k, expert: int64
        [M_real] in output order; row_weights [M_real]: the routing weight of each."""
        real = torch.bincount(expert, minlength=self.num_local_experts)
        padded = self._padded_counts(real, headers)
        last = ExpandHop.numbered(row, num_src, num_slots)
        if not torch.equal(padded, real):
            last.out_pos = padded_positions(expert, real, padded)
            last.out_rows = int(padded.sum())
        return Stage(last), ExpertRows(k, row_weights, padded, real)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(ep_size={self.groups.ep_size}, domain_size={self.groups.domain_size}, "
                f"num_experts={self.num_experts}, expert_alignment={self.config.expert_alignment}, "
                f"capacity_factor={self.config.capacity_factor})")


class Pending:
    """A dispatch or combine whose rows are in flight; ``wait()`` returns its result (the
    DispatchResult, or y [N, H]), computed once."""

    def __init__(self, verb: str, route: Route, finish):
        self.verb, self.route, self._finish, self._result = verb, route, finish, None

    def wait(self):
        if self._finish is not None:
            with self.route.running(f"{self.verb} (wait)"):    # another micro-batch may run meanwhile
                self._result = wait_exchange(self.verb, self._finish)
            self._finish = None
        return self._result


class _DispatchFunction(torch.autograd.Function):
    """Attaches precomputed dispatch outputs to the graph; backward is the route's transpose."""

    @staticmethod
    def forward(ctx, x, topk_weights, route, tokens, weights):
        ctx.route = route
        ctx.x_dtype = x.dtype
        ctx.tokens_differentiable = tokens.dtype != fp8.FP8    # fp8 rows for FP8 experts: no gradient path
        if not ctx.tokens_differentiable:
            ctx.mark_non_differentiable(tokens)
        return tokens, weights

    @staticmethod
    def backward(ctx, grad_tokens, grad_weights):
        # needs_input_grad agrees across ranks (checked in dispatch), so all ranks run the same
        # collectives here.
        route = ctx.route
        with route.running("dispatch backward"):
            rows_back = route.transpose_async(grad_tokens, out_dtype=ctx.x_dtype) \
                if ctx.needs_input_grad[0] and ctx.tokens_differentiable else None
            # Delayed weight gradients and another micro-batch run while the rows travel.
            grad_x = wait_exchange("dispatch backward", rows_back.wait) if rows_back is not None else None
            grad_w = route.weights_transpose(grad_weights) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None


class _CombineFunction(torch.autograd.Function):
    """y = route^T(w * out), computed by ``transfer``; backward dispatches grad_y along the
    route (one exchange) and scales it locally."""

    @staticmethod
    def forward(ctx, expert_out, weights, route, transfer):
        ctx.route = route
        ctx.save_for_backward(expert_out, weights)
        return transfer.wait()

    @staticmethod
    def backward(ctx, grad_y):
        expert_out, weights = ctx.saved_tensors
        with ctx.route.running("combine backward"):
            rows_out = ctx.route.forward(grad_y.contiguous(), async_op=True)
            grad_rows = wait_exchange("combine backward", rows_out.wait)
        if weights is None:
            return grad_rows.to(expert_out.dtype), None, None, None
        acc = torch.promote_types(torch.float32, weights.dtype)
        grad_out = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_out = (grad_rows.to(acc) * weights.to(acc).unsqueeze(1)).to(expert_out.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_rows.to(acc) * expert_out.to(acc)).sum(1).to(weights.dtype)
        return grad_out, grad_w, None, None
