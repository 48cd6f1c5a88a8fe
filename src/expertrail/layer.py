"""MoELayer: router -> dispatch -> grouped experts -> combine (+ shared experts).

``MoELayer(router, dispatcher, experts, shared_experts=None, num_chunks=1)`` maps
``[..., H] -> [..., H]`` on every rank of the EP group. The router is replicated (same
weights on every rank); each rank holds its ``E / ep_size`` experts, or, with a
``balance.ReplicaRouter`` (hot experts replicated), its physical slots; a ``balance.LoadRecorder``
given as ``recorder`` counts the router's loads in training. While the dispatch is in
flight the shared experts run (overlap); with ``num_chunks > 1`` the routed part runs in
overlapped chunks (`Dispatcher.moe`). The router's losses of the last forward are in
``layer.router_losses``; `router_loss(model)` sums them over a model's MoE layers.
"""
from __future__ import annotations

import torch
from torch import nn

from .dispatch import Dispatcher
from .errors import ConfigError
from .experts import GroupedExperts
from .router import TopKRouter


def expert_parallel_moe(dispatcher: Dispatcher, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        experts, shared=None, num_chunks: int = 1) -> torch.Tensor:
    """The sequence every expert-parallel MoE block runs (`MoELayer`, `hf.ExpertParallelMoE`):
    dispatch, the shared experts while the rows travel, the routed experts, combine, and the
    shared output added.

    x [T, H]; topk_idx / topk_weights [T, K] (already mapped to replica slots, if any);
    experts(tokens, tokens_per_expert) -> rows; shared: None, or a callable with no arguments
    giving the shared experts' output [T, H]; num_chunks > 1: the routed part in overlapped
    chunks (`Dispatcher.moe`). Returns [T, H].
    """
    if num_chunks > 1:
        y = dispatcher.moe(x, topk_idx, topk_weights, experts, num_chunks)
        return y if shared is None else y + shared()
    pending = dispatcher.dispatch(x, topk_idx, topk_weights, async_op=True)
    shared_out = None if shared is None else shared()          # while the rows travel
    res = pending.wait()
    y = dispatcher.combine(experts(res.tokens, res.tokens_per_expert), res)
    return y if shared_out is None else y + shared_out


class MoELayer(nn.Module):
    def __init__(self, router: TopKRouter, dispatcher: Dispatcher, experts: GroupedExperts,
                 shared_experts: nn.Module | None = None, num_chunks: int = 1, replicas=None,
                 recorder=None, layer_index: int = 0):
        super().__init__()
        slots = router.config.num_experts if replicas is None else replicas.num_slots
        if slots != dispatcher.num_experts:
            raise ConfigError(f"the dispatcher has {dispatcher.num_experts} experts but the router "
                              f"{'and its replica map give' if replicas is not None else 'has'} {slots}")
        if experts.num_local_experts != dispatcher.num_local_experts:
            raise ConfigError(f"experts hold {experts.num_local_experts} experts, but this rank owns "
                              f"{dispatcher.num_local_experts} (num_experts / ep_size)")
        if num_chunks < 1:
            raise ConfigError(f"num_chunks={num_chunks} must be >= 1")
        self.router, self.experts, self.shared_experts = router, experts, shared_experts
        self.dispatcher = dispatcher          # not a Module: holds process groups, no parameters
        self.num_chunks = num_chunks
        self.replicas = None
        if replicas is not None:
            self.set_replicas(replicas)
        self.recorder, self.layer_index = recorder, layer_index
        self.router_losses: dict = {}

    def set_replicas(self, replicas) -> None:
        """Route through ``replicas`` (a balance.ReplicaRouter) from now on, after checking that
        every rank of the EP group uses the same placement (collective)."""
        replicas.agree(self.dispatcher.groups, "MoELayer expert placement")
        self.replicas = replicas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        routing = self.router(x)
        self.router_losses = routing.losses
        if self.recorder is not None and self.training:
            self.recorder.record(self.layer_index, routing.tokens_per_expert)
        topk_idx = routing.topk_idx if self.replicas is None else self.replicas(routing.topk_idx)
        flat = x.reshape(-1, shape[-1])
        shared = None if self.shared_experts is None else (lambda: self.shared_experts(flat))
        return expert_parallel_moe(self.dispatcher, flat, topk_idx, routing.topk_weights, self.experts, shared,
                                   self.num_chunks).view(shape)


def router_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the router losses of every MoE layer of ``model`` (any module with a
    ``router_losses`` dict, as MoELayer has) from its last forward."""
    losses = [v for m in model.modules() for v in getattr(m, "router_losses", {}).values()]
    return sum(losses) if losses else 0.0
