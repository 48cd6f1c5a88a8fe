"""Hot-expert replication on 4 real gloo ranks: same outputs, predicted relief, exact migration."""
import pytest

import expertrail as er

import balance_ranks


@pytest.mark.parametrize("backend", sorted(er.BACKENDS))
def test_replicated_layer_matches_and_relieves_the_busiest_rank(world4, backend):
    results = world4.run(balance_ranks.replicated_layer, backend)
    before = max(r[0] for r in results)
    after = max(r[1] for r in results)
    predicted = results[0][2] / results[0][3]
    assert before == results[0][2]                       # the contiguous count is exact
    assert abs((before / after) / predicted - 1) <= 0.10, (before, after, predicted)
    assert predicted > 1.5                               # the skew was worth balancing
    import torch
    assert all(torch.equal(r[4], results[0][4]) for r in results)   # same token, same replica, every rank


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weight_migration_is_exact_and_minimal(world4, seed):
    moved = world4.run(balance_ranks.migration_is_exact, seed)
    assert sum(moved) > 0


def test_rebalance_from_recorded_loads_keeps_outputs(world4):
    results = world4.run(balance_ranks.rebalance_keeps_outputs)
    total, replicas = results[0]
    assert total == 4 * 2 * 64 * 2                       # 4 ranks x 2 steps x 64 tokens x top-2
    assert all(r == results[0] for r in results) and max(replicas) > 1


def test_placements_that_differ_between_ranks_raise_everywhere(world4):
    errors = world4.run_expect_error(balance_ranks.placement_mismatch)
    assert all(isinstance(e, er.ConfigMismatchError) and "placement_crc32" in str(e) for e in errors.values())
