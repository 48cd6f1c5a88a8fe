"""Functions run on every rank by tests/multirank/test_errors_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import torch

import expertrail as er
from expertrail.dispatch.reference import reference_moe

from ranks_common import dispatch_rows, groups_for
from scenarios import expert_fn, make_inputs, row_experts


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


def _combine_case(backend, rank, world, seed=1, **options):
    """A valid dispatch on EP=world, domain 2: (dispatcher, res, expert output, inputs)."""
    groups = groups_for(None, 2)
    d = er.make_dispatcher(backend, groups, num_experts=8, hidden=4, **options)
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


def weights_changed_on_one_rank(rank, world, backend, weights_at):
    """Rank 2 scales its res.weights in place; the others keep theirs. With weights_at="expert"
    each expert row is weighted exactly once, by the weights of the rank holding the expert;
    with "source" combine applies the dispatched routing weights (res.weights is a copy).
    Returns where the dispatcher applies them."""
    d, res, out, (xs, idxs, ws) = _combine_case(backend, rank, world, weights_at=weights_at)
    if rank == 2:
        res.weights.mul_(3)
    y = d.combine(out, res)
    if d.weights_at == "expert":
        ws = [w * torch.where((i >= 4) & (i < 6), 3.0, 1.0) for w, i in zip(ws, idxs)]   # rank 2 holds 4, 5
    ref = reference_moe(xs, idxs, ws, expert_fn, 8)[rank]
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    return d.weights_at


def from_default_timeout(rank, world, timeouts):
    """EPGroups.from_default with ``timeouts[rank]``."""
    er.EPGroups.from_default(timeout=timeouts[rank])
