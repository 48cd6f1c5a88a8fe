"""GroupedExperts: the E_local SwiGLU experts of one rank, computed as grouped GEMMs.

Weights are laid out as Hugging Face transformers 5 fuses them, so checkpoints map 1:1:
``gate_up_proj [E, 2F, H]`` (the F gate rows first, then the F up rows) and
``down_proj [E, H, F]``. An expert computes ``down @ (silu(gate @ x) * (up @ x))``.

Their backwards compute the weight gradients with the same kernels now or, inside an
overlapped schedule with delayed weight gradients (`schedule`), at the task's next switch
point, while an exchange is in flight.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from . import schedule
from .errors import InvalidInputError


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here: CUDA bf16 on Hopper or newer; CPU where the
    installed PyTorch has a CPU kernel (2.9+)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list) -> torch.Tensor:
    """Rows of expert e (``x[offsets[e-1]:offsets[e]]``) times ``weight[e].T``.

    x: [M, in]; weight: [E, out, in]; offsets: int32 [E] cumulative row counts; counts: the
    same as a list of ints (for the fallback). Returns [M, out].
    """
    aligned = all(d * x.element_size() % 16 == 0 for d in weight.shape[1:])   # the kernel needs 16-byte strides
    if aligned and grouped_mm_supported(x.device, x.dtype):
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    # Fallback: one GEMM per expert (E_local is small; tokens are never looped over).
    return torch.cat([rows @ w.T for rows, w in zip(x.split(counts), weight)]) if counts else x.new_zeros(0, weight.shape[1])


def grouped_weight_grad(grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, counts: list) -> torch.Tensor:
    """The weight gradient of `grouped_linear`: [E, out, in], expert e's ``grad_out_e.T @ x_e``.

    grad_out: [M, out]; x: [M, in]; offsets / counts as `grouped_linear`."""
    aligned = all(t.shape[1] * t.element_size() % 16 == 0 and t.shape[0] * t.element_size() % 16 == 0
                  for t in (grad_out, x))
    if aligned and grouped_mm_supported(x.device, x.dtype):
        return torch._grouped_mm(grad_out.t(), x, offs=offsets)
    return torch.stack([g.T @ rows for g, rows in zip(grad_out.split(counts), x.split(counts))])


class _GroupedLinear(torch.autograd.Function):
    """`grouped_linear` with its weight gradient computed now or, inside an overlapped
    schedule with delayed weight gradients, later (`schedule.defer`), into ``weight.grad``."""

    @staticmethod
    def forward(ctx, x, weight, offsets, counts):
        ctx.save_for_backward(x, weight, offsets)
        ctx.counts = counts
        return grouped_linear(x, weight, offsets, counts)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grouped_linear(grad_out, weight.transpose(1, 2), offsets, ctx.counts) \
            if ctx.needs_input_grad[0] else None
        return grad_x, _weight_grad(ctx, weight, lambda: grouped_weight_grad(grad_out, x, offsets, ctx.counts)), \
            None, None


class _Linear(torch.autograd.Function):
    """``x @ weight.T`` (no bias) with its weight gradient delayable, as `_GroupedLinear`."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        flat_grad, flat_x = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        return grad_x, _weight_grad(ctx, weight, lambda: flat_grad.T @ flat_x)


def delayable_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [..., In] @ weight [Out, In].T -> [..., Out]`` (no bias), whose backward hands its
    weight gradient to an overlapped schedule with delayed weight gradients (`schedule.defer`)
    and returns the input gradient at once. For any dense projection a model wants to give the
    schedule as filler for exchanges in flight: the shared expert's, attention's."""
    return _Linear.apply(x, weight)


def _weight_grad(ctx, weight: torch.Tensor, compute):
    """The weight gradient to return from a backward: ``compute()`` now, or None after handing
    it to the schedule, which adds it into ``weight.grad`` at the task's next switch point."""
    if not ctx.needs_input_grad[1]:
        return None
    if schedule.defer(lambda: schedule.accumulate_grad(weight, compute())):
        return None
    return compute()


class GroupedExperts(nn.Module):
    """E_local gated-MLP experts (SwiGLU by default; ``activation`` replaces the SiLU).
    ``forward(tokens [M, H], tokens_per_expert int64 [E_local]) -> [M, H]``.

    Rows are expert-major as a dispatcher returns them; padding rows (``expert_alignment``)
    belong to their expert's block and are computed like the others (the dispatcher never
    combines them).
    """

    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int, dtype=None, device=None,
                 activation=F.silu):
        super().__init__()
        self.num_local_experts, self.hidden, self.ffn_hidden = num_local_experts, hidden, ffn_hidden
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * ffn_hidden, hidden, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden, ffn_hidden, dtype=dtype, device=device))
        nn.init.normal_(self.gate_up_proj, std=hidden ** -0.5)
        nn.init.normal_(self.down_proj, std=ffn_hidden ** -0.5)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if tokens_per_expert.numel() != self.num_local_experts:
            raise InvalidInputError(f"tokens_per_expert has {tokens_per_expert.numel()} entries, "
                                    f"expected one per local expert ({self.num_local_experts})")
        counts = tokens_per_expert.tolist()
        if sum(counts) != tokens.shape[0]:
            raise InvalidInputError(f"tokens_per_expert sums to {sum(counts)} but tokens has {tokens.shape[0]} rows")
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        x = tokens.to(self.gate_up_proj.dtype)
        gate_up = _GroupedLinear.apply(x, self.gate_up_proj, offsets, counts)
        gate, up = gate_up.split(self.ffn_hidden, dim=-1)
        return _GroupedLinear.apply(self.activation(gate) * up, self.down_proj, offsets, counts).to(tokens.dtype)


class SwiGLUMLP(nn.Module):
    """A dense SwiGLU MLP (the shared experts): ``[..., H] -> [..., H]``."""

    def __init__(self, hidden: int, ffn_hidden: int, dtype=None, device=None):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * ffn_hidden, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=False, dtype=dtype, device=device)
        self.ffn_hidden = ffn_hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = delayable_linear(x, self.gate_up_proj.weight).split(self.ffn_hidden, dim=-1)
        return delayable_linear(F.silu(gate) * up, self.down_proj.weight)
