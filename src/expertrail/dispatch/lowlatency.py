"""``lowlatency``: decode-time dispatch and combine with every shape fixed at construction.

In decode a rank holds a few tokens, and the normal mode's costs are per call, not per byte:
a round trip to exchange counts, then planning on the host from them. DeepEP's low-latency
kernels answer with static buffers; this mode does the same on any torch.distributed backend:

- Every buffer is allocated once, sized by ``max_tokens_per_rank`` (T). A rank sends each peer
  a fixed block: T row slots, slot s holding token s (a token meets a rank at most once, so
  `dedup`'s one row per (token, rank) fits), then a metadata tail: per slot, which of the
  peer's local experts the row is for (none: the peer skips it) and with which routing
  weight, and an error flag. Slot s = token s makes the sender's side one broadcast copy of
  x and one of its routing table, with no positions to plan. One exchange per dispatch and
  one per combine, no count round, no sizes computed on the host, nothing outside tensors
  that depends on the data (on CUDA: no host synchronisation, so a decode step can be
  captured in a CUDA graph).
- The receiver expands the rows into DeepEP's low-latency layout, packed per local expert:
  ``tokens [E_local, P * T, H]`` with ``count [E_local]`` real rows each, ordered by source
  rank then source token, the rest of each expert's rows unspecified (experts may compute
  them; combine ignores them). The same rows, in the same order, as the normal mode's expert
  rows.
- combine sums each received row's expert outputs, weighted, on the expert side (fp32, in
  local-expert order, rounded to the payload dtype), sends that one row back to its slot (a
  zero row for slots it has no expert of), and the source sums slot s of every rank's block
  in rank order, over positions fixed at construction: `dedup`'s normal mode, with its
  kernel, so the same bits (the zero rows of ranks a token skips add exactly nothing).

Why one row per (token, rank) and not DeepEP's per (token, expert) slots: DeepEP's RDMA writes
only the real rows into its slots, but a collective moves whole blocks, so per-expert slots
would move E_local times the bytes (and the host would pass over them) whatever the routing.

Shapes: N <= T tokens per rank and call (N may change between calls); rows move as the
dispatcher's ``dtype`` (or as fp8 bytes with ``payload="fp8"``).

`res.tokens` is a view of a buffer the next dispatch overwrites (as DeepEP's): use it, or copy
it, before the next call. Inference only: nothing here records autograd.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import fp8, kernels
from ..errors import ConfigError, InvalidInputError
from ..kernels.torch_ops import CopyPositions
from ..schedule import wait_exchange
from ..topology import EPGroups, check_same_on_all_ranks, guarded

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Routing weights travel as fp64 (exact for each of these) with their dtype's index beside them.
_WEIGHT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HEADER_WORDS = 2                 # fp64 words at the head of each metadata tail: error flag, weights dtype


@dataclass
class LowLatencyResult:
    """Rows for this rank's local experts, in fixed shapes.

    tokens: [E_local, P * T, H] in the dispatcher's dtype (float8_e4m3fn with ``payload="fp8"``
        and ``dequantize=False``); expert e's real rows are ``tokens[e, :count[e]]``
    count: int64 [E_local] real rows per local expert
    scales: fp32 [E_local, P * T, ceil(H / 128)] with fp8 rows left quantized, else None
    """

    tokens: torch.Tensor
    count: torch.Tensor
    scales: torch.Tensor | None
    _expert_copies: CopyPositions   # each received slot's rows in tokens (flattened), by local expert
    _row_weights: torch.Tensor      # [E_local * P * T + 1] routing weight of each row of tokens (0 elsewhere)
    _token_copies: CopyPositions    # each sent token's rows in the combine exchange, by rank
    _dtype: torch.dtype


class LowLatencyDispatcher:
    """Fixed-shape dispatch/combine for decode (see the module docstring).

    Args:
        groups: the EPGroups to run on.
        num_experts: experts in the layer (a multiple of the EP size).
        max_tokens_per_rank: T, the most tokens a rank passes to one dispatch.
        hidden: H, the row width.
        dtype: the rows' dtype (float32, bfloat16 or float16); x must have it.
        payload: "native" or "fp8" (rows travel as e4m3 values plus one fp32 scale per 128).
        dequantize: with fp8, hand the experts rows in ``dtype`` (True) or fp8 values and scales.
        agree_on_errors: read every rank's error flag after each exchange, so that invalid input
            on one rank raises on all (default: on CPU; on CUDA reading it is a host sync, so
            there it is off unless asked for, and an invalid rank sends empty blocks and raises
            alone).
    Construction is collective over the EP group; every rank must pass the same arguments, and
    every rank's ``topk_weights`` must have one dtype (checked with ``agree_on_errors``).
    """

    name = "lowlatency"

    def __init__(self, groups: EPGroups, num_experts: int, max_tokens_per_rank: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, payload: str = "native", dequantize: bool = True,
                 agree_on_errors: bool | None = None):
        if int(max_tokens_per_rank) < 1:
            raise ConfigError(f"max_tokens_per_rank={max_tokens_per_rank} must be >= 1: the most tokens a rank "
                              "dispatches at once (e.g. the decode batch per rank)")
        if int(hidden) < 1:
            raise ConfigError(f"hidden={hidden} must be >= 1 (the row width)")
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype={dtype} must be one of {', '.join(map(str, _DTYPES))}")
        if payload not in ("native", "fp8"):
            raise ConfigError(f"payload={payload!r} must be 'native' or 'fp8'")
        check_same_on_all_ranks({"backend": self.name, "num_experts": num_experts,
                                 "max_tokens_per_rank": max_tokens_per_rank, "hidden": hidden, "dtype": str(dtype),
                                 "payload": payload, "dequantize": dequantize},
                                groups.ep_group, groups.device, type(self).__name__)
        self.groups, self.num_experts = groups, int(num_experts)
        self.num_local_experts = groups.num_local_experts(self.num_experts)
        self.max_tokens, self.hidden, self.dtype = int(max_tokens_per_rank), int(hidden), dtype
        self.payload, self.dequantize = payload, dequantize
        self.agree_on_errors = groups.device.type == "cpu" if agree_on_errors is None else agree_on_errors
        # Whether the expansion may read sizes on the host (free on CPU; a sync on CUDA, so there
        # it takes the fixed-size path; tests run that path on CPU too).
        self.sizes_on_host = groups.device.type == "cpu"
        p, local, t, dev = groups.ep_size, self.num_local_experts, self.max_tokens, groups.device
        quantized = payload == "fp8"
        width, wire = (fp8.row_bytes(self.hidden), torch.uint8) if quantized else (self.hidden, dtype)
        # Each peer's block: T row slots, then a metadata tail of fp64 words (the header, then per
        # slot E_local expert flags and E_local weights), so one message per peer and direction
        # carries everything. Combine's blocks carry T rows and the header.
        self._words = _HEADER_WORDS + 2 * t * local
        self._block = t + _rows_for(8 * self._words, width * wire.itemsize)
        self._back_block = t + _rows_for(8 * _HEADER_WORDS, self.hidden * dtype.itemsize)
        self._send = torch.zeros(p * self._block, width, dtype=wire, device=dev)
        self._recv = torch.zeros_like(self._send)
        # The experts' rows (+ a scratch row that slots nobody fills are written to on CUDA).
        packed_width, packed_dtype = (width, wire) if quantized and not dequantize else (self.hidden, dtype)
        self._packed = torch.zeros(local * p * t + 1, packed_width, dtype=packed_dtype, device=dev)
        self._back_send = torch.zeros(p * self._back_block, self.hidden, dtype=dtype, device=dev)
        self._back = torch.zeros_like(self._back_send)
        # Byte views of each buffer's slots and metadata tail (made once: the buffers never
        # move); the header bytes each call starts with (no error and the weights' dtype code,
        # or failed); the received metadata as fp64 words [P, words] (a copy: the tail need not
        # be aligned).
        headers = [[0.0, code] for code in range(len(_WEIGHT_DTYPES))] + [[1.0, -1.0]]
        self._headers = torch.tensor(headers, dtype=torch.float64, device=dev).view(torch.uint8)
        self._meta_in = torch.zeros(p, self._words, dtype=torch.float64, device=dev)
        self._back_headers = self._headers[[0, -1]]        # combine reads only the error flag: clear, failed
        self._back_flags_in = torch.zeros(p, _HEADER_WORDS, dtype=torch.float64, device=dev)
        self._send_tail, self._recv_tail = (self._tail(b, self._words) for b in (self._send, self._recv))
        self._back_send_tail, self._back_tail = (self._tail(b, _HEADER_WORDS) for b in (self._back_send, self._back))
        self._send_slots = self._send.view(p, self._block, -1)[:, :t]                 # [P, T, C]: slot s = token s
        self._send_meta = self._send_tail[:, 8 * _HEADER_WORDS:].view(p, t, 2, 8 * local)   # per slot: flags, weights
        self._back_slots = self._back_send.view(p, self._back_block, -1)[:, :t]       # [P, T, H]: slot s = token s
        self._before_expert = torch.arange(local, device=dev) * (p * t) - 1   # the row before each expert's first
        # The receive row of each (peer, slot), and the row each (slot, local expert) pair would
        # take from the rows the experts' rows are gathered from (the receive buffer, or the
        # dequantized slots); the packed rows' sources (_source_of_packed) are scattered from
        # them each call, and rows past an expert's count keep whatever row they last named.
        slot_rows = torch.arange(p, device=dev).unsqueeze(1) * self._block + torch.arange(t, device=dev)
        self._slot_rows = slot_rows.reshape(-1)
        from_slots = quantized and dequantize
        pair_source = torch.arange(p * t, device=dev) if from_slots else self._slot_rows
        self._pair_source = pair_source.repeat_interleave(local)
        self._source_of_packed = torch.zeros(local * p * t + 1, dtype=torch.int64, device=dev)
        # Where token s's row comes back from each rank: slot s of every rank's combine block, in
        # rank order. Ranks a token skips send a zero row there (an empty sum), so the source
        # sums all P of them with no per-call plan: [T, P] positions and their bag form.
        back = CopyPositions.from_dense(torch.arange(p, device=dev) * self._back_block
                                        + torch.arange(t, device=dev).unsqueeze(1))
        self._back_dense, self._back_bags = back.dense(), (back.pos, back.slot, back.source, back.offsets)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> LowLatencyResult:
        """x [N, H] in ``dtype``, N <= T; topk_idx [N, K] int (-1: no expert); topk_weights
        [N, K] float. Collective over the EP group: a rank with invalid input makes every rank
        raise InvalidInputError once the exchange lands (it sends empty blocks meanwhile)."""
        with guarded("lowlatency dispatch", self.groups.label, self.groups.timeout), torch.no_grad():
            message = self._check(x, topk_idx, topk_weights)
            table = None if message is not None else self._routing(topk_idx, topk_weights)
            if isinstance(table, str):
                message = table
            if message is None:
                # Slot s of every peer's block holds token s; the metadata says which of the
                # peer's experts it is for (none: the peer skips it).
                n = x.shape[0]
                self._send_slots[:, :n] = fp8.quantize(x) if self.payload == "fp8" else x
                self._send_meta[:, :n] = table.permute(2, 0, 1, 3).view(torch.uint8)
                self._send_meta[:, n:] = 0
                header = self._headers[_WEIGHT_DTYPES.index(topk_weights.dtype)]
            else:
                self._send_meta.zero_()                                       # no rows for anyone
                header = self._headers[-1]
            self._send_tail[:, :8 * _HEADER_WORDS] = header
            got = self._exchange(self._send, self._recv)
            wait_exchange("lowlatency dispatch", got.wait)
            meta = self._meta_in
            meta.view(torch.uint8).copy_(self._recv_tail)
            self._raise_if_any_failed(message, meta[:, 0], "dispatch")
            if self.agree_on_errors:
                self._check_weight_dtypes(meta[:, 1], topk_weights.dtype)
            return self._expand(meta[:, _HEADER_WORDS:], self._token_copies(x.shape[0]), topk_weights.dtype)

    def _routing(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """fp64 [N, 2, P, E_local]: per token, 1 where it meets that expert of that rank, then the
        routing weight there (0 elsewhere); or an error message."""
        n, e = topk_idx.shape[0], self.num_experts
        column = topk_idx.long().masked_fill(topk_idx < 0, e)               # dropped slots: a spare column
        table = torch.zeros(n, 2, e + 1, dtype=torch.float64, device=topk_idx.device)
        table[:, 0].scatter_add_(1, column, torch.ones_like(column, dtype=torch.float64))
        if topk_idx.device.type == "cpu" and n and float(table[:, 0, :e].amax()) > 1:    # a value check: CPU only
            return (f"lowlatency dispatch on EP rank {self.groups.ep_rank}: a token lists the same expert twice in "
                    "topk_idx; each of its K experts must differ")
        table[:, 1].scatter_(1, column, topk_weights.double())
        return table[:, :, :e].view(n, 2, self.groups.ep_size, self.num_local_experts)

    def _token_copies(self, n: int) -> CopyPositions:
        """Where this rank's n tokens come back in combine: slot s of every rank's block, in rank
        order (fixed positions, sliced to n)."""
        copies = n * self.groups.ep_size
        pos, slot, source, offsets = self._back_bags
        return CopyPositions(n, self.groups.ep_size, dense=self._back_dense[:n],
                             bags=(pos[:copies], slot[:copies], source[:copies], offsets[:n + 1]))

    def _expand(self, slots: torch.Tensor, token_copies: CopyPositions, weights_dtype: torch.dtype) -> LowLatencyResult:
        """The received blocks -> rows packed per local expert [E_local, P * T, C] (by source,
        then slot). slots: fp64 [P, T * 2 E_local], each slot's expert flags, then weights."""
        p, local, t = self.groups.ep_size, self.num_local_experts, self.max_tokens
        pt, scratch = p * t, local * p * t
        slots = slots.view(p, t, 2, local)
        member = (slots[:, :, 0] != 0).view(pt, local)                        # [P*T, E_local]
        place = member.cumsum(0).add_(self._before_expert)                   # its row in tokens (flattened)
        to = torch.where(member, place, scratch).view(-1)                    # each (slot, expert) pair's row
        row_weights = torch.zeros(scratch + 1, dtype=weights_dtype, device=slots.device)
        row_weights[to] = slots[:, :, 1].to(weights_dtype).reshape(-1)
        if self.sizes_on_host:                  # the sum's bags straight from the pairs (sizes known on the host)
            pair = torch.nonzero(member.view(-1)).squeeze(1)                  # by slot, then local expert
            offsets = torch.zeros(pt + 1, dtype=torch.int64, device=slots.device)
            torch.cumsum(member.sum(1), 0, out=offsets[1:])
            copies = CopyPositions(pt, local, bags=(to.index_select(0, pair), pair % local, pair // local, offsets))
        else:                                   # no host sync: the dense form
            copies = CopyPositions.from_dense(torch.where(member, place, -1))
        # Gather every packed row from its source (one pass, no sizes on the host): the
        # source of each real row is scattered in first, unused pairs into the scratch entry.
        self._source_of_packed[to] = self._pair_source
        source = (fp8.dequantize(self._recv.index_select(0, self._slot_rows), self.hidden, self.dtype)
                  if self.payload == "fp8" and self.dequantize else self._recv)
        torch.index_select(source, 0, self._source_of_packed[:scratch], out=self._packed[:scratch])
        rows, scales = self._packed[:scratch], None
        if self.payload == "fp8" and not self.dequantize:
            rows, scales = fp8.unpack(rows, self.hidden)
            scales = scales.view(local, pt, -1)
        return LowLatencyResult(rows.view(local, pt, self.hidden), member.sum(0), scales, copies, row_weights,
                                token_copies, self.dtype)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, res: LowLatencyResult) -> torch.Tensor:
        """expert_out [E_local, P * T, H] (rows past each expert's count are ignored) -> y [N, H]
        in x's dtype: each received row's experts summed on this side, w * out in fp32 in local
        expert order and rounded to ``dtype``, then a token's rows from its ranks summed in rank
        order in fp32 (`dedup`'s combine: the same bits)."""
        with guarded("lowlatency combine", self.groups.label, self.groups.timeout), torch.no_grad():
            if not isinstance(res, LowLatencyResult):
                raise InvalidInputError(f"lowlatency combine: res must be the LowLatencyResult dispatch returned, "
                                        f"got {type(res).__name__}")
            p, local, t = self.groups.ep_size, self.num_local_experts, self.max_tokens
            message = None
            if tuple(expert_out.shape) != (local, p * t, self.hidden) or not expert_out.is_floating_point():
                message = (f"lowlatency combine on EP rank {self.groups.ep_rank}: expert_out must be float "
                           f"[{local}, {p * t}, {self.hidden}] like res.tokens, got {tuple(expert_out.shape)} "
                           f"{expert_out.dtype}")
            else:
                summed = kernels.reduce_copies(expert_out.reshape(local * p * t, -1).to(self.dtype), res._expert_copies,
                                               res._row_weights, self.dtype)                    # [P*T, H]
                self._back_slots.copy_(summed.view(p, t, -1))
            self._back_send_tail.copy_(self._back_headers[int(message is not None)].expand(p, -1))
            back = self._exchange(self._back_send, self._back)
            wait_exchange("lowlatency combine", back.wait)
            self._back_flags_in.view(torch.uint8).copy_(self._back_tail)
            self._raise_if_any_failed(message, self._back_flags_in[:, 0], "combine")
            return kernels.reduce_copies(self._back, res._token_copies, None, self.dtype).to(res._dtype)

    # ------------------------------------------------------------------ shared
    def _tail(self, buffer: torch.Tensor, words: int) -> torch.Tensor:
        """uint8 [P, 8 * words]: the first ``words`` fp64 words after the T row slots of every
        peer's block in ``buffer`` (a view)."""
        p = self.groups.ep_size
        start = self.max_tokens * buffer.shape[1] * buffer.element_size()
        return buffer.view(torch.uint8).view(p, -1)[:, start:start + 8 * words]

    def _exchange(self, rows: torch.Tensor, out: torch.Tensor):
        """Every peer's block of ``rows`` to it, theirs into ``out`` (posted, not waited): one
        collective of equal blocks."""
        return dist.all_to_all_single(out, rows, group=self.groups.ep_group, async_op=True)

    def _check(self, x, topk_idx, topk_weights) -> str | None:
        where = f"lowlatency dispatch on EP rank {self.groups.ep_rank}"
        if x.dim() != 2 or x.shape[1] != self.hidden or x.shape[0] > self.max_tokens:
            return (f"{where}: x must be [N <= max_tokens_per_rank={self.max_tokens}, hidden={self.hidden}], got "
                    f"{tuple(x.shape)}; build the dispatcher with a larger max_tokens_per_rank or dispatch in parts")
        if x.dtype != self.dtype:
            return f"{where}: x is {x.dtype} but the dispatcher's buffers are {self.dtype}; pass x.to({self.dtype})"
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_weights.shape != topk_idx.shape:
            return (f"{where}: topk_idx and topk_weights must both be [N={x.shape[0]}, K], got "
                    f"{tuple(topk_idx.shape)} and {tuple(topk_weights.shape)}")
        if topk_idx.dtype.is_floating_point or topk_weights.dtype not in _WEIGHT_DTYPES:
            return (f"{where}: topk_idx must be integer and topk_weights one of "
                    f"{', '.join(map(str, _WEIGHT_DTYPES))}, got {topk_idx.dtype}, {topk_weights.dtype}")
        if x.device != self.groups.device:
            return f"{where}: x is on {x.device}, the EP group communicates on {self.groups.device}"
        if x.device.type == "cpu" and topk_idx.numel():     # a value check costs a host sync on CUDA: CPU only
            low, high = (int(v) for v in torch.aminmax(topk_idx))
            if low < -1 or high >= self.num_experts:
                return f"{where}: topk_idx values must be in [-1, {self.num_experts}), found {low if low < -1 else high}"
        return None

    def _raise_if_any_failed(self, message: str | None, failed: torch.Tensor, verb: str) -> None:
        """Raise on every rank when any rank flagged invalid input (``failed`` [P], nonzero
        where a rank did, from the headers), or on this rank alone without ``agree_on_errors``."""
        if message is not None and not self.agree_on_errors:
            raise InvalidInputError(message)
        if self.agree_on_errors and bool(failed.any()):
            if message:
                raise InvalidInputError(message)
            bad = ", ".join(str(r) for r in torch.nonzero(failed).flatten().tolist())
            raise InvalidInputError(f"lowlatency {verb} aborted on EP rank {self.groups.ep_rank}: invalid input on "
                                    f"EP rank(s) {bad}; see the error raised there")

    def _check_weight_dtypes(self, codes: torch.Tensor, mine: torch.dtype) -> None:
        """Every rank sees every rank's weights dtype (``codes`` [P]) and raises alike if they differ."""
        names = [str(_WEIGHT_DTYPES[int(c)]) for c in codes.tolist()]
        if len(set(names)) > 1:
            raise InvalidInputError(f"lowlatency dispatch on EP rank {self.groups.ep_rank}: topk_weights must have one "
                                    f"dtype on every EP rank, got {names} by rank; pass topk_weights.to({mine}) "
                                    "(or one common dtype) everywhere")

    def __repr__(self) -> str:
        return (f"LowLatencyDispatcher(ep_size={self.groups.ep_size}, num_experts={self.num_experts}, "
                f"max_tokens_per_rank={self.max_tokens}, hidden={self.hidden}, dtype={self.dtype}, "
                f"payload={self.payload!r})")


def _rows_for(nbytes: int, row_bytes: int) -> int:
    """Rows of ``row_bytes`` that hold ``nbytes``."""
    return -(-nbytes // row_bytes)
