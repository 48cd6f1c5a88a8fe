"""Triton kernels for the local data movement (see ``kernels/__init__.py`` for the contracts).

Each program handles one source row (or token) and a block of its columns: permute reads the
row once and writes every copy; reduce reads each copy once, adds in fp32 in copy order, and
writes the result once. Both are memory-bound by design: the copy loop is unrolled (``S`` is a
compile-time constant) and branch-free (absent copies are masked), so all of a row's copies are
in flight at once, and blocks are wide enough for 16-byte loads per thread.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program and warps: 8 elements (16 bytes of bf16) per thread; measured on an H100
# (7168 bf16 columns, top-8) against 256 to 8192 columns at 4 to 16 warps, this was the fastest.
BLOCK_C = 2048
MAX_WARPS = 8
MAX_UNROLLED_COPIES = 32  # more copies than this: a runtime loop (one copy in flight at a time)


@triton.jit
def _permute_kernel(rows_ptr, dest_ptr, out_ptr, C, col_blocks, row_stride, out_stride,
                    S: tl.constexpr, BLOCK: tl.constexpr):
    i, cols = _row_and_columns(col_blocks, BLOCK)
    values = tl.load(rows_ptr + i * row_stride + cols, mask=cols < C)
    for s in tl.static_range(S):
        d = tl.load(dest_ptr + i * S + s)
        tl.store(out_ptr + d * out_stride + cols, values, mask=cols < tl.where(d >= 0, C, 0))   # -1: no copy


@triton.jit
def _row_and_columns(col_blocks, BLOCK: tl.constexpr):
    """This program's row and columns: a 1-D grid whose neighbouring programs share a row
    (contiguous memory), with no 65535 limit on the rows. The row is int64: row * stride may
    pass 2**31."""
    pid = tl.program_id(0)
    return (pid // col_blocks).to(tl.int64), (pid % col_blocks) * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _add_copy(acc, rows_ptr, pos_ptr, w_ptr, i, s, S, cols, C, row_stride, HAS_WEIGHTS: tl.constexpr):
    """acc + weight * row of copy s of output row i (acc unchanged where the copy is absent)."""
    p = tl.load(pos_ptr + i * S + s)
    present = p >= 0
    v = tl.load(rows_ptr + p * row_stride + cols, mask=cols < tl.where(present, C, 0), other=0.0).to(acc.dtype)
    if HAS_WEIGHTS:
        v = v * tl.load(w_ptr + p, mask=present, other=0.0).to(acc.dtype)
    return tl.where(present, acc + v, acc)


@triton.jit
def _reduce_kernel(rows_ptr, pos_ptr, w_ptr, out_ptr, C, col_blocks, S, row_stride, out_stride,
                   HAS_WEIGHTS: tl.constexpr, ACC_F64: tl.constexpr, UNROLL: tl.constexpr, BLOCK: tl.constexpr):
    i, cols = _row_and_columns(col_blocks, BLOCK)
    if ACC_F64:
        acc = tl.zeros([BLOCK], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
    if UNROLL > 0:                  # S == UNROLL: every copy's load is issued before the sums
        for s in tl.static_range(UNROLL):
            acc = _add_copy(acc, rows_ptr, pos_ptr, w_ptr, i, s, UNROLL, cols, C, row_stride, HAS_WEIGHTS)
    else:
        for s in range(S):
            acc = _add_copy(acc, rows_ptr, pos_ptr, w_ptr, i, s, S, cols, C, row_stride, HAS_WEIGHTS)
    tl.store(out_ptr + i * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < C)


@triton.jit
def _layout_kernel(idx_ptr, counts_ptr, member_ptr, N, E, P, D, LOCAL, DOMAIN_EXPERTS,
                   K: tl.constexpr, BLOCK_T: tl.constexpr, E_P2: tl.constexpr, P_P2: tl.constexpr,
                   D_P2: tl.constexpr):
    """Counts of a block of tokens as histograms in registers, then one atomic add per bin and
    program (integer adds: the result does not depend on their order)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < N
    e_bins, p_bins, d_bins = tl.arange(0, E_P2), tl.arange(0, P_P2), tl.arange(0, D_P2)
    per_expert = tl.zeros([E_P2], dtype=tl.int32)
    member = tl.zeros([BLOCK_T, P_P2], dtype=tl.int32)
    in_domain = tl.zeros([BLOCK_T, D_P2], dtype=tl.int32)
    for k in tl.static_range(K):
        e = tl.load(idx_ptr + t * K + k, mask=tmask, other=-1)
        per_expert += tl.sum((e[:, None] == e_bins[None, :]).to(tl.int32), axis=0)
        # -1 stays -1 (integer division truncates towards zero, so -1 // x would be 0)
        r = tl.where(e >= 0, e // LOCAL, -1)
        d = tl.where(e >= 0, e // DOMAIN_EXPERTS, -1)
        member = tl.maximum(member, (r[:, None] == p_bins[None, :]).to(tl.int32))
        in_domain = tl.maximum(in_domain, (d[:, None] == d_bins[None, :]).to(tl.int32))
    tl.store(member_ptr + t[:, None] * P + p_bins[None, :], member.to(tl.int8),
             mask=tmask[:, None] & (p_bins[None, :] < P))
    tl.atomic_add(counts_ptr + e_bins, per_expert, mask=e_bins < E)
    tl.atomic_add(counts_ptr + E + p_bins, tl.sum(member, axis=0), mask=p_bins < P)
    tl.atomic_add(counts_ptr + E + P + d_bins, tl.sum(in_domain, axis=0), mask=d_bins < D)


def _launch(rows: int, width: int):
    """(grid, columns per program, column blocks, warps) for ``rows`` of ``width``: narrow rows
    get narrow programs."""
    block = min(BLOCK_C, triton.next_power_of_2(max(width, 1)))
    col_blocks = triton.cdiv(width, block)
    return (rows * col_blocks,), block, col_blocks, max(1, min(MAX_WARPS, block // 256))


def permute_rows(rows, dest, out_rows, zero_rows=None):
    rows, dest = rows.contiguous(), dest.contiguous()
    out = rows.new_empty(out_rows, rows.shape[1])
    if rows.shape[0] and rows.shape[1] and dest.shape[1]:
        grid, block, col_blocks, warps = _launch(rows.shape[0], rows.shape[1])
        _permute_kernel[grid](rows, dest, out, rows.shape[1], col_blocks, rows.stride(0), out.stride(0),
                              S=dest.shape[1], BLOCK=block, num_warps=warps)
    if zero_rows is not None and zero_rows.numel():
        out.index_fill_(0, zero_rows, 0)
    return out


def reduce_copies_dense(rows, pos, weights, out_dtype):
    rows, pos = rows.contiguous(), pos.contiguous()
    out = torch.empty(pos.shape[0], rows.shape[1], dtype=out_dtype, device=rows.device)
    if pos.shape[0] == 0 or rows.shape[1] == 0:
        return out
    if rows.shape[0] == 0 or pos.shape[1] == 0:
        return out.zero_()
    w = weights.contiguous() if weights is not None else rows      # unused pointer when no weights
    most = pos.shape[1]                         # copies per output row
    grid, block, col_blocks, warps = _launch(pos.shape[0], rows.shape[1])
    _reduce_kernel[grid](
        rows, pos, w, out, rows.shape[1], col_blocks, most, rows.stride(0), out.stride(0), HAS_WEIGHTS=weights is not None,
        ACC_F64=rows.dtype == torch.float64, UNROLL=most if most <= MAX_UNROLLED_COPIES else 0, BLOCK=block,
        num_warps=warps)
    return out


def layout_counts(topk_idx, num_experts, ep_size, domain_size):
    n, k = topk_idx.shape
    idx = topk_idx.contiguous()
    domains = ep_size // domain_size
    counts = torch.zeros(num_experts + ep_size + domains, dtype=torch.int32, device=idx.device)
    member = (torch.empty if k else torch.zeros)(n, ep_size, dtype=torch.uint8, device=idx.device)  # the kernel writes all
    if n and k:
        e_p2, p_p2 = triton.next_power_of_2(num_experts), triton.next_power_of_2(ep_size)
        block_t = max(1, min(32, 4096 // max(e_p2, p_p2)))          # bounds the [tokens, bins] tiles
        local = num_experts // ep_size
        _layout_kernel[(triton.cdiv(n, block_t),)](idx, counts, member, n, num_experts, ep_size, domains, local,
                                                   local * domain_size, K=k, BLOCK_T=block_t, E_P2=e_p2,
                                                   P_P2=p_p2, D_P2=triton.next_power_of_2(domains))
    per_expert, per_rank, per_domain = counts.long().split([num_experts, ep_size, domains])
    return per_expert, per_rank, per_domain, member.view(torch.bool)
