"""Rebalance planning: hand-checked cases, invariants, kept slots, the published bar."""
import numpy as np
import pytest

from expertrail.balance.planner import (balancedness, contiguous_balancedness, plan_placement, rank_loads,
                                        zipf_load)
from expertrail.errors import ConfigError, InvalidInputError


def check_invariants(p, experts, slots, ranks):
    assert p.phys_to_log.shape[1] == slots
    assert (p.replicas.sum(1) == slots).all()
    for layer in range(p.phys_to_log.shape[0]):
        assert set(p.phys_to_log[layer]) == set(range(experts))            # every expert has a slot
        for r in range(ranks):
            on_rank = p.phys_to_log[layer].reshape(ranks, -1)[r]
            assert len(set(on_rank)) == len(on_rank)                       # no two replicas on one rank
        for e in range(experts):                                           # log_to_phys is the inverse
            where = p.log_to_phys[layer, e][p.log_to_phys[layer, e] >= 0]
            assert sorted(where) == sorted(np.nonzero(p.phys_to_log[layer] == e)[0])


def test_hand_checked_case():
    # Loads 8, 1, 1, 2 on 6 slots of 2 ranks: expert 0 takes the first extra slot (8 -> 4 + 4);
    # it cannot take a third (2 ranks), so expert 3 takes the second. Packing, heaviest first:
    # 0 -> r0, 0 -> r1, 1 -> r0, 2 -> r1, 3 -> r0, 3 -> r1: both ranks carry 6 tokens.
    load = np.array([8.0, 1.0, 1.0, 2.0])
    p = plan_placement(load, num_slots=6, num_ranks=2)
    assert p.replicas.tolist() == [[2, 1, 1, 2]]
    assert p.phys_to_log.tolist() == [[0, 1, 3, 0, 2, 3]]
    check_invariants(p, 4, 6, 2)
    assert rank_loads(load, p).tolist() == [[6.0, 6.0]]
    assert balancedness(rank_loads(load, p))[0] == 1.0


def test_replicas_go_to_the_highest_load_per_replica():
    p = plan_placement(np.array([[10.0, 6.0, 1.0, 1.0]]), num_slots=6, num_ranks=2)
    # extra slot 1: expert 0 (10 -> 5/replica); extra slot 2: expert 1 (6 > 5).
    assert p.replicas.tolist() == [[2, 2, 1, 1]]


@pytest.mark.parametrize("policy,domains,groups", [("global", 1, None), ("hierarchical", 2, 4), ("hierarchical", 4, 8)])
def test_invariants_on_random_loads(policy, domains, groups):
    load = np.random.default_rng(0).gamma(0.5, 100.0, (3, 32))
    p = plan_placement(load, num_slots=40, num_ranks=8, policy=policy, num_domains=domains, num_groups=groups)
    check_invariants(p, 32, 40, 8)
    if policy == "hierarchical":          # replicas stay inside their group's domain
        slots_per_domain = 40 // domains
        for layer in range(3):
            for d in range(domains):
                experts = set(p.phys_to_log[layer, d * slots_per_domain:(d + 1) * slots_per_domain])
                groups_here = {e // (32 // groups) for e in experts}
                assert len(groups_here) == groups // domains


def test_unchanged_slots_stay_in_place():
    load = zipf_load(4, 64, 1.0)
    first = plan_placement(load, 72, 8)
    again = plan_placement(load, 72, 8, current=first.phys_to_log)
    assert np.array_equal(again.phys_to_log, first.phys_to_log)
    # Shuffle the current placement's ranks and slots: the plan keeps experts where they are.
    shuffled = first.phys_to_log.reshape(4, 8, 9)[:, ::-1, ::-1].reshape(4, 72)
    kept = plan_placement(load, 72, 8, current=shuffled)
    assert np.array_equal(kept.phys_to_log, shuffled)
    check_invariants(kept, 64, 72, 8)


def test_zipf_bar_global_policy():
    load = zipf_load(1, 256, 1.0)
    p = plan_placement(load, 288, 32)
    assert balancedness(rank_loads(load, p))[0] >= 0.95
    assert contiguous_balancedness(load, 32)[0] < 0.3


def test_bad_arguments():
    with pytest.raises(ConfigError, match="multiple of num_ranks"):
        plan_placement(np.ones(8), 10, 4)
    with pytest.raises(ConfigError, match="policy='random'"):
        plan_placement(np.ones(8), 8, 4, policy="random")
    with pytest.raises(ConfigError, match="cannot hold"):
        plan_placement(np.ones(8), 4, 4)


@pytest.mark.parametrize("load,message", [
    ([[4.0, -1.0, 2.0, 3.0]], r"load: 1 negative count\(s\), the first -1 at layer 0, expert 1; token counts must be "
                              r"finite and >= 0"),
    ([[4.0, 1.0], [np.nan, 2.0]], r"1 non-finite \(NaN or inf\) count\(s\), the first nan at layer 1, expert 0"),
    ([[np.inf, 1.0, 1.0, 1.0]], r"the first inf at layer 0, expert 0"),
    (np.ones((2, 2, 4)), r"expected token counts \[layers, experts\] \(or \[experts\]\) .*got shape \[2, 2, 4\]"),
    (np.ones((1, 0)), r"with at least one expert, got shape \[1, 0\]"),
])
def test_loads_must_be_finite_non_negative_counts(load, message):
    for call in (lambda: plan_placement(load, 4, 2), lambda: contiguous_balancedness(load, 2),
                 lambda: rank_loads(load, plan_placement(np.ones(4), 4, 2))):
        with pytest.raises(InvalidInputError, match=message) as err:
            call()
        assert isinstance(err.value, ValueError)


def test_a_layer_without_tokens_is_planned_as_equal_loads():
    """All zeros says nothing about which experts are hot: the extra slots spread evenly (not all
    onto expert 0), and the other layers plan as they would alone."""
    skewed = np.array([8.0, 1.0, 1.0, 2.0, 0.0, 3.0, 1.0, 1.0])
    p = plan_placement(np.stack([np.zeros(8), skewed]), num_slots=12, num_ranks=4)
    check_invariants(p, 8, 12, 4)
    assert p.replicas[0].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert p.phys_to_log[0].tolist() == plan_placement(np.ones(8), 12, 4).phys_to_log[0].tolist()
    assert p.phys_to_log[1].tolist() == plan_placement(skewed, 12, 4).phys_to_log[0].tolist()
    assert rank_loads(np.zeros(8), p)[0].tolist() == [0.0] * 4


@pytest.mark.parametrize("name,data,message", [
    ("zero.npy", np.zeros((2, 8)), "every count is 0, so there is no load to balance; record the loads over at least "
                                   "one step (LoadRecorder: call step() at the end of each step before load())"),
    ("nan.csv", "1,2,3,nan\n1,2,3,4\n", "1 non-finite (NaN or inf) count(s), the first nan at layer 0, expert 3"),
    ("inf.json", "[[1, 2, 3, 4], [1, 2, 1e999, 4]]", "1 non-finite (NaN or inf) count(s), the first inf at layer 1"),
    ("neg.json", "[[5, -2, 3, 4], [1, 2, 3, -1]]", "2 negative count(s), the first -2 at layer 0, expert 1; token "
                                                    "counts must be finite and >= 0"),
    ("layer.npy", np.array([[1.0, 2, 3, 4], [0, 0, 0, 0]]), "layer(s) 1 of 2 have no tokens (every count 0)"),
    ("text.json", '{"experts": 4}', "expected token counts [layers, experts] (or [experts])"),
    ("broken.json", "[[1, 2", "cannot read token counts from it"),
])
def test_balance_cli_refuses_a_load_that_is_not_token_counts(name, data, message, tmp_path, capsys):
    from expertrail.tools.cli import main
    path = tmp_path / name
    np.save(path, data) if name.endswith(".npy") else path.write_text(data)
    assert main(["balance", "--load", str(path), "--ranks", "2"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1, out
    assert out.err.startswith(f"expertrail balance: --load {str(path)!r}: {message}"), out.err


def test_balance_cli_text_json_without_torch(tmp_path):
    import json
    import subprocess
    import sys
    np.save(tmp_path / "load.npy", zipf_load(2, 64, 1.2))
    code = ("import sys; from expertrail.tools.cli import main; "
            f"rc = main(['balance', '--load', r'{tmp_path / 'load.npy'}', '--ranks', '8', '--redundant', '8', "
            f"'--domains', '2', '--groups', '4', '--plot', r'{tmp_path / 'b.png'}']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "contiguous" in out.stdout and "hierarchical" in out.stdout
    js = subprocess.run([sys.executable, "-m", "expertrail", "balance", "--zipf", "1.0", "--experts", "256",
                         "--ranks", "32", "--redundant", "32", "--json"], capture_output=True, text=True, timeout=60)
    result = json.loads(js.stdout)
    assert result["global"]["mean"] >= 0.95 and result["contiguous"]["mean"] < 0.3


def _random_loads(rng, layers, experts):
    """Uniform, zipf, Dirichlet, one hot expert and sparse loads [layers, experts]."""
    alpha = rng.choice([0.8, 1.0, 1.2, 1.4, 2.0])
    hot = np.ones((layers, experts))
    hot[np.arange(layers), rng.integers(0, experts, layers)] = 20.0 * experts
    sparse = rng.gamma(0.3, 1.0, (layers, experts))
    sparse[sparse < 0.2] = 0
    return {"uniform": np.full((layers, experts), 7.0), f"zipf {alpha}": zipf_load(layers, experts, alpha, seed=int(rng.integers(99))),
            "dirichlet": rng.dirichlet(np.full(experts, rng.choice([0.1, 0.5, 2.0])), layers) * 1e5,
            "one hot": hot, "sparse": sparse}


def _keeps_replicas_apart(phys, ranks):
    """Per layer: no rank holds two replicas of one expert."""
    return np.array([all(len(set(r)) == len(r) for r in row.reshape(ranks, -1)) for row in phys])


@pytest.mark.parametrize("experts,ranks,redundant,domains,groups", [
    (8, 2, 0, 2, 4), (8, 4, 4, 2, 4), (16, 4, 8, 2, 4), (32, 8, 8, 4, 8), (32, 8, 24, 2, 4),
    (64, 16, 16, 4, 8), (64, 8, 64, 2, 4), (256, 32, 32, 4, 8), (256, 64, 64, 4, 8), (256, 2, 2, 1, 2), (256, 4, 4, 2, 4)])
def test_every_policy_at_least_as_balanced_as_eplb_and_never_below_the_bound(experts, ranks, redundant, domains,
                                                                            groups):
    from expertrail.balance.quality import domain_bound, eplb_placement, lower_bound, slot_rank_loads
    rng = np.random.default_rng(experts * 1000 + ranks * 10 + redundant)
    slots = experts + redundant
    for name, load in _random_loads(rng, 2, experts).items():
        for policy, d, g in [("global", 1, None), ("hierarchical", domains, groups)]:
            p = plan_placement(load, slots, ranks, policy, d, g)
            check_invariants(p, experts, slots, ranks)
            ours = rank_loads(load, p).max(1)
            eplb = eplb_placement(load, slots, ranks, d, g)
            theirs = slot_rank_loads(load, eplb, ranks).max(1)
            # Where EPLB keeps an expert's replicas on distinct ranks, as expertrail must, its
            # plan is one of the policy's candidates: never better.
            apart = _keeps_replicas_apart(eplb, ranks)
            assert (ours[apart] <= theirs[apart] * (1 + 1e-9)).all(), (name, policy, ours, theirs)
            bound = lower_bound(load, slots, ranks) if policy == "global" else domain_bound(load, slots, ranks, d, g)
            assert (bound <= ours * (1 + 1e-9)).all(), (name, policy, bound, ours)


def test_strong_skew_headline():
    """zipf 1.4, 256 experts, 32 ranks, 32 redundant slots: both policies ahead of EPLB's greedy
    and the global one within 0.1% of perfect balance."""
    from expertrail.balance.quality import eplb_placement, slot_rank_loads
    load = zipf_load(1, 256, 1.4)
    glob = balancedness(rank_loads(load, plan_placement(load, 288, 32)))[0]
    assert glob >= 0.999 > balancedness(slot_rank_loads(load, eplb_placement(load, 288, 32), 32))[0]
    grouped = balancedness(rank_loads(load, plan_placement(load, 288, 32, "hierarchical", 4, 8)))[0]
    assert grouped > balancedness(slot_rank_loads(load, eplb_placement(load, 288, 32, 4, 8), 32))[0]


def test_lower_bound_hand_checked():
    from expertrail.balance.quality import domain_bound, lower_bound, water_level
    # 8, 1, 1, 2 on 6 slots of 2 ranks: the mean (6) is reachable (see test_hand_checked_case).
    assert lower_bound(np.array([8.0, 1.0, 1.0, 2.0]), 6, 2).tolist() == pytest.approx([6.0])
    # 9, 1, 1, 1 on 4 slots of 2 ranks: no replicas, expert 0 alone sets the busiest rank.
    assert lower_bound(np.array([9.0, 1.0, 1.0, 1.0]), 4, 2).tolist() == pytest.approx([9.0])
    # Three loads of 4 on 4 slots of 2 ranks: at most one replica of 4 fits under a level of 4
    # per rank, and the third expert has to share a rank; any split of one expert still leaves
    # a rank with 4 + 2 = 6 (mean 6) -- and the water level is 4.
    assert water_level(np.array([[4.0, 4.0, 4.0]]), 4, 2).tolist() == [4.0]
    assert lower_bound(np.array([4.0, 4.0, 4.0]), 4, 2).tolist() == pytest.approx([6.0])
    # Groups {0, 1} and {2, 3} on 2 domains of 1 rank: the hot group's domain carries it whole.
    assert domain_bound(np.array([5.0, 5.0, 1.0, 1.0]), 4, 2, 2, 2).tolist() == pytest.approx([10.0])


def test_packing_makes_room_for_late_replicas():
    # Three bins of two; the lightest expert has three replicas, placed last: without moving an
    # earlier item, its last replica would find only a bin that already holds it.
    from expertrail.balance.planner import pack
    weights = np.array([[5.0, 4.0, 3.0, 0.1, 0.1, 0.1]])
    ids = np.array([[0, 1, 2, 3, 3, 3]])
    bins = pack(weights, ids, 3, 2)[0]
    assert sorted(np.bincount(bins, minlength=3)) == [2, 2, 2]
    assert sorted(bins[3:]) == [0, 1, 2]                 # one replica of expert 3 per bin
