"""The torch reference of the local kernels (and the CPU path)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit floats and fp32, fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class CopyPositions:
    """Per slot s: the source rows that have a copy s (``present``, ascending) and the row
    holding it (``pos``)."""

    present: list
    pos: list
    num_src: int

    def dense(self) -> torch.Tensor:
        """int64 [num_src, num_slots]: the row of each copy, -1 where there is none."""
        device = self.pos[0].device if self.pos else None
        out = torch.full((self.num_src, len(self.pos)), -1, dtype=torch.int64, device=device)
        for s, (present, pos) in enumerate(zip(self.present, self.pos)):
            out[present, s] = pos
        return out

    @classmethod
    def from_dense(cls, pos: torch.Tensor) -> "CopyPositions":
        """From int64 [num_src, num_slots] rows of copies (-1: none)."""
        present = [torch.nonzero(p >= 0).squeeze(1) for p in pos.t()]
        return cls(present=present, pos=[p[i] for p, i in zip(pos.t(), present)], num_src=pos.shape[0])

    @classmethod
    def build(cls, index: torch.Tensor, slot: torch.Tensor, num_src: int, num_slots: int) -> "CopyPositions":
        order = torch.argsort(slot * max(num_src, 1) + index)         # by slot, then source row
        counts = torch.bincount(slot, minlength=num_slots).tolist()
        present, pos = index[order].split(counts), order.split(counts)
        return cls(present=list(present), pos=list(pos), num_src=num_src)


def reduce_copies(rows: torch.Tensor, copies: CopyPositions, weights: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum over slots s, ascending, of weights * rows[copy s of i].

    rows [R, C], weights [R] or None -> [num_src, C] in ``out_dtype``. Slot by slot, the copies
    are gathered and added in fp32 (fp64 for fp64); each slot adds at most once to a row, so
    the order is fixed without atomics and the result is bitwise reproducible. The work is
    proportional to the number of copies, not to slots x rows.
    """
    num_src, width = copies.num_src, rows.shape[1]
    if len(copies.pos) == 1 and weights is None:        # a permutation (with holes): no sum
        present, pos = copies.present[0], copies.pos[0]
        picked = rows.index_select(0, pos)
        if present.numel() == num_src:
            return picked.to(out_dtype)
        return picked.new_zeros(num_src, width).index_copy_(0, present, picked).to(out_dtype)
    acc_dtype = accumulation_dtype(rows.dtype)
    acc = None
    for present, pos in zip(copies.present, copies.pos):
        if present.numel() == 0:
            continue
        plane = rows.index_select(0, pos).to(acc_dtype)   # same-dtype kernels: mixed bf16/fp32 is slow on CPU
        if weights is not None:   # w * row rounded once, then added: the same bits on both paths below
            plane.mul_(weights.index_select(0, pos).to(acc_dtype).unsqueeze(1))
        if present.numel() == num_src:                     # every row has this copy: present == arange
            acc = plane if acc is None else acc.add_(plane)
            continue
        if acc is None:
            acc = torch.zeros(num_src, width, dtype=acc_dtype, device=rows.device)
        acc.index_add_(0, present, plane)
    if acc is None:
        return rows.new_zeros(num_src, width, dtype=out_dtype)
    return acc.to(out_dtype)


def permute_rows(rows, dest, out_rows, zero_rows=None):
    out = rows.new_empty(out_rows, rows.shape[1])
    src, slot = torch.nonzero(dest >= 0, as_tuple=True)
    out[dest[src, slot]] = rows[src]
    if zero_rows is not None and zero_rows.numel():
        out.index_fill_(0, zero_rows, 0)
    return out


def reduce_copies_dense(rows, pos, weights, out_dtype):
    return reduce_copies(rows, CopyPositions.from_dense(pos), weights, out_dtype)


def layout_counts(topk_idx, num_experts, ep_size, domain_size):
    n = topk_idx.shape[0]
    valid = topk_idx >= 0
    ranks = torch.where(valid, topk_idx.clamp(min=0) // (num_experts // ep_size), torch.full_like(topk_idx, ep_size))
    member = torch.zeros(n, ep_size + 1, dtype=torch.bool, device=topk_idx.device).scatter_(1, ranks, True)[:, :ep_size]
    per_domain = member.view(n, ep_size // domain_size, domain_size).any(2).sum(0)
    return torch.bincount(topk_idx[valid], minlength=num_experts), member.sum(0), per_domain, member
