"""Expert parallelism for Hugging Face transformers MoE models (transformers 5.x).

transformers 5 keeps a sparse MoE block's experts fused in 3D parameters
(``experts.gate_up_proj [E, 2F, H]``, ``experts.down_proj [E, H, F]``) next to its router
(``gate``, returning ``(logits, topk_weights, topk_idx)``), in Qwen3-MoE, Mixtral and
DeepSeek-V3 alike. `ExpertParallelMoE` keeps the block's own router (and shared experts),
keeps this rank's slice of the experts as `GroupedExperts`, and moves tokens with an
expertrail dispatcher. `patch_model` does it for every MoE block of a model.
"""
from __future__ import annotations

import torch
from torch import nn

from .dispatch import make_dispatcher
from .errors import ConfigError
from .experts import GroupedExperts
from .topology import EPGroups


def is_sparse_moe_block(module: nn.Module) -> bool:
    """A transformers-5 style MoE block: a ``gate`` and ``experts`` with fused 3D weights."""
    experts = getattr(module, "experts", None)
    weight = getattr(experts, "gate_up_proj", None)
    return hasattr(module, "gate") and isinstance(weight, torch.Tensor) and weight.dim() == 3


class ExpertParallelMoE(nn.Module):
    """A transformers sparse MoE block whose experts are sharded over ``groups``' EP group.

    ``forward(hidden_states [..., H]) -> [..., H]`` equals the original block's (within float
    rounding) on every backend; each rank keeps experts ``[r * E_local, (r + 1) * E_local)``.
    Every rank of the EP group must wrap the same block (same weights) and call forward
    together.
    """

    def __init__(self, block: nn.Module, groups: EPGroups, backend: str = "alltoall", **dispatcher_options):
        super().__init__()
        if not is_sparse_moe_block(block):
            raise ConfigError(f"{type(block).__name__} is not a sparse MoE block with fused 3D expert weights "
                              "(transformers 5.x: .gate and .experts.gate_up_proj [E, 2F, H])")
        fused = block.experts
        num_experts, two_f, hidden = fused.gate_up_proj.shape
        self.gate = block.gate
        self.shared_experts = getattr(block, "shared_experts", None)
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.dispatcher = make_dispatcher(backend, groups, num_experts=num_experts, hidden=hidden, **dispatcher_options)
        local = self.dispatcher.num_local_experts
        first = groups.ep_rank * local
        weight = fused.gate_up_proj
        self.experts = GroupedExperts(local, hidden, two_f // 2, dtype=weight.dtype, device=weight.device,
                                      activation=getattr(fused, "act_fn", nn.functional.silu))
        with torch.no_grad():
            self.experts.gate_up_proj.copy_(fused.gate_up_proj[first:first + local])
            self.experts.down_proj.copy_(fused.down_proj[first:first + local])
        self.first_expert = first

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:     # Mixtral's input jitter
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        flat = hidden_states.reshape(-1, shape[-1])
        _, topk_weights, topk_idx = self.gate(flat)
        pending = self.dispatcher.dispatch(flat, topk_idx, topk_weights, async_op=True)
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        res = pending.wait()
        y = self.dispatcher.combine(self.experts(res.tokens, res.tokens_per_expert), res).view(shape)
        return y if shared is None else y + shared


def patch_model(model: nn.Module, groups: EPGroups, backend: str = "alltoall", **dispatcher_options) -> int:
    """Replace every sparse MoE block of ``model`` by an `ExpertParallelMoE`; returns how many.

    Collective: every rank of the EP group must patch the same model.
    """
    targets = [(name, m) for name, m in model.named_modules() if is_sparse_moe_block(m)]
    for name, block in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, ExpertParallelMoE(block, groups, backend, **dispatcher_options))
    return len(targets)
