"""MoELayer: router -> dispatch -> grouped experts -> combine (+ shared experts).

``MoELayer(router, dispatcher, experts, shared_experts=None, num_chunks=1)`` maps
``[..., H] -> [..., H]`` on every rank of the EP group. The router is replicated (same
weights on every rank); each rank holds its ``E / ep_size`` experts, or, with a
``balance.ReplicaRouter`` (hot experts replicated), its physical slots; a ``balance.LoadRecorder``
given as ``recorder`` counts the router's loads in training. While the dispatch is in
flight the shared experts run (overlap); with ``num_chunks > 1`` the routed part runs in
overlapped chunks (`Dispatcher.moe`); with ``buckets`` (and the ``dedup`` dispatcher) each call
at decode sizes runs through the low-latency mode instead (`bucketed`). The router's losses of
the last forward are in ``layer.router_losses``; `router_loss(model)` sums them over a model's
MoE layers.

Data parallelism over the replicated weights: each rank's experts are its own, so DDP must
leave them alone. `exclude_experts_from_ddp(model)` (which `hf.patch_model` calls) tells DDP
so; inside a DDP forward an MoE layer checks that it was done, and scales its expert weight
gradients by 1 / DDP's world size, the factor DDP's averaging applies to everything else.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..dispatch import Dispatcher
from ..errors import ConfigError
from .experts import GroupedExperts
from .replicated import check_replicated
from .bucketed import bucketed_or_none
from .router import TopKRouter
from ..comm.schedule import TaskLocal
from ..comm.topology import all_gather_ints, guarded


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
    if isinstance(experts, GroupedExperts):
        experts.weight_grad_scale = _ddp_weight_grad_scale(dispatcher, experts)
    if num_chunks > 1:
        y = dispatcher.moe(x, topk_idx, topk_weights, experts, num_chunks)
        return y if shared is None else y + shared()
    pending = dispatcher.dispatch(x, topk_idx, topk_weights, async_op=True)
    shared_out = None if shared is None else shared()          # while the rows travel
    res = pending.wait()
    y = dispatcher.combine(experts(res.tokens, res.tokens_per_expert), res)
    return y if shared_out is None else y + shared_out


# Per DDP module, read once: the ids of the parameters it syncs, and the ranks it runs over.
_DDP_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _active_ddp():
    """The DistributedDataParallel module whose forward is running, or None."""
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return active() if active is not None else None


def _ddp_weight_grad_scale(dispatcher: Dispatcher, experts: GroupedExperts) -> float:
    """1 outside DDP. Inside a DDP forward: 1 / DDP's world size, after checking (on every
    rank alike: all see the same DDP) that DDP leaves these experts alone and runs over the
    EP group, so that DDP's mean over ranks and the experts' own gradients agree."""
    ddp = _active_ddp()
    if ddp is None:
        return 1.0
    if ddp not in _DDP_SEEN:
        _DDP_SEEN[ddp] = ({id(p) for p in ddp._module_parameters}, dist.get_process_group_ranks(ddp.process_group))
    synced, ddp_ranks = _DDP_SEEN[ddp]
    if any(id(p) in synced for p in experts.parameters()):
        raise ConfigError("DistributedDataParallel syncs this MoE layer's expert parameters: it broadcast rank 0's "
                          "experts to every rank at construction and would average gradients of different experts. "
                          "Call expertrail.exclude_experts_from_ddp(model) before DistributedDataParallel(model) "
                          "(hf.patch_model does it), then build the model and DDP again")
    groups = dispatcher.groups
    if sorted(ddp_ranks) != sorted(groups.ep_ranks):
        raise ConfigError(f"DistributedDataParallel runs over ranks {ddp_ranks[:8]}{'...' if len(ddp_ranks) > 8 else ''} "
                          f"but the MoE layer's EP group is {list(groups.ep_ranks)}: DDP leaves the experts alone, so "
                          "experts replicated in several EP groups would not have their gradients averaged. Use an "
                          "EP size equal to DDP's world size, or sum the expert gradients over the ranks holding the "
                          "same experts yourself instead of DDP")
    return 1.0 / len(ddp_ranks)


def _place(experts: GroupedExperts, groups, replicas) -> None:
    """Tell ``experts`` the global expert of each of its rows (this rank's slots, through
    ``replicas``); raise on every rank of the EP group if any rank's were built for others."""
    local = experts.num_local_experts
    slots = torch.arange(groups.ep_rank * local, (groups.ep_rank + 1) * local)
    problem = experts.place(slots if replicas is None else replicas.slot_experts.cpu()[slots])
    with guarded("MoELayer's expert placement check", groups):
        flags = all_gather_ints([problem is not None], groups.ep_group, groups.device)
    bad = [r for r, (flag,) in enumerate(flags) if flag]
    if bad:
        raise ConfigError(problem or f"MoELayer: the experts of EP rank(s) {bad} were built for other experts; see "
                                     "the error raised there")


def exclude_experts_from_ddp(model: nn.Module) -> list[str]:
    """Tell DistributedDataParallel to leave the expert parameters of ``model``'s expert-parallel
    layers (`MoELayer`, `hf.ExpertParallelMoE`) alone: DDP would otherwise broadcast rank 0's
    experts to every rank and average the gradients of different experts. Call it on the
    module you wrap in DDP, before wrapping; returns the names it excluded. Names a user
    excluded before are kept; calling it again after the layers changed updates the list."""
    ours = [f"{name}.experts.{p}" if name else f"experts.{p}"
            for name, m in model.named_modules() if getattr(m, "holds_expert_shard", False)
            for p, _ in m.experts.named_parameters()]
    previous = set(getattr(model, "_expertrail_ddp_excluded", ()))
    user = [n for n in getattr(model, "_ddp_params_and_buffers_to_ignore", ()) if n not in previous]
    model._ddp_params_and_buffers_to_ignore = user + ours
    model._expertrail_ddp_excluded = ours
    return ours


class MoELayer(nn.Module):
    """An expert-parallel MoE layer (see the module docstring). Collective to build over the
    dispatcher's EP group: with ``check_weights`` (default) every rank must hold the same
    router and shared experts (compared by checksum; `ConfigMismatchError` on every rank
    otherwise). ``experts`` built without ``first_expert`` are placed here: their rows learn
    their global experts and, if still as drawn, are drawn again for them (`GroupedExperts`)."""

    router_losses = TaskLocal()       # the last forward's, per task: two forwards may be in flight

    holds_expert_shard = True          # for exclude_experts_from_ddp

    def __init__(self, router: TopKRouter, dispatcher: Dispatcher, experts: GroupedExperts,
                 shared_experts: nn.Module | None = None, num_chunks: int = 1, replicas=None,
                 recorder=None, layer_index: int = 0, check_weights: bool = True, buckets=None):
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
        if check_weights:
            check_replicated({"router": router, "shared_experts": shared_experts}, dispatcher.groups, "MoELayer")
        if isinstance(experts, GroupedExperts):
            _place(experts, dispatcher.groups, replicas)
        self.recorder, self.layer_index = recorder, layer_index
        # buckets: decode steps through the low-latency mode (bucketed.py), agreed per call here.
        self.bucketed = bucketed_or_none(dispatcher.groups, dispatcher, buckets)

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
        if self.bucketed is not None:
            return self.bucketed.moe(flat, topk_idx, routing.topk_weights, self.experts, shared,
                                     self.num_chunks).view(shape)
        return expert_parallel_moe(self.dispatcher, flat, topk_idx, routing.topk_weights, self.experts, shared,
                                   self.num_chunks).view(shape)


def router_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the router losses of every MoE layer of ``model`` (any module with a
    ``router_losses`` dict, as MoELayer has) from its last forward."""
    losses = [v for m in model.modules() for v in getattr(m, "router_losses", {}).values()]
    return sum(losses) if losses else 0.0
