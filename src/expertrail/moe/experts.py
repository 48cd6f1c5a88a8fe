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

from ..comm import schedule
from ..errors import InvalidInputError


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
    def forward(ctx, x, weight, offsets, counts, scale=1.0):
        ctx.save_for_backward(x, weight, offsets)
        ctx.counts, ctx.scale = counts, scale
        return grouped_linear(x, weight, offsets, counts)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grouped_linear(grad_out, weight.transpose(1, 2), offsets, ctx.counts) \
            if ctx.needs_input_grad[0] else None

        def weight_grad():
            grad = grouped_weight_grad(grad_out, x, offsets, ctx.counts)
            return grad if ctx.scale == 1.0 else grad.mul_(ctx.scale)
        return grad_x, _weight_grad(ctx, weight, weight_grad), None, None, None


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
    if schedule.defer(lambda: schedule.accumulate_grad(weight, compute()), weight):
        return None
    return compute()


class GroupedExperts(nn.Module):
    """E_local gated-MLP experts (SwiGLU by default; ``activation`` replaces the SiLU).
    ``forward(tokens [M, H], tokens_per_expert int64 [E_local]) -> [M, H]``.

    Rows are expert-major as a dispatcher returns them; padding rows (``expert_alignment``)
    belong to their expert's block and are computed like the others (the dispatcher never
    combines them).

    Initialisation is by global expert index: expert g's weights are drawn from a generator
    seeded with (a seed drawn once from torch's global generator, g), so ranks seeded alike
    build the same model at any EP size, and each rank its own experts. ``first_expert``: the
    global index of row 0 (rows hold experts ``first_expert + i``). Left None, `MoELayer`
    places the rows when it learns them from its dispatcher (`place`).
    ``weight_grad_scale`` multiplies the weight gradients (`MoELayer` sets it under DDP).
    """

    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int, dtype=None, device=None,
                 activation=F.silu, first_expert: int | None = None):
        super().__init__()
        self.num_local_experts, self.hidden, self.ffn_hidden = num_local_experts, hidden, ffn_hidden
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(num_local_experts, 2 * ffn_hidden, hidden, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(num_local_experts, hidden, ffn_hidden, dtype=dtype, device=device))
        self.init_seed = int(torch.randint(2 ** 62, ()).item())      # the same on ranks seeded alike
        self.weight_grad_scale = 1.0
        self.global_experts = None if first_expert is None else \
            torch.arange(first_expert, first_expert + num_local_experts)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw row i's weights for global expert ``global_experts[i]`` (``i`` while unplaced):
        normal with std hidden^-1/2 (gate_up_proj) and ffn_hidden^-1/2 (down_proj)."""
        ids = range(self.num_local_experts) if self.global_experts is None else self.global_experts.tolist()
        weights = (self.gate_up_proj, self.down_proj)
        if self.gate_up_proj.device.type != "meta":
            with torch.no_grad():
                for row, expert in enumerate(ids):
                    g = torch.Generator(self.gate_up_proj.device).manual_seed((self.init_seed + 1_000_003 * expert) % 2 ** 63)
                    for w, fan_in in zip(weights, (self.hidden, self.ffn_hidden)):
                        w[row].normal_(0.0, fan_in ** -0.5, generator=g)
        self._untouched = tuple(w._version for w in weights)

    def place(self, global_experts: torch.Tensor) -> str | None:
        """Learn the global expert of each row (int64 [E_local]; replicas of one expert may
        repeat it). Weights still as this module drew them are drawn again for those experts;
        weights set since (loaded, copied, trained) are kept. Returns why the rows cannot be
        these experts (built with another ``first_expert``), or None; the caller raises, on
        every rank alike."""
        global_experts = torch.as_tensor(global_experts, dtype=torch.int64).cpu()
        if self.global_experts is not None and torch.equal(self.global_experts, global_experts):
            return None
        untouched = tuple(w._version for w in (self.gate_up_proj, self.down_proj)) == self._untouched
        if self.global_experts is not None and untouched:
            return (f"GroupedExperts was built with first_expert={int(self.global_experts[0])} (experts "
                    f"{self.global_experts.tolist()}), but this rank holds experts {global_experts.tolist()}: pass "
                    "first_expert=groups.ep_rank * num_local_experts, or leave it None")
        self.global_experts = global_experts
        if untouched:
            self.reset_parameters()
        return None

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if tokens_per_expert.numel() != self.num_local_experts:
            raise InvalidInputError(f"tokens_per_expert has {tokens_per_expert.numel()} entries, "
                                    f"expected one per local expert ({self.num_local_experts})")
        counts = tokens_per_expert.tolist()
        if sum(counts) != tokens.shape[0]:
            raise InvalidInputError(f"tokens_per_expert sums to {sum(counts)} but tokens has {tokens.shape[0]} rows")
        offsets = torch.cumsum(tokens_per_expert, 0).to(torch.int32)
        x = tokens.to(self.gate_up_proj.dtype)
        if torch.is_grad_enabled() and (x.requires_grad or self.gate_up_proj.requires_grad or self.down_proj.requires_grad):
            scale = self.weight_grad_scale

            def linear(rows, weight):
                return _GroupedLinear.apply(rows, weight, offsets, counts, scale)
        else:      # nothing to record (decode): the same GEMMs without an autograd node's cost
            def linear(rows, weight):
                return grouped_linear(rows, weight, offsets, counts)
        gate, up = linear(x, self.gate_up_proj).split(self.ffn_hidden, dim=-1)
        return linear(self.activation(gate) * up, self.down_proj).to(tokens.dtype)


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
