"""Functions run on every rank by tests/multirank/test_layer_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import expertrail as er

from ranks_common import _ep_slice, groups_for


def moe_layer_matches_reference(rank, world, backend, num_chunks, shared, alignment=1, dtype=torch.float32):
    """MoELayer on EP=world against the same MoE computed on one rank with all experts."""
    from expertrail.moe.experts import GroupedExperts, SwiGLUMLP
    from expertrail.moe.layer import MoELayer, router_loss
    from expertrail.moe.router import RouterConfig, TopKRouter
    hidden, ffn, num_experts = 16, 8, 8
    local = num_experts // world
    torch.manual_seed(0)                                    # the same full model on every rank
    router = TopKRouter(RouterConfig(hidden=hidden, num_experts=num_experts, topk=2, aux_loss_coeff=0.01))
    full = GroupedExperts(num_experts, hidden, ffn)
    shared_mlp = SwiGLUMLP(hidden, 12) if shared else None
    mine = GroupedExperts(local, hidden, ffn)
    with torch.no_grad():
        mine.gate_up_proj.copy_(full.gate_up_proj[rank * local:(rank + 1) * local])
        mine.down_proj.copy_(full.down_proj[rank * local:(rank + 1) * local])
    d = er.make_dispatcher(backend, groups_for(None, 2), num_experts=num_experts, expert_alignment=alignment)
    layer = MoELayer(router, d, mine, shared_mlp, num_chunks=num_chunks)
    layer.train()
    n = [5, 0, 7, 3, 6, 2, 4, 9][rank]
    x = torch.randn(n, hidden, generator=torch.Generator().manual_seed(rank + 10)).to(dtype).requires_grad_()
    y = layer(x)
    (y.float().sin().sum() + router_loss(layer)).backward()
    router_grad = router.weight.grad.clone()
    router.weight.grad = None
    # Reference: the whole MoE on this rank's tokens with all experts on one process.
    xr = x.detach().clone().requires_grad_()
    routing = router(xr)
    order = routing.topk_idx.reshape(-1).argsort(stable=True)           # slots, expert-major
    counts = torch.bincount(routing.topk_idx.reshape(-1), minlength=num_experts)
    expert_out = full(xr.repeat_interleave(2, dim=0)[order], counts)
    per_slot = torch.empty_like(expert_out).index_copy(0, order, expert_out)
    yr = (per_slot.view(n, 2, hidden).float() * routing.topk_weights.unsqueeze(-1)).sum(1).to(dtype)
    if shared:
        yr = yr + shared_mlp(xr)
    (yr.float().sin().sum() + sum(routing.losses.values())).backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, yr, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    torch.testing.assert_close(router_grad, router.weight.grad, **tol)
    # Each expert's gradient sums all ranks' tokens: the parent adds up the references.
    return mine.gate_up_proj.grad.clone(), mine.down_proj.grad.clone(), full.gate_up_proj.grad.clone(), \
        full.down_proj.grad.clone()


def expert_bias_update_sums_loads(rank, world):
    """update_expert_bias adds rate * sign(mean - load) with loads summed over the group."""
    from expertrail.moe.router import RouterConfig, TopKRouter
    torch.manual_seed(0)
    r = TopKRouter(RouterConfig(hidden=8, num_experts=8, topk=2, expert_bias=True, bias_update_rate=0.5),
                   load_group=dist.group.WORLD)
    r.train()
    out = r(torch.randn(5 + rank, 8, generator=torch.Generator().manual_seed(rank)))
    mine = torch.bincount(out.topk_idx.reshape(-1), minlength=8).float()
    total = mine.clone()
    dist.all_reduce(total)
    used = r.update_expert_bias()
    assert torch.equal(used, total)
    torch.testing.assert_close(r.expert_bias, 0.5 * torch.sign(total.mean() - total))
    return r.expert_bias


def moe_layer_seeded_alike(rank, world):
    """GroupedExperts are initialised by global expert index: every rank seeded alike builds
    the same model whatever the EP size (and each rank its own experts), the same as one
    process building all experts."""
    from expertrail.moe.experts import GroupedExperts
    from expertrail.moe.layer import MoELayer
    from expertrail.moe.router import RouterConfig, TopKRouter
    hidden, ffn, num_experts = 16, 8, 8
    full = {}
    for ep_size in (2, 4):
        torch.manual_seed(0)
        router = TopKRouter(RouterConfig(hidden=hidden, num_experts=num_experts, topk=2))
        experts = GroupedExperts(num_experts // ep_size, hidden, ffn)
        groups = groups_for(ep_size, 1)
        MoELayer(router, er.make_dispatcher("alltoall", groups, num_experts=num_experts), experts)
        gathered = [torch.empty_like(experts.down_proj) for _ in range(world)]
        dist.all_gather(gathered, experts.down_proj.detach().contiguous())
        full[ep_size] = torch.cat(_ep_slice(groups, gathered))
    torch.manual_seed(0)
    TopKRouter(RouterConfig(hidden=hidden, num_experts=num_experts, topk=2))
    alone = GroupedExperts(num_experts, hidden, ffn, first_expert=0)
    assert torch.equal(full[2], full[4]) and torch.equal(full[4], alone.down_proj.detach())
    distinct = {tuple(full[4][e].flatten()[:4].tolist()) for e in range(num_experts)}
    return len(distinct)


def moe_layer_misuse(rank, world, kind):
    """MoELayer with what must raise on every rank: a router or shared expert that differs on
    one rank (unseeded), experts built for other experts, DDP syncing the experts."""
    from torch.nn.parallel import DistributedDataParallel

    from expertrail.moe.experts import GroupedExperts, SwiGLUMLP
    from expertrail.moe.layer import MoELayer, exclude_experts_from_ddp
    from expertrail.moe.router import RouterConfig, TopKRouter
    torch.manual_seed(1 if (rank == 2 and kind == "router") else 0)
    router = TopKRouter(RouterConfig(hidden=16, num_experts=8, topk=2))
    torch.manual_seed(1 if (rank == 1 and kind == "shared") else 0)
    shared = SwiGLUMLP(16, 8)
    experts = GroupedExperts(2, 16, 8, first_expert=0 if kind == "first_expert" else 2 * rank)
    layer = MoELayer(router, er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=8), experts, shared)
    model = torch.nn.Sequential(layer)
    if kind == "ddp_excluded":
        assert exclude_experts_from_ddp(model) == ["0.experts.gate_up_proj", "0.experts.down_proj"]
    ddp = DistributedDataParallel(model)
    ddp(torch.randn(3, 16)).sum().backward()
    return experts.weight_grad_scale
