"""Rebalance planning: logical experts -> physical slots, replicas for hot experts.

A pure function of the measured load ``[layers, experts]`` and the machine (slots, ranks,
domains), vectorized over layers, never more than one replica of an expert per rank. Two
policies, as in DeepSeek's EPLB, each at least as balanced as EPLB's greedy wherever EPLB's
plan keeps replicas apart (that plan is the first candidate; see docs/balance.md):

- ``global``: EPLB's greedy (the extra slots to the experts with the highest load per replica,
  then replicas heaviest first onto the least loaded rank with a free slot and no replica of
  that expert yet), then swaps off the busiest rank, then replica counts shaped for lower
  levels of the busiest rank, by bisection, each packed and swapped the same way.
- ``hierarchical``: first pack expert groups onto domains (so a group's tokens stay inside its
  fast-link domain), then the global policy inside each domain; replicas never leave their
  domain.

Given the current placement, the planner keeps every slot whose expert stays on the same rank
in its place, so only changed slots move weights.

Loads are token counts: finite and >= 0, else `check_load` raises InvalidInputError naming the
first bad entry. A layer with no tokens at all (every count 0: nothing recorded yet) says
nothing about which experts are hot; it is planned as if every expert had the same load (the
extra slots spread evenly over the experts), not refused, so a rebalance that runs before a
layer has seen traffic still gets a usable placement.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, InvalidInputError


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


def check_load(load, name: str = "load") -> np.ndarray:
    """``load`` [L, E] (or [E]) as float64 [L, E], checked: a 1- or 2-D array (NumPy, a CPU
    tensor, nested lists) with at least one expert and one layer, every count finite and >= 0.
    Raises InvalidInputError naming ``name``, what is wrong and the first bad entry."""
    try:
        arr = np.asarray(load, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise InvalidInputError(f"{name}: expected token counts [layers, experts] (or [experts]), got "
                                f"{type(load).__name__} ({err})") from None
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or 0 in arr.shape:
        raise InvalidInputError(f"{name}: expected token counts [layers, experts] (or [experts]) with at least one "
                                f"expert, got shape {list(np.shape(load))}")
    for bad, what in ((~np.isfinite(arr), "non-finite (NaN or inf)"), (arr < 0, "negative")):
        if bad.any():
            layer, expert = np.argwhere(bad)[0]
            raise InvalidInputError(f"{name}: {int(bad.sum())} {what} count(s), the first {arr[layer, expert]:g} at "
                                    f"layer {layer}, expert {expert}; token counts must be finite and >= 0")
    return arr


def _even_where_empty(load: np.ndarray) -> np.ndarray:
    """``load`` with each layer that has no tokens (all 0) replaced by equal loads: nothing
    says which experts are hot there, so the extra slots spread evenly."""
    empty = ~load.any(1)
    if empty.any():
        load = load.copy()
        load[empty] = 1.0
    return load


def replicate(load: np.ndarray, slots: int, max_replicas: int, start: np.ndarray | None = None,
              to_lightest: bool = False, with_order: bool = False):
    """Replica counts [L, N] summing to ``slots``: from ``start`` (one each by default), each
    extra slot goes to the expert with the highest load per replica (the lowest with
    ``to_lightest``), at most ``max_replicas`` each. From one each, the highest-first order gives
    the least possible largest load per replica. ``with_order`` also returns the expert that
    took each extra slot, in turn [L, slots - N] (from one each)."""
    layers, n = load.shape
    if slots < n:
        raise ConfigError(f"{slots} slots cannot hold {n} experts")
    counts = np.ones((layers, n), dtype=np.int64) if start is None else start.copy()
    rows = np.arange(layers)
    order = []
    for _ in range(int((slots - counts.sum(1)).max(initial=0))):
        per_replica = np.where(counts < max_replicas, -load / counts if to_lightest else load / counts, -np.inf)
        room = counts.sum(1) < slots
        order.append(per_replica.argmax(1))
        counts[rows[room], order[-1][room]] += 1
    if with_order:
        return counts, np.stack(order, 1) if order else np.zeros((layers, 0), dtype=np.int64)
    return counts


def counts_for_level(load: np.ndarray, level: np.ndarray, slots: int, max_replicas: int, per_rank: int,
                     depth: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Replica counts [L, N] shaped for a busiest rank of ``level [L]``, and whether they fit
    the slots [L].

    Each expert gets enough replicas that none carries more than the level. A rank holds at
    most j items heavier than level / (j + 1), so for j = 1, 2, ... while there are more than
    j * ranks of them, the experts that shed the most such items per extra slot get just enough
    replicas to fall below it. The slots left over split the lightest experts: splitting the
    heavy ones further would bring back the items just counted out."""
    level = level[:, None]
    num_ranks = max_replicas
    with np.errstate(divide="ignore", invalid="ignore"):
        counts = np.maximum(1, np.ceil(load / level - 1e-9))
    for j in range(1, min(per_rank, depth + 1)):
        heavy = np.where(load / counts > level / (j + 1), counts, 0)
        surplus = heavy.sum(1, keepdims=True) - j * num_ranks
        if (surplus <= 0).all():
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            shed_at = np.maximum(counts, np.ceil((j + 1) * load / level - 1e-9))
        price = np.where((heavy > 0) & (shed_at <= max_replicas), (shed_at - counts) / np.maximum(heavy, 1), np.inf)
        order = np.argsort(price, axis=1, kind="stable")
        before = np.cumsum(np.take_along_axis(heavy, order, 1), 1) - np.take_along_axis(heavy, order, 1)
        shed = np.zeros(counts.shape, dtype=bool)
        np.put_along_axis(shed, order, (before < surplus) & np.isfinite(np.take_along_axis(price, order, 1)), 1)
        counts = np.where(shed, shed_at, counts)
    fits = (counts <= max_replicas).all(1) & (counts.sum(1) <= slots)
    counts = np.where(fits[:, None], counts, 1).astype(np.int64)
    return replicate(load, slots, max_replicas, start=counts, to_lightest=True), fits


def pack(weights: np.ndarray, ids: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """Greedy balanced packing of items [L, M] (weights, expert ids) into ``bins`` of
    ``per_bin`` items: heaviest first onto the lightest bin with room and without that id.
    Returns the bin of each item [L, M].

    When every bin with room already holds the item's id (replicas of one expert placed late),
    an item of a full bin without that id moves to the lightest bin with room, and the new item
    takes its place: one replica of an expert per bin, as long as no id has more than ``bins``
    items."""
    layers, m = weights.shape
    if m != bins * per_bin:
        raise ConfigError(f"{m} items do not fill {bins} bins of {per_bin}")
    if ids.size and np.stack([np.bincount(row) for row in ids]).max() > bins:
        raise ConfigError("cannot place replicas: an expert has more replicas than there are ranks")
    order = np.argsort(-weights, axis=1, kind="stable")
    rows = np.arange(layers)
    load = np.zeros((layers, bins))
    used = np.zeros((layers, bins), dtype=np.int64)
    holds = np.zeros((layers, bins, int(ids.max()) + 1 if ids.size else 1), dtype=bool)
    out = np.full((layers, m), -1, dtype=np.int64)
    for j in range(m):
        item = order[:, j]
        e = ids[rows, item]
        room = np.where(used < per_bin, load, np.inf)
        cost = np.where(holds[rows, :, e], np.inf, room)
        b = cost.argmin(1)
        for layer in np.nonzero(np.isinf(cost[rows, b]))[0]:
            b[layer] = _make_room(weights[layer], ids[layer], out[layer], load[layer], used[layer], holds[layer],
                                  room[layer].argmin(), e[layer], weights[layer, item[layer]])
        out[rows, item] = b
        load[rows, b] += weights[rows, item]
        used[rows, b] += 1
        holds[rows, b, e] = True
    return out


def _make_room(weights, ids, bin_of_item, load, used, holds, open_bin, expert, weight) -> int:
    """One layer of ``pack``: ``open_bin`` has room but holds ``expert`` already. Move an item
    from a full bin without ``expert`` (one whose id ``open_bin`` lacks) to ``open_bin``, the
    move that leaves the lighter heaviest of the two bins; return the freed bin. Updates
    ``bin_of_item``, ``load``, ``used`` and ``holds`` in place."""
    placed = np.nonzero(bin_of_item >= 0)[0]
    where = bin_of_item[placed]
    movable = placed[~holds[where, expert] & ~holds[open_bin, ids[placed]]]
    src = bin_of_item[movable]
    after = np.maximum(load[open_bin] + weights[movable], load[src] - weights[movable] + weight)
    x = movable[after.argmin()]
    freed = bin_of_item[x]
    bin_of_item[x] = open_bin
    load[open_bin] += weights[x]
    load[freed] -= weights[x]
    used[open_bin] += 1
    used[freed] -= 1
    holds[freed, ids[x]], holds[open_bin, ids[x]] = False, True
    return int(freed)


def refine(weights: np.ndarray, ids: np.ndarray, bin_of_item: np.ndarray, bins: int, per_bin: int,
           max_swaps: int | None = None) -> np.ndarray:
    """Local search after packing: swap an item of the heaviest bin with a lighter item of
    another bin whenever that lowers the heaviest bin (the best such swap each time, all layers
    at once), keeping at most one item of an id per bin. Returns the new bin of each item."""
    layers, m = weights.shape
    bin_of_item = bin_of_item.copy()
    rows = np.arange(layers)
    members = np.argsort(bin_of_item, axis=1, kind="stable").reshape(layers, bins, per_bin)   # items by bin
    load = np.zeros((layers, bins))
    np.add.at(load, (rows[:, None], bin_of_item), weights)
    holds = np.zeros((layers, bins, int(ids.max()) + 1), dtype=bool)
    holds[rows[:, None], bin_of_item, ids] = True
    active = rows
    for _ in range(max_swaps or 4 * m):
        a = np.arange(len(active))
        heaviest = load[active].argmax(1)
        top = load[active, heaviest]
        mine = members[active, heaviest]                                        # [A, per_bin]
        gain = np.take_along_axis(weights[active], mine, 1)[:, :, None] - weights[active][:, None, :]
        other = bin_of_item[active]
        after = np.maximum(top[:, None, None] - gain, np.take_along_axis(load[active], other, 1)[:, None, :] + gain)
        allowed = ((gain > 0) & (other != heaviest[:, None])[:, None, :]
                   & ~holds[active[:, None, None], other[:, None, :], np.take_along_axis(ids[active], mine, 1)[:, :, None]]
                   & ~holds[active, heaviest][a[:, None], ids[active]][:, None, :])
        after = np.where(allowed, after, np.inf).reshape(len(active), -1)
        best = after.argmin(1)
        lowers = after[a, best] < top * (1 - 1e-12)
        if not lowers.any():
            break
        active, best, heaviest = active[lowers], best[lowers], heaviest[lowers]
        i = members[active, heaviest, best // m]
        j = best % m
        bi, bj = heaviest, bin_of_item[active, j]
        moved = weights[active, i] - weights[active, j]
        load[active, bi] -= moved
        load[active, bj] += moved
        holds[active, bi, ids[active, i]] = holds[active, bj, ids[active, j]] = False
        holds[active, bi, ids[active, j]] = holds[active, bj, ids[active, i]] = True
        members[active, bi, best // m] = j
        members[active, bj] = np.where(members[active, bj] == j[:, None], i[:, None], members[active, bj])
        bin_of_item[active, i], bin_of_item[active, j] = bj, bi
    return bin_of_item


def _place(load: np.ndarray, counts: np.ndarray, num_ranks: int, per_rank: int,
           extra: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Replicas of ``counts [L, N]`` packed onto ranks (greedy, then swaps): the slot map
    [L, S] and the busiest rank's load [L]. Items come one per expert and then the replicas
    in ``extra`` order if given (EPLB's order: ties in the packing then fall as in EPLB),
    else expert by expert."""
    ids, share = _replica_items(load, counts, extra)
    rank_of = pack(share, ids, num_ranks, per_rank)
    rank_of = refine(share, ids, rank_of, num_ranks, per_rank)
    per_rank_load = np.zeros((load.shape[0], num_ranks))
    np.add.at(per_rank_load, (np.arange(load.shape[0])[:, None], rank_of), share)
    return _layout(rank_of, ids, num_ranks, per_rank), per_rank_load.max(1)


def place_replicas(load: np.ndarray, num_slots: int, num_ranks: int, search_steps: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Replica counts and placement of ``load [L, N]`` on ``num_slots`` slots: the slot map
    [L, S] (expert of each slot, rank by rank) and the busiest rank's load [L].

    First the counts with the least largest load per replica, as EPLB makes them; with these
    counts the greedy packing is EPLB's own placement whenever EPLB keeps replicas of an expert
    on distinct ranks, and the swaps only lower the busiest rank. Then, where the busiest rank
    is still above the mean and the largest share, a bisection on the level it could reach
    tries counts shaped for that level (``counts_for_level``), keeping each layer's best.
    ``load`` is checked as in `check_load` (a layer with no tokens gets a valid placement, but
    not an even one: `plan_placement` plans such layers as equal loads)."""
    load = check_load(load)
    per_rank = num_slots // num_ranks
    counts, extra = replicate(load, num_slots, num_ranks, with_order=True)
    phys, top = _place(load, counts, num_ranks, per_rank, extra)
    lo = np.maximum(load.sum(1) / num_ranks, (load / counts).max(1))
    hi = top.copy()
    for step in range(search_steps):
        todo = np.nonzero(hi > lo * (1 + 1e-3))[0]              # within 0.1% of reach: done
        if not todo.size:
            break
        level = lo[todo] if step == 0 else (lo[todo] + hi[todo]) / 2
        counts, fits = counts_for_level(load[todo], level, num_slots, num_ranks, per_rank)
        found, found_top = _place(load[todo], counts, num_ranks, per_rank)
        found_top = np.where(fits, found_top, np.inf)
        better = found_top < top[todo]
        phys[todo[better]], top[todo[better]] = found[better], found_top[better]
        reached = found_top <= level
        hi[todo] = np.where(reached, found_top, hi[todo])
        lo[todo] = np.where(reached, lo[todo], level)
    return phys, top


def _layout(bin_of_item: np.ndarray, ids: np.ndarray, bins: int, per_bin: int) -> np.ndarray:
    """Items grouped by bin -> phys_to_log [L, bins * per_bin] (within a bin, by expert id)."""
    key = bin_of_item * (ids.max() + 1 if ids.size else 1) + ids
    order = np.argsort(key, axis=1, kind="stable")
    return np.take_along_axis(ids, order, axis=1)


def _replica_items(load: np.ndarray, counts: np.ndarray, extra: np.ndarray | None = None):
    """Flatten replica counts into items: expert id and load share per replica, [L, S]; one
    item per expert then ``extra`` if given, else each expert's replicas together."""
    layers, n = load.shape
    if extra is None:
        ids = np.stack([np.repeat(np.arange(n), counts[l]) for l in range(layers)])
    else:
        ids = np.concatenate([np.tile(np.arange(n), (layers, 1)), extra], axis=1)
    share = np.take_along_axis(load / counts, ids, axis=1)
    return ids, share


def plan_placement(load: np.ndarray, num_slots: int, num_ranks: int, policy: str = "global",
                   num_domains: int = 1, num_groups: int | None = None, current: np.ndarray | None = None) -> Placement:
    """Plan replicas and placement for ``load [L, E]`` (or [E]) on ``num_slots`` slots.

    policy "global" or "hierarchical" (needs ``num_groups`` expert groups, a multiple of
    ``num_domains``). ``current`` (phys_to_log [L, S]) keeps unchanged slots where they are.
    ``load``: token counts, finite and >= 0 (else InvalidInputError, see `check_load`); a layer
    whose counts are all 0 is planned as if every expert had the same load.
    """
    load = _even_where_empty(check_load(load))
    layers, experts = load.shape
    if num_slots % num_ranks:
        raise ConfigError(f"num_slots={num_slots} must be a multiple of num_ranks={num_ranks}")
    if num_ranks % num_domains:
        raise ConfigError(f"num_domains={num_domains} must divide num_ranks={num_ranks}")
    if num_slots > experts * num_ranks:
        raise ConfigError(f"{num_slots} slots need more than one replica of an expert per rank on {num_ranks} ranks")
    if policy == "global":
        phys, _ = place_replicas(load, num_slots, num_ranks)
    elif policy == "hierarchical":
        groups = num_groups or num_domains
        if experts % groups or groups % num_domains:
            raise ConfigError(f"hierarchical policy: num_groups={groups} must divide the {experts} experts and be a "
                              f"multiple of num_domains={num_domains}")
        if num_slots % num_domains:
            raise ConfigError(f"num_slots={num_slots} must split evenly over {num_domains} domains")
        group_load = load.reshape(layers, groups, experts // groups).sum(2)
        group_ids = np.tile(np.arange(groups), (layers, 1))
        greedy = pack(group_load, group_ids, num_domains, groups // num_domains)
        phys, top = _place_in_domains(load, greedy, groups, num_slots, num_ranks, num_domains)
        swapped = refine(group_load, group_ids, greedy, num_domains, groups // num_domains)
        if not np.array_equal(swapped, greedy):        # lighter heaviest domain: keep it where it helps
            other, other_top = _place_in_domains(load, swapped, groups, num_slots, num_ranks, num_domains)
            phys = np.where((other_top < top)[:, None], other, phys)
    else:
        raise ConfigError(f"policy={policy!r}; choose 'global' or 'hierarchical'")
    if current is not None:
        phys = keep_in_place(np.atleast_2d(current), phys, num_ranks)
    return _finish(phys, experts, num_ranks)


def _place_in_domains(load: np.ndarray, domain_of_group: np.ndarray, groups: int, num_slots: int, num_ranks: int,
                      num_domains: int) -> tuple[np.ndarray, np.ndarray]:
    """Each domain's groups replicated and placed on its own ranks and slots: the slot map
    [L, S] and the busiest rank's load [L]."""
    layers, experts = load.shape
    size = experts // groups
    phys = np.empty((layers, num_slots), dtype=np.int64)
    top = np.zeros(layers)
    ranks_per_domain, slots_per_domain = num_ranks // num_domains, num_slots // num_domains
    # A domain lists its groups heaviest first (the order they were packed), as EPLB does.
    heaviest_first = np.argsort(-load.reshape(layers, groups, size).sum(2), axis=1, kind="stable")
    for d in range(num_domains):
        # Experts of the groups packed onto domain d, per layer: [L, experts / domains].
        here = np.take_along_axis(domain_of_group, heaviest_first, 1) == d
        mine = heaviest_first[here].reshape(layers, -1)
        members = (mine[:, :, None] * size + np.arange(size)).reshape(layers, -1)
        local, local_top = place_replicas(np.take_along_axis(load, members, axis=1), slots_per_domain, ranks_per_domain)
        phys[:, d * slots_per_domain:(d + 1) * slots_per_domain] = np.take_along_axis(members, local, axis=1)
        top = np.maximum(top, local_top)
    return phys, top


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
    """Tokens per rank [L, R] when each expert's load splits evenly over its replicas. ``load``
    is checked as in `check_load`."""
    load = check_load(load)
    share = np.take_along_axis(load / placement.replicas, placement.phys_to_log, axis=1)
    return share.reshape(share.shape[0], placement.num_ranks, -1).sum(2)


def balancedness(per_rank: np.ndarray) -> np.ndarray:
    """mean / max tokens per rank, per layer (1.0 = perfectly even)."""
    per_rank = np.atleast_2d(per_rank)
    return per_rank.mean(1) / np.maximum(per_rank.max(1), 1e-12)


def contiguous_balancedness(load: np.ndarray, num_ranks: int) -> np.ndarray:
    """Balancedness of the default placement: expert e on rank e // (E / R), no replicas.
    ``load`` is checked as in `check_load`."""
    load = check_load(load)
    if load.shape[1] % num_ranks:
        raise ConfigError(f"{load.shape[1]} experts do not split evenly over num_ranks={num_ranks}")
    return balancedness(load.reshape(load.shape[0], num_ranks, -1).sum(2))


def zipf_load(layers: int, experts: int, alpha: float, tokens: int = 1_000_000, seed: int = 0) -> np.ndarray:
    """Expected token counts [L, E] of Zipf(alpha) popularity, hot experts shuffled per layer."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, experts + 1) ** alpha
    base = base / base.sum() * tokens
    return np.stack([rng.permutation(base) for _ in range(layers)])
