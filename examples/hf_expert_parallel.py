"""Make a transformers Qwen3-MoE model expert parallel over 4 local CPU ranks.

    python examples/hf_expert_parallel.py

Builds a tiny random Qwen3-MoE (no download), patches every sparse MoE block with
`expertrail.hf.patch_model`, and checks the logits and one training step's gradients
against the unpatched model on every rank. Then it takes the step, saves the checkpoint of
the unpatched model (`full_state_dict`), loads it into a plain transformers model, and turns
the patched model back (`unpatch_model`): all three give the same logits.
"""
import copy
import os
import tempfile

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import expertrail as er
from expertrail.hf import ExpertParallelMoE, full_state_dict, patch_model, unpatch_model


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

    # One SGD step on the mean of the ranks' losses. A rank's expert gradients already sum over
    # every rank's tokens; the replicated rest (attention, routers...) must be summed over the
    # ranks, as DDP would, or the replicas drift apart and no single checkpoint holds them.
    sharded = {id(p) for m in ep_model.modules() if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
    with torch.no_grad():
        for p in ep_model.parameters():
            if p.grad is not None:
                if id(p) not in sharded:
                    torch.distributed.all_reduce(p.grad)
                p -= 0.1 * p.grad / world
        trained = ep_model(ids).logits
    state = full_state_dict(ep_model)                      # collective: original keys, all 8 experts
    path = os.path.join(tempfile.gettempdir(), f"expertrail-hf-example-{os.getppid()}.pt")
    if rank == 0:
        torch.save(state, path)                             # one file, loadable without expertrail
    torch.distributed.barrier()
    plain = Qwen3MoeForCausalLM(config)
    plain.load_state_dict(torch.load(path))
    unpatch_model(ep_model)                                 # collective: plain transformers blocks again
    with torch.no_grad():
        saved = (plain(ids).logits - trained).abs().max().item()
        back = (ep_model(ids).logits - trained).abs().max().item()
    torch.distributed.barrier()
    if rank == 0:
        os.remove(path)
        print(f"after a step: checkpoint loaded into the plain model: max |logits diff| = {saved:.1e}; "
              f"unpatched: {back:.1e}")
    return max(err, emb, saved, back)


if __name__ == "__main__":
    from expertrail.emulation.launch import LocalRanks
    with LocalRanks(4) as ranks:
        errors = ranks.run(run)
    assert max(errors) < 1e-4, errors
    print("ok")
