"""How good a placement is: EPLB's greedy as the yardstick, and a lower bound on the busiest rank.

- ``eplb_placement``: DeepSeek EPLB's ``rebalance_experts`` written out in NumPy (our own code of
  its published algorithm): groups packed onto nodes, then inside each node every extra slot to
  the expert with the highest load per replica (no cap), then replicas packed heaviest first onto
  the lightest GPU with a free slot. Unlike expertrail's policies it may put two replicas of an
  expert on one GPU; its rank loads count them both.
- ``lower_bound``: no placement on these slots has a busiest rank lighter than this. The busiest
  rank carries at least the mean, and at least the largest share of one expert's replica, whose
  least possible value over all replica counts (at most one replica per rank) the greedy by load
  per replica finds exactly. ``domain_bound`` adds what keeping groups inside their domain costs.
"""
from __future__ import annotations

import numpy as np


def slot_rank_loads(load: np.ndarray, phys_to_log: np.ndarray, num_ranks: int) -> np.ndarray:
    """Tokens per rank [L, R] of any slot map ``phys_to_log [L, S]`` (an expert's load split
    evenly over its replicas; two replicas on one rank both count)."""
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    phys_to_log = np.atleast_2d(phys_to_log)
    counts = np.stack([np.bincount(row, minlength=load.shape[1]) for row in phys_to_log])
    share = np.take_along_axis(load / np.maximum(counts, 1), phys_to_log, axis=1)
    return share.reshape(share.shape[0], num_ranks, -1).sum(2)


def _eplb_pack(weight: np.ndarray, bins: int) -> np.ndarray:
    """EPLB's balanced packing of one layer: items heaviest first onto the lightest bin that is
    not full (bins of equal item count). Returns the bin of each item."""
    per_bin = len(weight) // bins
    if per_bin == 1:
        return np.arange(len(weight))
    load, used = np.zeros(bins), np.zeros(bins, dtype=np.int64)
    out = np.empty(len(weight), dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        b = int(np.where(used < per_bin, load, np.inf).argmin())
        out[item], load[b], used[b] = b, load[b] + weight[item], used[b] + 1
    return out


def _eplb_replicate(weight: np.ndarray, slots: int) -> np.ndarray:
    """EPLB's replicas of one layer: the expert of each slot, one each then every extra slot to
    the highest load per replica."""
    counts = np.ones(len(weight), dtype=np.int64)
    ids = list(range(len(weight)))
    for _ in range(slots - len(weight)):
        ids.append(int((weight / counts).argmax()))
        counts[ids[-1]] += 1
    return np.array(ids)


def eplb_placement(load: np.ndarray, num_slots: int, num_ranks: int, num_domains: int = 1,
                   num_groups: int | None = None) -> np.ndarray:
    """phys_to_log [L, S] that EPLB's greedy gives: its hierarchical policy with ``num_groups``
    groups on ``num_domains`` nodes, its global policy with one of each."""
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    layers, experts = load.shape
    groups = num_groups or num_domains
    size, ranks_per_domain = experts // groups, num_ranks // num_domains
    slots_per_domain, per_rank = num_slots // num_domains, num_slots // num_ranks
    out = np.empty((layers, num_slots), dtype=np.int64)
    for layer, w in enumerate(load):
        group_load = w.reshape(groups, size).sum(1)
        domain_of_group = _eplb_pack(group_load, num_domains)
        packed_order = np.argsort(-group_load, kind="stable")      # a node lists its groups as packed
        for d in range(num_domains):
            mine = packed_order[domain_of_group[packed_order] == d]
            members = (mine[:, None] * size + np.arange(size)).ravel()
            ids = _eplb_replicate(w[members], slots_per_domain)
            counts = np.bincount(ids, minlength=len(members))
            rank = _eplb_pack(w[members][ids] / counts[ids], ranks_per_domain)
            slots = ids[np.argsort(rank, kind="stable")].reshape(ranks_per_domain, per_rank)
            out[layer, d * slots_per_domain:(d + 1) * slots_per_domain] = members[slots].ravel()
    return out


def water_level(load: np.ndarray, slots: np.ndarray | int, cap: int) -> np.ndarray:
    """Least possible largest load per replica [L] of ``load [L, N]`` on ``slots`` replicas
    (per layer or one for all), each expert with 1..``cap`` replicas: the greedy by load per
    replica is exact for this, done here by bisection on the level (vectorized)."""
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    slots = np.broadcast_to(np.asarray(slots), load.shape[:1])
    # The level is some load_e / c: the least candidate whose replica counts fit the slots.
    candidates = np.sort((load[:, :, None] / np.arange(1, cap + 1)).reshape(load.shape[0], -1), axis=1)
    lo, hi = np.zeros(load.shape[0], dtype=np.int64), np.full(load.shape[0], candidates.shape[1] - 1)
    rows = np.arange(load.shape[0])

    def fits(level):
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.where(load > 0, np.ceil(load / level[:, None] - 1e-12), 1)
        need = np.maximum(need, 1)
        return (need <= cap).all(1) & (need.sum(1) <= slots)

    while (lo < hi).any():
        mid = (lo + hi) // 2
        ok = fits(candidates[rows, mid])
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid + 1)
    return candidates[rows, lo]


def _slots_needed(load: np.ndarray, level: np.ndarray, num_ranks: int, per_rank: int, depth: int = 16) -> np.ndarray:
    """Fewest slots [L] any placement with no rank above ``level [L]`` needs (a relaxation, so
    never more than the truth; inf where even all ranks' worth of replicas is not enough).

    Each expert needs ceil(load / level) replicas. And a rank holds at most j items heavier than
    level / (j + 1), so at most j * ranks such items may exist: for each j, the cheapest way to
    bring the surplus down (more replicas for the experts that shed the most heavy items per
    extra slot, fractionally) adds to the count. The largest over j is needed."""
    level = level[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        base = np.maximum(1, np.ceil(load / level - 1e-9))
    need = base.sum(1)
    need[(base > num_ranks).any(1)] = np.inf
    extra = np.zeros_like(need)
    for j in range(1, min(per_rank, depth + 1)):
        heavy = np.where(load / base > level / (j + 1), base, 0)
        surplus = heavy.sum(1) - j * num_ranks
        with np.errstate(divide="ignore", invalid="ignore"):
            shed_at = np.maximum(1, np.ceil((j + 1) * load / level - 1e-9))
        cost = np.where(shed_at <= num_ranks, shed_at - base, np.inf)
        price = np.where(heavy > 0, cost / np.maximum(heavy, 1), np.inf)
        order = np.argsort(price, axis=1)
        heavy, cost = np.take_along_axis(heavy, order, 1), np.take_along_axis(cost, order, 1)
        before = np.cumsum(heavy, 1) - heavy
        # Shed whole experts while the surplus lasts; the last one only in part.
        part = np.clip((surplus[:, None] - before) / np.maximum(heavy, 1), 0, 1)
        with np.errstate(invalid="ignore"):
            slots = np.where(part > 0, part * cost, 0).sum(1)
        extra = np.maximum(extra, np.where(surplus > 0, slots, 0))
    return need + extra


def lower_bound(load: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """No placement of ``load [L, E]`` on ``num_slots`` slots of ``num_ranks`` ranks (at most one
    replica of an expert per rank) has a busiest rank below this [L]: the least level that
    ``_slots_needed`` says the slots can reach, by bisection from the mean and the least possible
    largest replica share."""
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    per_rank = num_slots // num_ranks
    lo = np.maximum(load.sum(1) / num_ranks, water_level(load, num_slots, num_ranks))
    hi = np.maximum(lo, load.sum(1))                     # one rank holding everything
    hi = np.where(_slots_needed(load, lo, num_ranks, per_rank) <= num_slots, lo, hi)
    for _ in range(40):                                  # to 1e-12 of the range
        mid = (lo + hi) / 2
        ok = _slots_needed(load, mid, num_ranks, per_rank) <= num_slots
        lo, hi = np.where(ok, lo, mid), np.where(ok, mid, hi)
    return lo


def domain_bound(load: np.ndarray, num_slots: int, num_ranks: int, num_domains: int, num_groups: int) -> np.ndarray:
    """Lower bound [L] for placements that keep each group of experts inside one domain (the
    hierarchical policy): ``lower_bound``, and for each group, the domain that holds it carries
    at least that group plus the lightest other groups, spread over its ranks at best, and its
    experts can have at most the domain's slots less one per expert of the other groups."""
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    layers, experts = load.shape
    size, per_domain = experts // num_groups, num_groups // num_domains
    ranks_per_domain, slots_per_domain = num_ranks // num_domains, num_slots // num_domains
    groups = load.reshape(layers, num_groups, size)
    group_load = groups.sum(2)
    lightest = np.sort(group_load, axis=1)
    # The lightest (per_domain - 1) other groups: the lightest per_domain, less this one if among them.
    few = lightest[:, :per_domain].sum(1, keepdims=True)
    others = np.where(group_load <= lightest[:, per_domain - 1:per_domain], few - group_load,
                      few - lightest[:, per_domain - 1:per_domain])
    domain_load = (group_load + others).max(1) / ranks_per_domain
    budget = slots_per_domain - (per_domain - 1) * size
    level = water_level(groups.reshape(layers * num_groups, size), budget, ranks_per_domain)
    return np.maximum.reduce([lower_bound(load, num_slots, num_ranks), domain_load,
                              level.reshape(layers, num_groups).max(1)])
