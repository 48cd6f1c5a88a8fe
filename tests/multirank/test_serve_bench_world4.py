"""Serving a Hugging Face MoE model: bucketed dispatch and live rebalancing, on 4 real gloo ranks."""
import pytest

import serve_bench_ranks

pytest.importorskip("transformers")


def test_bucketed_model_equals_normal_mode_bit_for_bit_and_agrees_once_per_forward(world4):
    results = world4.run(serve_bench_ranks.bucketed_model_matches_normal)
    modes, reduces = results[0]
    # the largest count of any rank picks: 4, 4, 9 -> 16, 20 -> normal, 16, 2 -> 4; then training
    assert modes == [4, 4, 16, "normal", 16, 4, "normal"]
    assert all(r[0] == modes for r in results)             # the same choice on every rank
    assert all(count == [1] * 6 for _, count in results)   # one all-reduce per forward, not per block


def test_bucketed_block_alone_agrees_per_call(world4):
    assert world4.run(serve_bench_ranks.bucketed_block_standalone) == [[8, 8, "normal"]] * 4


def test_bad_buckets_raise_on_every_rank(world4):
    results = world4.run(serve_bench_ranks.bad_buckets)
    assert "every bucket must be a positive int" in results[2]["not positive"]
    for rank, texts in enumerate(results):
        assert all(t is not None for t in texts.values()), (rank, texts)
        if rank != 2:
            assert "EP rank(s) [2]" in texts["not positive"]
        assert "ConfigMismatchError" in texts["differ"] and "rank 1=[8, 16]" in texts["differ"]
        assert "backend='dedup'" in texts["backend"]
        assert "ConfigMismatchError" in texts["empty on one rank"]


def test_serve_bench_tokens_identical_and_ranks_switch_at_the_same_step(world4):
    reports = world4.run(serve_bench_ranks.serve_small)
    first = reports[0]
    assert first["tokens_identical_detail"] == {"buckets_vs_normal": True, "rebalanced_vs_static": True}
    assert first["migrations"] > 0
    assert any(e[1] == "switch" for e in first["events"])
    assert all(r["events"] == first["events"] for r in reports)
    assert set(first["by_mode"]["buckets"]) == {"prefill:32", "decode:8"}   # 4 x 4 prompt tokens per rank
    assert set(first["by_mode"]["normal"]) == {"prefill:normal", "decode:normal"}


def test_early_finishers_keep_the_exchanges_going(world4):
    results = world4.run(serve_bench_ranks.early_finishers)
    for rank, (normal, served, events, steps) in enumerate(results):
        assert served == normal and len(normal[0]) == 4 + 3 + 2 * rank
        assert steps == results[-1][3] and events == results[0][2]      # every rank ran every forward


def test_bucketed_moe_layer_equals_normal_mode_bit_for_bit(world4):
    assert world4.run(serve_bench_ranks.bucketed_moe_layer) == [[8, 8, "normal", "normal"]] * 4
