"""Functions run on every rank by tests/multirank/test_serving_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import numpy as np
import torch

from expertrail.moe.experts import GroupedExperts
from expertrail.tools.serving import DriftingZipf, ServedLayer

from ranks_common import groups_for

_MIGRATION_GROUPS = {}


def serve_and_compare(rank, world, steps=30, rebalance_every=10, drift_every=15):
    """The unreplicated layer and the rebalancing one serve the same drifting traffic: their
    outputs agree at every step (within fp32 rounding). Returns the rows per rank of each
    layer per step [2, steps, P] (this rank's), the events, and the slots the rebalancing layer
    picks for a probe shared by every rank after each step."""
    import torch.distributed as dist
    groups = groups_for(None, 2)
    key = tuple(groups.ep_ranks)
    if key not in _MIGRATION_GROUPS:                       # creating groups is collective: once per pool
        _MIGRATION_GROUPS[key] = dist.new_group(list(key))
    torch.manual_seed(0)
    experts, topk, hidden = 8, 2, 16
    full = GroupedExperts(experts, hidden, 16)
    traffic = DriftingZipf(experts, topk, alpha=1.2, drift_every=drift_every, seed=3)
    static = ServedLayer(groups, full)
    live = ServedLayer(groups, full, slots=12, rebalance_every=rebalance_every, window=5,
                       migration_group=_MIGRATION_GROUPS[key])
    probe = torch.randint(0, experts, (64, topk), generator=torch.Generator().manual_seed(7))
    rows, events, probes, bitwise = [], [], [], 0
    for step in range(steps):
        x, idx, w = traffic.batch(step, rank, 48, hidden)
        y_static, y_live = static(step, x, idx, w), live(step, x, idx, w)
        torch.testing.assert_close(y_live, y_static, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        bitwise += int(torch.equal(y_live, y_static))
        rows.append(torch.stack([static.rows_per_rank, live.rows_per_rank]))
        events.append(live.event)
        chosen = live.replicas(probe, first_position=step * 1000)
        assert torch.equal(live.replicas.slot_experts[chosen], probe)            # a replica of the right expert
        probes.append(chosen)
    slot_experts = live.replicas.slot_experts
    mine = np.asarray(live.phys_to_log[rank * live.per_rank:(rank + 1) * live.per_rank])
    assert torch.equal(live.experts.gate_up_proj, full.gate_up_proj[mine])   # migrated weights, bitwise
    assert torch.equal(live.experts.down_proj, full.down_proj[mine])
    return torch.stack(rows, 1), events, torch.stack(probes), slot_experts, live.migrations, bitwise
