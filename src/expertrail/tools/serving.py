"""Serving while rebalancing: a decode loop that keeps replicating its hot experts as traffic drifts.

Each decode step, every rank routes its tokens through one expert-parallel MoE layer
(`layer.expert_parallel_moe`: dispatch, grouped experts, combine). The layer's experts sit on
``E + redundant`` physical slots; its `LoadRecorder` keeps the tokens per expert of the last
``window`` steps (or seconds). Every ``rebalance_every`` steps, at the end of a step:

1. plan: the window's loads (summed over the EP group) go to `plan_placement`, which keeps
   the slots that stay put; `balanced_shares` weights each replica by its rank's planned load;
2. migrate: if the new placement relieves the busiest rank (on the window's loads) by at least
   ``min_gain`` against the current one with its replicas re-weighted, the weights of the
   slots a rank lacks start moving point to point, in the background, on a process group of
   their own (`migrate(..., async_op=True)`); else the placement stays and only its replica
   weights change (nothing moves);
3. switch: at the start of the next step the rank waits for its transfers (they had the
   step's own work to hide behind) and routes through the new map from then on.

So a rebalance never holds the loop up for more than the step that plans it. Every (token, k)
picks a replica by a hash of its position (step, source rank, index) read against the
replicas' shares: the same choice on every rank, no random numbers. The replicas hold the
logical experts' weights bit for bit, so the outputs are the unreplicated layer's; they agree
within fp32 rounding rather than bitwise, because a row's expert GEMM runs in a block of
another size on a replica.

`DriftingZipf` is the traffic: Zipf(alpha) popularity over a ranking of the experts that is
reshuffled every ``drift_every`` steps. `serve_rank` runs the unreplicated layer and the
rebalancing one side by side on the same traffic, for `expertrail serve-sim` (serve_sim.py),
which reports balancedness (mean / max rows per rank) and step latency over time
(docs/balance.md, "Rebalancing while serving").
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist

from ..balance.migration import migrate, transfers
from ..balance.planner import balancedness, plan_placement
from ..balance.recorder import LoadRecorder
from ..balance.replicas import ReplicaRouter
from ..errors import ConfigError
from ..kernels.torch_ops import count_kept
from ..moe.experts import GroupedExperts
from ..moe.layer import expert_parallel_moe


class DriftingZipf:
    """Decode traffic whose hot experts move.

    Each token picks ``topk`` distinct experts with P(e) proportional to 1 / rank(e) ** alpha
    (K draws without replacement by Gumbel top-k, as the bench's ``zipf:<alpha>`` routing),
    where rank(e) is the expert's place in a ranking that is reshuffled every ``drift_every``
    steps. The ranking is a function of the seed and the period (the same on every rank); the
    tokens and their draws are a function of the seed, the step and the rank.
    """

    def __init__(self, num_experts: int, topk: int, alpha: float, drift_every: int, seed: int = 0):
        self.num_experts, self.topk, self.alpha = num_experts, topk, alpha
        self.drift_every, self.seed = drift_every, seed

    def ranking(self, step: int) -> torch.Tensor:
        """int64 [E]: the experts during ``step``'s period, hottest first."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step // self.drift_every)
        return torch.randperm(self.num_experts, generator=g)

    def popularity(self, step: int) -> torch.Tensor:
        """float64 [E]: each expert's probability in a single draw during ``step``."""
        p = torch.arange(1, self.num_experts + 1, dtype=torch.float64) ** -self.alpha
        out = torch.empty_like(p)
        out[self.ranking(step)] = p / p.sum()
        return out

    def batch(self, step: int, rank: int, tokens: int, hidden: int) -> tuple:
        """This rank's decode step: x fp32 [N, H], topk_idx int64 [N, K], topk_weights fp32 [N, K]
        (random, summing to 1 per token)."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) * 4099 + rank)
        x = torch.randn(tokens, hidden, generator=g)
        gumbel = -torch.log(-torch.log(torch.rand(tokens, self.num_experts, generator=g, dtype=torch.float64)))
        topk_idx = (self.popularity(step).log() + gumbel).topk(self.topk, dim=1).indices
        weights = torch.rand(tokens, self.topk, generator=g)
        return x, topk_idx, weights / weights.sum(1, keepdim=True)


class ServedLayer:
    """One expert-parallel MoE layer, as a decode loop serves it on this rank.

    ``full``: a `GroupedExperts` holding all E logical experts (the same weights on every rank);
    this rank keeps copies of the ones its slots hold. Without ``rebalance_every`` (and
    ``slots`` None or E) it is the unreplicated layer: expert e on rank e // (E / P). With it,
    the layer starts from a plan for even loads on ``slots`` slots and rebalances from its
    `LoadRecorder` every ``rebalance_every`` steps as the module docstring says.
    ``migration_group``: a process group over the EP ranks for the background transfers
    (default: a new one; creating groups is collective). ``min_gain``: the least relief of the
    busiest rank (a fraction of its load) a new placement must bring to be worth moving weights.

    After each call: ``rows_per_rank`` int64 [P], the rows this rank sent to each rank;
    ``event``: "migrate" (a new placement was planned and its weights started moving),
    "reweight" (the placement stays, its replicas re-weighted from the next step), "switch"
    (migrated weights took over), or "".
    """

    def __init__(self, groups, full: GroupedExperts, slots: int | None = None, rebalance_every: int | None = None,
                 window: int = 10, window_seconds: float | None = None, backend: str = "alltoall",
                 migration_group=None, min_gain: float = 0.02):
        from ..dispatch import make_dispatcher
        num_experts = full.num_local_experts
        self.groups, self.num_experts = groups, num_experts
        self.num_slots = num_experts if slots is None else slots
        if self.num_slots % groups.ep_size or self.num_slots < num_experts:
            raise ConfigError(f"slots={self.num_slots}: give at least the {num_experts} experts, a multiple of the "
                              f"EP size {groups.ep_size}")
        self.per_rank = self.num_slots // groups.ep_size
        self.rebalance_every = rebalance_every
        replicated = rebalance_every is not None or self.num_slots != num_experts
        if replicated:
            placement = plan_placement(np.ones(num_experts), self.num_slots, groups.ep_size)
            self.phys_to_log = placement.phys_to_log[0]
            self.replicas = ReplicaRouter.from_placement(placement)
            self.replicas.agree(groups, "ServedLayer expert placement")
        else:
            self.phys_to_log, self.replicas = np.arange(num_experts), None
        mine = self.phys_to_log[groups.ep_rank * self.per_rank:(groups.ep_rank + 1) * self.per_rank].tolist()
        self.experts = GroupedExperts(self.per_rank, full.hidden, full.ffn_hidden, dtype=full.gate_up_proj.dtype)
        with torch.no_grad():
            self.experts.gate_up_proj.copy_(full.gate_up_proj[mine])
            self.experts.down_proj.copy_(full.down_proj[mine])
        self.dispatcher = make_dispatcher(backend, groups, num_experts=self.num_slots, hidden=full.hidden)
        self.recorder = None
        if rebalance_every is not None:
            if rebalance_every < 1:
                raise ConfigError(f"rebalance_every={rebalance_every}: must be at least 1 step")
            steps = None if window_seconds is not None else window
            self.recorder = LoadRecorder(1, num_experts, window_steps=steps, window_seconds=window_seconds)
            self.migration_group = migration_group or dist.new_group(list(groups.ep_ranks))
        self.min_gain, self._next = min_gain, None
        self.event, self.migrations, self.slots_received = "", 0, 0
        self.rows_per_rank = torch.zeros(groups.ep_size, dtype=torch.int64)

    @torch.no_grad()
    def __call__(self, step: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """One decode step: x [N, H], topk_idx int64 [N, K] logical experts (-1 = none),
        topk_weights [N, K] -> y [N, H]."""
        self.event = ""
        if self._next is not None:
            self._switch()
        slots = topk_idx
        if self.replicas is not None:
            first_position = (step * self.groups.ep_size + self.groups.ep_rank) * topk_idx.shape[0]
            slots = self.replicas(topk_idx, first_position)
        self.rows_per_rank = count_kept(slots // self.per_rank, self.groups.ep_size)   # a dropped slot stays -1
        y = expert_parallel_moe(self.dispatcher, x, slots, topk_weights, self.experts)
        if self.recorder is not None:
            self.recorder.record(0, count_kept(topk_idx, self.num_experts))
            self.recorder.step()
            if (step + 1) % self.rebalance_every == 0:
                self._plan()
        return y

    def _plan(self) -> None:
        """Plan from the window. Worth moving weights for (the busiest rank, on the window's
        loads, at least ``min_gain`` lighter than with the current placement re-weighted): start
        the migration. Else keep the placement with its replicas re-weighted. Either takes over
        at the start of the next step."""
        load = self.recorder.load(self.groups.ep_group)[0].double().numpy()                      # [E]
        ranks = self.groups.ep_size
        kept = self.replicas.reweighted(load, ranks)
        placement = plan_placement(load, self.num_slots, ranks, current=self.phys_to_log[None])
        planned = ReplicaRouter.from_placement(placement, load=load)
        if planned.rank_loads(load, ranks).max() < (1 - self.min_gain) * kept.rank_loads(load, ranks).max():
            new = placement.phys_to_log[0]
            planned.agree(self.groups, "ServedLayer expert placement")
            weights = [self.experts.gate_up_proj.data, self.experts.down_proj.data]
            moving = migrate(weights, self.phys_to_log, new, self.groups.ep_rank, list(self.groups.ep_ranks),
                             self.migration_group, async_op=True)
            self.slots_received += sum(t[2] == self.groups.ep_rank for t in transfers(self.phys_to_log, new, ranks))
            self._next = (new, planned, moving)
            self.migrations += 1
            self.event = "migrate"
        else:
            self._next = (self.phys_to_log, kept, None)
            self.event = "reweight"

    def _switch(self) -> None:
        new, router, moving = self._next
        if moving is not None:
            self.experts.gate_up_proj.data, self.experts.down_proj.data = moving.wait()
            self.event = "switch"
        self.phys_to_log, self.replicas, self._next = new, router, None


MODES = ("static", "rebalanced")


def serve_rank(rank: int, world: int, cfg) -> dict:
    """Run on every rank of a `LocalRanks` pool (or torchrun): the unreplicated layer and the
    rebalancing one on the same drifting traffic, step by step (their order alternating), each
    step timed between barriers. ``cfg``: a `serve_sim.ServeConfig`. Returns the report, the
    same on every rank."""
    from ..comm.topology import EPGroups
    groups = EPGroups.from_default()
    torch.manual_seed(cfg.seed)
    full = GroupedExperts(cfg.experts, cfg.hidden, cfg.ffn)
    traffic = DriftingZipf(cfg.experts, cfg.topk, cfg.zipf, cfg.drift_every, cfg.seed)
    layers = {"static": ServedLayer(groups, full, backend=cfg.backend),
              "rebalanced": ServedLayer(groups, full, cfg.experts + cfg.redundant, cfg.rebalance_every, cfg.window,
                                        cfg.window_seconds, cfg.backend, min_gain=cfg.min_gain)}
    seconds = torch.zeros(cfg.steps, len(MODES), dtype=torch.float64)
    rows = torch.zeros(len(MODES), cfg.steps, groups.ep_size, dtype=torch.int64)
    diff = torch.zeros(cfg.steps, 2, dtype=torch.float64)          # max |y_rebalanced - y_static|, max |y_static|
    unequal = torch.zeros(cfg.steps, dtype=torch.int64)
    events = []
    for step in range(cfg.steps):
        x, topk_idx, weights = traffic.batch(step, groups.ep_rank, cfg.tokens, cfg.hidden)
        out = {}
        for i in (range(len(MODES)) if step % 2 == 0 else reversed(range(len(MODES)))):
            dist.barrier(group=groups.ep_group)
            start = time.perf_counter()
            out[MODES[i]] = layers[MODES[i]](step, x, topk_idx, weights)
            seconds[step, i] = time.perf_counter() - start
            rows[i, step] = layers[MODES[i]].rows_per_rank
        diff[step] = torch.stack([(out["rebalanced"] - out["static"]).abs().max(), out["static"].abs().max()])
        unequal[step] = int(not torch.equal(out["rebalanced"], out["static"]))
        events.append(layers["rebalanced"].event)
    for t, op in ((seconds, dist.ReduceOp.MAX), (rows, dist.ReduceOp.SUM), (diff, dist.ReduceOp.MAX),
                  (unequal, dist.ReduceOp.MAX)):
        dist.all_reduce(t, op=op, group=groups.ep_group)
    moved = torch.tensor([layers["rebalanced"].slots_received])
    dist.all_reduce(moved, group=groups.ep_group)
    return report(cfg, seconds, rows, diff, unequal, events, layers["rebalanced"].migrations, int(moved))


def _p50(values: list) -> float | None:
    return statistics.median(values) if values else None


def report(cfg, seconds, rows, diff, unequal, events: list, migrations: int, slots_moved: int) -> dict:
    """The figures of a run from its per-step tensors (slowest rank's seconds [T, modes], rows
    per rank [modes, T, P], output difference and scale [T, 2], unequal [T])."""
    bal = {m: balancedness(rows[i].double().numpy()) for i, m in enumerate(MODES)}
    sec = {m: seconds[:, i].tolist() for i, m in enumerate(MODES)}
    by_event = {kind: [s for s, e in zip(sec["rebalanced"], events) if e == kind]
                for kind in ("", "migrate", "reweight", "switch")}
    tolerance = 1e-5 * max(1.0, float(diff[:, 1].max()))
    return {
        "config": asdict(cfg),
        "steps": {"balancedness": {m: b.tolist() for m, b in bal.items()}, "seconds": sec, "event": events,
                  "rows_per_rank": {m: rows[i].tolist() for i, m in enumerate(MODES)}},
        "summary": {
            "balancedness_mean": {m: float(b.mean()) for m, b in bal.items()},
            "step_p50_s": {m: _p50(s) for m, s in sec.items()},
            "rebalanced_step_p50_s": {kind or "normal": _p50(s) for kind, s in by_event.items()},
            "rebalanced_step_max_s": {kind or "normal": max(s, default=None) for kind, s in by_event.items()},
            "migrations": migrations,
            "reweights": len(by_event["reweight"]),
            "slots_moved": slots_moved,
            "max_abs_diff": float(diff[:, 0].max()),
            "outputs_match": bool(float(diff[:, 0].max()) <= tolerance),
            "bitwise_equal_steps": int(len(events) - int(unequal.sum())),
        },
    }
