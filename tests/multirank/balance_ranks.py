"""Functions run on every rank by tests/multirank/test_balance_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import expertrail as er

from ranks_common import groups_for


def replicated_layer(rank, world, backend):
    """A zipf-skewed MoE layer before and after replicating hot experts: same outputs; rows
    received by each rank before and after, with the plan's prediction."""
    import numpy as np

    from expertrail.balance import ReplicaRouter, plan_placement, rank_loads
    from expertrail.moe.experts import GroupedExperts
    from expertrail.moe.layer import MoELayer
    from expertrail.moe.router import RouterConfig, TopKRouter
    hidden, ffn, experts, slots = 16, 8, 16, 24
    torch.manual_seed(0)
    router = TopKRouter(RouterConfig(hidden=hidden, num_experts=experts, topk=2, expert_bias=True))
    with torch.no_grad():
        router.expert_bias.copy_(-2.0 * torch.log(torch.arange(1, experts + 1, dtype=torch.float32)))  # hot low ids
    full = GroupedExperts(experts, hidden, ffn)

    def experts_for(ids):
        local = GroupedExperts(len(ids), hidden, ffn)
        with torch.no_grad():
            local.gate_up_proj.copy_(full.gate_up_proj[ids])
            local.down_proj.copy_(full.down_proj[ids])
        return local

    groups = groups_for(None, 2)
    per_rank = experts // world
    base_d = er.make_dispatcher(backend, groups, num_experts=experts)
    base = MoELayer(router, base_d, experts_for(list(range(rank * per_rank, (rank + 1) * per_rank)))).eval()
    x = torch.randn(400, hidden, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        routing = router(x)
        load = routing.tokens_per_expert.clone()
        dist.all_reduce(load)
        placement = plan_placement(load.numpy().astype(np.float64), slots, world)
        phys = placement.phys_to_log[0]
        slots_per_rank = slots // world
        replicas = ReplicaRouter.from_placement(placement)
        rep_d = er.make_dispatcher(backend, groups, num_experts=slots)
        rep = MoELayer(router, rep_d, experts_for(phys[rank * slots_per_rank:(rank + 1) * slots_per_rank].tolist()),
                       replicas=replicas).eval()
        y0, y1 = base(x), rep(x)
        rows_before = base_d.dispatch(x, routing.topk_idx, routing.topk_weights).real_tokens_per_expert.sum().item()
        rows_after = rep_d.dispatch(x, replicas(routing.topk_idx), routing.topk_weights).real_tokens_per_expert.sum().item()
        physical = replicas(routing.topk_idx)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    assert torch.equal(physical, replicas(routing.topk_idx))                 # deterministic
    same_expert = torch.as_tensor(phys)[physical.clamp(min=0)]
    assert torch.equal(torch.where(physical >= 0, same_expert, physical), routing.topk_idx)
    predicted_after = rank_loads(load.numpy().astype(np.float64), placement).max()
    predicted_before = load.view(world, -1).sum(1).max().item()
    shared = torch.randint(0, experts, (50, 2), generator=torch.Generator().manual_seed(99))   # same on every rank
    return rows_before, rows_after, predicted_before, float(predicted_after), replicas(shared)


def migration_is_exact(rank, world, seed):
    """Weights that encode their logical id move to the new placement, bitwise."""
    import numpy as np

    from expertrail.balance import migrate, plan_placement
    from expertrail.balance.migration import transfers
    experts, slots = 12, 16
    rng = np.random.default_rng(seed)
    old = plan_placement(rng.gamma(0.5, 10, experts), slots, world).phys_to_log[0]
    new = plan_placement(rng.gamma(0.5, 10, experts), slots, world).phys_to_log[0]
    per_rank = slots // world

    def encoded(phys):
        ids = torch.as_tensor(phys[rank * per_rank:(rank + 1) * per_rank])
        return ids.view(-1, 1, 1).double() * 1000 + torch.arange(15, dtype=torch.float64).view(1, 3, 5)

    weights, state = encoded(old), encoded(old) * -1
    moved_w, moved_s = migrate([weights, state], old, new, rank, list(range(world)))
    assert torch.equal(moved_w, encoded(new)) and torch.equal(moved_s, encoded(new) * -1)
    mine = [t for t in transfers(old, new, world) if t[2] == rank]
    local_old = set(old[rank * per_rank:(rank + 1) * per_rank].tolist())
    assert len(mine) == sum(e not in local_old for e in new[rank * per_rank:(rank + 1) * per_rank].tolist())
    return len(mine)


def rebalance_keeps_outputs(rank, world):
    """Record loads in training, plan from them, migrate the expert weights, swap the replica
    map: the layer's outputs stay the same."""
    import numpy as np

    from expertrail.balance import LoadRecorder, ReplicaRouter, migrate, plan_placement
    from expertrail.moe.experts import GroupedExperts
    from expertrail.moe.layer import MoELayer
    from expertrail.moe.router import RouterConfig, TopKRouter
    hidden, ffn, experts, slots = 16, 8, 8, 12
    torch.manual_seed(0)
    router = TopKRouter(RouterConfig(hidden=hidden, num_experts=experts, topk=2, expert_bias=True))
    with torch.no_grad():
        router.expert_bias.copy_(-1.5 * torch.log(torch.arange(1, experts + 1, dtype=torch.float32)))
    full = GroupedExperts(experts, hidden, ffn)
    per_rank = slots // world
    first = plan_placement(np.ones(experts), slots, world)
    ids = first.phys_to_log[0][rank * per_rank:(rank + 1) * per_rank]
    local = GroupedExperts(per_rank, hidden, ffn)
    with torch.no_grad():
        local.gate_up_proj.copy_(full.gate_up_proj[ids.tolist()])
        local.down_proj.copy_(full.down_proj[ids.tolist()])
    recorder = LoadRecorder(1, experts, window_steps=3)
    d = er.make_dispatcher("dedup", groups_for(None, 2), num_experts=slots)
    layer = MoELayer(router, d, local, replicas=ReplicaRouter.from_placement(first), recorder=recorder)
    x = torch.randn(64, hidden, generator=torch.Generator().manual_seed(rank))
    layer.train()
    for _ in range(2):
        layer(x)
        recorder.step()
    load = recorder.load(dist.group.WORLD)
    layer.eval()
    with torch.no_grad():
        before = layer(x)
        second = plan_placement(load.numpy().astype(np.float64), slots, world, current=first.phys_to_log)
        moved = migrate([local.gate_up_proj.data, local.down_proj.data], first.phys_to_log[0], second.phys_to_log[0],
                        rank, list(range(world)))
        local.gate_up_proj.data, local.down_proj.data = moved
        layer.set_replicas(ReplicaRouter.from_placement(second))
        after = layer(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    return int(load.sum()), second.replicas[0].tolist()


def placement_mismatch(rank, world):
    """Ranks holding different placements: set_replicas raises on every rank."""
    import numpy as np

    from expertrail.balance import ReplicaRouter, plan_placement
    from expertrail.moe.experts import GroupedExperts
    from expertrail.moe.layer import MoELayer
    from expertrail.moe.router import RouterConfig, TopKRouter
    router = TopKRouter(RouterConfig(hidden=8, num_experts=8, topk=2))
    d = er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=12)
    load = np.arange(1, 9, dtype=np.float64) if rank != 2 else np.arange(8, 0, -1, dtype=np.float64)
    MoELayer(router, d, GroupedExperts(3, 8, 4), replicas=ReplicaRouter.from_placement(plan_placement(load, 12, world)))
