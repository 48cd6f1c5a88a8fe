"""Live rebalancing of a patched Hugging Face model's hot experts while it generates.

`LiveRebalancer(model)` does for every `hf.ExpertParallelMoE` block of a model patched with
replicas (``patch_model(..., replicas=...)``: E + redundant slots) what `tools/serving.py`'s
`ServedLayer` does for one layer, driven by the model's own forwards (so ``generate`` runs it
unchanged, one forward per decode step):

- record: a forward hook on each block's router adds the step's tokens per logical expert to
  one `LoadRecorder` ([blocks, E], a window of steps or seconds); the model's forward hook
  closes the step;
- plan: every ``rebalance_every`` steps, at the end of a forward, the window's loads (summed
  over the EP group: one all-reduce) plan a placement per block whose busiest rank carries more
  than ``1 + min_gain`` times the mean under its current map (`plan_placement`, keeping slots
  that stay put; `balanced_shares` weights the replicas). A block whose busiest rank the
  new placement relieves by at least ``min_gain`` starts migrating the weights its ranks lack,
  point to point on a process group of its own, in the background (`migrate(async_op=True)`);
  the others keep their placement, re-weighted;
- switch: at the start of the next forward every rank waits for its transfers (they had the
  generation's host work between two forwards to hide behind) and routes through the new maps.

Every rank counts the same forwards (generate's ``synced_gpus`` keeps early finishers
running), so they plan and switch at the same step, and the new maps are checked to be the
same on every rank (one all-gather of their digests). ``events`` lists (step, what) for each plan and
switch.

Replica choice: each (token, k) picks a replica by a hash of its position; positions are
numbered by step, block and rank here (`PositionedReplicas`), so that ranks holding the same
token index at the same step do not all pick the same replica.

Outputs: replicas hold the logical experts' weights bit for bit, but a token's expert GEMM
runs among other rows on a replica (blocks of another size), so outputs agree with the
unreplicated model's within fp32 rounding, not bitwise; greedy decoding then gives the same
tokens unless two logits are within that rounding of each other (a near tie).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..balance.migration import migrate
from ..balance.planner import plan_placement
from ..balance.recorder import LoadRecorder
from ..balance.replicas import ReplicaRouter
from ..errors import ConfigError
from ..kernels.torch_ops import count_kept


class PositionedReplicas:
    """A `ReplicaRouter` whose tokens' positions count from (step, block, rank): call it as the
    router is called (``replicas(topk_idx)``); everything else reads through to ``router``.
    ``rows_per_rank`` int64 [P]: rows sent to each rank by the last call."""

    def __init__(self, router: ReplicaRouter, clock, block: int, groups):
        self.router, self._clock, self._block, self._groups = router, clock, block, groups
        self.rows_per_rank = torch.zeros(groups.ep_size, dtype=torch.int64)

    def __getattr__(self, name):
        return getattr(self.router, name)

    def __call__(self, topk_idx: torch.Tensor, first_position: int = 0) -> torch.Tensor:
        g, n = self._groups, topk_idx.shape[0]
        position = ((self._clock.steps * 64 + self._block) * g.ep_size + g.ep_rank) * max(n, 1) + first_position
        slots = self.router(topk_idx, position)
        self.rows_per_rank = count_kept(slots // (self.router.num_slots // g.ep_size), g.ep_size)   # -1 stays -1
        return slots


class LiveRebalancer:
    """Rebalance ``model``'s replicated expert-parallel blocks as it runs (module docstring).

    Args:
        model: a model patched with ``replicas=`` (every block with slots > experts).
        rebalance_every: forwards between plans.
        window / window_seconds: the load window, in forwards or seconds (one of them).
        min_gain: the least relief of a block's busiest rank worth moving weights for.
        migration_group: a process group over the EP ranks for the transfers (default: a new
            one; creating it is collective).
    Collective to build. `detach()` removes its hooks (the current placement stays).
    """

    def __init__(self, model: nn.Module, rebalance_every: int = 8, window: int | None = 16,
                 window_seconds: float | None = None, min_gain: float = 0.02, migration_group=None):
        from .hf import _patched_blocks
        blocks = [b for _, b in _patched_blocks(model)]
        if not blocks:
            raise ConfigError("LiveRebalancer: the model has no expert-parallel block; call hf.patch_model first")
        flat = [b for b in blocks if b.replicas is None or b.replicas.num_slots <= b.num_experts]
        if flat:
            raise ConfigError(f"LiveRebalancer: {len(flat)} of {len(blocks)} blocks have no spare slots for replicas; "
                              "patch the model with replicas= on E + redundant slots (e.g. a plan_placement of even "
                              "loads) so that hot experts have room")
        if int(rebalance_every) < 1:
            raise ConfigError(f"rebalance_every={rebalance_every}: must be at least 1 forward")
        self.groups = blocks[0].groups
        self.blocks, self.rebalance_every, self.min_gain = blocks, int(rebalance_every), float(min_gain)
        steps = None if window_seconds is not None else window
        self.recorder = LoadRecorder(len(blocks), blocks[0].num_experts, window_steps=steps,
                                     window_seconds=window_seconds)
        self.migration_group = migration_group or dist.new_group(list(self.groups.ep_ranks))
        self.steps, self.events, self.migrations = 0, [], 0
        self._next: list | None = None
        for i, b in enumerate(blocks):
            b.replicas = PositionedReplicas(_router_of(b.replicas), self, i, self.groups)
        self._hooks = [b.gate.register_forward_hook(self._recording(i)) for i, b in enumerate(blocks)]
        self._hooks += [model.register_forward_pre_hook(self._before), model.register_forward_hook(self._after)]

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _recording(self, index: int):
        num_experts = self.blocks[index].num_experts

        def record(gate, args, output):
            topk_idx = output[-1]
            ids = topk_idx[topk_idx >= 0].long().flatten()
            self.recorder.record(index, torch.bincount(ids.cpu(), minlength=num_experts))
        return record

    def _before(self, module, args) -> None:
        if self._next is None:
            return
        for block, (router, moving) in zip(self.blocks, self._next):
            if moving is not None:
                block.experts.gate_up_proj.data, block.experts.down_proj.data = moving.wait()
            block.replicas.router = router
        self._next = None
        self.events.append((self.steps, "switch"))

    def _after(self, module, args, output) -> None:
        self.recorder.step()
        self.steps += 1
        if self.steps % self.rebalance_every == 0:
            self._plan()

    @torch.no_grad()
    def _plan(self) -> None:
        """Plan every block from the window (one all-reduce); start the migrations worth it."""
        loads = self.recorder.load(self.groups.ep_group).double().numpy()                 # [blocks, E]
        g, ranks, plans, moved = self.groups, self.groups.ep_size, [], 0
        for block, load in zip(self.blocks, loads):
            current = block.replicas.router
            now = current.rank_loads(load, ranks)
            if now.max() <= (1 + self.min_gain) * now.mean():      # balanced as it is: nothing to plan
                plans.append((current, None))
                continue
            old = current.slot_experts.cpu().numpy()
            kept = current.reweighted(load, ranks)
            placement = plan_placement(load, current.num_slots, ranks, current=old[None])
            planned = ReplicaRouter.from_placement(placement, load=load)
            if planned.rank_loads(load, ranks).max() < (1 - self.min_gain) * kept.rank_loads(load, ranks).max():
                new = placement.phys_to_log[0]
                weights = [block.experts.gate_up_proj.data, block.experts.down_proj.data]
                plans.append((planned, migrate(weights, old, np.asarray(new), g.ep_rank, list(g.ep_ranks),
                                               self.migration_group, async_op=True)))
                moved += 1
            else:
                plans.append((kept, None))
        if all(router is block.replicas.router for block, (router, _) in zip(self.blocks, plans)):
            return                                      # every block kept as it is (alike on every rank)
        g.check_same({"placements (crc32 of each block's)": [router.digest() for router, _ in plans]},
                     "LiveRebalancer placements")
        self.migrations += moved
        self._next = plans
        self.events.append((self.steps, f"plan:{moved}"))


def _router_of(replicas) -> ReplicaRouter:
    return replicas.router if isinstance(replicas, PositionedReplicas) else replicas
