"""The fixed-shape decode mode (``LowLatencyDispatcher``) on 4 real gloo ranks."""
import pytest
import torch

import lowlatency_ranks


@pytest.mark.parametrize("dtype,payload", [(torch.float32, "native"), (torch.bfloat16, "native"),
                                           (torch.bfloat16, "fp8")])
def test_lowlatency_gives_the_normal_modes_rows_and_outputs(world4, dtype, payload):
    assert world4.run(lowlatency_ranks.lowlatency_matches_normal, dtype, payload) == [6] * 4


@pytest.mark.parametrize("payload", ["native", "fp8"])
def test_lowlatency_without_host_sizes_gives_the_same_bits(world4, payload):
    """The expansion CUDA runs (fixed-size index map, dense copy positions), here on CPU."""
    assert world4.run(lowlatency_ranks.lowlatency_matches_normal, torch.bfloat16, payload, False) == [6] * 4


@pytest.mark.parametrize("metadata_on_host", [True, False])
def test_lowlatency_bad_input_on_one_rank_raises_on_every_rank(world4, metadata_on_host):
    results = world4.run(lowlatency_ranks.lowlatency_bad_input, metadata_on_host)
    assert "max_tokens_per_rank=4" in results[2][0]
    assert all(r[0] and "EP rank(s) 2" in r[0] for i, r in enumerate(results) if i != 2)
    assert all(r[1] == (4, 16) for r in results)
    assert all(r[2] and "topk_weights must have one dtype on every EP rank" in r[2] for r in results)
    for i, (bad_rank, text) in enumerate(((3, "values must be in [-1, 8) (num_experts=8, -1 = no expert), found 8"),
                                          (0, "found -2"),
                                          (1, "lists the same expert twice"))):
        assert text in results[bad_rank][3][i]
        assert all(f"EP rank(s) {bad_rank}" in r[3][i] for rank, r in enumerate(results) if rank != bad_rank)
    assert all(r[4] == (4, 16) for r in results)


def test_lowlatency_refuses_gradients_and_stale_results_on_every_rank(world4):
    results = world4.run(lowlatency_ranks.lowlatency_misuse)
    assert "x.requires_grad=True" in results[1]["grad x"] and "torch.no_grad()" in results[1]["grad x"]
    assert "expert_out.requires_grad=True" in results[0]["grad out"]
    assert "res.tokens: this LowLatencyResult is from dispatch call" in results[2]["stale tokens"]
    assert "overwritten" in results[3]["stale combine"] and "res.tokens.clone()" in results[3]["stale combine"]
    for rank, r in enumerate(results):
        assert r["no_grad"] is None and r["after"] is None
        assert r["stale tokens"] is not None                                 # every rank read a stale result
        for step, culprit in (("grad x", 1), ("stale combine", 3), ("grad out", 0)):
            if rank != culprit:
                assert f"invalid input on EP rank(s) {culprit}" in r[step], (rank, step, r[step])


def test_lowlatency_carries_bf16_fp64_and_fp16_routing_weights_exactly(world4):
    assert world4.run(lowlatency_ranks.lowlatency_weight_dtypes) == [[True] * 6] * 4


@pytest.mark.parametrize("metadata_on_host", [True, False])
def test_lowlatency_without_agreement_raises_on_the_bad_rank_alone_and_goes_on(world4, metadata_on_host):
    results = world4.run(lowlatency_ranks.lowlatency_errors_unagreed, metadata_on_host)
    shape, ids, healthy = results[1]
    assert "hidden=16" in shape and "found 9" in ids and healthy is None
    assert all(r == [None, None, None] for i, r in enumerate(results) if i != 1)


def test_fixed_blocks_travel_alike_through_either_transport(world4):
    from expertrail.comm.transport import COLLECTIVE_MAX_BLOCK_BYTES
    assert world4.run(lowlatency_ranks.fixed_blocks_both_transports) == [[3, COLLECTIVE_MAX_BLOCK_BYTES // 4 + 1]] * 4
