"""Rebalance planning: logical experts -> physical slots, replicas for hot experts.

A pure function of the measured load ``[layers, experts]`` and the machine (slots, ranks,
domains), vectorized over layers. Two policies, as in DeepSeek's EPLB:

- ``global``: give the extra slots to the experts with the highest load per replica, then pack
  all replicas onto ranks greedily (heaviest first onto the least loaded rank that has a free
  slot and no replica of that expert yet).
- ``hierarchical``: first pack expert groups onto domains (so a group's tokens stay inside its
  fast-link domain), then replicate and pack inside each domain; replicas never leave their
  domain.

Given the current placement, the planner keeps every slot whose expert stays on the same rank
in its place, so only changed slots move weights.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


@dataclass
class Placement:
    """phys_to_log: int64 [L, S] logical expert of each physical slot (slot s on rank s // (S/R)).
    log_to_phys: int64 [L, E, max_replicas] slots of each expert (-1 padded).
    replicas: int64 [L, E] replica count of each expert."""

    phys_to_log: np.ndarray
    log_to_phys: np.ndarray
    replicas: np.ndarray
    num_ranks: int

    @property
    def slots_per_rank(self) -> int:
        return self.phys_to_log.shape[1] // self.num_ranks


def replicate(load: np.ndarray, slots: int, max_replicas: int) -> np.ndarray:
    """Replica counts [L, N] summing to ``slots``: each extra slot goes to the expert with the
    highest load per replica (at most ``max_replicas`` each)."""
    layers, n = load.shape
    if slots < n:
        raise ConfigError(f"{slots} slots cannot hold {n} experts")
    counts = np.ones((layers, n), dtype=np.int64)
    rows = np.arange(layers)
    for _ in range(slots - n):
        per_replica = np.where(counts < max_replicas, load / counts, -np.inf)
        counts[rows, per_replica.argmax(1)] += 1
    return counts


def pack(weights: np.ndarray, ids: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """Greedy balanced packing of items [L, M] (weights, expert ids) into ``bins`` of
    ``per_bin`` items: heaviest first onto the lightest bin with room and without that id.
    Returns the bin of each item [L, M]."""
    layers, m = weights.shape
    if m != bins * per_bin:
        raise ConfigError(f"{m} items do not fill {bins} bins of {per_bin}")
    order = np.argsort(-weights, axis=1, kind="stable")
    rows = np.arange(layers)
    load = np.zeros((layers, bins))
    used = np.zeros((layers, bins), dtype=np.int64)
    holds = np.zeros((layers, bins, int(ids.max()) + 1 if ids.size else 1), dtype=bool)
    out = np.empty((layers, m), dtype=np.int64)
    for j in range(m):
        item = order[:, j]
        e = ids[rows, item]
        cost = np.where((used < per_bin) & ~holds[rows, :, e], load, np.inf)
        b = cost.argmin(1)
        if np.isinf(cost[rows, b]).any():
            raise ConfigError("cannot place replicas: an expert has more replicas than there are ranks")
        out[rows, item] = b
        load[rows, b] += weights[rows, item]
        used[rows, b] += 1
        holds[rows, b, e] = True
    return out


def _layout(bin_of_item: np.ndarray, ids: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """Items grouped by bin -> phys_to_log [L, bins * per_bin] (within a bin, by expert id)."""
    key = bin_of_item * (ids.max() + 1 if ids.size else 1) + ids
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1)


def _replica_items(load: np.ndarray, counts: np.ndarray):
    """Flatten replica counts into items: expert id and load share per replica, [L, S]."""
    layers, n = load.shape
    ids = np.stack([np.repeat(np.arange(n), counts[l]) for l in range(layers)])
    share = np.take_along_axis(load / counts, ids, axis=1)
    return ids, share


def plan_placement(load: np.ndarray, num_slots: int, num_ranks: int, policy: str = "global",
                   num_domains: int = 1, num_groups: int | None = None, current: np.ndarray | None = None) -> Placement:
    """Plan replicas and placement for ``load [L, E]`` (or [E]) on ``num_slots`` slots.

    policy "global" or "hierarchical" (needs ``num_groups`` expert groups, a multiple of
    ``num_domains``). ``current`` (phys_to_log [L, S]) keeps unchanged slots where they are.
    """
    load = np.atleast_2d(np.asarray(load, dtype=np.float64))
    layers, experts = load.shape
    if num_slots % num_ranks:
        raise ConfigError(f"num_slots={num_slots} must be a multiple of num_ranks={num_ranks}")
    if num_ranks % num_domains:
        raise ConfigError(f"num_domains={num_domains} must divide num_ranks={num_ranks}")
    per_rank = num_slots // num_ranks
    if policy == "global":
        counts = replicate(load, num_slots, num_ranks)
        ids, share = _replica_items(load, counts)
        phys = _layout(pack(share, ids, num_ranks, per_rank), ids, num_ranks, per_rank)
    elif policy == "hierarchical":
        groups = num_groups or num_domains
        if experts % groups or groups % num_domains:
            raise ConfigError(f"hierarchical policy: num_groups={groups} must divide the {experts} experts and be a "
                              f"multiple of num_domains={num_domains}")
        if num_slots % num_domains:
            raise ConfigError(f"num_slots={num_slots} must split evenly over {num_domains} domains")
        size = experts // groups
        group_load = load.reshape(layers, groups, size).sum(2)
        domain_of_group = pack(group_load, np.tile(np.arange(groups), (layers, 1)), num_domains, groups // num_domains)
        phys = np.empty((layers, num_slots), dtype=np.int64)
        ranks_per_domain, slots_per_domain = num_ranks // num_domains, num_slots // num_domains
        for d in range(num_domains):
            # Experts of the groups packed onto domain d, per layer: [L, experts / domains].
            mine = np.sort(np.nonzero(domain_of_group == d)[1].reshape(layers, -1), axis=1)
            members = (mine[:, :, None] * size + np.arange(size)).reshape(layers, -1)
            local_load = np.take_along_axis(load, members, axis=1)
            counts = replicate(local_load, slots_per_domain, ranks_per_domain)
            ids, share = _replica_items(local_load, counts)
            local = _layout(pack(share, ids, ranks_per_domain, per_rank), ids, ranks_per_domain, per_rank)
            phys[:, d * slots_per_domain:(d + 1) * slots_per_domain] = np.take_along_axis(members, local, axis=1)
    else:
        raise ConfigError(f"policy={policy!r}; choose 'global' or 'hierarchical'")
    if current is not None:
        phys = keep_in_place(np.atleast_2d(current), phys, num_ranks)
    return _finish(phys, experts, num_ranks)


def keep_in_place(current: np.ndarray, new: np.ndarray, num_ranks: int) -> np.ndarray:
    """Relabel new ranks to match the old ones they overlap most, then keep each slot whose
    expert was already at that position of its rank (fewest weight moves)."""
    layers, slots = new.shape
    per_rank = slots // num_ranks
    out = new.copy()
    for l in range(layers):
        old_sets = current[l].reshape(num_ranks, per_rank)
        new_sets = new[l].reshape(num_ranks, per_rank)
        overlap = (old_sets[:, :, None, None] == new_sets[None, None, :, :]).any(3).sum(1)   # [old, new]
        mapping, taken = {}, set()
        for old, nw in sorted(np.ndindex(num_ranks, num_ranks), key=lambda p: -overlap[p]):
            if old not in mapping and nw not in taken:
                mapping[old] = nw
                taken.add(nw)
        for old, nw in mapping.items():
            want = list(new_sets[nw])
            row = [-1] * per_rank
            for i, e in enumerate(old_sets[old]):          # same expert, same place
                if e in want:
                    row[i] = e
                    want.remove(e)
            row = [e if e != -1 else want.pop(0) for e in row]
            out[l, old * per_rank:(old + 1) * per_rank] = row
    return out


def _finish(phys: np.ndarray, experts: int, num_ranks: int) -> Placement:
    layers, slots = phys.shape
    counts = np.stack([np.bincount(phys[l], minlength=experts) for l in range(layers)])
    most = int(counts.max())
    log_to_phys = np.full((layers, experts, most), -1, dtype=np.int64)
    order = np.argsort(phys, axis=1, kind="stable")
    for l in range(layers):
        starts = np.concatenate([[0], np.cumsum(counts[l])[:-1]])
        rank_in_expert = np.arange(slots) - np.repeat(starts, counts[l])
        log_to_phys[l, phys[l, order[l]], rank_in_expert] = order[l]
    return Placement(phys_to_log=phys, log_to_phys=log_to_phys, replicas=counts, num_ranks=num_ranks)


def rank_loads(load: np.ndarray, placement: Placement) -> np.ndarray:
    """Tokens per rank [L, R] when each expert's load splits evenly over its replicas."""
    load = np.atleast_2d(load)
    share = np.take_along_axis(load / placement.replicas, placement.phys_to_log, axis=1)
    return share.reshape(share.shape[0], placement.num_ranks, -1).sum(2)


def balancedness(per_rank: np.ndarray) -> np.ndarray:
    """mean / max tokens per rank, per layer (1.0 = perfectly even)."""
    per_rank = np.atleast_2d(per_rank)
    return per_rank.mean(1) / np.maximum(per_rank.max(1), 1e-12)


def contiguous_balancedness(load: np.ndarray, num_ranks: int) -> np.ndarray:
    """Balancedness of the default placement: expert e on rank e // (E / R), no replicas."""
    load = np.atleast_2d(load)
    return balancedness(load.reshape(load.shape[0], num_ranks, -1).sum(2))


def zipf_load(layers: int, experts: int, alpha: float, tokens: int = 1_000_000, seed: int = 0) -> np.ndarray:
    """Expected token counts [L, E] of Zipf(alpha) popularity, hot experts shuffled per layer."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, experts + 1) ** alpha
    base = base / base.sum() * tokens
    return np.stack([rng.permutation(base) for _ in range(layers)])
