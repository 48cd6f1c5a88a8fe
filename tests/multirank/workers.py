"""Functions run on every rank by the multi-rank tests: fn(rank, world, ...)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

import expertrail as er
from expertrail.dispatch.reference import reference_dispatch, reference_moe
from expertrail.dispatch.routing import token_membership

from scenarios import SCENARIOS, expert_fn, make_inputs, row_experts

_GROUPS = {}


def groups_for(ep_size=None, domain_size=None) -> er.EPGroups:
    """EPGroups cached per (ep_size, domain_size): building groups is collective and slow."""
    key = (ep_size, domain_size)
    if key not in _GROUPS:
        _GROUPS[key] = er.EPGroups.from_default(ep_size=ep_size, domain_size=domain_size)
    return _GROUPS[key]


def _ep_slice(groups, seq):
    """The entries of ``seq`` (indexed by global rank) that belong to this rank's EP group."""
    first = groups.ep_ranks[0]
    return seq[first:first + groups.ep_size]


def check_backend(rank, world, backend, ep_size, domain_size, hidden=8, num_experts=16, topk=4, seed=0, **options):
    """Every scenario x dtype: dispatch rows bitwise equal to the reference, combine close,
    gradients of x and topk_weights equal to the reference's autograd. Returns #cases checked."""
    groups = groups_for(ep_size, domain_size)
    d = er.make_dispatcher(backend, groups, num_experts=num_experts, hidden=hidden, **options)
    local = num_experts // groups.ep_size
    cases = 0
    for scenario in SCENARIOS:
        for dtype in (torch.float32, torch.bfloat16):
            xs, idxs, ws = make_inputs(scenario, world, hidden, num_experts, topk, seed, dtype)
            xs, idxs, ws = (_ep_slice(groups, v) for v in (xs, idxs, ws))
            me = groups.ep_rank
            x = xs[me].clone().requires_grad_()
            w = ws[me].clone().requires_grad_()
            res = d.dispatch(x, idxs[me], w)
            ref_tokens, ref_counts, ref_weights = reference_dispatch(xs, idxs, ws, num_experts, groups.ep_size)[me]
            assert torch.equal(res.tokens.detach(), ref_tokens), f"{scenario} {dtype}: rows differ"
            assert torch.equal(res.tokens_per_expert, ref_counts)
            assert torch.equal(res.weights.detach(), ref_weights)
            out = expert_fn(res.tokens, row_experts(res, me, local))
            y = d.combine(out, res)
            assert y.dtype == dtype and y.shape == x.shape
            # Reference forward and backward in fp64 over all ranks' inputs.
            xr = [t.double().requires_grad_() for t in xs]
            wr = [t.double().requires_grad_() for t in ws]
            yr = reference_moe(xr, idxs, wr, expert_fn, num_experts)
            tol = 1e-6 if dtype == torch.float32 else 2e-2
            _assert_close(y.double(), yr[me].detach(), tol, f"{backend} {scenario} {dtype} combine")
            g = torch.Generator().manual_seed(seed + 1)
            cot = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in xs]
            (y.double() * cot[me]).sum().backward()
            sum((a * c).sum() for a, c in zip(yr, cot)).backward()
            gtol = 1e-5 if dtype == torch.float32 else 5e-2
            _assert_close(x.grad.double(), xr[me].grad, gtol, f"{backend} {scenario} {dtype} grad x")
            _assert_close(w.grad.double(), wr[me].grad, gtol, f"{backend} {scenario} {dtype} grad w")
            cases += 1
    return cases


def _assert_close(actual, expected, rel, what):
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= rel * max(scale, 1.0), f"{what}: max error {err:.3g} > {rel} x {max(scale, 1.0):.3g}"


def dispatch_rows(rank, world, backend, domain_size, scenario, dtype=torch.float32, seed=3, **options):
    """Dispatch and combine one scenario; return (tokens, tokens_per_expert, weights, y)."""
    groups = groups_for(None, domain_size)
    d = er.make_dispatcher(backend, groups, num_experts=16, **options)
    xs, idxs, ws = make_inputs(scenario, world, 8, 16, 4, seed, dtype)
    res = d.dispatch(xs[rank], idxs[rank], ws[rank])
    y = d.combine(expert_fn(res.tokens, row_experts(res, rank, 16 // world)), res)
    return res.tokens, res.tokens_per_expert, res.weights, y


def check_options(rank, world, backend, domain_size, alignment, capacity_factor, drop_policy, pad, **options):
    """Alignment / capacity / pad-to-capacity against the reference, padding kept out of combine."""
    groups = groups_for(None, domain_size)
    num_experts, local = 16, 16 // world
    d = er.make_dispatcher(backend, groups, num_experts=num_experts, expert_alignment=alignment,
                           capacity_factor=capacity_factor, drop_policy=drop_policy, pad_to_capacity=pad, **options)
    xs, idxs, ws = make_inputs("random", world, 8, num_experts, 4, 5)
    res = d.dispatch(xs[rank], idxs[rank], ws[rank])
    ref = reference_dispatch(xs, idxs, ws, num_experts, world, expert_alignment=alignment,
                             capacity_factor=capacity_factor, drop_policy=drop_policy, pad_to_capacity=pad)[rank]
    assert torch.equal(res.tokens, ref[0]) and torch.equal(res.tokens_per_expert, ref[1])
    assert torch.equal(res.weights, ref[2])
    assert (res.tokens_per_expert % alignment == 0).all()
    padding = torch.ones(res.tokens.shape[0], dtype=torch.bool)
    starts = torch.cumsum(res.tokens_per_expert, 0) - res.tokens_per_expert
    for e in range(local):   # mark real rows
        padding[starts[e]:starts[e] + res.real_tokens_per_expert[e]] = False
    assert (res.tokens[padding] == 0).all()
    out = expert_fn(res.tokens, row_experts(res, rank, local))
    out[padding] = 1e6                                     # must never reach combine
    y = d.combine(out, res)
    yref = reference_moe(xs, idxs, ws, expert_fn, num_experts, capacity_factor, drop_policy)[rank]
    _assert_close(y.double(), yref.double(), 1e-6, "combine with options")
    y_plain = d.combine(out, res, weighted=False)
    yref_plain = reference_moe(xs, idxs, ws, expert_fn, num_experts, capacity_factor, drop_policy,
                               weighted=False)[rank]
    _assert_close(y_plain.double(), yref_plain.double(), 1e-6, "unweighted combine")
    return int(padding.sum())


def bytes_moved(rank, world, backend, domain_size, hidden=8, num_experts=16, topk=4):
    """Dispatch/combine stats next to the minimum the algorithm promises, counted from routing."""
    groups = groups_for(None, domain_size)
    d = er.make_dispatcher(backend, groups, num_experts=num_experts)
    xs, idxs, ws = make_inputs("random", world, hidden, num_experts, topk, 7)
    idx = idxs[rank]
    res = d.dispatch(xs[rank], idx, ws[rank])
    d.combine(res.tokens, res)
    rank_of_expert = torch.arange(num_experts) // (num_experts // world)
    in_rank = token_membership(idx, rank_of_expert, world)                          # [N, P]
    in_domain = in_rank.view(idx.shape[0], world // domain_size, domain_size).any(2)
    my_domain = rank // domain_size
    same_domain = (torch.arange(world) // domain_size) == my_domain
    pairs = torch.stack([(idx == e).sum() for e in range(num_experts)])            # pairs per expert
    pairs_per_rank = pairs.view(world, -1).sum(1)
    return {
        "stats": (res.stats.rows, res.stats.bytes, res.combine_stats.rows, res.combine_stats.bytes),
        "row_bytes": hidden * 4,
        "remote_pairs_intra": int(pairs_per_rank[same_domain].sum() - pairs_per_rank[rank]),
        "remote_pairs_inter": int(pairs_per_rank[~same_domain].sum()),
        "self_pairs": int(pairs_per_rank[rank]),
        "ranks_intra": int(in_rank[:, same_domain].sum() - in_rank[:, rank].sum()),
        "ranks_inter": int(in_rank[:, ~same_domain].sum()),
        "ranks_self": int(in_rank[:, rank].sum()),
        "remote_domains": int(in_domain.sum() - in_domain[:, my_domain].sum()),
        "num_tokens": [x.shape[0] for x in xs],
    }


def dist_gradcheck(rank, world, backend, domain_size, eps=1e-6):
    """Finite differences of a global scalar loss against autograd, in fp64, in lockstep:
    at each step one rank perturbs one input element and every rank runs forward."""
    groups = groups_for(None, domain_size)
    num_experts, topk = 8, 3
    d = er.make_dispatcher(backend, groups, num_experts=num_experts)
    xs, idxs, ws = make_inputs("random", world, 3, num_experts, topk, 11, torch.float64, zero_rank=2)
    xs = [t[:2] for t in xs]
    idxs = [t[:2] for t in idxs]
    ws = [t[:2].double() for t in ws]
    local = num_experts // world
    cot = torch.randn(xs[rank].shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)

    def loss(x, w):
        res = d.dispatch(x, idxs[rank], w)
        y = d.combine(expert_fn(res.tokens, row_experts(res, rank, local)), res)
        mine = (y * cot).sum().reshape(1)
        dist.all_reduce(mine)
        return mine[0]

    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    loss(x, w).backward()
    analytic = torch.cat([x.grad.reshape(-1), w.grad.reshape(-1)])
    sizes = [xs[r].numel() + ws[r].numel() for r in range(world)]
    numeric = torch.zeros(sizes[rank], dtype=torch.float64)
    with torch.no_grad():
        for owner in range(world):
            for i in range(sizes[owner]):
                values = []
                for sign in (1, -1):
                    xp, wp = xs[rank].clone(), ws[rank].clone()
                    if owner == rank:
                        flat = torch.cat([xp.reshape(-1), wp.reshape(-1)])
                        flat[i] += sign * eps
                        xp = flat[:xp.numel()].view_as(xp)
                        wp = flat[xp.numel():].view_as(wp)
                    values.append(loss(xp, wp))
                if owner == rank:
                    numeric[i] = (values[0] - values[1]) / (2 * eps)
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-7)
    return int(analytic.numel())


def group_layout(rank, world, ep_size, domain_size, env=None):
    """Members of this rank's EP, domain and rail groups (global ranks)."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        g = er.EPGroups.from_default(ep_size=ep_size, domain_size=domain_size)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    members = dist.get_process_group_ranks
    return {"ep": members(g.ep_group), "domain": members(g.domain_group), "rail": members(g.rail_group),
            "ep_rank": g.ep_rank, "domain_size": g.domain_size, "domain_index": g.domain_index,
            "domain_rank": g.domain_rank}


def bad_dispatch(rank, world, kind, bad_rank=2, backend="alltoall"):
    """Dispatch where only ``bad_rank`` passes a bad input of ``kind``; every rank must raise."""
    groups = groups_for(None, 2)
    d = er.make_dispatcher(backend, groups, num_experts=8, hidden=4)
    xs, idxs, ws = make_inputs("random", world, 4, 8, 2, 1)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    if rank == bad_rank:
        x, idx, w = corrupt(kind, x, idx, w)
    d.dispatch(x, idx, w)


def corrupt(kind, x, idx, w):
    if kind == "expert_out_of_range":
        idx = idx.clone(); idx[0, 0] = 8
    elif kind == "expert_below_minus_one":
        idx = idx.clone(); idx[0, 0] = -2
    elif kind == "k_mismatch":
        w = w[:, :1]
    elif kind == "n_mismatch":
        w = w[:-1]
    elif kind == "nonfinite_weights":
        w = w.clone(); w[0, 0] = float("nan")
    elif kind == "x_dtype":
        x = x.to(torch.int32)
    elif kind == "idx_dtype":
        idx = idx.float()
    elif kind == "device":
        x = x.to("meta")
    elif kind == "hidden":
        x = torch.zeros(x.shape[0], 5)
    elif kind == "x_rank3":
        x = x.unsqueeze(0)
    return x, idx, w


def healthy_dispatch(rank, world, backend="hierarchical"):
    """A valid dispatch after errors: the group must still work."""
    return dispatch_rows(rank, world, backend, 2, "random")[1].sum().item()


def bad_construction(rank, world, kind):
    if kind == "experts_not_divisible":
        er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=6)
    elif kind == "domain_not_dividing":
        er.EPGroups.from_default(domain_size=3)
    elif kind == "ep_not_dividing":
        er.EPGroups.from_default(ep_size=3)
    elif kind == "num_experts_differ":
        er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=8 if rank else 16)
    elif kind == "hidden_differs":
        er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=8, hidden=64 if rank == 3 else 32)
    elif kind == "backend_differs":
        er.make_dispatcher("dedup" if rank == 1 else "alltoall", groups_for(None, 2), num_experts=8)
    elif kind == "unknown_backend":
        er.make_dispatcher("ring", groups_for(None, 2), num_experts=8)
    elif kind == "alignment":
        er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=8, expert_alignment=0)
    elif kind == "layout_differs":
        er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=8, land_in_place=rank == 2)
    elif kind == "bad_layout":
        er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=8, land_in_place="yes")
    elif kind == "unknown_option":
        er.make_dispatcher("dedup", groups_for(None, 2), num_experts=8, hiden=16)
    elif kind == "option_of_another_backend":
        er.make_dispatcher("dedup", groups_for(None, 2), num_experts=8, land_in_place=True)


def hidden_differs_per_call(rank, world):
    """No hidden given at construction: one rank calls with another hidden size."""
    d = er.make_dispatcher("dedup", groups_for(None, 2), num_experts=8)
    h = 6 if rank == 0 else 4
    d.dispatch(torch.zeros(3, h), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def dtype_differs_per_call(rank, world):
    """Rank 1 dispatches bf16 rows, the others fp32."""
    d = er.make_dispatcher("alltoall", groups_for(None, 2), num_experts=8)
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    d.dispatch(torch.zeros(3, 4, dtype=dtype), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2))


def chunked_matches_unchunked(rank, world, backend, num_chunks):
    """d.moe with chunks overlapping communication gives bitwise the same y and gradients."""
    groups = groups_for(None, 2)
    d = er.make_dispatcher(backend, groups, num_experts=16)
    xs, idxs, ws = make_inputs("random", world, 8, 16, 4, 9)
    local = 16 // world

    def experts(tokens, tokens_per_expert):
        ids = torch.repeat_interleave(torch.arange(local), tokens_per_expert) + rank * local
        return expert_fn(tokens, ids)

    outs = []
    for chunks in (1, num_chunks):
        x = xs[rank].clone().requires_grad_()
        w = ws[rank].clone().requires_grad_()
        y = d.moe(x, idxs[rank], w, experts, num_chunks=chunks)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        outs.append((y.detach(), x.grad, w.grad))
    (y1, gx1, gw1), (yc, gxc, gwc) = outs
    assert torch.equal(y1, yc), "chunked output differs"
    torch.testing.assert_close(gxc, gx1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gwc, gw1, rtol=1e-6, atol=1e-6)
    return xs[rank].shape[0]


def replaced_weights_are_used(rank, world, backend):
    """Combine uses res.weights as the caller left them (replaced or changed in place)."""
    groups = groups_for(None, 2)
    d = er.make_dispatcher(backend, groups, num_experts=16)
    xs, idxs, ws = make_inputs("random", world, 8, 16, 4, 4)
    res = d.dispatch(xs[rank], idxs[rank], ws[rank])
    base = d.combine(res.tokens, res)
    res.weights = res.weights * 2
    doubled = d.combine(res.tokens, res)
    res.weights.mul_(0.5)
    again = d.combine(res.tokens, res)
    torch.testing.assert_close(doubled, 2 * base, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(again, base, rtol=1e-6, atol=1e-6)


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


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (0 when both are empty or zero)."""
    diff = (a.double() - b.double()).norm().item()
    ref = b.double().norm().item()
    return diff / ref if ref else diff


def tiny_block(kind: str, dtype):
    """A transformers MoE block built from a tiny random config, the same on every rank."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                                                      num_experts_per_tok=2, norm_topk_prob=True))
    elif kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        block = MixtralSparseMoeBlock(MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8,
                                                    num_experts_per_tok=2, router_jitter_noise=0.0))
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
        block = DeepseekV3MoE(DeepseekV3Config(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                               n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                               n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.to(dtype)


def hf_block_matches(rank, world, kind, backend, ep_size, dtype=torch.float32, num_chunks=1):
    """ExpertParallelMoE vs the original transformers block: output and gradients."""
    import copy

    from expertrail.hf import ExpertParallelMoE
    original = tiny_block(kind, dtype)
    groups = groups_for(ep_size, 1)
    ep = ExpertParallelMoE(copy.deepcopy(original), groups, backend, num_chunks=num_chunks)
    n = 0 if rank == 1 else 3 + rank
    x = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(rank)).to(dtype)
    cot = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = original(xa)
    if ya.requires_grad:              # transformers returns a constant for 0 tokens
        (ya.float() * cot).sum().backward()
    yb = ep(xb)
    (yb.float() * cot).sum().backward()
    for t in (xa, original.gate.weight, original.experts.gate_up_proj, original.experts.down_proj):
        if t.grad is None:            # no token reached it: transformers leaves no gradient
            t.grad = torch.zeros_like(t)
    bound = 1e-5 if dtype == torch.float32 else 2e-2     # relative error ||a - b|| / ||b||
    for name, a, b in (("output", yb, ya), ("grad x", xb.grad, xa.grad),
                       ("grad router", ep.gate.weight.grad, original.gate.weight.grad)):
        err = relative_error(a, b)
        assert err <= bound, f"{kind} {backend} {dtype} {name}: relative error {err:.3g} > {bound}"
    return (ep.first_expert, ep.experts.gate_up_proj.grad.float(), ep.experts.down_proj.grad.float(),
            original.experts.gate_up_proj.grad.float(), original.experts.down_proj.grad.float(), n)


def patched_model_counts(rank, world):
    """patch_model replaces every MoE block of a tiny Qwen3-MoE model and keeps its output."""
    import copy

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from expertrail.hf import ExpertParallelMoE, patch_model
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, mlp_only_layers=[], decoder_sparse_step=1)
    model = Qwen3MoeForCausalLM(cfg).eval()
    ep_model = copy.deepcopy(model)
    replaced = patch_model(ep_model, groups_for(None, 2), backend="hierarchical")
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        torch.testing.assert_close(ep_model(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    return replaced, sum(isinstance(m, ExpertParallelMoE) for m in ep_model.modules())


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


def triton_path_matches_torch(rank, world, backend, **options):
    """The Triton kernels (interpreted on the CPU) inside dispatch and combine give the torch
    path's rows bitwise and its combine within fp32 rounding, with alignment padding."""
    from expertrail import kernels
    outs = {}
    for mode in ("torch", "triton"):
        previous = kernels.set_mode(mode)
        try:
            groups = groups_for(None, 2)
            d = er.make_dispatcher(backend, groups, num_experts=8, expert_alignment=4, **options)
            xs, idxs, ws = make_inputs("random", world, 8, 8, 3, 2)
            x = xs[rank].clone().requires_grad_()
            res = d.dispatch(x, idxs[rank], ws[rank])
            y = d.combine(expert_fn(res.tokens, row_experts(res, rank, 2)), res)
            y.sum().backward()
            outs[mode] = (res.tokens.detach(), y.detach(), x.grad)
        finally:
            kernels.set_mode(previous)
    (t0, y0, g0), (t1, y1, g1) = outs["torch"], outs["triton"]
    assert torch.equal(t0, t1)
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-6)
    return t0.shape[0]


def property_case(rank, world, case):
    """One generated case: every backend's rows equal the reference bitwise, combine within
    tolerance; invalid cases raise InvalidInputError on every rank."""
    num_experts, hidden, topk = case["experts"], case["hidden"], case["topk"]
    g = torch.Generator().manual_seed(case["seed"])
    xs, idxs, ws = [], [], []
    for r in range(world):
        n = case["tokens"][r]
        xs.append(torch.randn(n, hidden, generator=g))
        if case["routing"] == "one_expert":
            idx = torch.full((n, topk), -1, dtype=torch.long)
            if n:
                idx[:, 0] = case["seed"] % num_experts
        else:
            scores = torch.rand(n, num_experts, generator=g)
            if case["routing"] == "skewed":
                scores = scores * torch.linspace(4, 1, num_experts)
            idx = scores.topk(topk, dim=1).indices if n else torch.zeros(0, topk, dtype=torch.long)
            idx[torch.rand(n, topk, generator=g) < case["drop"]] = -1
        ws.append(torch.rand(n, topk, generator=g))
        idxs.append(idx)
    if case["invalid"] and rank == case["invalid_rank"]:
        idxs[rank] = idxs[rank].clone()
        if idxs[rank].numel():
            idxs[rank][0, 0] = num_experts + 3
        else:
            ws[rank] = ws[rank][:, :max(topk - 1, 0)]
    options = dict(expert_alignment=case["alignment"], capacity_factor=case["capacity"])
    outcome = {}
    for backend in sorted(er.BACKENDS):
        d = er.make_dispatcher(backend, groups_for(None, case["domain"]), num_experts=num_experts, **options)
        try:
            res = d.dispatch(xs[rank], idxs[rank], ws[rank])
        except er.InvalidInputError:
            outcome[backend] = "invalid"
            continue
        ref = reference_dispatch(xs, idxs, ws, num_experts, world, **options)[rank]
        assert torch.equal(res.tokens, ref[0]) and torch.equal(res.tokens_per_expert, ref[1]), backend
        y = d.combine(expert_fn(res.tokens, row_experts(res, rank, num_experts // world)), res)
        yr = reference_moe(xs, idxs, ws, expert_fn, num_experts, case["capacity"])[rank]
        _assert_close(y.double(), yr.double(), 1e-6, f"{backend} combine")
        outcome[backend] = "ok"
    return outcome


def digest(rank, world, backend):
    """A fingerprint of dispatch rows, combine output and gradient for fixed inputs."""
    import hashlib
    xs, idxs, ws = make_inputs("random", world, 8, 16, 4, 21, torch.bfloat16)
    d = er.make_dispatcher(backend, groups_for(None, 2), num_experts=16)
    x = xs[rank].clone().requires_grad_()
    w = ws[rank].clone().requires_grad_()
    res = d.dispatch(x, idxs[rank], w)
    y = d.combine(expert_fn(res.tokens, row_experts(res, rank, 16 // world)), res)
    y.float().square().sum().backward()
    h = hashlib.sha256()
    for t in (res.tokens, y, x.grad, w.grad):
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def fault_during_dispatch(rank, world, mode, timeout):
    """Rank 3 dies (``die``) or stops calling (``stall``) before a dispatch; the others must
    raise a CollectiveError naming the operation within twice the timeout."""
    import os
    import time
    groups = er.EPGroups.from_default(domain_size=2, timeout=timeout)
    d = er.make_dispatcher("hierarchical", groups, num_experts=8)
    xs, idxs, ws = make_inputs("random", world, 8, 8, 2, 0)
    d.dispatch(xs[rank], idxs[rank], ws[rank])               # all healthy once
    if rank == 3:
        if mode == "die":
            os._exit(17)
        time.sleep(2.5 * timeout)
        return "stalled"
    start = time.monotonic()
    try:
        d.dispatch(xs[rank], idxs[rank], ws[rank])
    except er.ExpertrailError as err:
        first = f"{err} [after {time.monotonic() - start:.2f} s]"
    else:
        return "no error"
    # The groups are broken now: a later call and a new dispatcher on them raise at once.
    later = []
    for call in (lambda: d.dispatch(xs[rank], idxs[rank], ws[rank]),
                 lambda: er.make_dispatcher("dedup", groups, num_experts=8)):
        start = time.monotonic()
        try:
            call()
        except er.CollectiveError as err:
            later.append(f"{err} [after {time.monotonic() - start:.2f} s]")
    raise er.CollectiveError(" || ".join([first, *later]))


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


def alltoall_layout_choice(rank, world):
    """Which layout `alltoall` picks (True: runs land in place) for headers of 4 ranks with
    N tokens each, top-2, bf16, with the mean run of rows per (source, destination, local
    expert) at the threshold and just under it; and the layout a small dispatch then uses."""
    from expertrail.dispatch.alltoall import LANDING_MIN_RUN_BYTES
    from expertrail.dispatch.header import DTYPE_CODES, Header, Headers
    groups = groups_for(None, 2)
    picks = {}
    for num_experts in (4, 16):
        d = er.make_dispatcher("alltoall", groups, num_experts=num_experts)
        runs = world * world * (num_experts // world)
        for hidden in (512, 1024):
            tokens = LANDING_MIN_RUN_BYTES * runs // (world * 2 * hidden * 2)   # mean run = threshold
            for n in (tokens, tokens - 1):
                header = Header(num_tokens=n, hidden=hidden, topk=2, dtype=DTYPE_CODES[torch.bfloat16],
                                x_requires_grad=False, weights_require_grad=False, error=0)
                headers = Headers(torch.tensor([header.pack()] * world))
                picks[(num_experts, hidden, n == tokens)] = d._lands_in_place(headers)
    forced = er.make_dispatcher("alltoall", groups, num_experts=16, land_in_place=True)
    xs, idxs, ws = make_inputs("random", world, 8, 16, 2, 1)
    small = d.dispatch(xs[rank], idxs[rank], ws[rank]).route.lands_in_place
    landed = forced.dispatch(xs[rank], idxs[rank], ws[rank]).route.lands_in_place
    return picks, small, landed


def _combine_case(backend, rank, world, seed=1):
    """A valid dispatch on EP=world, domain 2: (dispatcher, res, expert output, inputs)."""
    groups = groups_for(None, 2)
    d = er.make_dispatcher(backend, groups, num_experts=8, hidden=4)
    xs, idxs, ws = make_inputs("random", world, 4, 8, 2, seed)
    res = d.dispatch(xs[rank], idxs[rank], ws[rank])
    return d, res, expert_fn(res.tokens, row_experts(res, rank, 2)), (xs, idxs, ws)


def bad_combine(rank, world, kind, bad_rank=2, backend="alltoall"):
    """Combine where only ``bad_rank`` passes a bad expert_out (or differs in its call); every
    rank must raise InvalidInputError (not time out), and the group must still work after."""
    d, res, out, _ = _combine_case(backend, rank, world)
    if rank == bad_rank or bad_rank is None:        # None: every rank
        if kind == "wider":
            out = torch.cat([out, out], 1)
        elif kind == "fewer_rows":
            out = out[:-1]
        elif kind == "integer":
            out = out.long()
        elif kind == "rank3":
            out = out.unsqueeze(0)
        elif kind == "device":
            out = out.to("meta")
        elif kind == "not_a_tensor":
            out = out.tolist()
        elif kind == "needs_grad":
            out = out.clone().requires_grad_()
    try:
        handle = d.combine(out, res, async_op=kind == "wider")   # async: the peers' error comes at wait()
        if kind == "wider":
            handle.wait()
    except er.InvalidInputError as err:
        message = str(err)
    else:
        raise AssertionError(f"combine with {kind} on rank {bad_rank} did not raise on rank {rank}")
    d2, res2, out2, (xs, idxs, ws) = _combine_case(backend, rank, world, seed=2)
    y = d2.combine(out2, res2)
    ref = reference_moe(xs, idxs, ws, expert_fn, 8)[rank]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    return message


def combine_casts_to_dispatched_dtype(rank, world, backend):
    """One rank hands bf16 expert outputs, the others fp32 (dispatched fp32): every rank's y is
    fp32 and right to bf16 rounding of that rank's rows. Returns the largest error."""
    d, res, out, (xs, idxs, ws) = _combine_case(backend, rank, world)
    y = d.combine(out.bfloat16() if rank == 1 else out, res)
    ref = reference_moe(xs, idxs, ws, expert_fn, 8)[rank]
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)
    return (y - ref).abs().max().item() if y.numel() else 0.0


def weights_changed_on_one_rank(rank, world, backend):
    """Rank 2 scales its res.weights in place; the others keep theirs. Each expert row must be
    weighted exactly once, by the weights of the rank holding the expert."""
    d, res, out, (xs, idxs, ws) = _combine_case(backend, rank, world)
    if rank == 2:
        res.weights.mul_(3)
    y = d.combine(out, res)
    scaled = [w * torch.where((i >= 4) & (i < 6), 3.0, 1.0) for w, i in zip(ws, idxs)]   # rank 2 holds 4, 5
    ref = reference_moe(xs, idxs, scaled, expert_fn, 8)[rank]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def from_default_timeout(rank, world, timeouts):
    """EPGroups.from_default with ``timeouts[rank]``."""
    er.EPGroups.from_default(timeout=timeouts[rank])


def rows_per_link(rank, world, backend, domain_size, scenario):
    """(this rank's dispatch rows and bytes per link class as the engine counted them, every
    rank's topk_idx)."""
    groups = groups_for(None, domain_size)
    d = er.make_dispatcher(backend, groups, num_experts=16)
    xs, idxs, ws = make_inputs(scenario, world, 8, 16, 4, 5)
    res = d.dispatch(xs[rank], idxs[rank], ws[rank])
    return dict(res.stats.rows), dict(res.stats.bytes), [i.numpy() for i in idxs]


def hierarchical_hop_kinds(rank, world, domain_size):
    """The kinds of hierarchical's hops for one dispatch, and whether its split domain hop's early
    part forwards only rows this rank sent itself in the rail hop."""
    from expertrail.dispatch.route import SplitHop
    groups = groups_for(None, domain_size)
    d = er.make_dispatcher("hierarchical", groups, num_experts=16)
    xs, idxs, ws = make_inputs("random", world, 8, 16, 4, 5, torch.float32)
    route = d.dispatch(xs[rank], idxs[rank], ws[rank]).route
    split = next((h for h in route.hops if isinstance(h, SplitHop)), None)
    early_in_own_block = None
    if split is not None:
        start, end = split.own
        early_in_own_block = (start, end) == route.hops[0].own_block_received() and \
            bool((split.early.index < end - start).all()) and \
            not bool(((split.late.index >= start) & (split.late.index < end)).any())
    return [type(h).__name__ for h in route.hops], early_in_own_block


def route_exchanges(rank, world, backend, domain_size):
    """A dispatch's public route description: (kind, peers) of each exchange, and whether the
    rows they send (with this rank's own block) and carry metadata for equal the dispatch's
    stats."""
    groups = groups_for(None, domain_size)
    d = er.make_dispatcher(backend, groups, num_experts=16)
    xs, idxs, ws = make_inputs("random", world, 8, 16, 4, 7, torch.float32)
    res = d.dispatch(xs[rank], idxs[rank], ws[rank])
    exchanges = res.route.exchanges()
    sent = sum(sum(max(e.recv_splits) for _ in e.peers) if e.kind == "all-gather" else sum(e.send_splits)
               for e in exchanges)
    return [(e.kind, e.peers) for e in exchanges], sent == sum(res.stats.rows.values())


def fp8_payload(rank, world, backend, domain_size, scenario, dtype):
    """payload="fp8": rows are the reference's rows of the quantized input (the same bytes on
    every backend), within e4m3's step of the unquantized ones; fp8 output mode gives the same
    values with their scales; combine travels in x's dtype; gradients pass straight through to
    x; dispatch bytes as the planner counts fp8 rows. Returns (tokens, fp8 bytes, native bytes)."""
    from expertrail.kernels import fp8
    hidden, experts, topk = 200, 16, 4                 # two scale blocks, the last one short
    groups = groups_for(None, domain_size)
    d = er.make_dispatcher(backend, groups, num_experts=experts, payload="fp8")
    raw = er.make_dispatcher(backend, groups, num_experts=experts, payload="fp8", dequantize=False)
    native = er.make_dispatcher(backend, groups, num_experts=experts)
    xs, idxs, ws = make_inputs(scenario, world, hidden, experts, topk, 7, dtype)
    xs = [x * torch.logspace(-2, 2, x.shape[0]).to(dtype).unsqueeze(1) for x in xs]     # magnitudes differ
    quantized = [fp8.dequantize(fp8.quantize(x), hidden, dtype) for x in xs]
    x = xs[rank].clone().requires_grad_()
    res = d.dispatch(x, idxs[rank], ws[rank])
    ref_tokens, ref_counts, _ = reference_dispatch(quantized, idxs, ws, experts, world)[rank]
    assert res.tokens.dtype == dtype and res.scales is None
    assert torch.equal(res.tokens.detach(), ref_tokens) and torch.equal(res.tokens_per_expert, ref_counts)
    exact, _, _ = reference_dispatch(xs, idxs, ws, experts, world)[rank]
    blocks = torch.nn.functional.pad(exact.float(), (0, 56)).view(-1, 2, 128)
    err = torch.nn.functional.pad((res.tokens.detach().float() - exact.float()).abs(), (0, 56)).view(-1, 2, 128)
    assert (err.amax(-1) <= 2 ** -3 * blocks.abs().amax(-1)).all(), "fp8 error beyond e4m3's step of the amax"
    packed = raw.dispatch(xs[rank], idxs[rank], ws[rank])
    assert packed.tokens.dtype == fp8.FP8 and packed.scales.shape == (packed.tokens.shape[0], 2)
    assert torch.equal(fp8.dequantize_values(packed.tokens, packed.scales, dtype), ref_tokens)
    out = expert_fn(res.tokens, row_experts(res, rank, experts // world))
    y = d.combine(out, res)
    assert y.dtype == dtype and res.combine_stats.total_bytes == \
        sum(res.combine_stats.rows.values()) * hidden * x.element_size()
    yref = reference_moe([t.double() for t in quantized], idxs, [w.double() for w in ws], expert_fn, experts)[rank]
    _assert_close(y.double(), yref, 1e-6 if dtype == torch.float32 else 2e-2, f"{backend} fp8 combine")
    y.float().sum().backward()                          # straight through: d y / d x as for the quantized x
    xq = quantized[rank].double().requires_grad_()
    reference_moe([xq if r == rank else q.double() for r, q in enumerate(quantized)], idxs,
                  [w.double() for w in ws], expert_fn, experts)[rank].sum().backward()
    _assert_close(x.grad.double(), xq.grad, 1e-5 if dtype == torch.float32 else 5e-2, f"{backend} fp8 grad x")
    plain = native.dispatch(xs[rank].to(torch.bfloat16), idxs[rank], ws[rank])
    return res.tokens.detach(), dict(res.stats.bytes), dict(plain.stats.bytes), [i.numpy() for i in idxs]


def workspace_reuse(rank, world, backend):
    """Buffers are reused call after call, never under a live tensor: results kept across
    later calls stay intact, two dispatches in flight at once, backward after a second forward,
    chunked overlap; the pool stops growing once the largest call has run."""
    groups = groups_for(None, 2)
    d = er.make_dispatcher(backend, groups, num_experts=16)
    ws_ = d.workspace
    calls = [make_inputs("random", world, 8192, 16, 4, seed, torch.float32) for seed in range(4)]   # rows of 32 KiB: pooled
    x0, i0, w0 = (t[rank] for t in calls[0])
    first = d.dispatch(x0, i0, w0)
    kept = first.tokens.clone()
    y_first = d.combine(first.tokens * 2, first)
    kept_y = y_first.clone()
    for xs, idxs, wts in calls[1:]:                    # later calls must not write into kept results
        res = d.dispatch(xs[rank], idxs[rank], wts[rank])
        d.combine(res.tokens, res)
    assert torch.equal(first.tokens, kept) and torch.equal(y_first, kept_y)
    # Two dispatches in flight at once, then waited for in reverse order.
    (xa, ia, wa), (xb, ib, wb) = ((t[rank] for t in c) for c in calls[1:3])
    pa, pb = d.dispatch(xa, ia, wa, async_op=True), d.dispatch(xb, ib, wb, async_op=True)
    rb, ra = pb.wait(), pa.wait()
    ref_a, ref_b = (reference_dispatch(*c, 16, world)[rank][0] for c in calls[1:3])
    assert torch.equal(ra.tokens, ref_a) and torch.equal(rb.tokens, ref_b)
    # Backward of the first forward after a second forward has run.
    x1 = xa.clone().requires_grad_()
    r1 = d.dispatch(x1, ia, wa)
    y1 = d.combine(r1.tokens * 3, r1)
    r2 = d.dispatch(xb.clone().requires_grad_(), ib, wb)
    d.combine(r2.tokens, r2).sum().backward()
    y1.sum().backward()
    xr = [t.double().requires_grad_() if r == rank else t.double() for r, t in enumerate(calls[1][0])]
    reference_moe(xr, calls[1][1], [w.double() for w in calls[1][2]], lambda rows, e: 3 * rows, 16)[rank].sum().backward()
    _assert_close(x1.grad.double(), xr[rank].grad, 1e-5, f"{backend} backward after a second forward")
    # Chunked overlap: several dispatches in flight, results as unchunked.
    experts = lambda tokens, counts: tokens * 2
    y_chunked = d.moe(xa, ia, wa, experts, num_chunks=3)
    y_plain = d.moe(xa, ia, wa, experts, num_chunks=1)
    assert torch.equal(y_chunked, y_plain)
    # Steady state: repeating a sequence of calls is served from the pool, which stays bounded.
    # (A gloo worker thread may still hold a finished transfer's tensor for a moment, so a
    # buffer can look busy and be replaced now and then: the bound, not zero growth, is what
    # holds. Every rank runs the same number of passes: no early exit.)
    sizes = []
    for _ in range(6):
        for xs, idxs, wts in calls:
            res = d.dispatch(xs[rank], idxs[rank], wts[rank])
            d.combine(res.tokens, res)
        sizes.append(ws_.high_water_bytes)
    steady = sizes[-1] <= 1.5 * sizes[0] and ws_.reused > 4 * ws_.allocated, f"high water per pass {sizes}, {ws_!r}"
    ws_.release()
    released = ws_.nbytes
    res = d.dispatch(xa, ia, wa)               # last collective: assertions below cannot strand a peer
    assert steady[0], steady[1]
    assert released == 0 and torch.equal(res.tokens, ref_a)
    return sizes


def overlap_matches_sequential(rank, world, backend, dtype, micro_batches=3):
    """The tiny LM trained one step on ``micro_batches`` micro-batches: sequentially, with
    1F1B overlap and delayed weight gradients, and with overlap alone. Returns, per variant,
    the losses and every parameter's gradient (to be compared bitwise)."""
    from expertrail.comm import schedule
    from expertrail.tools.configs import TrainConfig
    from expertrail.moe.layer import router_loss
    from expertrail.tools.train import build_ep_model, lm_loss, make_batch
    cfg = TrainConfig(hidden=16, ffn=16, experts=8, topk=2, layers=2, seq=8, batch=2)
    groups = groups_for(None, 2)
    batches = [make_batch(cfg, m, rank) for m in range(micro_batches)]
    out = {}
    for name, overlap, delay in (("sequential", False, False), ("overlap+delay", True, True),
                                 ("overlap", True, False)):
        model = build_ep_model(cfg, groups, backend).to(dtype)

        def forward(batch, model=model):
            return (lm_loss(model, batch) + router_loss(model)) / micro_batches
        losses = schedule.train_micro_batches(forward, batches, overlap=overlap, delay_wgrad=delay)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (torch.stack(losses), grads)
    return out


def lowlatency_matches_normal(rank, world, dtype, payload="native", plan_on_host=True):
    """The lowlatency mode against dedup's normal mode (one row per (token, rank), summed on the
    expert side) on the same inputs, call after call with changing token counts (0 on one
    rank, dropped slots, one hot expert, every token on one rank's experts). Returns the
    number of calls checked."""
    groups = groups_for(None, 2)
    experts, topk, hidden, most = 16, 4, 256, 12
    local = experts // world
    ll = er.make_dispatcher("lowlatency", groups, num_experts=experts, max_tokens_per_rank=most, hidden=hidden,
                            dtype=dtype, payload=payload)
    ll.plan_on_host = plan_on_host                           # False: the plan CUDA makes (torch, no host reads)
    raw = er.make_dispatcher("lowlatency", groups, num_experts=experts, max_tokens_per_rank=most, hidden=hidden,
                             dtype=dtype, payload=payload, dequantize=False) if payload == "fp8" else None
    normal = er.make_dispatcher("dedup", groups, num_experts=experts, payload=payload)
    checked = 0
    for call, n in enumerate([most, 5, 0 if rank == 1 else 3, 1, most, 7]):
        g = torch.Generator().manual_seed(100 * call + rank)
        x = torch.randn(n, hidden, generator=g).to(dtype)
        idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(n)]) if n else \
            torch.zeros(0, topk, dtype=torch.int64)
        if call == 1 and n:
            idx[:, 0] = -1                                   # dropped slots
        if call == 3:
            idx[:, 0] = 5                                    # a hot expert (still distinct per token)
            idx[:, 1:] = torch.tensor([6, 7, 8])[:topk - 1]
        if call == 5:                                        # every token's experts on rank 0
            idx = torch.stack([torch.randperm(local, generator=g)[:topk] for _ in range(n)])
        w = torch.rand(n, topk, generator=g)
        res = ll.dispatch(x, idx, w)
        ref = normal.dispatch(x, idx, w)
        assert res.tokens.shape == (local, world * most, hidden)
        assert torch.equal(res.count, ref.real_tokens_per_expert)
        expert_of_row = torch.repeat_interleave(torch.arange(local), ref.tokens_per_expert)
        for e in range(local):
            assert torch.equal(res.tokens[e, :int(res.count[e])], ref.tokens[expert_of_row == e]), (call, e)
        if raw is not None:                                  # fp8 values and scales for FP8 experts
            kept = raw.dispatch(x, idx, w)
            assert kept.tokens.dtype == torch.float8_e4m3fn and torch.equal(kept.count, res.count)
            for e in range(local):
                c = int(res.count[e])
                assert torch.equal(er.fp8.dequantize_values(kept.tokens[e, :c], kept.scales[e, :c], dtype),
                                   res.tokens[e, :c]), (call, e)
        scale = torch.linspace(0.5, 1.5, local).view(local, 1, 1)
        out = (res.tokens.float() * scale).to(dtype)
        y = ll.combine(out, res)
        y_ref = normal.combine((ref.tokens.float() * scale.flatten()[expert_of_row].unsqueeze(1)).to(dtype), ref)
        assert y.shape == (n, hidden) and y.dtype == dtype
        assert torch.equal(y, y_ref), (call, (y - y_ref).abs().max())     # the same kernel: the same bits
        checked += 1
    return checked


def lowlatency_bad_input(rank, world):
    """x wider than the buffers on one rank: every rank raises, then the next call works."""
    groups = groups_for(None, 2)
    ll = er.make_dispatcher("lowlatency", groups, num_experts=8, max_tokens_per_rank=4, hidden=16, dtype=torch.float32)
    x = torch.randn(6 if rank == 2 else 4, 16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(x.shape[0])])
    try:
        ll.dispatch(x, idx, torch.rand(idx.shape))
        raised = None
    except er.InvalidInputError as err:
        raised = str(err)
    x = torch.randn(4, 16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(4)])
    res = ll.dispatch(x, idx, torch.rand(4, 2))
    y = ll.combine(res.tokens, res)
    try:                                                     # routing weights of another dtype on rank 1
        ll.dispatch(x, idx, torch.rand(4, 2, dtype=torch.float64 if rank == 1 else torch.float32))
        mixed = None
    except er.InvalidInputError as err:
        mixed = str(err)
    values = []
    for bad_rank, bad in ((3, [[0, 8]]), (0, [[-2, 1]]), (1, [[5, 5]])):   # out of range, below -1, twice
        wrong = idx.clone()
        if rank == bad_rank:
            wrong[1:2] = torch.tensor(bad)
        try:
            ll.dispatch(x, wrong, torch.rand(4, 2))
            values.append(None)
        except er.InvalidInputError as err:
            values.append(str(err))
    res = ll.dispatch(x, idx, torch.rand(4, 2))              # and the next call works again
    return raised, tuple(y.shape), mixed, values, tuple(ll.combine(res.tokens, res).shape)


def lowlatency_misuse(rank, world):
    """What the lowlatency mode cannot honour raises on every rank: inputs that need gradients
    (its output would be cut from the graph) and a result read or combined after the next
    dispatch overwrote its rows. Returns each step's error text (None: no error)."""
    groups = groups_for(None, 2)
    ll = er.make_dispatcher("lowlatency", groups, num_experts=8, max_tokens_per_rank=4, hidden=16, dtype=torch.float32)
    x = torch.randn(4, 16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(4)])

    def attempt(call):
        try:
            call()
        except er.InvalidInputError as err:
            return str(err)
        return None

    texts = {"grad x": attempt(lambda: ll.dispatch(x.requires_grad_(rank == 1), idx, torch.rand(4, 2)))}
    x = x.detach()
    with torch.no_grad():                                  # the same tensor is fine where nothing records
        texts["no_grad"] = attempt(lambda: ll.dispatch(x.clone().requires_grad_(), idx, torch.rand(4, 2)))
    old = ll.dispatch(x, idx, torch.rand(4, 2))
    new = ll.dispatch(x, idx, torch.rand(4, 2))
    texts["stale tokens"] = attempt(lambda: old.tokens)
    texts["stale combine"] = attempt(lambda: ll.combine(new.tokens, old if rank == 3 else new))
    fresh = ll.dispatch(x, idx, torch.rand(4, 2))
    out = fresh.tokens.clone().requires_grad_(rank == 0)
    texts["grad out"] = attempt(lambda: ll.combine(out * 1, fresh))
    fresh = ll.dispatch(x, idx, torch.rand(4, 2))
    texts["after"] = attempt(lambda: ll.combine(fresh.tokens, fresh))   # and the mode works again
    return texts


def lowlatency_weight_dtypes(rank, world):
    """bf16, fp64 and fp16 routing weights (carried exactly, summed as dedup sums them): the same
    bits as dedup's normal mode, with the host plan and with the device plan."""
    groups = groups_for(None, 2)
    ll = er.make_dispatcher("lowlatency", groups, num_experts=8, max_tokens_per_rank=6, hidden=32,
                            dtype=torch.bfloat16)
    normal = er.make_dispatcher("dedup", groups, num_experts=8)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 32, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(6)])
    same = []
    for plan_on_host in (True, False):
        ll.plan_on_host = plan_on_host
        for wdtype in (torch.bfloat16, torch.float64, torch.float16):
            w = torch.rand(6, 3, generator=g).to(wdtype)
            res, ref = ll.dispatch(x, idx, w), normal.dispatch(x, idx, w)
            same.append(torch.equal(ll.combine(res.tokens, res), normal.combine(ref.tokens, ref)))
    return same


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
