"""TopKRouter features, each against a direct computation."""
import pytest
import torch

from expertrail.errors import ConfigError
from expertrail.moe.router import RouterConfig, TopKRouter, balanced_topk, switch_loss


def router(**kw):
    cfg = dict(hidden=16, num_experts=8, topk=2)
    cfg.update(kw)
    torch.manual_seed(0)
    return TopKRouter(RouterConfig(**cfg))


def tokens(n=32, dtype=torch.float32):
    return torch.randn(n, 16, generator=torch.Generator().manual_seed(1)).to(dtype)


def test_post_softmax_takes_topk_logits_then_softmax():
    r = router()
    x = tokens()
    out = r(x)
    logits = x @ r.weight.T
    top = logits.topk(2, dim=-1)
    assert torch.equal(out.topk_idx, top.indices)
    torch.testing.assert_close(out.topk_weights, torch.softmax(top.values, -1))
    torch.testing.assert_close(out.probs, torch.softmax(logits, -1))


def test_pre_softmax_with_renormalisation_and_scaling():
    r = router(pre_softmax=True, normalize_topk=True, scaling_factor=2.5)
    x = tokens()
    probs = torch.softmax(x @ r.weight.T, -1)
    top = probs.topk(2, dim=-1)
    out = r(x)
    assert torch.equal(out.topk_idx, top.indices)
    torch.testing.assert_close(out.topk_weights, 2.5 * top.values / top.values.sum(-1, keepdim=True))


def test_sigmoid_scores():
    r = router(score_function="sigmoid", normalize_topk=True)
    x = tokens()
    scores = torch.sigmoid(x @ r.weight.T)
    top = scores.topk(2, dim=-1)
    out = r(x)
    assert torch.equal(out.topk_idx, top.indices)
    torch.testing.assert_close(out.topk_weights, top.values / top.values.sum(-1, keepdim=True))


def test_router_math_is_fp32_for_bf16_inputs():
    r = router()
    out = r(tokens(dtype=torch.bfloat16))
    assert out.topk_weights.dtype == torch.float32 and out.probs.dtype == torch.float32


def test_group_limited_routing_picks_inside_the_best_groups():
    r = router(num_experts=16, topk=4, num_groups=4, group_topk=2, score_function="sigmoid")
    x = tokens(64)
    scores = torch.sigmoid(x @ r.weight.T)
    out = r(x)
    for t in range(64):
        groups = scores[t].view(4, 4)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        best = set(group_score.topk(2).indices.tolist())
        allowed = torch.cat([torch.arange(g * 4, g * 4 + 4) for g in sorted(best)])
        expect = allowed[scores[t, allowed].topk(4).indices]
        assert set(out.topk_idx[t].tolist()) == set(expect.tolist())
        assert {e // 4 for e in out.topk_idx[t].tolist()} <= best


def test_expert_bias_changes_selection_but_not_weights_and_updates_by_sign():
    r = router(score_function="sigmoid", expert_bias=True, bias_update_rate=0.1)
    r.train()
    x = tokens(64)
    first = r(x)
    loads = torch.bincount(first.topk_idx.reshape(-1), minlength=8).float()
    used = r.update_expert_bias()
    assert torch.equal(used, loads)
    torch.testing.assert_close(r.expert_bias, 0.1 * torch.sign(loads.mean() - loads))
    r.expert_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0, 10.0]))   # expert 7 always chosen
    out = r(x)
    assert (out.topk_idx == 7).any(1).all()
    scores = torch.sigmoid(x @ r.weight.T)
    torch.testing.assert_close(out.topk_weights, scores.gather(1, out.topk_idx))   # bias not in weights


def test_aux_losses_match_their_formulas():
    r = router(aux_loss_coeff=0.01, seq_aux_loss_coeff=0.1, global_aux_loss_coeff=0.5, z_loss_coeff=1e-3)
    r.train()
    x = tokens(24).view(3, 8, 16)
    out = r(x)
    logits = x.reshape(-1, 16) @ r.weight.T
    probs = torch.softmax(logits, -1)
    counts = torch.bincount(out.topk_idx.reshape(-1), minlength=8).float()
    switch = 8 * ((probs.mean(0)) * counts / (24 * 2)).sum()
    torch.testing.assert_close(out.losses["aux_loss"], 0.01 * switch)
    torch.testing.assert_close(out.losses["global_aux_loss"], 0.5 * switch)
    per_seq = []
    for b in range(3):
        c = torch.bincount(out.topk_idx[b * 8:(b + 1) * 8].reshape(-1), minlength=8).float()
        per_seq.append(8 * (probs[b * 8:(b + 1) * 8].mean(0) * c / (8 * 2)).sum())
    torch.testing.assert_close(out.losses["seq_aux_loss"], 0.1 * sum(per_seq) / 3)
    torch.testing.assert_close(out.losses["z_loss"], 1e-3 * torch.logsumexp(logits, -1).square().mean())
    sum(out.losses.values()).backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_a_loss_that_waits_for_an_exchange_is_computed_when_first_read():
    """`RouterLosses`: the global-batch loss (its loads summed over ranks) is computed on first
    read, so its all-reduce travels while the forward goes on; every way of reading it gives
    the same tensor, computed once."""
    from expertrail.moe.router import RouterLosses
    calls = []
    losses = RouterLosses()
    losses["aux_loss"] = torch.tensor(1.0)
    losses.add_pending("global_aux_loss", lambda: calls.append(1) or torch.tensor(2.0))
    assert calls == [] and len(losses) == 2 and "global_aux_loss" in losses
    assert dict(losses) == {"aux_loss": torch.tensor(1.0), "global_aux_loss": torch.tensor(2.0)}
    assert sum(losses.values()).item() == 3.0 and {**losses}["global_aux_loss"].item() == 2.0
    assert calls == [1]


def test_the_global_loss_keeps_its_gradient_when_first_read_without_one():
    r = router(global_aux_loss_coeff=0.5)
    r.train()
    out = r(tokens(24))
    with torch.no_grad():
        value = out.losses["global_aux_loss"]
    assert value.requires_grad
    value.backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_switch_loss_is_one_when_uniform():
    assert switch_loss(torch.full((4,), 10 / 4), torch.full((4,), 5), 10, 2).item() == pytest.approx(1.0)


def test_input_jitter_only_in_training():
    r = router(input_jitter=0.1)
    x = tokens()
    r.eval()
    assert torch.equal(r(x).probs, r(x).probs)
    r.train()
    assert not torch.equal(r(x).probs, r(x).probs)


def test_forced_balance_gives_every_expert_the_same_rows():
    r = router(force_balance=True, topk=3)
    out = r(tokens(40))
    counts = torch.bincount(out.topk_idx.reshape(-1), minlength=8)
    assert counts.max() - counts.min() <= 1
    assert torch.equal(out.topk_idx, balanced_topk(40, 8, 3))


@pytest.mark.parametrize("kw,text", [
    (dict(score_function="relu"), "score_function='relu'"),
    (dict(topk=9), "topk=9 must be in [1, num_experts=8]"),
    (dict(num_groups=3, group_topk=1), "num_groups=3 must divide num_experts=8"),
    (dict(num_groups=4), "num_groups and group_topk go together"),
    (dict(num_groups=4, group_topk=0), "group_topk=0 groups of 2 experts cannot hold topk=2"),
])
def test_bad_router_config_is_rejected(kw, text):
    with pytest.raises(ConfigError, match=text.replace("[", r"\[").replace("(", r"\(")):
        router(**kw)
