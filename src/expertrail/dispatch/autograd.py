"""Dispatch and combine in autograd: each one's backward is the other run along the same route
(combine is dispatch's transpose), so the gradients move with the same exchanges."""
from __future__ import annotations

import torch

from ..comm.schedule import wait_exchange
from ..comm.transport import Transfer
from ..kernels import fp8


class DispatchFunction(torch.autograd.Function):
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
            # Posted right behind the rows: sent after the wait, it queued behind the other
            # micro-batch's rows on the same sockets with nothing to run meanwhile.
            weights_back = route.weights_transpose_async(grad_weights) if ctx.needs_input_grad[1] else None
            if rows_back is None:
                return None, weights_back.wait() if weights_back is not None else None, None, None, None
            # Delayed weight gradients and another micro-batch run while the rows travel.
            in_flight = Transfer(works=[t for t in (rows_back, weights_back) if t is not None])
            grad_x, grad_w = wait_exchange(
                "dispatch backward", lambda: (rows_back.wait(), weights_back.wait() if weights_back is not None else None),
                watch=in_flight)
        return grad_x, grad_w, None, None, None


class CombineFunction(torch.autograd.Function):
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
            grad_rows = wait_exchange("combine backward", rows_out.wait, watch=rows_out)
        if weights is None:
            return grad_rows.to(expert_out.dtype), None, None, None
        acc = torch.promote_types(torch.float32, weights.dtype)
        grad_out = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_out = (grad_rows.to(acc) * weights.to(acc).unsqueeze(1)).to(expert_out.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_rows.to(acc) * expert_out.to(acc)).sum(1).to(weights.dtype)
        return grad_out, grad_w, None, None
