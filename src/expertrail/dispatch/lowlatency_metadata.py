"""The lowlatency mode's per-call metadata, made on the host (numpy) or on the device (torch).

Each dispatch writes into every peer's block tail a header (error flag, routing weights' dtype
code) and, per token row, which of the peer's local experts the row is for and with which weight
(fp64 words); once the exchange lands it reads every peer's header and turns the received tables
into the packed layout: which token row each packed row comes from, each row's weight,
and the bags the combine sums. Combine's blocks carry only the header.

Two implementations make the same metadata through one interface:

- `HostMetadata` (CPU ranks): numpy on views of the buffers' tails (shared memory, no copies). A
  decode step's metadata is a few hundred numbers, and a torch call costs its dispatcher
  overhead whatever its size (5-30 us with 4 ranks on 2 cores, most of a step's CPU time:
  docs/benchmarks.md), numpy's a few us.
- `DeviceMetadata` (CUDA): torch on the device, reading nothing on the host (that would be a
  sync), so that a decode step can be captured in a CUDA graph (benchmarks/gpu_lowlatency.py
  checks both on a GPU, recorded in docs/benchmarks.md; the tests run it on CPU).

Both check the expert ids' values (in [-1, E), none twice in a token): `HostMetadata` on the
host, with the message; `DeviceMetadata` on the device, into the header's error flag and
`DeviceMetadata.rejected` (a device bool), which the dispatcher reads where it agrees on errors
and asserts on the device where it does not.

The tests run both on CPU and compare each with the normal mode bit for bit.
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.torch_ops import CopyPositions, cast
from .checks import TWICE, id_range_message

HEADER_WORDS = 2                  # fp64 words at the head of each metadata tail: error flag, weights dtype
# Routing weights travel as fp64 (exact for each of these) with their dtype's index beside them.
WEIGHT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


class _Plan:
    """What both planners know: the geometry and the buffers' metadata tails.

    Args:
        num_experts, ep_size (P), local_experts (E_local), max_tokens (T): the dispatcher's shape.
        send_tail, recv_tail: uint8 [P, 8 * (HEADER_WORDS + 2 T E_local)] views of the dispatch
            blocks' tails (the header, then per token row E_local expert flags and E_local weights).
        back_send_tail, back_tail: uint8 [P, 8 * HEADER_WORDS] views of the combine blocks' tails.
        source_of_packed: int64 [E_local * P * T + 1], the row each packed row is gathered from
            (written by `expansion`; the last entry is a scratch entry); pair_source: int64
            [P * T * E_local], the row each (token row, local expert) pair takes.
    """

    def __init__(self, num_experts: int, ep_size: int, local_experts: int, max_tokens: int,
                 send_tail: torch.Tensor, recv_tail: torch.Tensor, back_send_tail: torch.Tensor,
                 back_tail: torch.Tensor, source_of_packed: torch.Tensor, pair_source: torch.Tensor):
        self.num_experts, self.ep_size, self.local, self.max_tokens = num_experts, ep_size, local_experts, max_tokens
        self.rows = ep_size * max_tokens                                          # P * T received token rows
        self.send_tail, self.recv_tail, self.back_send_tail, self.back_tail = send_tail, recv_tail, back_send_tail, back_tail
        self.source_of_packed, self.pair_source = source_of_packed, pair_source


class HostMetadata(_Plan):
    """The metadata in numpy on views of the tails (CPU buffers only)."""

    rejected = None                   # the ids are checked in `write`, with the message

    def __init__(self, *args):
        super().__init__(*args)
        p, t, local = self.ep_size, self.max_tokens, self.local
        self._send_header = _float64_words(self.send_tail)[:, :HEADER_WORDS]                 # [P, 2]
        self._send_table = _reshaped(_float64_words(self.send_tail)[:, HEADER_WORDS:], (p, t, 2, local))
        self._recv_header = _float64_words(self.recv_tail)[:, :HEADER_WORDS]
        self._recv_table = _reshaped(_float64_words(self.recv_tail)[:, HEADER_WORDS:], (p, t, 2, local))
        self._back_header = _float64_words(self.back_send_tail)
        self._back_received = _float64_words(self.back_tail)
        self._before_expert = np.arange(local) * self.rows - 1       # the packed row before each expert's first
        self._source_of_packed, self._pair_source = self.source_of_packed.numpy(), self.pair_source.numpy()

    def write(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, message: str | None, where: str) -> str | None:
        """Every peer's header and token-row tables from ``topk_idx [N, K]`` and ``topk_weights
        [N, K]``, after checking the ids (in [-1, num_experts), none twice in a token). With an
        error (``message``, or found here) the header says failed and every token row is empty.
        Returns the error message or None."""
        table = self._send_table                                                  # [P, T, 2, E_local]
        table[...] = 0
        idx = topk_idx.numpy() if message is None else None
        low, high = (int(idx.min()), int(idx.max())) if idx is not None and idx.size else (-1, -1)
        if low < -1 or high >= self.num_experts:
            message = id_range_message(where, self.num_experts, low if low < -1 else high)
        if message is None:
            token, k = np.nonzero(idx >= 0)
            peer, expert = np.divmod(idx[token, k], self.local)
            flags = table[:, :, 0]
            flags[peer, token, expert] = 1
            if flags.sum() == token.size:
                weights = topk_weights.detach()
                weights = (weights if weights.dtype in _NUMPY_DTYPES else weights.to(torch.float64)).numpy()
                table[peer, token, 1, expert] = weights[token, k]
            else:                                                  # fewer flags than ids: one listed twice
                table[...] = 0
                message = f"{where}: {TWICE}"
        self._send_header[:] = (1.0, -1.0) if message else (0.0, WEIGHT_DTYPES.index(topk_weights.dtype))
        return message

    def received_header(self) -> tuple:
        """(failed [P], weights dtype codes [P]) of the landed dispatch blocks."""
        return self._recv_header[:, 0], self._recv_header[:, 1]

    def expansion(self, weights_dtype: torch.dtype) -> tuple:
        """From the landed tables: (copies, row_weights, count), see `LowLatencyResult`, with
        ``source_of_packed`` pointing each expert's real rows at their token rows."""
        member = (self._recv_table[:, :, 0] != 0).reshape(self.rows, self.local)    # [P*T, E_local]
        place = member.cumsum(0) + self._before_expert                             # each pair's packed row
        pair = np.flatnonzero(member)                                               # by token row, then local expert
        to = place.reshape(-1)[pair]
        self._source_of_packed[to] = self._pair_source[pair]
        row_weights = np.zeros(self.local * self.rows + 1, dtype=_NUMPY_DTYPES.get(weights_dtype, np.float64))
        row_weights[to] = self._recv_table[:, :, 1].reshape(-1)[pair]
        offsets = np.zeros(self.rows + 1, dtype=np.int64)
        np.cumsum(member.sum(1), out=offsets[1:])
        source, copy = np.divmod(pair, self.local)
        copies = CopyPositions(self.rows, self.local, bags=tuple(map(torch.from_numpy, (to, copy, source, offsets))))
        return copies, cast(torch.from_numpy(row_weights), weights_dtype), torch.from_numpy(member.sum(0))

    def write_back_header(self, failed: bool) -> None:
        self._back_header[:] = (1.0, -1.0) if failed else (0.0, 0.0)

    def back_failed(self) -> np.ndarray:
        """[P] the landed combine blocks' error flags."""
        return self._back_received[:, 0]


class DeviceMetadata(_Plan):
    """The metadata in torch on the buffers' device, reading nothing on the host."""

    def __init__(self, *args):
        super().__init__(*args)
        p, t, local, dev = self.ep_size, self.max_tokens, self.local, self.send_tail.device
        # The header bytes each call starts with: no error and the weights' dtype code, or failed.
        headers = [[0.0, code] for code in range(len(WEIGHT_DTYPES))] + [[1.0, -1.0]]
        self._headers = torch.tensor(headers, dtype=torch.float64, device=dev).view(torch.uint8)
        self._send_table = self.send_tail[:, 8 * HEADER_WORDS:].view(p, t, 2, 8 * local)    # per token row: flags, weights
        # The landed metadata as fp64 words (copies: a tail need not be 8-byte aligned).
        self._received = torch.zeros(p, self.recv_tail.shape[1] // 8, dtype=torch.float64, device=dev)
        self._back_received = torch.zeros(p, HEADER_WORDS, dtype=torch.float64, device=dev)
        self._before_expert = torch.arange(local, device=dev) * self.rows - 1

    def write(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, message: str | None, where: str) -> str | None:
        """As `HostMetadata.write`, checking the ids' values on the device: ids out of range or
        listed twice in a token make the header say failed and every token row empty, and set
        ``rejected`` (a device bool; nothing read on the host). Returns ``message``."""
        self.rejected = None
        if message is not None:
            self._send_table.zero_()
            self.send_tail[:, :8 * HEADER_WORDS] = self._headers[-1]
            return message
        n, e = topk_idx.shape[0], self.num_experts
        idx = topk_idx.long()
        listed = (idx >= 0) & (idx < e)
        column = idx.masked_fill(~listed, e)                                   # dropped or invalid: a spare column
        table = torch.zeros(n, 2, e + 1, dtype=torch.float64, device=idx.device)
        table[:, 0].scatter_(1, column, 1.0)
        table[:, 1].scatter_(1, column, topk_weights.detach().double())
        flags = table[:, 0, :e].sum(1)
        self.rejected = ((idx < -1) | (idx >= e)).any() | (flags != listed.sum(1)).any()   # out of range, or twice
        table = table[:, :, :e].mul_(~self.rejected).view(n, 2, self.ep_size, self.local)
        self._send_table[:, :n] = table.permute(2, 0, 1, 3).view(torch.uint8)
        self._send_table[:, n:] = 0
        header = self._headers[WEIGHT_DTYPES.index(topk_weights.dtype)]
        self.send_tail[:, :8 * HEADER_WORDS] = torch.where(self.rejected, self._headers[-1], header)
        return message

    def received_header(self) -> tuple:
        self._received.view(torch.uint8).copy_(self.recv_tail)
        return self._received[:, 0], self._received[:, 1]

    def expansion(self, weights_dtype: torch.dtype) -> tuple:
        """As `HostMetadata.expansion`, with the copies in dense form (no sizes on the host)."""
        scratch = self.local * self.rows
        tables = self._received[:, HEADER_WORDS:].view(self.ep_size, self.max_tokens, 2, self.local)
        member = (tables[:, :, 0] != 0).view(self.rows, self.local)               # [P*T, E_local]
        place = member.cumsum(0).add_(self._before_expert)                         # each pair's packed row
        to = torch.where(member, place, scratch).view(-1)                          # unused pairs: the scratch entry
        row_weights = torch.zeros(scratch + 1, dtype=weights_dtype, device=member.device)
        row_weights[to] = tables[:, :, 1].to(weights_dtype).reshape(-1)
        self.source_of_packed[to] = self.pair_source
        return CopyPositions.from_dense(torch.where(member, place, -1)), row_weights, member.sum(0)

    def write_back_header(self, failed: bool) -> None:
        self.back_send_tail.copy_(self._headers[-1 if failed else 0].expand(self.ep_size, -1))

    def back_failed(self) -> torch.Tensor:
        self._back_received.view(torch.uint8).copy_(self.back_tail)
        return self._back_received[:, 0]


def _float64_words(words: torch.Tensor) -> np.ndarray:
    """float64 [P, w] numpy view of uint8 [P, 8 * w] (writes reach the tensor; may be unaligned)."""
    return words.numpy().view(np.float64)


def _reshaped(view: np.ndarray, shape: tuple) -> np.ndarray:
    """``view`` in ``shape`` without a copy (raises if that would need one: writes must land)."""
    out = view.view()
    out.shape = shape
    return out
