"""The torch reference of the local kernels (and the CPU path)."""
from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def permute_rows(rows, dest, out_rows, zero_rows=None):
    out = rows.new_empty(out_rows, rows.shape[1])
    src, slot = torch.nonzero(dest >= 0, as_tuple=True)
    out[dest[src, slot]] = rows[src]
    if zero_rows is not None and zero_rows.numel():
        out.index_fill_(0, zero_rows, 0)
    return out


def reduce_copies_dense(rows, pos, weights, out_dtype):
    acc_dtype = accumulation_dtype(rows.dtype)
    acc = torch.zeros(pos.shape[0], rows.shape[1], dtype=acc_dtype, device=rows.device)
    for s in range(pos.shape[1]):
        present = torch.nonzero(pos[:, s] >= 0).squeeze(1)
        p = pos[present, s]
        plane = rows.index_select(0, p).to(acc_dtype)
        if weights is not None:
            plane.mul_(weights.index_select(0, p).to(acc_dtype).unsqueeze(1))
        acc.index_add_(0, present, plane)
    return acc.to(out_dtype)


def layout_counts(topk_idx, num_experts, ep_size, domain_size):
    n = topk_idx.shape[0]
    valid = topk_idx >= 0
    ranks = torch.where(valid, topk_idx.clamp(min=0) // (num_experts // ep_size), torch.full_like(topk_idx, ep_size))
    member = torch.zeros(n, ep_size + 1, dtype=torch.bool, device=topk_idx.device).scatter_(1, ranks, True)[:, :ep_size]
    per_domain = member.view(n, ep_size // domain_size, domain_size).any(2).sum(0)
    return torch.bincount(topk_idx[valid], minlength=num_experts), member.sum(0), per_domain, member
