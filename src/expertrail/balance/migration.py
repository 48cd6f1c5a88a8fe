"""Weight migration after a new plan: each rank receives only the slots it lacks.

For every slot of the new placement, the expert's weights come from this rank's own old slots
when it already held that expert (a local copy), else from one rank that held it (chosen
deterministically, spreading the load over the holders). Transfers are point-to-point; all
ranks derive the same transfer list from the two maps, so no metadata is exchanged. They may
run in the background (``async_op=True``) while the old placement keeps serving.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist


def transfers(old: np.ndarray, new: np.ndarray, num_ranks: int) -> list:
    """(src_rank, src_local_slot, dst_rank, dst_local_slot) for every slot that must cross ranks;
    old / new: phys_to_log [S] of one layer."""
    per_rank = len(new) // num_ranks
    out = []
    for dst_slot, expert in enumerate(new.tolist()):
        dst = dst_slot // per_rank
        holders = np.nonzero(old == expert)[0]
        if any(h // per_rank == dst for h in holders):
            continue                                            # a local copy suffices
        src_slot = int(holders[dst_slot % len(holders)])
        out.append((src_slot // per_rank, src_slot % per_rank, dst, dst_slot % per_rank))
    return out


class Migration:
    """Weights on their way (``migrate(..., async_op=True)``): ``wait()`` returns the new local
    tensors once every transfer of this rank has landed."""

    def __init__(self, out: list, works: list):
        self._out, self._works = out, works

    def wait(self) -> list:
        for work in self._works:
            work.wait()
        self._works = []
        return self._out


@torch.no_grad()
def migrate(tensors: list, old: np.ndarray, new: np.ndarray, ep_rank: int, ep_ranks: list, group=None,
            async_op: bool = False):
    """Move per-slot tensors (each [slots_per_rank, ...]: expert weights, optimizer state) from
    the ``old`` placement to the ``new`` one; returns the new local tensors. Collective over
    the EP group (``ep_ranks``: global rank of each EP rank).

    ``async_op=True`` returns a `Migration` as soon as the transfers are posted: the caller
    keeps computing with ``tensors`` (which must not change until ``wait()``) while the rows
    travel; give such a migration a ``group`` of its own, so that its point-to-point messages
    never meet another exchange's."""
    num_ranks = len(ep_ranks)
    per_rank = len(new) // num_ranks
    mine_old = old[ep_rank * per_rank:(ep_rank + 1) * per_rank].tolist()
    out = [torch.empty_like(t) for t in tensors]
    for i, expert in enumerate(new[ep_rank * per_rank:(ep_rank + 1) * per_rank].tolist()):
        if expert in mine_old:
            j = mine_old.index(expert)
            for src, dst in zip(tensors, out):
                dst[i].copy_(src[j])
    ops = []
    for tag, (src, src_slot, dst, dst_slot) in enumerate(transfers(old, new, num_ranks)):
        for n, (t, o) in enumerate(zip(tensors, out)):
            if src == ep_rank and dst != ep_rank:
                ops.append(dist.P2POp(dist.isend, t[src_slot].contiguous(), ep_ranks[dst], group, tag * len(tensors) + n))
            elif dst == ep_rank and src != ep_rank:
                ops.append(dist.P2POp(dist.irecv, o[dst_slot], ep_ranks[src], group, tag * len(tensors) + n))
    moving = Migration(out, dist.batch_isend_irecv(ops) if ops else [])
    return moving if async_op else moving.wait()
