"""MoELayer on 4 real gloo ranks against the same MoE on one process."""
import pytest
import torch

import expertrail as er

import workers


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
@pytest.mark.parametrize("num_chunks,shared,alignment", [(1, True, 1), (2, False, 1), (1, False, 8)])
def test_moe_layer_matches_single_process_forward_and_backward(world4, backend, num_chunks, shared, alignment):
    results = world4.run(workers.moe_layer_matches_reference, backend, num_chunks, shared, alignment)
    ref_gate_up = sum(r[2] for r in results)
    ref_down = sum(r[3] for r in results)
    local = 8 // 4
    for rank, (gate_up, down, _, _) in enumerate(results):
        torch.testing.assert_close(gate_up, ref_gate_up[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(down, ref_down[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-5)


def test_expert_bias_update_uses_loads_of_every_rank(world4):
    biases = world4.run(workers.expert_bias_update_sums_loads)
    assert all(torch.equal(b, biases[0]) for b in biases)      # every replica updates alike
