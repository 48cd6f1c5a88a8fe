"""Dispatch, run experts, combine: on 4 local CPU ranks, or under torchrun.

    .venv/bin/python examples/quickstart.py                          # spawns 4 gloo ranks
    .venv/bin/torchrun --nproc-per-node 4 examples/quickstart.py     # uses torchrun's ranks

Either way every rank checks its result against the same computation done locally, and the
script prints "ok" only if every rank agrees within 1e-5 (it exits non-zero otherwise).
"""
import os

import torch
import torch.distributed as dist

import expertrail as er


def moe_step(rank: int, world: int) -> float:
    groups = er.EPGroups.from_default(domain_size=2)          # 2 domains of 2 ranks
    num_experts, hidden, topk = 8, 16, 2
    weights = torch.randn(num_experts, hidden, hidden, generator=torch.Generator().manual_seed(0)) / hidden ** 0.5
    d = er.make_dispatcher("hierarchical", groups, num_experts=num_experts, hidden=hidden)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10 + rank, hidden, generator=g, requires_grad=True)   # uneven tokens per rank
    scores = torch.randn(x.shape[0], num_experts, generator=g).softmax(-1)
    topk_weights, topk_idx = scores.topk(topk, dim=1)

    res = d.dispatch(x, topk_idx, topk_weights)                 # rows for this rank's experts
    local = weights[groups.ep_rank * 2:(groups.ep_rank + 1) * 2]   # this rank's 2 experts
    chunks = res.tokens.split(res.tokens_per_expert.tolist())
    out = torch.cat([c @ w for c, w in zip(chunks, local)])
    y = d.combine(out, res)                                     # [N, H] = sum_k w_k * expert_k(x)
    y.square().mean().backward()

    # The same computation on this rank alone, for comparison.
    expected = sum(topk_weights[:, k, None] * torch.einsum("nh,nhj->nj", x, weights[topk_idx[:, k]])
                   for k in range(topk))
    err = (y - expected).abs().max().item()
    if rank == 0:
        print(f"rank 0: {x.shape[0]} tokens -> {res.tokens.shape[0]} expert rows; max |y - reference| = {err:.2e}; "
              f"sent {res.stats.bytes}")
    return err


if __name__ == "__main__":
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        worst = torch.tensor([moe_step(dist.get_rank(), dist.get_world_size())])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)       # every rank's error, so that all agree
        dist.barrier()               # leave together: gloo aborts a rank whose peer tears down first
        dist.destroy_process_group()
        assert worst.item() < 1e-5, f"max |y - reference| = {worst.item():.2e} on some rank"
        if os.environ["RANK"] == "0":
            print("ok")
    else:
        from expertrail.emulation.launch import LocalRanks
        with LocalRanks(4) as ranks:
            errors = ranks.run(moe_step)
        assert max(errors) < 1e-5, errors
        print("ok")
