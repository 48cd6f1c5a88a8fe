"""Triton kernels for the local data movement (see ``kernels/__init__.py`` for the contracts).

Each program handles one source row (or token) and a block of its columns: permute reads the
row once and writes every copy; reduce reads each copy once, adds in fp32 in slot order, and
writes the result once. Both are memory-bound by design.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 256


@triton.jit
def _permute_kernel(rows_ptr, dest_ptr, out_ptr, C, S, row_stride, out_stride, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    values = tl.load(rows_ptr + i * row_stride + cols, mask=mask)
    for s in range(S):
        d = tl.load(dest_ptr + i * S + s)
        if d >= 0:
            tl.store(out_ptr + d * out_stride + cols, values, mask=mask)


@triton.jit
def _reduce_kernel(rows_ptr, pos_ptr, w_ptr, out_ptr, C, S, row_stride, out_stride,
                   HAS_WEIGHTS: tl.constexpr, ACC_F64: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    if ACC_F64:
        acc = tl.zeros([BLOCK], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        p = tl.load(pos_ptr + i * S + s)
        if p >= 0:
            v = tl.load(rows_ptr + p * row_stride + cols, mask=mask, other=0.0).to(acc.dtype)
            if HAS_WEIGHTS:
                v = v * tl.load(w_ptr + p).to(acc.dtype)
            acc += v
    tl.store(out_ptr + i * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layout_kernel(idx_ptr, expert_count_ptr, member_ptr, K, P, LOCAL):
    n = tl.program_id(0)
    for k in range(K):
        e = tl.load(idx_ptr + n * K + k)
        if e >= 0:
            tl.atomic_add(expert_count_ptr + e, 1)
            tl.store(member_ptr + n * P + e // LOCAL, 1)


def _grid(rows: int, width: int):
    return (rows, triton.cdiv(max(width, 1), BLOCK_C))


def permute_rows(rows, dest, out_rows, zero_rows=None):
    rows, dest = rows.contiguous(), dest.contiguous()
    out = rows.new_empty(out_rows, rows.shape[1])
    if rows.shape[0] and rows.shape[1]:
        _permute_kernel[_grid(rows.shape[0], rows.shape[1])](rows, dest, out, rows.shape[1], dest.shape[1],
                                                           rows.stride(0), out.stride(0), BLOCK=BLOCK_C)
    if zero_rows is not None and zero_rows.numel():
        out.index_fill_(0, zero_rows, 0)
    return out


def reduce_copies_dense(rows, pos, weights, out_dtype):
    rows, pos = rows.contiguous(), pos.contiguous()
    out = torch.empty(pos.shape[0], rows.shape[1], dtype=out_dtype, device=rows.device)
    if pos.shape[0] == 0 or rows.shape[1] == 0:
        return out
    if rows.shape[0] == 0:
        return out.zero_()
    w = weights.contiguous() if weights is not None else rows      # unused pointer when no weights
    _reduce_kernel[_grid(pos.shape[0], rows.shape[1])](rows, pos, w, out, rows.shape[1], pos.shape[1], rows.stride(0),
                                                     out.stride(0), HAS_WEIGHTS=weights is not None,
                                                     ACC_F64=rows.dtype == torch.float64, BLOCK=BLOCK_C)
    return out


def layout_counts(topk_idx, num_experts, ep_size, domain_size):
    n, k = topk_idx.shape
    idx = topk_idx.contiguous()
    experts = torch.zeros(num_experts, dtype=torch.int32, device=idx.device)
    member = torch.zeros(n, ep_size, dtype=torch.int32, device=idx.device)
    if n and k:
        _layout_kernel[(n,)](idx, experts, member, k, ep_size, num_experts // ep_size)
    per_rank = member.sum(0)
    per_domain = member.view(n, ep_size // domain_size, domain_size).amax(2).sum(0)
    return experts.long(), per_rank.long(), per_domain.long(), member.bool()
