"""``lowlatency``: decode-time dispatch and combine with every shape fixed at construction.

In decode a rank holds a few tokens, and the normal mode's costs are per call, not per byte:
a round trip to exchange counts, then planning on the host from them. DeepEP's low-latency
kernels answer with static buffers; this mode does the same on any torch.distributed backend:

- Every buffer is allocated once, sized by ``max_tokens_per_rank`` (T). A rank sends each peer
  a fixed block ``[E_local, T, C]``: the rows for each of the peer's local experts in slots
  0..count-1 (a token meets an expert at most once, so T slots are always enough), plus the
  counts. Both go out at once: one exchange per dispatch and one per combine, no count round,
  no sizes computed on the host, nothing that depends on the data outside tensors (on CUDA:
  no host synchronisation, so a decode step can be captured in a CUDA graph).
- The received rows come out packed per local expert (DeepEP's low-latency layout):
  ``tokens [E_local, P * T, H]`` with ``count [E_local]`` real rows each, ordered by source rank
  then source token, the rest of each expert's rows unspecified (experts may compute them;
  combine ignores them). The same rows, in the same order, as the normal mode's expert blocks.
- combine sends each expert row back to the slot it came from and sums each token's rows,
  weighted by its routing weights in fp32, in k order (the normal mode's kernel: the same bits).

Shapes: N <= T tokens per rank and call (N may change between calls); rows move as the
dispatcher's ``dtype`` (or as fp8 bytes with ``payload="fp8"``). The fixed blocks move T rows
per (peer, expert) whatever the real counts: the bytes of a decode step, not of its tokens.

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
    _slot: torch.Tensor           # int64 [N, K]: the send-block row of each (token, k), or the scratch row
    _copies: CopyPositions        # the same rows as each token's copies (dropped slots left out)
    _weights: torch.Tensor        # [N, K] routing weights, 0 on dropped slots
    _packed_at: torch.Tensor      # int64 [P, E_local, T]: each received slot's row in tokens (clamped)
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
    Construction is collective over the EP group; every rank must pass the same arguments.
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
        p, local, t, dev = groups.ep_size, self.num_local_experts, self.max_tokens, groups.device
        width = fp8.row_bytes(self.hidden) if payload == "fp8" else self.hidden
        wire = torch.uint8 if payload == "fp8" else dtype
        # Each peer's block: local * T data rows (slot s of local expert l at l * T + s), then
        # header rows carrying the counts and an error flag, so that one message per peer
        # and direction carries everything. One row past the blocks: the scratch row unused
        # slots are written to, and on the way back the zero row dropped slots read.
        self._header_bytes = 4 * (local + 1)                      # int32 counts + the error flag
        header_rows = -(-self._header_bytes // (width * torch.empty(0, dtype=wire).element_size()))
        self._block = local * t + header_rows
        rows = p * self._block
        self._send = torch.zeros(rows + 1, width, dtype=wire, device=dev)
        self._recv = torch.zeros(rows, width, dtype=wire, device=dev)
        self._packed = torch.zeros(local * p * t + 1, width, dtype=wire, device=dev)
        back_header = -(-self._header_bytes // (self.hidden * torch.empty(0, dtype=dtype).element_size()))
        if back_header != header_rows:
            raise ConfigError(f"hidden={hidden} is too narrow to carry {local + 1} counts in one row each way; "
                              "use a larger hidden size")
        self._back_send = torch.zeros(rows, self.hidden, dtype=dtype, device=dev)
        self._back = torch.zeros(rows + 1, self.hidden, dtype=dtype, device=dev)
        self._slot_ids = torch.arange(t, device=dev)
        self._expert_base = torch.arange(local, device=dev).view(1, local, 1) * (p * t)    # packed row of slot 0
        self._no_counts = torch.zeros(p, local, dtype=torch.int64, device=dev)
        # Row indices per block row (header rows: the packed scratch row on the way in, row 0 on
        # the way back, overwritten by the header): filled per call in their data part.
        self._landing = torch.full((p, self._block), local * p * t, dtype=torch.int64, device=dev)
        self._gather_back = torch.zeros(p, self._block, dtype=torch.int64, device=dev)

    def _header(self, buffer: torch.Tensor) -> torch.Tensor:
        """uint8 [P, 4 * (E_local + 1)]: the header bytes of every peer's block in ``buffer``."""
        p, data = self.groups.ep_size, self.num_local_experts * self.max_tokens
        blocks = buffer[:p * self._block].view(torch.uint8).view(p, self._block, -1)
        return blocks[:, data:].reshape(p, -1)[:, :self._header_bytes]

    def _write_header(self, buffer: torch.Tensor, counts: torch.Tensor, failed: bool) -> None:
        """counts int [P, E_local] (rows to each peer's experts) and this rank's error flag."""
        words = torch.zeros(counts.shape[0], counts.shape[1] + 1, dtype=torch.int32, device=counts.device)
        words[:, :-1] = counts
        words[:, -1] = int(failed)
        self._header(buffer).copy_(words.view(torch.uint8))

    def _read_header(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts int64 [P, E_local] from each peer, error flags [P])."""
        words = self._header(buffer).contiguous().view(torch.int32).long()
        return words[:, :-1], words[:, -1]

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> LowLatencyResult:
        """x [N, H] in ``dtype``, N <= T; topk_idx [N, K] int (-1: no expert); topk_weights
        [N, K] float. Collective over the EP group: a rank with invalid input makes every rank
        raise InvalidInputError once the exchange lands (it sends empty blocks meanwhile)."""
        with guarded("lowlatency dispatch", self.groups.label, self.groups.timeout), torch.no_grad():
            message = self._check(x, topk_idx, topk_weights)
            p, local, t = self.groups.ep_size, self.num_local_experts, self.max_tokens
            scratch = p * self._block
            if message is None:
                n, k = topk_idx.shape
                valid = topk_idx >= 0
                expert = topk_idx.long().clamp(min=0)
                hits = torch.zeros(n, self.num_experts, dtype=torch.int64, device=x.device)
                hits.scatter_add_(1, expert, valid.long())                 # [N, E]: 1 where the token meets e
                if x.device.type == "cpu" and bool(hits.gt(1).any()):       # a value check: CPU only (host sync)
                    message = (f"lowlatency dispatch on EP rank {self.groups.ep_rank}: a token lists the same expert "
                               "twice in topk_idx; each of its K experts must differ")
            if message is None:
                slot_of = (hits.cumsum(0) - 1).gather(1, expert)             # [N, K] its slot among e's tokens
                peer, rest = expert // local, expert % local
                slot = torch.where(valid, peer * self._block + rest * t + slot_of, scratch)
                rows = fp8.quantize(x) if self.payload == "fp8" else x
                self._send[slot.reshape(-1)] = rows.repeat_interleave(k, 0)  # dropped slots: into the scratch row
                self._write_header(self._send, hits.sum(0).view(p, local), False)
                weights = torch.where(valid, topk_weights, torch.zeros_like(topk_weights))
            else:
                self._write_header(self._send, self._no_counts, True)
                slot = weights = None
            got = self._exchange(self._send[:scratch], self._recv)
            wait_exchange("lowlatency dispatch", got.wait)
            counts, failed = self._read_header(self._recv)
            self._raise_if_any_failed(message, failed, "dispatch")
            return self._pack(counts, slot, weights, x.dtype)

    def _pack(self, counts, slot, weights, dtype) -> LowLatencyResult:
        """The received blocks -> rows packed per local expert [E_local, P * T, C] (by source,
        then slot). counts: int64 [P, E_local] rows each source sent each local expert."""
        p, local, t = self.groups.ep_size, self.num_local_experts, self.max_tokens
        before = counts.cumsum(0) - counts                                   # rows of earlier sources
        at = before.unsqueeze(-1) + self._slot_ids                           # [P, E_local, T]
        real = self._slot_ids < counts.unsqueeze(-1)
        packed_at = self._expert_base + at.clamp(max=p * t - 1)
        scratch = local * p * t
        # Where every received row goes, header rows and unused slots to the scratch row.
        self._landing[:, :local * t] = torch.where(real, packed_at, scratch).view(p, -1)
        self._packed[self._landing.view(-1)] = self._recv
        rows = self._packed[:scratch]
        scales = None
        if self.payload == "fp8":
            if self.dequantize:
                rows = fp8.dequantize(rows, self.hidden, dtype)
            else:
                values, scales = fp8.unpack(rows, self.hidden)
                rows, scales = values, scales.view(local, p * t, -1)
        copies = None if slot is None else CopyPositions.from_dense(torch.where(slot < p * self._block, slot, -1))
        return LowLatencyResult(rows.view(local, p * t, self.hidden), counts.sum(0), scales, slot, copies, weights,
                                packed_at, dtype)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, res: LowLatencyResult) -> torch.Tensor:
        """expert_out [E_local, P * T, H] (rows past each expert's count are ignored) -> y [N, H]
        in x's dtype: y[n] = sum over k, in order, of w[n, k] * out[n, k], in fp32."""
        with guarded("lowlatency combine", self.groups.label, self.groups.timeout), torch.no_grad():
            local, pt = self.num_local_experts, self.groups.ep_size * self.max_tokens
            message = None
            if not isinstance(res, LowLatencyResult):
                raise InvalidInputError(f"lowlatency combine: res must be the LowLatencyResult dispatch returned, "
                                        f"got {type(res).__name__}")
            p = self.groups.ep_size
            if tuple(expert_out.shape) != (local, pt, self.hidden) or not expert_out.is_floating_point():
                message = (f"lowlatency combine on EP rank {self.groups.ep_rank}: expert_out must be float "
                           f"[{local}, {pt}, {self.hidden}] like res.tokens, got {tuple(expert_out.shape)} "
                           f"{expert_out.dtype}")
            else:     # each received slot's output back to its place in the blocks (headers: rewritten below)
                self._gather_back[:, :local * self.max_tokens] = res._packed_at.view(p, -1)
                torch.index_select(expert_out.reshape(local * pt, -1).to(self.dtype), 0, self._gather_back.view(-1),
                                   out=self._back_send)
            self._write_header(self._back_send, self._no_counts, message is not None)
            back = self._exchange(self._back_send, self._back[:-1])
            wait_exchange("lowlatency combine", back.wait)
            self._raise_if_any_failed(message, self._read_header(self._back)[1], "combine")
            self._back[-1].zero_()
            # The normal mode's sum (same kernel, same order): bitwise the same y.
            row_weights = torch.zeros(self._back.shape[0], dtype=res._weights.dtype, device=self._back.device)
            row_weights[res._slot.reshape(-1)] = res._weights.reshape(-1)
            return kernels.reduce_copies(self._back, res._copies, row_weights, res._dtype)

    # ------------------------------------------------------------------ shared
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
        if topk_idx.dtype.is_floating_point or not topk_weights.is_floating_point():
            return f"{where}: topk_idx must be integer and topk_weights float, got {topk_idx.dtype}, {topk_weights.dtype}"
        if x.device != self.groups.device:
            return f"{where}: x is on {x.device}, the EP group communicates on {self.groups.device}"
        if x.device.type == "cpu" and topk_idx.numel():     # a value check costs a host sync on CUDA: CPU only
            low, high = (int(v) for v in torch.aminmax(topk_idx))
            if low < -1 or high >= self.num_experts:
                return f"{where}: topk_idx values must be in [-1, {self.num_experts}), found {low if low < -1 else high}"
        return None

    def _raise_if_any_failed(self, message: str | None, failed: torch.Tensor, verb: str) -> None:
        """Raise on every rank when any rank flagged invalid input (``failed`` [P], from the
        headers), or on this rank alone without ``agree_on_errors``."""
        if message is not None and not self.agree_on_errors:
            raise InvalidInputError(message)
        if self.agree_on_errors and bool(failed.any()):
            if message:
                raise InvalidInputError(message)
            bad = ", ".join(str(r) for r in torch.nonzero(failed).flatten().tolist())
            raise InvalidInputError(f"lowlatency {verb} aborted on EP rank {self.groups.ep_rank}: invalid input on "
                                    f"EP rank(s) {bad}; see the error raised there")

    def __repr__(self) -> str:
        return (f"LowLatencyDispatcher(ep_size={self.groups.ep_size}, num_experts={self.num_experts}, "
                f"max_tokens_per_rank={self.max_tokens}, hidden={self.hidden}, dtype={self.dtype}, "
                f"payload={self.payload!r})")
