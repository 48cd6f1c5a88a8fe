"""Make a transformers Qwen3-MoE model expert parallel over 4 local CPU ranks.

    python examples/hf_expert_parallel.py

Builds a tiny random Qwen3-MoE (no download), patches every sparse MoE block with
`expertrail.hf.patch_model`, and checks the logits and one training step's gradients
against the unpatched model on every rank.
"""
import copy

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import expertrail as er
from expertrail.hf import patch_model


def run(rank: int, world: int) -> float:
    torch.manual_seed(0)                                    # the same model on every rank
    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    model = Qwen3MoeForCausalLM(config)
    ep_model = copy.deepcopy(model)
    groups = er.EPGroups.from_default(domain_size=2)
    blocks = patch_model(ep_model, groups, backend="hierarchical")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(rank))   # this rank's batch
    ref = model(ids, labels=ids)
    out = ep_model(ids, labels=ids)
    ref.loss.backward()
    out.loss.backward()
    err = (out.logits - ref.logits).abs().max().item()
    emb = (ep_model.model.embed_tokens.weight.grad - model.model.embed_tokens.weight.grad).abs().max().item()
    if rank == 0:
        print(f"{blocks} MoE blocks expert parallel over {groups.ep_size} ranks ({8 // groups.ep_size} experts each); "
              f"max |logits - original| = {err:.1e}, max |embedding grad - original| = {emb:.1e}")
    return max(err, emb)


if __name__ == "__main__":
    from expertrail.launch import LocalRanks
    with LocalRanks(4) as ranks:
        errors = ranks.run(run)
    assert max(errors) < 1e-4, errors
    print("ok")
