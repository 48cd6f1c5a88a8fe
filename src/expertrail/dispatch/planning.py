"""What a backend's route planning shares: what the source rank prepares before any exchange
(`Outgoing`), routing weights carried as int64 metadata (`weight_bits`), and the
expansion of received rows into padded, expert-major rows (`expand_local`, `padded_positions`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.torch_ops import stable_argsort


def weight_bits(weights: torch.Tensor) -> torch.Tensor:
    """Float weights -> int64 bit patterns of their fp64 value (travel with int metadata)."""
    return weights.to(torch.float64).contiguous().view(torch.int64)


def bits_weight(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return bits.contiguous().view(torch.float64).to(dtype)


def expand_local(local_ids: torch.Tensor, src_key: torch.Tensor | None = None, bound: int = 1):
    """Expand received rows into (row, k, local expert) triples in expert-major order.

    local_ids: int64 [R, K] local expert of each top-k entry, -1 where the entry is not for this rank.
    Rows must arrive in (source rank, source token) order, or give ``src_key [R] < bound`` that
    sorts them so. Returns row, k, expert: int64 [M] each.
    """
    row, k = torch.nonzero(local_ids >= 0).unbind(1)
    expert = local_ids[row, k]
    key = expert if src_key is None else expert * bound + src_key.index_select(0, row)
    order = stable_argsort(key)
    return row.index_select(0, order), k.index_select(0, order), expert.index_select(0, order)


def padded_positions(expert: torch.Tensor, real: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    """Row of each real output row in the padded expert-major output.

    expert: int64 [M_real] local expert of each row, in output order; real / padded: int64
    [E_local] rows per expert without / with padding.
    """
    position = torch.arange(expert.numel(), device=expert.device) - (torch.cumsum(real, 0) - real)[expert]
    return (torch.cumsum(padded, 0) - padded)[expert] + position


@dataclass
class Outgoing:
    """What a backend prepares on the source rank before any exchange (`Dispatcher._outgoing`).

    topk_idx: int64 [N, K], after capacity drops
    counts: int64 [P, C] sent to every EP peer in the control exchange (``count_columns``)
    token: int64 [R] the token each row of the first hop copies, grouped by destination member
        (None when the first hop sends the tokens as they are: allgather)
    send_splits: rows per member of the first hop's channel; me: this rank's index in it
    dest: int64 [R] destination member of each sent row (dedup: EP rank, hierarchical: domain)
    pairs: alltoall: the (token, k) pair ``n * K + k`` of each sent row
    host_counts: ``counts`` copied to the host, where the backend plans with them (alltoall)
    """

    topk_idx: torch.Tensor
    counts: torch.Tensor
    token: torch.Tensor | None = None
    send_splits: list | None = None
    me: int | None = None
    dest: torch.Tensor | None = None
    pairs: torch.Tensor | None = None
    host_counts: torch.Tensor | None = None
