"""Benchmark routing: uniform, zipf, balanced and recorded files."""
import pytest
import torch

from expertrail.errors import ConfigError
from expertrail.tools.workload import make_routing


def test_uniform_routing_picks_distinct_experts_with_normalised_weights():
    idx, w = make_routing("uniform", 500, 16, 8, rank=1, world=4)
    assert idx.shape == (500, 8) and idx.dtype == torch.int64
    assert all(len(set(row)) == 8 for row in idx.tolist())
    torch.testing.assert_close(w.sum(1), torch.ones(500))
    counts = torch.bincount(idx.reshape(-1), minlength=16).float()
    assert counts.max() / counts.mean() < 1.3


def test_zipf_routing_makes_hot_experts():
    idx, _ = make_routing("zipf:1.2", 2000, 32, 2, rank=0, world=1)
    counts = torch.bincount(idx.reshape(-1), minlength=32)
    assert counts[0] > 4 * counts[16] and all(len(set(r)) == 2 for r in idx.tolist())


@pytest.mark.parametrize("tokens,experts,topk", [(64, 16, 8), (100, 12, 3)])
def test_balanced_routing_gives_every_expert_the_same_rows(tokens, experts, topk):
    counts = sum(torch.bincount(make_routing("balanced", tokens, experts, topk, r, 4)[0].reshape(-1),
                                minlength=experts) for r in range(4))
    assert counts.max() - counts.min() <= 1
    idx, _ = make_routing("balanced", tokens, experts, topk, 0, 4)
    assert all(len(set(row)) == topk for row in idx.tolist())


def test_routing_file_is_replayed_per_rank(tmp_path):
    recorded = torch.randint(0, 8, (2, 5, 2))
    path = tmp_path / "route.pt"
    torch.save(recorded, path)
    for rank in range(2):
        idx, w = make_routing(str(path), 5, 8, 2, rank, 2)
        assert torch.equal(idx, recorded[rank])
    with pytest.raises(ConfigError, match="holds 2 ranks, the run has 4"):
        make_routing(str(path), 5, 8, 2, 0, 4)
    with pytest.raises(ConfigError, match="top-k 2, but --topk is 3"):
        make_routing(str(path), 5, 8, 3, 0, 2)


def test_unknown_routing_is_a_clear_error():
    with pytest.raises(ConfigError, match="not uniform, zipf:<alpha>, balanced, nor an existing file"):
        make_routing("gaussian", 4, 8, 2, 0, 1)
    with pytest.raises(ConfigError, match="write zipf:<alpha>"):
        make_routing("zipf:hot", 4, 8, 2, 0, 1)
