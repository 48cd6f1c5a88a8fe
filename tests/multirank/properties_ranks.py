"""Functions run on every rank by tests/multirank/test_properties_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import torch

import expertrail as er
from expertrail.dispatch.reference import reference_dispatch, reference_moe

from ranks_common import _assert_close, groups_for
from scenarios import expert_fn, make_inputs, row_experts


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
