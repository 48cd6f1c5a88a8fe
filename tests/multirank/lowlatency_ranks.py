"""Functions run on every rank by tests/multirank/test_lowlatency_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import torch

import expertrail as er

from ranks_common import groups_for


def lowlatency_matches_normal(rank, world, dtype, payload="native", metadata_on_host=True):
    """The lowlatency mode against dedup's normal mode (one row per (token, rank), summed on the
    expert side) on the same inputs, call after call with changing token counts (0 on one
    rank, dropped slots, one hot expert, every token on one rank's experts). Returns the
    number of calls checked."""
    groups = groups_for(None, 2)
    experts, topk, hidden, most = 16, 4, 256, 12
    local = experts // world
    ll = er.LowLatencyDispatcher(groups, num_experts=experts, max_tokens_per_rank=most, hidden=hidden,
                            dtype=dtype, payload=payload)
    ll.metadata_on_host = metadata_on_host                           # False: the plan CUDA makes (torch, no host reads)
    raw = er.LowLatencyDispatcher(groups, num_experts=experts, max_tokens_per_rank=most, hidden=hidden,
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


def lowlatency_bad_input(rank, world, metadata_on_host=True):
    """x wider than the buffers on one rank: every rank raises, then the next call works; ids
    out of range or listed twice on one rank raise on every rank, with the host metadata and with
    the device metadata (which checks them on the device) alike."""
    groups = groups_for(None, 2)
    ll = er.LowLatencyDispatcher(groups, num_experts=8, max_tokens_per_rank=4, hidden=16, dtype=torch.float32)
    ll.metadata_on_host = metadata_on_host
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
    dispatch overwrote its rows. Returns each step's error text (None: no error). Built the old
    way, through make_dispatcher, which still works and says to use LowLatencyDispatcher."""
    import warnings
    groups = groups_for(None, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ll = er.make_dispatcher("lowlatency", groups, num_experts=8, max_tokens_per_rank=4, hidden=16,
                                dtype=torch.float32)
    assert isinstance(ll, er.LowLatencyDispatcher)
    assert [w.category for w in caught] == [DeprecationWarning] and "LowLatencyDispatcher(" in str(caught[0].message)
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
    bits as dedup's normal mode, with the host metadata and with the device metadata."""
    groups = groups_for(None, 2)
    ll = er.LowLatencyDispatcher(groups, num_experts=8, max_tokens_per_rank=6, hidden=32,
                            dtype=torch.bfloat16)
    normal = er.make_dispatcher("dedup", groups, num_experts=8)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 32, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(6)])
    same = []
    for metadata_on_host in (True, False):
        ll.metadata_on_host = metadata_on_host
        for wdtype in (torch.bfloat16, torch.float64, torch.float16):
            w = torch.rand(6, 3, generator=g).to(wdtype)
            res, ref = ll.dispatch(x, idx, w), normal.dispatch(x, idx, w)
            same.append(torch.equal(ll.combine(res.tokens, res), normal.combine(ref.tokens, ref)))
    return same


def lowlatency_errors_unagreed(rank, world, metadata_on_host):
    """``agree_on_errors=False`` (the CUDA default): a rank with invalid input (a bad shape, or
    ids out of range) raises alone, after taking part in the exchange with empty blocks, so
    the others return and the next call works everywhere. Returns each call's error or None."""
    groups = groups_for(None, 2)
    ll = er.LowLatencyDispatcher(groups, num_experts=8, max_tokens_per_rank=4, hidden=16, dtype=torch.float32,
                                 agree_on_errors=False)
    ll.metadata_on_host = metadata_on_host
    x = torch.randn(4, 16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(4)])
    outcomes = []
    for bad in ("shape", "ids", None):
        xs, ids = x, idx.clone()
        if rank == 1 and bad == "shape":
            xs = torch.randn(4, 8)
        if rank == 1 and bad == "ids":
            ids[0, 0] = 9
        try:
            res = ll.dispatch(xs, ids, torch.rand(4, 2))
            ll.combine(res.tokens, res)
            outcomes.append(None)
        except er.InvalidInputError as err:
            outcomes.append(str(err))
    return outcomes


def fixed_blocks_both_transports(rank, world):
    """`Channel.all_to_all_fixed` with blocks under and over `COLLECTIVE_MAX_BLOCK_BYTES` (gloo's
    all-to-all, then point-to-point transfers): every rank gets block ``rank`` of every peer's
    rows, in peer order, into ``out`` when given. Returns the sizes checked."""
    from expertrail.comm.transport import COLLECTIVE_MAX_BLOCK_BYTES
    groups = groups_for(None, 2)
    checked = []
    for width in (3, COLLECTIVE_MAX_BLOCK_BYTES // 4 + 1):            # fp32 rows of one block: small, then too big
        rows = torch.arange(world * 2 * width, dtype=torch.float32).view(world * 2, width) + 1000 * rank
        out = torch.full_like(rows, -1.0) if width == 3 else None
        got = groups.ep_channel.all_to_all_fixed(rows, out=out).wait()
        want = torch.cat([torch.arange(world * 2 * width, dtype=torch.float32).view(world * 2, width)[2 * rank:2 * rank + 2]
                          + 1000 * peer for peer in range(world)])
        assert torch.equal(got, want), (width, got[:, :4], want[:, :4])
        assert out is None or got.data_ptr() == out.data_ptr()
        checked.append(width)
    return checked
