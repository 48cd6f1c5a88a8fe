"""MoELayer on 4 real gloo ranks against the same MoE on one process."""
import pytest
import torch

import expertrail as er

import layer_ranks


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
@pytest.mark.parametrize("num_chunks,shared,alignment", [(1, True, 1), (2, False, 1), (1, False, 8)])
def test_moe_layer_matches_single_process_forward_and_backward(world4, backend, num_chunks, shared, alignment):
    results = world4.run(layer_ranks.moe_layer_matches_reference, backend, num_chunks, shared, alignment)
    ref_gate_up = sum(r[2] for r in results)
    ref_down = sum(r[3] for r in results)
    local = 8 // 4
    for rank, (gate_up, down, _, _) in enumerate(results):
        torch.testing.assert_close(gate_up, ref_gate_up[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(down, ref_down[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-5)


def test_expert_bias_update_uses_loads_of_every_rank(world4):
    biases = world4.run(layer_ranks.expert_bias_update_sums_loads)
    assert all(torch.equal(b, biases[0]) for b in biases)      # every replica updates alike


def test_experts_seeded_alike_are_the_same_model_at_any_ep_size(world4):
    assert world4.run(layer_ranks.moe_layer_seeded_alike) == [8] * 4       # and 8 distinct experts


LAYER_MISUSE = {
    "router": (er.ConfigMismatchError, "router.weight (ranks holding the same copy: [0, 1, 3], [2])"),
    "shared": (er.ConfigMismatchError, "shared_experts.gate_up_proj.weight (ranks holding the same copy: [0, 2, 3], [1])"),
    "first_expert": (er.ConfigError, "the experts of EP rank(s) [1, 2, 3] were built for other experts"),
    "ddp": (er.ConfigError, "Call expertrail.exclude_experts_from_ddp(model) before DistributedDataParallel(model)"),
}


@pytest.mark.parametrize("kind", sorted(LAYER_MISUSE))
def test_moe_layer_misuse_raises_on_every_rank(world4, kind):
    cls, text = LAYER_MISUSE[kind]
    errors = world4.run_expect_error(layer_ranks.moe_layer_misuse, kind)
    assert sorted(errors) == [0, 1, 2, 3]
    for rank, exc in errors.items():
        assert isinstance(exc, cls), repr(exc)
        own = "built with first_expert=0 (experts [0, 1]), but this rank holds experts" \
            if kind == "first_expert" and rank else text
        assert own in str(exc), str(exc)


def test_moe_layer_under_ddp_with_experts_excluded_scales_their_gradients(world4):
    assert world4.run(layer_ranks.moe_layer_misuse, "ddp_excluded") == [0.25] * 4
