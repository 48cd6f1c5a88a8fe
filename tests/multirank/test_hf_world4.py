"""transformers MoE blocks made expert parallel: equal to the original block, on 4 gloo ranks."""
import pytest
import torch

import expertrail as er

import hf_ranks

pytest.importorskip("transformers")


def _check_expert_grads(results, ep_size):
    """Each rank's expert gradients equal the sum over its EP group's ranks of the original's."""
    for group_start in range(0, 4, ep_size):
        members = results[group_start:group_start + ep_size]
        ref_gate_up = sum(r[3] for r in members)
        ref_down = sum(r[4] for r in members)
        for first, gate_up, down, *_ in members:
            local = gate_up.shape[0]
            torch.testing.assert_close(gate_up, ref_gate_up[first:first + local], rtol=2e-4, atol=2e-4)
            torch.testing.assert_close(down, ref_down[first:first + local], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3", "ernie4_5_moe", "olmoe"])
@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_hf_block_equals_original_fp32_ep2_and_ep4(world4, kind, backend):
    for ep_size in (2, 4):
        results = world4.run(hf_ranks.hf_block_matches, kind, backend, ep_size)
        assert results[1][5] == 0                     # a rank with no tokens took part
        _check_expert_grads(results, ep_size)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3", "ernie4_5_moe", "olmoe"])
@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_hf_block_equals_original_bf16(world4, kind, backend):
    for ep_size in (2, 4):
        world4.run(hf_ranks.hf_block_matches, kind, backend, ep_size, torch.bfloat16)


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_hf_block_in_overlapped_chunks_equals_original(world4, kind):
    """num_chunks > 1: the routed part in chunks whose transfers overlap (as MoELayer's), the
    same outputs and gradients."""
    for backend in ("alltoall", "hierarchical"):
        results = world4.run(hf_ranks.hf_block_matches, kind, backend, 4, torch.float32, 3)
        _check_expert_grads(results, 4)


def test_patch_model_replaces_every_moe_block(world4):
    assert world4.run(hf_ranks.patched_model_counts) == [(2, 2)] * 4


WEIGHT_MISMATCHES = {
    # how -> text every rank's error must contain
    "unseeded": ["model.layers.0.mlp: gate.weight", "model.layers.1.mlp:", "experts.gate_up_proj",
                 "ranks holding the same copy: [0], [1], [2], [3]", "seed every rank the same"],
    "one_bit": ["model.layers.1.mlp: experts.gate_up_proj differ (ranks holding the same copy: [0, 1, 3], [2])"],
    "block": ["DeepseekV3MoE: shared_experts.down_proj.weight differ (ranks holding the same copy: [0, 2, 3], [1])"],
}


@pytest.mark.parametrize("how", sorted(WEIGHT_MISMATCHES))
def test_patch_refuses_ranks_with_different_weights(world4, how):
    errors = world4.run_expect_error(hf_ranks.patch_with_differing_weights, how)
    for exc in errors.values():
        assert isinstance(exc, er.ConfigMismatchError), repr(exc)
        for text in WEIGHT_MISMATCHES[how]:
            assert text in str(exc), str(exc)
    if how == "one_bit":
        assert "layers.0" not in str(errors[0])


UNSUPPORTED = {
    "dense_llama": (er.ConfigError, "found no transformers-5 sparse MoE block in LlamaForCausalLM"),
    "qwen2_moe": (er.ConfigError, "model.layers.0.mlp (Qwen2MoeSparseMoeBlock): the block has submodules "
                                  "['shared_expert', 'shared_expert_gate']"),
    "layers_differ": (er.ConfigMismatchError, "MoE blocks found: rank 0=2, rank 1=2, rank 2=2, rank 3=1"),
}


@pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
def test_patch_refuses_models_it_cannot_reproduce_on_every_rank(world4, kind):
    cls, text = UNSUPPORTED[kind]
    errors = world4.run_expect_error(hf_ranks.patch_unsupported_model, kind)
    for exc in errors.values():
        assert isinstance(exc, cls) and text in str(exc), repr(exc)


def test_full_state_dict_loads_into_the_unpatched_model_and_unpatch_round_trips(world4):
    assert world4.run(hf_ranks.save_and_load_round_trip) == [(8, 32, 32)] * 4


def test_unpatch_gives_back_the_original_model(world4):
    world4.run(hf_ranks.unpatch_gives_the_original)


def test_state_dict_shard_of_another_rank_is_refused(world4):
    refused = world4.run(hf_ranks.load_other_ranks_shard)
    assert refused[0] is None                     # rank 0 loads its own shard
    for message in refused[1:]:
        assert "this state dict holds experts [0, 2) of 8" in message and "full_state_dict" in message, message


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_hf_block_with_replicas_equals_original_and_rebalances(world4, backend):
    """replicas= on the HF block: hot experts on several slots, the original's outputs and
    gradients; set_replicas moves weights and optimizer state; checkpoints under a placement."""
    assert world4.run(hf_ranks.block_with_replicas, backend) == [0, 3, 6, 9]


def test_patch_model_with_a_placement_per_block(world4):
    assert world4.run(hf_ranks.patched_model_with_replicas) == [[12, 16]] * 4


@pytest.mark.parametrize("backend", ["alltoall", "hierarchical"])
def test_patched_model_overlaps_micro_batches_with_the_same_bits(world4, backend):
    assert all(n > 5 for n in world4.run(hf_ranks.patched_model_overlapped, backend))


def test_ddp_over_a_patched_model_keeps_each_ranks_experts_and_the_gradients_right(world4):
    assert all(n > 5 for n in world4.run(hf_ranks.ddp_over_patched_model))


def test_patching_twice_and_save_pretrained_of_a_patched_model_are_refused(world4, tmp_path):
    for texts in world4.run(hf_ranks.patched_model_misuse, str(tmp_path)):
        assert "already expert parallel (2 blocks patched, e.g. model.layers.0.mlp)" in texts["twice"]
        assert "unpatch_model(model) first" in texts["twice"]
        assert "would write this rank's experts only" in texts["save"] and "full_state_dict" in texts["save"]
