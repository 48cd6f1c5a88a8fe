"""Hugging Face checkpoints at real sizes on 4 gloo ranks: each rank loads and saves only its
share (expertrail.hf.from_pretrained / save_pretrained), with the whole model's logits and tokens.

The checkpoints are tiny random Qwen3-MoE, Mixtral and DeepSeek-V3 models that transformers
itself saves in several shards (per-expert tensors), plus Qwen3-MoE with fused 3-D experts.
GPT-OSS is not among them: its block (GptOssMLP: a `router`, experts with biases and a clamped
SwiGLU) is not one the adapter reproduces (hf.why_unsupported says so)."""
import pytest

import expertrail as er

import hf_checkpoint_ranks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_checkpoint_ranks.write_checkpoints(str(tmp_path_factory.mktemp("hf_checkpoints")))


@pytest.mark.parametrize("kind, backend", [("qwen3_moe", "alltoall"), ("mixtral", "hierarchical"),
                                           ("deepseek_v3", "dedup"), ("fused", "allgather")])
def test_from_pretrained_reads_its_experts_and_gives_the_whole_models_logits(world4, checkpoints, kind, backend):
    assert world4.run(hf_checkpoint_ranks.load_and_compare, checkpoints[kind], backend) == [(2, 8)] * 4


def test_from_pretrained_at_ep2_and_with_replicas_loads_each_slot_from_its_expert(world4, checkpoints):
    assert world4.run(hf_checkpoint_ranks.load_and_compare, checkpoints["deepseek_v3"], "alltoall", 2) == [(4, 8)] * 4
    assert world4.run(hf_checkpoint_ranks.load_and_compare, checkpoints["mixtral"], "dedup", None, True) \
        == [(3, 12)] * 4


@pytest.mark.parametrize("kind, replicas, ep_size", [("mixtral", False, None), ("deepseek_v3", True, None),
                                                     ("qwen3_moe", False, 2)])
def test_save_pretrained_writes_each_ranks_share_and_transformers_loads_it(world4, checkpoints, tmp_path, kind,
                                                                          replicas, ep_size):
    """Each rank of the EP group writes its files; at EP 2 of 4 ranks one EP group writes."""
    files = world4.run(hf_checkpoint_ranks.save_and_reload, checkpoints[kind], str(tmp_path / "saved"), "alltoall",
                       replicas, ep_size)
    assert all(f == files[0] for f in files) and "model.safetensors.index.json" in files[0]
    assert sum(f.endswith(".safetensors") for f in files[0]) >= (ep_size or 4)      # a file per writing rank


@pytest.mark.parametrize("kind, backend", [("qwen3_moe", "alltoall"), ("deepseek_v3", "hierarchical")])
def test_generate_gives_the_whole_models_tokens_while_early_finishers_keep_taking_part(world4, checkpoints, kind,
                                                                                      backend):
    # new tokens per rank: greedy, sampled (max_new_tokens 2 + 3 * rank), greedy with an eos rank 0 meets at once
    done = world4.run(hf_checkpoint_ranks.generate_like_the_whole_model, checkpoints[kind], backend)
    assert [d[:2] for d in done] == [[2, 2], [5, 5], [8, 8], [11, 11]]
    assert done[0][2] < max(d[2] for d in done) == 8          # rank 0 stopped first, others went on


BAD = {
    # how -> text every rank's ConfigError must contain
    "missing": ["2 tensors of Qwen3MoeForCausalLM are missing from the checkpoint: model.norm.weight, "
                "model.layers.1.mlp.experts.<e>.up_proj.weight for experts 5"],
    "extra": ["1 checkpoint tensors have no place in Qwen3MoeForCausalLM: model.layers.0.mlp.extra_bias"],
    "shapes": ["shapes do not match the config: model.layers.0.mlp.experts.0.gate_proj.weight (16, 32), "
               "expected (24, 32)"],
    "other_model": ["model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.mlp.gate.weight",
                    "the files hold another model than config.json describes"],
    "six_experts": ["the EP size 4 does not divide the experts per MoE block ([6])", "ep_size"],
    "unreadable_on_one_rank": ["on rank(s) 2: cannot read the checkpoint at path=", "qwen3_moe-missing",
                               "every rank must be able to read the same checkpoint"],
}


def test_bad_checkpoints_are_refused_on_every_rank_by_name(world4, checkpoints, tmp_path):
    bad = hf_checkpoint_ranks.write_bad_checkpoints(checkpoints, str(tmp_path))
    bad["unreadable_on_one_rank"] = bad["another_on_one_rank"] = checkpoints["qwen3_moe"]
    errors = world4.run_expect_error(hf_checkpoint_ranks.load_expecting_error, bad["another_on_one_rank"],
                                     "another_on_one_rank")
    for exc in errors.values():
        assert isinstance(exc, er.ConfigMismatchError), repr(exc)
        assert "config.json (crc32)" in str(exc) and "every rank of the group must pass the same" in str(exc)
    for how, texts in BAD.items():
        errors = world4.run_expect_error(hf_checkpoint_ranks.load_expecting_error, bad[how], how)
        for exc in errors.values():
            assert isinstance(exc, er.ConfigError) and str(exc) == str(errors[0]), repr(exc)
            for text in texts:
                assert text in str(exc), (how, str(exc))
