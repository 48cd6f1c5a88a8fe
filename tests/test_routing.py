"""Routing tensors: converters, layouts and token dropping, against direct loops."""
import math

import pytest
import torch

import expertrail as er
from expertrail.dispatch.routing import expert_capacity


def random_routing(n=40, num_experts=12, topk=3, seed=0, drop=0.25):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(n)])
    idx[torch.rand(n, topk, generator=g) < drop] = -1
    return idx, torch.rand(n, topk, generator=g)


def test_routing_map_round_trip_keeps_every_pair():
    idx, w = random_routing()
    routing_map, probs = er.topk_to_routing_map(idx, w, 12)
    assert routing_map.sum() == (idx >= 0).sum()
    for n in range(idx.shape[0]):
        for k in range(3):
            if idx[n, k] >= 0:
                assert routing_map[n, idx[n, k]] and probs[n, idx[n, k]] == w[n, k]
    idx2, w2 = er.routing_map_to_topk(routing_map, probs, topk=3)
    back_map, back_probs = er.topk_to_routing_map(idx2, w2, 12)
    assert torch.equal(back_map, routing_map) and torch.equal(back_probs, probs)
    # rows list experts in ascending order, -1 padding last, weight 0 there
    for row, wrow in zip(idx2.tolist(), w2.tolist()):
        real = [e for e in row if e >= 0]
        assert real == sorted(real) and row == real + [-1] * (3 - len(real))
        assert all(v == 0 for e, v in zip(row, wrow) if e < 0)


def test_routing_map_to_topk_rejects_too_small_k():
    routing_map = torch.zeros(2, 4, dtype=torch.bool)
    routing_map[0, :3] = True
    with pytest.raises(er.InvalidInputError, match="topk=2 but a token of routing_map selects 3"):
        er.routing_map_to_topk(routing_map, torch.ones(2, 4), topk=2)
    assert er.routing_map_to_topk(routing_map, torch.ones(2, 4))[0].shape == (2, 3)


@pytest.mark.parametrize("domain_size", [1, 2, 4])
def test_layout_counts_match_a_loop(domain_size):
    idx, _ = random_routing(seed=1)
    ep = 4
    lay = er.compute_layout(idx, 12, ep, domain_size)
    per_expert = torch.zeros(12, dtype=torch.long)
    per_rank = torch.zeros(ep, dtype=torch.long)
    per_domain = torch.zeros(ep // domain_size, dtype=torch.long)
    for row in idx.tolist():
        experts = [e for e in row if e >= 0]
        for e in experts:
            per_expert[e] += 1
        ranks = {e // 3 for e in experts}
        for r in ranks:
            per_rank[r] += 1
        for d in {r // domain_size for r in ranks}:
            per_domain[d] += 1
    assert torch.equal(lay.tokens_per_expert, per_expert)
    assert torch.equal(lay.tokens_per_rank, per_rank)
    assert torch.equal(lay.tokens_per_domain, per_domain)


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0, 4.0])
def test_capacity_drops_what_a_loop_drops(policy, factor):
    idx, w = random_routing(n=50, seed=2, drop=0.1)
    cap = expert_capacity(50, 3, 12, factor)
    assert cap == math.ceil(50 * 3 / 12 * factor)
    expected = idx.clone()
    for e in range(12):
        slots = [(n, k) for n in range(50) for k in range(3) if idx[n, k] == e]
        if policy == "probs":   # highest weight first, earlier slot on ties
            slots.sort(key=lambda s: -w[s].item())
        for n, k in slots[cap:]:
            expected[n, k] = -1
    got = er.apply_capacity(idx, w, 12, factor, policy)
    assert torch.equal(got, expected)
    counts = torch.bincount(got[got >= 0], minlength=12)
    assert (counts <= cap).all()


def test_capacity_rejects_unknown_policy():
    idx, w = random_routing()
    with pytest.raises(er.InvalidInputError, match="drop_policy='random'"):
        er.apply_capacity(idx, w, 12, 1.0, "random")


def test_empty_routing_is_valid():
    idx = torch.zeros(0, 2, dtype=torch.long)
    lay = er.compute_layout(idx, 8, 4)
    assert lay.tokens_per_expert.sum() == 0 and lay.token_in_rank.shape == (0, 4)
    assert er.apply_capacity(idx, torch.zeros(0, 2), 8, 1.0).shape == (0, 2)
