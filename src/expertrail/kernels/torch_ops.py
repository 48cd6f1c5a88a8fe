"""The torch kernels: the CPU path, and the reference the Triton kernels are checked against."""
from __future__ import annotations

import numpy as np
import torch

from .workspace import allocate, allocate_zeros


def count_values(values: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how many of ``values`` (int64, each in [0, n)) equal each of 0 .. n-1.

    ``torch.bincount`` without its host synchronisation: on CUDA it reads the values' range on
    the host (two waits for the GPU) to size its output; here the size is given. Integer sums
    are exact, so the result is the same in any order."""
    return torch.zeros(n, dtype=torch.int64, device=values.device).scatter_add_(0, values, torch.ones_like(values))


def count_kept(values: torch.Tensor, n: int) -> torch.Tensor:
    """`count_values` of int64 ``values`` (any shape) in [0, n) or negative (dropped: not counted),
    still without a host synchronisation (the dropped ones go to an extra bin, left off)."""
    flat = values.reshape(-1)
    return count_values(torch.where(flat >= 0, flat, n), n + 1)[:n]


_RADIX_BOUND = 1 << 16


def stable_argsort(key: torch.Tensor) -> torch.Tensor:
    """int64 [n]: the order that sorts the integer ``key [n]`` stably.

    Routing plans sort small keys (expert, rank, token, copy). On the CPU, keys in [0, 2^16)
    use numpy's radix sort on uint16 (one pass per byte), faster than
    ``torch.sort(stable=True)`` at routing sizes (docs/decisions.md: Radix sorts). Other keys,
    and other devices, use ``torch.sort``.
    """
    if key.device.type == "cpu" and key.numel():
        low, high = torch.aminmax(key)
        if low >= 0 and high < _RADIX_BOUND:
            return torch.from_numpy(np.argsort(key.numpy().astype(np.uint16), kind="stable"))
    return torch.sort(key, stable=True).indices


def take_rows(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``rows[index]`` along dim 0 (into ``out`` when given)."""
    return torch.index_select(rows, 0, index, out=out) if out is not None else rows.index_select(0, index)


def gather_rows(rows: torch.Tensor, index: torch.Tensor, skip: tuple | None = None) -> torch.Tensor:
    """rows[index] -> [len(index), C]; the output rows in the range ``skip = (start, end)`` are
    left unfilled (rows that stay on this rank and are put in place by the hop itself)."""
    out = allocate((index.numel(), *rows.shape[1:]), rows.dtype, rows.device)
    if skip is None or skip[0] == skip[1]:
        return take_rows(rows, index, out=out)
    start, end = skip
    take_rows(rows, index[:start], out=out[:start])
    take_rows(rows, index[end:], out=out[end:])
    return out


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, without the call when it already has it (a no-op ``to`` still costs
    a dispatch, which small decode-time tensors feel)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit floats and fp32, fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class CopyPositions:
    """Where the copies of each of ``num_src`` source rows sit, in the form a kernel asks for
    (each built on first use, so a path pays only for its own):

    - bags (the torch path, ``embedding_bag``): ``pos[offsets[i]:offsets[i + 1]]`` are the rows
      holding source row i's copies, in ascending copy order (``copy``), and ``source`` repeats
      i for each of them; all int64 [copies] except ``offsets`` [num_src + 1];
    - ``dense()`` (the Triton path): int64 [num_src, max_copies], the row of each copy or -1. It
      is one scatter: no sort and no host sync (the bags need both).
    """

    def __init__(self, num_src: int, max_copies: int, index: torch.Tensor | None = None,
                 copy: torch.Tensor | None = None, dense: torch.Tensor | None = None, bags: tuple | None = None):
        self.num_src, self.max_copies = num_src, max_copies
        self._index, self._copy, self._dense, self._bags = index, copy, dense, bags

    @classmethod
    def build(cls, index: torch.Tensor, copy: torch.Tensor, num_src: int, max_copies: int) -> "CopyPositions":
        """From the source row ``index [R]`` and ``copy [R]`` of each of R rows (no two rows
        share both)."""
        return cls(num_src, max_copies, index=index, copy=copy)

    @classmethod
    def from_dense(cls, pos: torch.Tensor) -> "CopyPositions":
        """From int64 [num_src, max_copies] rows of copies (-1: none)."""
        return cls(pos.shape[0], pos.shape[1], dense=pos)

    def dense(self) -> torch.Tensor:
        """int64 [num_src, max_copies]: the row of each copy, -1 where there is none (cached)."""
        if self._dense is None:
            if self._index is not None:
                rows, at = (self._index, self._copy), torch.arange(self._index.numel(), device=self._index.device)
            else:                                       # made from bags only
                pos, copy, source, _ = self._bags
                rows, at = (source, copy), pos
            out = torch.full((self.num_src, self.max_copies), -1, dtype=torch.int64, device=at.device)
            out[rows] = at
            self._dense = out
        return self._dense

    @property
    def pos(self) -> torch.Tensor:
        return self._bag_form()[0]

    @property
    def copy(self) -> torch.Tensor:
        return self._bag_form()[1]

    @property
    def source(self) -> torch.Tensor:
        return self._bag_form()[2]

    @property
    def offsets(self) -> torch.Tensor:
        return self._bag_form()[3]

    def _bag_form(self) -> tuple:
        """(pos, copy, source, offsets), see the class docstring (cached)."""
        if self._bags is None:
            if self._index is None:                                     # from the dense form
                present = self._dense >= 0
                n, s = present.shape
                if n and s and bool(present.all()):                     # every copy used: no search
                    every = torch.arange(n * s, device=present.device)
                    self._bags = (self._dense.reshape(-1), every % s, every // s,
                                  torch.arange(0, n * s + 1, s, device=present.device))
                else:
                    source, copy = torch.nonzero(present, as_tuple=True)    # row-major: by source, then copy
                    self._bags = (self._dense[source, copy], copy, source, self._offsets(present.sum(1)))
            else:
                index, copy = self._index, self._copy
                key = index * max(self.max_copies, 1) + copy                 # unique per copy
                bound = self.num_src * max(self.max_copies, 1)
                if key.device.type == "cpu" and bound <= _RADIX_BOUND:
                    order = stable_argsort(key)                              # by source row, then copy
                elif bound <= 4 * key.numel() + 4096:                        # sort by key with a scatter
                    at = torch.full((bound,), -1, dtype=torch.int64, device=key.device)
                    at[key] = torch.arange(key.numel(), device=key.device)
                    order = at[at >= 0]
                else:
                    order = torch.argsort(key)
                counts = count_values(index, self.num_src)
                self._bags = (order, copy.index_select(0, order), index.index_select(0, order),
                              self._offsets(counts))
        return self._bags

    def _offsets(self, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.zeros(self.num_src + 1, dtype=torch.int64, device=counts.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        return offsets


# Payload dtypes whose copies are summed as they are (fp32 accumulation inside the kernel);
# others are widened to fp32 first.
_NATIVE = (torch.float32, torch.float64, torch.bfloat16)
# A weight as a sum of bf16 parts (8 significand bits each) whose products with a bf16 row are
# exact in fp32: as many parts as the weight's dtype has significand bits (fp32: 24, fp16: 11).
_WEIGHT_PARTS = {torch.bfloat16: 1, torch.float16: 2}


def reduce_copies(rows: torch.Tensor, copies: CopyPositions, weights: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum over copies s, ascending, of weights * rows[copy s of i].

    rows [R, C], weights [R] or None -> [num_src, C] in ``out_dtype``. One fused pass
    (``embedding_bag``): each row is read once, the sum of a source row's copies is formed in
    fp32 (fp64 for fp64) in copy order by one thread and written once, so the result is
    bitwise reproducible. bf16 rows keep their dtype in the pass: a fp32 weight is split into
    three bf16 parts whose products with a bf16 row are exact in fp32, so the result matches
    fp32 arithmetic on widened rows (tests compare it with an fp64 sum). A fp16 weight needs
    two parts and a bf16 weight one (same result, a third of the work; docs/decisions.md: bf16
    weights in one part, Three parts for an fp32 weight, not two).
    """
    num_src, width = copies.num_src, rows.shape[1]
    if copies.pos.numel() == 0:
        return rows.new_zeros(num_src, width, dtype=out_dtype)
    if copies.max_copies == 1 and weights is None:       # a permutation (with holes): no sum
        return _pick(rows, copies.pos, copies.source, num_src, out_dtype)
    return reduce_bags(rows, copies.pos, copies.offsets, weights, out_dtype)


def reduce_copies_of(rows: torch.Tensor, copies: CopyPositions, weights: torch.Tensor | None,
                     out_dtype: torch.dtype, start: int, end: int,
                     rows_of: torch.Tensor | None = None) -> torch.Tensor:
    """Source rows [start, end) of `reduce_copies`' result -> [end - start, C], the same bits.
    rows_of: int64, the row of ``rows`` holding each copy position (the positions count real
    rows, ``rows`` has padding); weights [rows] as ``rows``. For a caller summing one table in
    several calls, ``rows`` as `summing_table` gives them (widened once)."""
    first, last = int(copies.offsets[start]), int(copies.offsets[end])
    index = copies.pos[first:last]
    if rows_of is not None:
        index = rows_of.index_select(0, index)
    if copies.max_copies == 1 and weights is None:       # as `reduce_copies`: picked, not summed
        return _pick(rows, index, copies.source[first:last] - start, end - start, out_dtype)
    return reduce_bags(rows, index, copies.offsets[start:end + 1] - first, weights, out_dtype)


def _pick(rows: torch.Tensor, index: torch.Tensor, source: torch.Tensor, num_out: int,
          out_dtype: torch.dtype) -> torch.Tensor:
    """out[source[j]] = rows[index[j]], zeros where no row lands -> [num_out, C] in ``out_dtype``."""
    width = rows.shape[1]
    if index.numel() == num_out:                # every output row has its one copy, in order
        picked = take_rows(rows, index, out=allocate((num_out, width), rows.dtype, rows.device))
    else:
        picked = allocate_zeros((num_out, width), rows.dtype, rows.device).index_copy_(0, source,
                                                                                     take_rows(rows, index))
    return cast(picked, out_dtype)


def reduce_bags(rows: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum over j in [offsets[i], offsets[i + 1]), ascending, of weights[index[j]] *
    rows[index[j]] (`reduce_copies` on bags given directly: the same pass, so a bag sums to the
    same bits whichever bags are summed with it). rows [R, C], index int64 [n], offsets int64
    [num_out + 1] from 0, weights [R] or None -> [num_out, C] in ``out_dtype``."""
    table = summing_table(rows, out_dtype)
    per_copy = None
    if weights is not None:
        per_copy = cast(weights.index_select(0, index), accumulation_dtype(table.dtype))
        if table.dtype == torch.bfloat16:
            parts = _WEIGHT_PARTS.get(weights.dtype, 3)
            per_copy = _split(per_copy, torch.bfloat16, parts).reshape(-1)
            if parts > 1:
                index, offsets = index.repeat_interleave(parts), offsets * parts
        else:
            per_copy = cast(per_copy, table.dtype)
    return cast(_embedding_bag_sum(table, index, offsets, per_copy), out_dtype)


def summing_table(rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The rows as `reduce_bags` sums them: as they are where the pass accumulates them in fp32
    (fp64) itself, else widened once (a caller summing a table in several calls widens it once)."""
    native = rows.dtype in _NATIVE and (rows.dtype == out_dtype or rows.dtype != torch.bfloat16)
    return rows if native else cast(rows, accumulation_dtype(rows.dtype))


def _embedding_bag_sum(table, index, offsets, per_copy) -> torch.Tensor:
    """``embedding_bag(..., mode="sum", include_last_offset=True)``: [len(offsets) - 1, C],
    empty bags give zero rows. The functional form into a fresh tensor, not aten's forward-only
    ``out`` variant into a pooled buffer: that one zero-fills its output and then accumulates,
    which costs more than a fresh output's page faults (docs/decisions.md: Combine's sums into
    fresh tensors)."""
    return torch.embedding_bag(table, index, offsets, False, 0, False, per_copy, True)[0]


def _split(values: torch.Tensor, dtype: torch.dtype, parts: int) -> torch.Tensor:
    """[n] fp32 -> [n, parts] in ``dtype`` whose row sums are ``values`` (each part rounds the
    remainder of the previous ones; the remainders are exact in fp32)."""
    out = [values.to(dtype)]
    rest = values
    for _ in range(parts - 1):
        rest = rest - out[-1]                       # promoted to fp32: the exact remainder
        out.append(rest.to(dtype))
    return torch.stack(out, 1)


def permute_rows(rows, dest, out_rows, zero_rows=None):
    out = rows.new_empty(out_rows, rows.shape[1])
    src, copy = torch.nonzero(dest >= 0, as_tuple=True)
    out[dest[src, copy]] = rows[src]
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
    return count_values(topk_idx[valid], num_experts), member.sum(0), per_domain, member
