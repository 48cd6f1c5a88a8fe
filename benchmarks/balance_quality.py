"""Balance quality: each policy's balancedness next to EPLB's greedy and a lower bound.

Balancedness = mean / max tokens per rank (1.0 is perfectly even); the bound columns are the
best any placement could reach (mean / lower bound on the busiest rank): ``bound`` for any
placement, ``domain bound`` for placements that keep each group inside its domain. EPLB's
columns come from ``expertrail.balance.quality.eplb_placement``, which may put two replicas of
an expert on one rank (expertrail's policies never do). Mean over the layers.

    .venv/bin/python benchmarks/balance_quality.py
"""
import argparse
import time

import numpy as np

from expertrail.balance.planner import balancedness, plan_placement, zipf_load
from expertrail.balance.quality import domain_bound, eplb_placement, lower_bound, slot_rank_loads


def headline_loads(layers: int, experts: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    loads = {"uniform": np.full((layers, experts), 1000.0)}
    for alpha in (0.8, 1.0, 1.2, 1.4, 2.0):
        loads[f"zipf {alpha}"] = zipf_load(layers, experts, alpha, seed=seed)
    loads["dirichlet 0.3"] = rng.dirichlet(np.full(experts, 0.3), layers) * 1e6
    hot = np.full((layers, experts), 1000.0)
    hot[np.arange(layers), rng.integers(0, experts, layers)] = 1000.0 * experts
    loads["one hot expert"] = hot
    return loads


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--redundant", type=int, default=32)
    p.add_argument("--domains", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    slots = a.experts + a.redundant
    print(f"{a.layers} layers x {a.experts} experts on {a.ranks} ranks, {a.redundant} redundant slots; hierarchical: "
          f"{a.domains} domains, {a.groups} groups. Balancedness = mean / max tokens per rank, mean over layers.")
    print(f"{'load':<16}{'global':>8}{'EPLB':>8}{'bound':>8}  {'hierarchical':>13}{'EPLB':>8}{'domain bound':>14}"
          f"{'plan ms':>9}")
    for name, load in headline_loads(a.layers, a.experts, a.seed).items():
        def score(phys):
            return balancedness(slot_rank_loads(load, phys, a.ranks)).mean()
        start = time.perf_counter()
        ours = plan_placement(load, slots, a.ranks).phys_to_log
        planned = time.perf_counter() - start
        grouped = plan_placement(load, slots, a.ranks, "hierarchical", a.domains, a.groups).phys_to_log
        mean = load.sum(1) / a.ranks
        print(f"{name:<16}{score(ours):>8.4f}{score(eplb_placement(load, slots, a.ranks)):>8.4f}"
              f"{(mean / lower_bound(load, slots, a.ranks)).mean():>8.4f}  {score(grouped):>13.4f}"
              f"{score(eplb_placement(load, slots, a.ranks, a.domains, a.groups)):>8.4f}"
              f"{(mean / domain_bound(load, slots, a.ranks, a.domains, a.groups)).mean():>14.4f}"
              f"{planned * 1e3 / a.layers:>9.1f}")


if __name__ == "__main__":
    main()
