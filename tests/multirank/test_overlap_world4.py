"""Two micro-batches in flight (`expertrail.comm.schedule`) on 4 real gloo ranks: the same bits as
one micro-batch after another."""
import pytest
import torch

import expertrail as er

import overlap_ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_overlapped_micro_batches_give_the_same_losses_and_gradients(world4, backend, dtype):
    for per_rank in world4.run(overlap_ranks.overlap_matches_sequential, backend, dtype):
        losses, grads = per_rank["sequential"]
        assert len(grads) > 10 and all(g.abs().sum() > 0 for g in grads.values())
        for variant in ("overlap+delay", "overlap"):
            other_losses, other_grads = per_rank[variant]
            assert torch.equal(other_losses, losses), variant
            assert other_grads.keys() == grads.keys()
            for name, g in grads.items():
                assert torch.equal(other_grads[name], g), f"{variant}: {name}"


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_a_dispatch_backward_posts_the_weights_gradients_before_it_waits(world4, backend):
    for events, weights_got_gradients in world4.run(overlap_ranks.dispatch_backward_posts_before_it_waits, backend):
        assert weights_got_gradients
        assert events == ["combine backward", "weights posted", "dispatch backward"]
