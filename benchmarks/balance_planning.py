"""Planning time: expertrail's planner against a per-expert Python loop of the greedy it starts
from (replicate the highest load per replica, then heaviest-first onto the lightest rank with
room and without that expert), 61 layers x 256 experts onto 288 slots of 32 ranks. The planner
then improves on the greedy (swaps off the busiest rank, other replica counts; docs/balance.md),
so its time includes that search.

    .venv/bin/python benchmarks/balance_planning.py
"""
import time

import numpy as np

from expertrail.balance.planner import balancedness, plan_placement, rank_loads, zipf_load


def plan_loop(load, slots, ranks):
    """The same greedy, one layer, one expert, one replica at a time."""
    out = []
    per_rank = slots // ranks
    for layer in load:
        counts = [1] * len(layer)
        for _ in range(slots - len(layer)):
            best = max((layer[e] / counts[e], -e) for e in range(len(layer)) if counts[e] < ranks)
            counts[-best[1]] += 1
        items = [(layer[e] / counts[e], e) for e in range(len(layer)) for _ in range(counts[e])]
        order = sorted(range(len(items)), key=lambda i: -items[i][0])
        rank_load, used, holds = [0.0] * ranks, [0] * ranks, [set() for _ in range(ranks)]
        placed = [[] for _ in range(ranks)]
        for i in order:
            w, e = items[i]
            r = min((rank_load[r], r) for r in range(ranks) if used[r] < per_rank and e not in holds[r])[1]
            rank_load[r] += w
            used[r] += 1
            holds[r].add(e)
            placed[r].append(e)
        out.append([e for r in range(ranks) for e in sorted(placed[r])])
    return np.array(out)


def main():
    load = zipf_load(61, 256, 1.0)
    plan_placement(load, 288, 32)                       # warm-up
    t0 = time.perf_counter()
    p = plan_placement(load, 288, 32)
    fast = time.perf_counter() - t0
    t0 = time.perf_counter()
    slow_plan = plan_loop(load, 288, 32)
    slow = time.perf_counter() - t0
    same = np.array_equal(np.sort(slow_plan, axis=1), np.sort(p.phys_to_log, axis=1))
    print("61 layers x 256 experts -> 288 slots on 32 ranks (zipf 1.0)")
    print(f"vectorized planner: {fast * 1e3:.1f} ms; per-expert Python loop: {slow * 1e3:.1f} ms; "
          f"ratio {slow / fast:.1f}x; same replica counts: {same}")
    print(f"balancedness: {balancedness(rank_loads(load, p)).mean():.3f} (global policy, mean over layers)")


if __name__ == "__main__":
    main()
