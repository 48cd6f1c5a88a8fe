"""Functions run on every rank by tests/multirank/test_hf_world4.py (transformers): fn(rank, world, ...)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import expertrail as er
from expertrail.hf import ExpertParallelMoE, full_state_dict, patch_model, unpatch_model

from ranks_common import groups_for


def tiny_qwen3(seed: int = 0, layers: int = 2):
    """A tiny random Qwen3-MoE language model (hidden 32, 8 experts, top-2), in eval mode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=8, num_experts_per_tok=2, mlp_only_layers=[], decoder_sparse_step=1)
    return Qwen3MoeForCausalLM(cfg).eval()


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))


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
    elif kind == "ernie4_5_moe":                # expert-bias router statistics, shared experts
        from transformers import Ernie4_5_MoeConfig
        from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock
        block = Ernie4_5_MoeSparseMoeBlock(Ernie4_5_MoeConfig(hidden_size=32, moe_intermediate_size=16,
                                                              moe_num_experts=8, moe_k=2, moe_num_shared_experts=1))
    elif kind == "olmoe":                       # softmax over all experts, top-k weights not renormalised
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
        block = OlmoeSparseMoeBlock(OlmoeConfig(hidden_size=32, intermediate_size=16, num_experts=8,
                                                num_experts_per_tok=2, norm_topk_prob=False))
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


def patch_with_differing_weights(rank, world, how):
    """Patch models whose replicated weights differ between ranks; must raise everywhere."""
    groups = groups_for(None, 2)
    if how == "unseeded":                 # each rank builds its own random model
        patch_model(tiny_qwen3(seed=rank), groups)
    elif how == "one_bit":                # rank 2's layer-1 experts differ in one float's last bit
        model = tiny_qwen3()
        if rank == 2:
            with torch.no_grad():
                w = model.model.layers[1].mlp.experts.gate_up_proj.view(-1)
                w[5] = torch.nextafter(w[5], torch.tensor(float("inf")))
        patch_model(model, groups)
    elif how == "block":                  # ExpertParallelMoE on its own checks too
        block = tiny_block("deepseek_v3", torch.float32)
        if rank == 1:
            with torch.no_grad():
                block.shared_experts.down_proj.weight[0, 0] += 1e-3
        ExpertParallelMoE(block, groups)
    else:
        raise ValueError(how)


def patch_unsupported_model(rank, world, kind):
    """patch_model on a model it must refuse (on every rank)."""
    groups = groups_for(None, 2)
    if kind == "dense_llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    elif kind == "qwen2_moe":             # a gated shared expert the adapter would drop
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
        torch.manual_seed(0)
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                   moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   num_experts=8, num_experts_per_tok=2))
    elif kind == "layers_differ":         # rank 3 holds a different model: must not hang
        model = tiny_qwen3(layers=1 if rank == 3 else 2)
    else:
        raise ValueError(kind)
    patch_model(model, groups)


def save_and_load_round_trip(rank, world):
    """patch -> train step -> full_state_dict -> load into the unpatched model and into a
    patched model of another EP size -> same logits; unpatch -> the same model again."""
    original = tiny_qwen3()
    model = copy.deepcopy(original)
    patch_model(model, groups_for(None, 2), backend="alltoall")
    ids = _ids(rank)
    model.train()
    model(ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    model.eval()
    with torch.no_grad():
        logits = model(ids).logits

    # Each rank stepped on its own batch with no gradient sum: the replicas drifted apart.
    try:
        full_state_dict(model)
        drift = None
    except er.ConfigMismatchError as err:
        drift = str(err)
    assert drift is not None and "model.embed_tokens.weight (ranks holding the same copy: [0], [1], [2], [3])" in drift \
        and "check_replicas=False" in drift, drift
    state = full_state_dict(model, check_replicas=False)          # this rank's copy, knowingly
    ref = original.state_dict()
    assert list(state) == list(ref) or sorted(state) == sorted(ref), sorted(set(state) ^ set(ref))
    for key, t in ref.items():
        assert state[key].shape == t.shape, (key, state[key].shape, t.shape)
    experts_key = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(state[experts_key], ref[experts_key]), "the train step did not change the experts"

    fresh = copy.deepcopy(original)
    fresh.load_state_dict(state)                       # strict: same keys, same shapes
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, logits, rtol=1e-5, atol=1e-5)

    other = copy.deepcopy(original)                    # a full checkpoint loads at any EP size
    patch_model(other, groups_for(2, 1), backend="dedup")
    other.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, logits, rtol=1e-5, atol=1e-5)

    assert unpatch_model(model) == 2
    assert not any(isinstance(m, ExpertParallelMoE) for m in model.modules())
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]
    restored = model.state_dict()
    assert sorted(restored) == sorted(state)
    for key, t in state.items():
        assert torch.equal(restored[key], t), key
    with torch.no_grad():                              # runs alone: no collective any more
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
    return tuple(state[experts_key].shape)


def unpatch_gives_the_original(rank, world):
    """patch then unpatch, no training: bitwise the original parameters, classes and logits."""
    original = tiny_qwen3()
    model = copy.deepcopy(original)
    patch_model(model, groups_for(None, 2), backend="hierarchical")
    assert unpatch_model(model) == 2
    a, b = model.state_dict(), original.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert [type(m) for m in model.modules()] == [type(m) for m in original.modules()]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n, _ in original.named_parameters()}
    with torch.no_grad():
        assert torch.equal(model(_ids(rank)).logits, original(_ids(rank)).logits)
    return len(a)


def load_other_ranks_shard(rank, world):
    """A patched state_dict() is this rank's shard: it reloads on its own rank, another
    rank's shard is refused, and a full checkpoint loads (this rank's rows)."""
    original = tiny_qwen3()
    model = copy.deepcopy(original)
    groups = groups_for(None, 2)
    patch_model(model, groups)
    shard = model.state_dict()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    assert shard[key].shape[0] == 2 and "model.layers.0.mlp._extra_state" in shard
    target = copy.deepcopy(original)
    patch_model(target, groups)
    target.load_state_dict(shard)                      # its own shard
    shards = [None] * world
    dist.all_gather_object(shards, shard)
    try:
        target.load_state_dict(shards[0])              # "saved on rank 0, loaded everywhere"
        refused = None
    except er.ConfigMismatchError as err:
        refused = str(err)
    fresh = copy.deepcopy(original)
    patch_model(fresh, groups)
    with torch.no_grad():
        fresh.model.layers[0].mlp.experts.gate_up_proj.zero_()
    fresh.load_state_dict(original.state_dict())       # the unpatched checkpoint: rows sliced
    assert torch.equal(fresh.model.layers[0].mlp.experts.gate_up_proj,
                       original.model.layers[0].mlp.experts.gate_up_proj[2 * rank:2 * rank + 2])
    return refused


def _placement(seed: int, slots: int, world: int):
    """A ReplicaRouter for 8 experts on ``slots`` slots, planned from a skewed random load."""
    import numpy as np

    from expertrail.balance import ReplicaRouter, plan_placement
    load = np.random.default_rng(seed).gamma(0.5, 10, 8)
    return ReplicaRouter.from_placement(plan_placement(load, slots, world))


def block_with_replicas(rank, world, backend):
    """ExpertParallelMoE(replicas=...): the original block's outputs and gradients (each
    expert's gradient split over its slots), a rebalance that moves weights and optimizer
    state, and shards and full checkpoints under a placement."""
    original = tiny_block("qwen3_moe", torch.float32)
    groups = groups_for(None, 2)
    first = _placement(0, 12, world)
    ep = ExpertParallelMoE(copy.deepcopy(original), groups, backend, replicas=first)
    assert ep.dispatcher.num_experts == 12 and ep.experts.num_local_experts == 3
    assert torch.equal(ep.experts.down_proj.detach(), original.experts.down_proj[ep.local_experts()])
    x = torch.randn(1, 5 + rank, 32, generator=torch.Generator().manual_seed(rank))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = original(xa), ep(xb)
    yb.square().sum().backward()
    ya.square().sum().backward()
    # Each slot gets the gradient of the tokens routed to it: summed over an expert's slots
    # (on every rank) they give the original expert's gradient (summed over ranks).
    per_slot = torch.zeros(12, *original.experts.down_proj.shape[1:])
    per_slot[ep.first_expert:ep.first_expert + 3] = ep.experts.down_proj.grad
    dist.all_reduce(per_slot)
    want = original.experts.down_proj.grad.clone()
    dist.all_reduce(want)
    got = torch.zeros_like(want).index_add_(0, first.slot_experts, per_slot)
    for a, b in ((yb, ya), (xb.grad, xa.grad), (got, want)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    # Rebalance: weights and the optimizer's per-slot state move with their experts.
    opt = torch.optim.SGD(ep.experts.parameters(), lr=0.0, momentum=0.9)
    opt.step()
    for p in ep.experts.parameters():       # mark each slot's state with its logical expert
        opt.state[p]["momentum_buffer"] = ep.local_experts().view(-1, 1, 1).float().expand_as(p).clone()
    shard = {k: v.clone() for k, v in ep.state_dict().items()}
    second = _placement(1, 12, world)
    ep.set_replicas(second, opt)
    rows = ep.local_experts()
    assert torch.equal(rows, second.slot_experts[ep.first_expert:ep.first_expert + 3])
    assert torch.equal(ep.experts.gate_up_proj.detach(), original.experts.gate_up_proj[rows])
    for p in ep.experts.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"][:, 0, 0], rows.float())
    with torch.no_grad():
        torch.testing.assert_close(ep(x), ya.detach(), rtol=1e-5, atol=1e-5)
    full = ep.full_expert_weights()
    assert torch.equal(full[0], original.experts.gate_up_proj) and torch.equal(full[1], original.experts.down_proj)

    # Saving and loading: a shard needs its placement; a full checkpoint loads under any.
    try:
        ep.load_state_dict(shard)
        refused = None
    except er.ConfigMismatchError as err:
        refused = str(err)
    assert refused is not None and "another replica placement" in refused, refused
    other = ExpertParallelMoE(copy.deepcopy(original), groups, backend, replicas=first)
    other.load_state_dict(shard)
    fresh = ExpertParallelMoE(copy.deepcopy(original), groups, backend, replicas=second)
    with torch.no_grad():
        fresh.experts.down_proj.zero_()
    fresh.load_state_dict(original.state_dict())
    assert torch.equal(fresh.experts.down_proj, ep.experts.down_proj)
    with torch.no_grad():
        torch.testing.assert_close(other(x), ya.detach(), rtol=1e-5, atol=1e-5)
    return ep.first_expert


def patched_model_with_replicas(rank, world):
    """patch_model(replicas=[one per block]): the same logits as the original model."""
    model = tiny_qwen3()
    ep_model = copy.deepcopy(model)
    assert patch_model(ep_model, groups_for(None, 2), backend="hierarchical",
                       replicas=[_placement(2, 12, world), _placement(3, 16, world)]) == 2
    slots = [m.dispatcher.num_experts for m in ep_model.modules() if isinstance(m, ExpertParallelMoE)]
    with torch.no_grad():
        torch.testing.assert_close(ep_model(_ids(rank)).logits, model(_ids(rank)).logits, rtol=1e-5, atol=1e-5)
    return slots


def patched_model_overlapped(rank, world, backend):
    """A patch_model-ed tiny Qwen3-MoE: two-batch overlapped forwards and 1F1B overlapped
    training give the same bits as one micro-batch after another."""
    from expertrail.comm import schedule
    batches = [torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(10 * rank + m)) for m in range(3)]
    results = {}
    for overlap in (False, True):
        model = tiny_qwen3()
        patch_model(model, groups_for(None, 2), backend=backend)
        with torch.no_grad():
            logits = schedule.forward_interleaved(lambda ids: model(ids).logits, batches) if overlap else \
                [model(ids).logits for ids in batches]
        model.train()
        losses = schedule.train_micro_batches(lambda ids: model(ids, labels=ids).loss, batches, overlap=overlap)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        results[overlap] = (logits, losses, grads)
    (logits, losses, grads), (o_logits, o_losses, o_grads) = results[False], results[True]
    assert all(torch.equal(a, b) for a, b in zip(logits, o_logits))
    assert all(torch.equal(a, b) for a, b in zip(losses, o_losses))
    assert grads.keys() == o_grads.keys() and len(grads) > 5
    assert all(torch.equal(grads[n], o_grads[n]) for n in grads)
    return len(grads)


def ddp_over_patched_model(rank, world):
    """DistributedDataParallel(patch_model-ed model) just works: DDP leaves the experts alone
    (each rank keeps its own), the logits are the unpatched model's, and after backward the
    dense gradients (averaged by DDP) and the expert gradients (scaled by 1/world) are those
    of the mean loss over every rank's batch on one process."""
    from torch.nn.parallel import DistributedDataParallel
    original = tiny_qwen3()
    model = copy.deepcopy(original)
    patch_model(model, groups_for(None, 2))
    ddp = DistributedDataParallel(model.train())
    ids = _ids(rank)
    loss = ddp(ids, labels=ids).loss
    loss.backward()
    with torch.no_grad():
        torch.testing.assert_close(ddp(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    original.train()
    sum(original(_ids(r), labels=_ids(r)).loss for r in range(world)).div(world).backward()
    got = dict(model.named_parameters())
    dense = 0
    for name, p in original.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            first = 2 * rank
            want = p.grad[first:first + 2]
        else:
            want, dense = p.grad, dense + 1
        torch.testing.assert_close(got[name].grad, want, rtol=1e-4, atol=1e-6, msg=name)
    return dense


def patched_model_misuse(rank, world, tmp):
    """patch_model twice, save_pretrained on a patched model: clear errors on every rank;
    after unpatch_model save_pretrained works again."""
    model = tiny_qwen3()
    groups = groups_for(None, 2)
    patch_model(model, groups)
    texts = {}
    try:
        patch_model(model, groups, backend="dedup")
    except er.ConfigError as err:
        texts["twice"] = str(err)
    try:
        model.save_pretrained(tmp)
    except er.ConfigError as err:
        texts["save"] = str(err)
    unpatch_model(model)
    if rank == 0:
        model.save_pretrained(tmp)               # a plain model again
    dist.barrier()
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(tmp).eval()
    with torch.no_grad():
        assert torch.equal(loaded(_ids(rank)).logits, model(_ids(rank)).logits)
    return texts
