"""transformers MoE blocks made expert parallel: equal to the original block, on 4 gloo ranks."""
import pytest
import torch

import expertrail as er

import workers

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


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_hf_block_equals_original_fp32_ep2_and_ep4(world4, kind, backend):
    for ep_size in (2, 4):
        results = world4.run(workers.hf_block_matches, kind, backend, ep_size)
        assert results[1][5] == 0                     # a rank with no tokens took part
        _check_expert_grads(results, ep_size)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_hf_block_equals_original_bf16(world4, kind, backend):
    for ep_size in (2, 4):
        world4.run(workers.hf_block_matches, kind, backend, ep_size, torch.bfloat16)


def test_patch_model_replaces_every_moe_block(world4):
    assert world4.run(workers.patched_model_counts) == [(2, 2)] * 4
