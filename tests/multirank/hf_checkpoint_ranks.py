"""Functions run on every rank by tests/multirank/test_hf_checkpoint_world4.py: fn(rank, world, ...).

The checkpoints are written by transformers itself in the test process (`write_checkpoints`):
each rank loads its share with expertrail.hf.from_pretrained and compares with the whole model
loaded by plain transformers."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import expertrail as er
from expertrail.hf import ExpertParallelMoE, from_pretrained, save_pretrained, unpatch_model

from ranks_common import groups_for

VOCAB = 64


def tiny_model(kind: str):
    """A tiny random transformers MoE causal LM of ``kind`` (8 experts, top-2), seeded."""
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_key_value_heads=2, head_dim=8,
                                num_experts=8, mlp_only_layers=[], decoder_sparse_step=1, **common)
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=8, **common)
    elif kind == "deepseek_v3":            # one dense layer first, shared experts, the router's bias buffer
        common["num_hidden_layers"] = 3
        cfg = tf.DeepseekV3Config(intermediate_size=48, moe_intermediate_size=16, first_k_dense_replace=1,
                                  num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1,
                                  n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, **common)
    else:
        raise ValueError(kind)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():                  # larger weights than the init's, so that experts matter
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model


def write_checkpoints(root: str) -> dict[str, str]:
    """Checkpoints as transformers writes them, each in several shards: kind -> directory.
    ``fused``: Qwen3-MoE with its fused 3-D expert tensors (the model's own state dict) in two
    files with an index."""
    from safetensors.torch import save_file
    dirs = {}
    for kind in ("qwen3_moe", "mixtral", "deepseek_v3"):
        dirs[kind] = os.path.join(root, kind)
        tiny_model(kind).save_pretrained(dirs[kind], max_shard_size="40KB")
    model = tiny_model("qwen3_moe")
    fused = dirs["fused"] = os.path.join(root, "fused")
    model.config.save_pretrained(fused)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    halves = [dict(list(state.items())[:len(state) // 2]), dict(list(state.items())[len(state) // 2:])]
    weight_map = {}
    for i, part in enumerate(halves):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, os.path.join(fused, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    Path(fused, "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dirs


def _reference(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _prompt(rank: int, length: int | None = None) -> torch.Tensor:
    """[2, 3 + rank] token ids (ranks' prompts differ in content and length)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randint(3, VOCAB, (2, length or 3 + rank), generator=g)


def _placement(world: int, seed: int = 0):
    import numpy as np

    from expertrail.balance import ReplicaRouter, plan_placement
    load = np.random.default_rng(seed).gamma(0.5, 10, 8)
    return ReplicaRouter.from_placement(plan_placement(load, 12, world))


def load_and_compare(rank, world, path, backend="alltoall", ep_size=None, replicas=False):
    """from_pretrained at ``ep_size``: this rank's experts only, each slot from its logical
    expert, buffers computed; logits equal to the whole model's. Returns (E_local, slots)."""
    from expertrail.moe import hf_checkpoint
    groups = groups_for(ep_size, 1 if ep_size == 2 else 2)
    read, original = [], hf_checkpoint.Checkpoint.read

    def counted(self, jobs):                # the bytes this rank copies out of the checkpoint
        read.extend(target.numel() * target.element_size() for _, _, target in jobs)
        return original(self, jobs)
    hf_checkpoint.Checkpoint.read = counted
    try:
        model = from_pretrained(path, groups, backend, replicas=_placement(groups.ep_size) if replicas else None)
    finally:
        hf_checkpoint.Checkpoint.read = original
    reference = _reference(path)
    whole = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    mine = sum(t.numel() * t.element_size() for t in model.state_dict().values() if t.dtype != torch.int64)
    assert sum(read) == mine < whole, (sum(read), mine, whole)     # its experts and the replicated weights only
    blocks = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    full = dict(reference.named_parameters())
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            rows = m.local_experts()
            assert torch.equal(m.experts.gate_up_proj, full[f"{name}.experts.gate_up_proj"][rows]), name
            assert torch.equal(m.experts.down_proj, full[f"{name}.experts.down_proj"][rows]), name
    for (name, a), (_, b) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, b), name                    # rotary inv_freq computed, not garbage
    assert not model.training
    ids = _prompt(rank)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
    # Ready for training: the same loss, and gradients reach this rank's experts.
    loss, want = model.train()(ids, labels=ids).loss, reference.train()(ids, labels=ids).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert all(b.experts.gate_up_proj.grad is not None for b in blocks)
    return blocks[0].experts.num_local_experts, blocks[0].dispatcher.num_experts


def generate_like_the_whole_model(rank, world, path, backend="alltoall"):
    """generate on every rank, each its own prompt length and number of new tokens (ranks that
    finish first keep taking part), greedy and sampled with a shared seed: the whole model's
    tokens. Returns the number of new tokens each rank generated."""
    model = from_pretrained(path, groups_for(None, 2), backend)
    reference = _reference(path)
    ids = _prompt(rank)
    out = []
    for sample in (False, True):
        kwargs = dict(max_new_tokens=2 + 3 * rank, do_sample=sample, pad_token_id=0)
        if sample:
            kwargs.update(top_k=0, top_p=1.0, temperature=1.0)
        torch.manual_seed(11)
        got = model.generate(ids, **kwargs)
        torch.manual_seed(11)
        want = reference.generate(ids, **kwargs)
        assert torch.equal(got, want), (sample, got, want)
        out.append(got.shape[1] - ids.shape[1])
    # An end-of-sequence token that rank 0's greedy run meets early: it stops, the others go on.
    ids = ids[:1]
    greedy = reference.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eos = int(greedy[0, ids.shape[1] + 1]) if rank == 0 else -1
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=eos if rank == 0 else 2)
    got, want = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    assert torch.equal(got, want), (got, want)
    return out + [got.shape[1] - ids.shape[1]]


def save_and_reload(rank, world, path, out, backend="alltoall", replicas=False, ep_size=None):
    """save_pretrained from every rank (each its experts), then plain transformers
    from_pretrained of the result: the same tensors and logits as the original checkpoint.
    Returns the names of the files this directory holds."""
    from transformers import AutoModelForCausalLM
    groups = groups_for(ep_size, 1 if ep_size == 2 else 2)
    model = from_pretrained(path, groups, backend, replicas=_placement(groups.ep_size, 1) if replicas else None)
    save_pretrained(model, out, max_shard_size="30KB")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = _reference(path)
    want = reference.state_dict()
    got = reloaded.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    ids = _prompt(rank)
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, reference(ids).logits)
    unpatch_model(model)                                   # the plain transformers model again
    for k, t in model.state_dict().items():
        assert torch.equal(t, want[k]), k
    saved = json.loads(Path(out, "model.safetensors.index.json").read_text())["weight_map"]
    original = json.loads(Path(path, "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(saved) == sorted(original)               # the names transformers itself writes
    dist.barrier()
    return sorted(os.listdir(out))


def load_expecting_error(rank, world, path, how):
    """from_pretrained of a bad checkpoint or a bad setup: must raise (on every rank)."""
    groups = groups_for(None, 2)
    if how == "unreadable_on_one_rank":
        path = path if rank != 2 else path + "-missing"
    elif how == "another_on_one_rank":
        path = path if rank != 1 else path.replace("qwen3_moe", "mixtral")
    from_pretrained(path, groups)


def write_bad_checkpoints(dirs: dict[str, str], root: str) -> dict[str, str]:
    """Broken copies of the Qwen3-MoE checkpoint: how -> directory."""
    import shutil

    from safetensors.torch import save_file
    good = dirs["qwen3_moe"]
    out = {}

    def copy(how, edit_config=None, edit_index=None):
        out[how] = os.path.join(root, how)
        shutil.copytree(good, out[how])
        if edit_config:
            cfg = json.loads(Path(out[how], "config.json").read_text())
            edit_config(cfg)
            Path(out[how], "config.json").write_text(json.dumps(cfg))
        if edit_index:
            index = json.loads(Path(out[how], "model.safetensors.index.json").read_text())
            edit_index(index["weight_map"])
            Path(out[how], "model.safetensors.index.json").write_text(json.dumps(index))

    def drop(weight_map):              # one expert's up projection and a norm are not listed
        del weight_map["model.layers.1.mlp.experts.5.up_proj.weight"], weight_map["model.norm.weight"]

    def add(weight_map):
        save_file({"model.layers.0.mlp.extra_bias": torch.zeros(8)}, os.path.join(out["extra"], "extra.safetensors"))
        weight_map["model.layers.0.mlp.extra_bias"] = "extra.safetensors"

    copy("missing", edit_index=drop)
    copy("extra", edit_index=add)
    copy("shapes", edit_config=lambda c: c.update(moe_intermediate_size=24))
    copy("six_experts", edit_config=lambda c: c.update(num_local_experts=6))
    # Qwen3-MoE's config.json over Mixtral's tensors: a checkpoint of another model.
    out["other_model"] = os.path.join(root, "other_model")
    shutil.copytree(dirs["mixtral"], out["other_model"])
    shutil.copy(os.path.join(good, "config.json"), out["other_model"])
    return out
