"""Local data movement of dispatch and combine: the torch kernels (`torch_ops`) and the Triton
fast path, the row buffers a dispatcher owns (`workspace`) and the FP8 row format (`fp8`).

``copy_rows`` (one read of each row, written to each of its copies), ``reduce_copies`` (the
weighted sum of each row's copies in fp32, fixed order, written once) and ``layout_counts``,
each choosing between the two in one place. The torch implementations are the reference and the CPU path; the
Triton kernels run for CUDA tensors when Triton is installed (`set_mode`: "torch" turns them
off, "triton" forces them, e.g. on the CPU with ``TRITON_INTERPRET=1`` in tests; the mode at
import is ``EXPERTRAIL_KERNELS``, default "auto").
"""
from __future__ import annotations

import os

import torch

from . import torch_ops

_triton = None                         # the Triton module, imported on first need (it is optional)


def _triton_kernels():
    global _triton
    if _triton is None:
        try:
            from . import triton_kernels
            _triton = triton_kernels
        except ImportError:            # pragma: no cover - depends on the install
            _triton = False
    return _triton


MODES = ("auto", "torch", "triton")
_mode = os.environ.get("EXPERTRAIL_KERNELS", "auto")


def set_mode(mode: str) -> str:
    """Choose the kernels: "auto" (Triton for CUDA tensors when it is installed), "torch" or
    "triton". Returns the previous mode, to restore it."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernel mode {mode!r}; choose one of {MODES}")
    previous, _mode = _mode, mode
    return previous


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels handle tensor ``t`` (see `set_mode`)."""
    if _mode == "torch" or not (_mode == "triton" or t.is_cuda):
        return False
    return bool(_triton_kernels())


def copy_rows(rows: torch.Tensor, index: torch.Tensor, out_rows: int, destinations, zero_rows=None,
              skip: tuple | None = None, place=None) -> torch.Tensor:
    """The dispatch path's row copy: out[j] = rows[index[j]], choosing the kernel in one place.

    rows [num_src, C], index int64 [R] -> [out_rows, C]. With Triton (`use_triton`), one read
    of each source row written to each of its copies: ``destinations()`` gives them (int64
    [num_src, S], -1: none) and ``zero_rows()`` the output rows to zero (padding), both only
    computed on that path. On the torch path, ``rows[index]`` with the rows in ``skip = (start,
    end)`` left unfilled (a block the caller puts in place itself), then ``place(out)`` (the
    padding) when given.
    """
    if use_triton(rows):
        return _triton_kernels().permute_rows(rows, destinations(), out_rows, zero_rows() if zero_rows else None)
    out = torch_ops.gather_rows(rows, index, skip)
    return place(out) if place is not None else out


def reduce_copies(rows: torch.Tensor, copies: torch_ops.CopyPositions, weights: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum over copies s, ascending, of weights * rows[copy s of i], in fp32 (fp64 for
    fp64): the Triton kernel on its dense positions (`use_triton`), else the torch reference
    on its bags."""
    if use_triton(rows):
        return _triton_kernels().reduce_copies_dense(rows, copies.dense(), weights, out_dtype)
    return torch_ops.reduce_copies(rows, copies, weights, out_dtype)


def layout_counts(topk_idx: torch.Tensor, num_experts: int, ep_size: int, domain_size: int):
    """(rows per expert [E], tokens per rank [P], tokens per domain [P / domain_size],
    token-has-an-expert-on-rank bool [N, P]) of ``topk_idx [N, K]`` with contiguous placement."""
    impl = _triton_kernels() if use_triton(topk_idx) else torch_ops
    return impl.layout_counts(topk_idx, num_experts, ep_size, domain_size)
