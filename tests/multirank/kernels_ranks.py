"""Functions run on every rank by tests/multirank/test_kernels_world4.py (and reused by
test_backends_world4.py): fn(rank, world, ...)."""
from __future__ import annotations

import torch

import expertrail as er

from ranks_common import groups_for
from scenarios import expert_fn, make_inputs, row_experts


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


def lowlatency_under_triton(rank, world, metadata_on_host):
    """The low-latency mode with the Triton kernels (interpreted on the CPU): its combine sums
    through the Triton reduction on dense positions, and gives the normal mode's bits."""
    from expertrail import kernels
    from lowlatency_ranks import lowlatency_matches_normal
    previous = kernels.set_mode("triton")
    try:
        return lowlatency_matches_normal(rank, world, torch.float32, "native", metadata_on_host)
    finally:
        kernels.set_mode(previous)
