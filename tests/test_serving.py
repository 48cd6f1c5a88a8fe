"""Single-process parts of the serving loop: drifting traffic, load-weighted replica choice."""
import numpy as np
import pytest
import torch

from expertrail.balance import ReplicaRouter, plan_placement
from expertrail.balance.replicas import balanced_shares
from expertrail.errors import ConfigError
from expertrail.tools.commands.serve_sim import ServeConfig
from expertrail.tools.serving import DriftingZipf


def test_drifting_zipf_is_seeded_and_moves_its_hot_experts_every_period():
    t = DriftingZipf(16, 4, alpha=1.2, drift_every=10, seed=1)
    assert torch.equal(t.ranking(0), t.ranking(9)) and not torch.equal(t.ranking(9), t.ranking(10))
    assert torch.allclose(t.popularity(3).sum(), torch.tensor(1.0, dtype=torch.float64))
    x, idx, w = t.batch(3, rank=2, tokens=4000, hidden=8)
    x2, idx2, _ = DriftingZipf(16, 4, 1.2, 10, seed=1).batch(3, rank=2, tokens=4000, hidden=8)
    assert torch.equal(x, x2) and torch.equal(idx, idx2)                    # same seed, step, rank: same batch
    assert not torch.equal(idx, t.batch(3, rank=1, tokens=4000, hidden=8)[1])
    assert (idx.sort(1).values.diff(1) > 0).all()                           # K distinct experts per token
    torch.testing.assert_close(w.sum(1), torch.ones(4000))
    counts = torch.bincount(idx.reshape(-1), minlength=16)
    assert counts.argmax() == t.ranking(3)[0]                               # the hottest expert leads


def test_balanced_shares_never_load_the_busiest_rank_more_than_equal_shares():
    rng = np.random.default_rng(0)
    for trial in range(20):
        load = rng.gamma(0.4, 100, 12)
        placement = plan_placement(rng.gamma(0.4, 100, 12), 16, 4)         # planned for other loads
        equal = ReplicaRouter.from_placement(placement)
        weighted = ReplicaRouter.from_placement(placement, load=load)
        assert weighted.rank_loads(load, 4).max() <= equal.rank_loads(load, 4).max() * (1 + 1e-9)
        shares = balanced_shares(load, placement.log_to_phys[0], placement.replicas[0], 4)
        np.testing.assert_allclose(shares.sum(1), 1.0)
        assert (shares[placement.log_to_phys[0] < 0] == 0).all()


def test_weighted_choice_follows_the_shares_and_is_deterministic():
    placement = plan_placement(np.array([90.0, 5.0, 3.0, 2.0]), 8, 4)
    router = ReplicaRouter.from_placement(placement)
    shares = (placement.log_to_phys[0] >= 0) * 1.0
    shares[0, :placement.replicas[0, 0]] = np.linspace(1, 2, placement.replicas[0, 0])
    shares /= shares.sum(1, keepdims=True)
    weighted = ReplicaRouter(router.log_to_phys, router.replicas, shares=shares)
    idx = torch.zeros(20000, 1, dtype=torch.long)
    first = weighted(idx, first_position=123)
    assert torch.equal(first, weighted(idx.clone(), first_position=123))
    used = torch.bincount(first[:, 0], minlength=8)[torch.as_tensor(placement.log_to_phys[0, 0][:placement.replicas[0, 0]])]
    np.testing.assert_allclose(used.numpy() / 20000, shares[0, :placement.replicas[0, 0]], atol=0.01)
    assert weighted.digest() != router.digest()


@pytest.mark.parametrize("field,value", [("experts", 30), ("redundant", 3), ("topk", 64), ("min_gain", 1.0),
                                         ("rebalance_every", 0)])
def test_serve_config_names_the_bad_option(field, value):
    with pytest.raises(ConfigError, match=f"--{field.replace('_', '-')}"):
        ServeConfig(**{field: value}).check()
