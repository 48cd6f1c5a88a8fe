"""Functions run on every rank by tests/multirank/test_serve_bench_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import expertrail as er
from expertrail.hf import ExpertParallelMoE, patch_model, unpatch_model
from expertrail.moe.hf import _patched_blocks

from hf_ranks import tiny_block, tiny_qwen3
from ranks_common import groups_for


class _CountingAllReduce:
    """Counts the all-reduces this rank makes while installed (each still runs for real)."""

    def __init__(self):
        self.calls, self._real = 0, dist.all_reduce

    def __enter__(self):
        def counted(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._real


def bucketed_model_matches_normal(rank, world):
    """A tiny Qwen3-MoE patched with buckets [4, 16] against the same model in the normal mode:
    logits equal bit for bit at every step, whatever each rank's token count; the mode picked
    from the largest count of any rank; one all-reduce per model forward; gradients -> normal.
    Returns (modes per step, all-reduces per forward)."""
    groups = groups_for(None, 2)
    original = tiny_qwen3()
    normal, bucketed = copy.deepcopy(original), copy.deepcopy(original)
    patch_model(normal, groups, backend="dedup")
    patch_model(bucketed, groups, backend="dedup", buckets=[16, 4])
    blocks = [b.bucketed for _, b in _patched_blocks(bucketed)]
    modes, reduces = [], []
    for step, n in enumerate([1 + rank, 4, 9 if rank == 2 else 2, 20 if rank == 0 else 3, 16, 1 if rank == 1 else 2]):
        ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(10 * step + rank))
        with torch.no_grad():
            want = normal(ids).logits
            with _CountingAllReduce() as counter:
                got = bucketed(ids).logits
        assert torch.equal(got, want), (step, (got - want).abs().max())
        assert len({b.last for b in blocks}) == 1
        modes.append(blocks[0].last)
        reduces.append(counter.calls)
    bucketed.train()
    ids = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(rank))
    bucketed(ids).logits.sum().backward()                  # training: the normal mode, gradients flow
    modes.append(blocks[0].last)
    assert _patched_blocks(bucketed)[0][1].experts.gate_up_proj.grad is not None
    unpatch_model(bucketed)                                # and its hooks go with the blocks
    with torch.no_grad(), _CountingAllReduce() as counter:
        bucketed(ids)
    assert counter.calls == 0
    return modes, reduces


def bucketed_block_standalone(rank, world):
    """One ExpertParallelMoE with buckets, outside a model: it agrees at every call; outputs
    equal the normal mode's bit for bit. Returns the modes."""
    groups = groups_for(None, 2)
    block = tiny_block("qwen3_moe", torch.float32)
    normal = ExpertParallelMoE(copy.deepcopy(block), groups, "dedup")
    bucketed = ExpertParallelMoE(copy.deepcopy(block), groups, "dedup", buckets=[8])
    modes = []
    for n in (0 if rank == 1 else 3 + rank, 8, 5 if rank == 3 else 40):
        x = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(n + rank))
        with torch.no_grad():
            assert torch.equal(bucketed(x), normal(x))
        modes.append(bucketed.bucketed.last)
    return modes


def bad_buckets(rank, world):
    """Bad bucket settings on one rank raise on every rank: returns each case's error text."""
    groups = groups_for(None, 2)
    texts = {}
    cases = {"not positive": ([0, 8] if rank == 2 else [8], "dedup"),
             "differ": ([8, 16] if rank == 1 else [8], "dedup"),
             "backend": ([8], "alltoall"),
             "empty on one rank": ([] if rank == 3 else [8], "dedup")}
    for name, (buckets, backend) in cases.items():
        try:
            patch_model(tiny_qwen3(), groups, backend=backend, buckets=buckets)
            texts[name] = None
        except er.ExpertrailError as err:
            texts[name] = f"{type(err).__name__}: {err}"
    return texts


def serve_small(rank, world):
    """tools/serve_bench on a small tiny model: the report of every rank (tokens compared,
    the rebalancer's plan and switch steps)."""
    from expertrail.tools.serve_bench import ServeBenchConfig, serve_bench_rank
    cfg = ServeBenchConfig(batch=4, prompt_len=4, new_tokens=6, rounds=2, topic_every=1, layers=2, hidden=32,
                           experts=8, topk=2, vocab=64, redundant=4, rebalance_every=2, window=2)
    return serve_bench_rank(rank, world, cfg)


def early_finishers(rank, world):
    """generate on a bucketed, rebalancing model where ranks stop at different lengths (rank r
    generates 3 + 2r tokens): no rank hangs; tokens equal the normal-mode model's."""
    from expertrail.balance import ReplicaRouter, plan_placement
    from expertrail.moe.rebalancing import LiveRebalancer
    import numpy as np
    groups = groups_for(None, 2)
    original = tiny_qwen3()
    normal, served = copy.deepcopy(original), copy.deepcopy(original)
    patch_model(normal, groups, backend="dedup")
    patch_model(served, groups, backend="dedup", buckets=[8],
                replicas=ReplicaRouter.from_placement(plan_placement(np.ones(8), 12, world)))
    rebalancer = LiveRebalancer(served, rebalance_every=1, window=2)
    ids = torch.randint(1, 64, (2, 4), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name, model in (("normal", normal), ("served", served)):
        with torch.no_grad():
            out[name] = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=3 + 2 * rank, pad_token_id=0)
    return out["normal"].tolist(), out["served"].tolist(), rebalancer.events, rebalancer.steps


def bucketed_moe_layer(rank, world):
    """MoELayer(buckets=[8]) against the same layer in the normal mode: outputs equal bit for
    bit at decode sizes (a rank holding no token included) and past the bucket; with gradients
    the normal mode. Returns the modes."""
    from expertrail.moe.experts import GroupedExperts, SwiGLUMLP
    from expertrail.moe.layer import MoELayer
    from expertrail.moe.router import RouterConfig, TopKRouter
    groups = groups_for(None, 2)
    layers = []
    for buckets in (None, [8]):
        torch.manual_seed(0)                                # the same router, shared and experts per rank
        router = TopKRouter(RouterConfig(hidden=16, num_experts=8, topk=2))
        shared = SwiGLUMLP(16, 8)
        experts = GroupedExperts(2, 16, 8)
        layers.append(MoELayer(router, er.make_dispatcher("dedup", groups, num_experts=8), experts, shared,
                               buckets=buckets))
    normal, bucketed = layers
    modes = []
    for n in (0 if rank == 2 else 5, 8, 12 if rank == 0 else 1):
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n + 7 * rank))
        with torch.no_grad():
            assert torch.equal(bucketed(x), normal(x)), n
        modes.append(bucketed.bucketed.last)
    x = torch.randn(3, 16, requires_grad=True)
    bucketed(x).sum().backward()
    modes.append(bucketed.bucketed.last)
    assert x.grad is not None
    return modes
