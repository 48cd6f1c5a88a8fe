"""``lowlatency``: decode-time dispatch and combine with every shape fixed at construction.

In decode a rank holds a few tokens, and the normal mode's costs are per call, not per byte:
a round trip to exchange counts, then planning on the host from them. DeepEP's low-latency
kernels answer with static buffers; this mode does the same on any torch.distributed backend:

- Every buffer is allocated once, sized by ``max_tokens_per_rank`` (T). A rank sends each peer
  a fixed block: T token rows, row t holding token t (a token meets a rank at most once, so
  `dedup`'s one row per (token, rank) fits), then a metadata tail: per token row, which of the
  peer's local experts the row is for (none: the peer skips it) and with which routing
  weight, and an error flag. Row t = token t makes the sender's side one broadcast copy of
  x and one of its routing table, with no positions to plan. One exchange per dispatch and
  one per combine, no count round. The small per-call metadata (lowlatency_metadata.py) is
  made with torch on CUDA, reading nothing on the host (no host synchronisation, so a decode
  step can be captured in a CUDA graph: benchmarks/gpu_lowlatency.py checks both, recorded on
  an H200 in docs/benchmarks.md), and in numpy on CPU, where torch's per-call
  overhead would be most of the step.
- The receiver expands the rows into DeepEP's low-latency layout, packed per local expert:
  ``tokens [E_local, P * T, H]`` with ``count [E_local]`` real rows each, ordered by source
  rank then source token, the rest of each expert's rows unspecified (experts may compute
  them; combine ignores them). The same rows, in the same order, as the normal mode's expert
  rows.
- combine sums each received row's expert outputs, weighted, on the expert side (fp32, in
  local-expert order, rounded to the payload dtype), sends that one row back to its token row (a
  zero row for tokens it has no expert of), and the source sums token row t of every rank's block
  in rank order, over positions fixed at construction: `dedup`'s normal mode, with its
  kernel, so the same bits (the zero rows of ranks a token skips add exactly nothing).

Why one row per (token, rank) and not DeepEP's per (token, expert) rows: DeepEP's RDMA writes
only the real rows into its buffers, but a collective moves whole blocks, so per-expert rows
would move E_local times the bytes (and the host would pass over them) whatever the routing.

Shapes: N <= T tokens per rank and call (N may change between calls); rows move as the
dispatcher's ``dtype`` (or as fp8 bytes with ``payload="fp8"``).

`res.tokens` is a view of a buffer the next dispatch overwrites (as DeepEP's): use it, or copy
it, before the next call. Reading ``res.tokens`` (or ``count``, ``scales``) or combining ``res``
after the next dispatch raises `InvalidInputError` (a view taken before that call cannot be
guarded). Inference only: nothing here records autograd, so inputs that require gradients
are refused (on every rank) rather than silently cut from the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import fp8
from .. import kernels
from ..errors import ConfigError, InvalidInputError
from ..kernels.torch_ops import CopyPositions, cast
from ..comm.schedule import wait_exchange
from ..comm.topology import EPGroups, guarded
from ..kernels.workspace import Workspace
from .checks import ids_problem, input_problem
from .lowlatency_metadata import HEADER_WORDS, WEIGHT_DTYPES, DeviceMetadata, HostMetadata

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class LowLatencyResult:
    """Rows for this rank's local experts, in fixed shapes, valid until the dispatcher's next
    dispatch (which overwrites them: reading them after it raises `InvalidInputError`).

    tokens: [E_local, P * T, H] in the dispatcher's dtype (float8_e4m3fn with ``payload="fp8"``
        and ``dequantize=False``); expert e's real rows are ``tokens[e, :count[e]]``
    count: int64 [E_local] real rows per local expert
    scales: fp32 [E_local, P * T, ceil(H / 128)] with fp8 rows left quantized, else None
    """

    _tokens: torch.Tensor
    _count: torch.Tensor
    _scales: torch.Tensor | None
    _expert_copies: CopyPositions   # each received token row's rows in tokens (flattened), by local expert
    _row_weights: torch.Tensor      # [E_local * P * T + 1] routing weight of each row of tokens (0 elsewhere)
    _token_copies: CopyPositions    # each sent token's rows in the combine exchange, by rank
    _dtype: torch.dtype
    _owner: "LowLatencyDispatcher"  # whose buffers hold the rows
    _call: int                      # which of its dispatches made them
    _error: str | None = None       # this rank's invalid input, raised by combine (without agree_on_errors)

    def stale(self) -> str | None:
        """Why this result's rows are no longer there (a later dispatch overwrote them), or None."""
        calls = self._owner._calls
        if calls == self._call:
            return None
        return (f"this LowLatencyResult is from dispatch call {self._call} of {self._owner!r}, whose buffers call "
                f"{calls} has overwritten: use res.tokens (or copy it, res.tokens.clone()) and combine before the "
                "next dispatch")

    def _fresh(self, value, name: str):
        why = self.stale()
        if why is not None:
            raise InvalidInputError(f"res.{name}: {why}")
        return value

    @property
    def tokens(self) -> torch.Tensor:
        return self._fresh(self._tokens, "tokens")

    @property
    def count(self) -> torch.Tensor:
        return self._fresh(self._count, "count")

    @property
    def scales(self) -> torch.Tensor | None:
        return self._fresh(self._scales, "scales")


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
            there it is off unless asked for). Without it an invalid rank sends empty blocks,
            still receives and packs its peers' rows, and raises alone in its combine, once that
            exchange is done too, so its peers (whose outputs lack its tokens only) stay in step.
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
        groups.check_same({"backend": self.name, "num_experts": num_experts,
                           "max_tokens_per_rank": max_tokens_per_rank, "hidden": hidden, "dtype": str(dtype),
                           "payload": payload, "dequantize": dequantize}, type(self).__name__)
        self.groups, self.num_experts = groups, int(num_experts)
        self.num_local_experts = groups.num_local_experts(self.num_experts)
        self.max_tokens, self.hidden, self.dtype = int(max_tokens_per_rank), int(hidden), dtype
        self.payload, self.dequantize = payload, dequantize
        self.agree_on_errors = groups.device.type == "cpu" if agree_on_errors is None else agree_on_errors
        # Whether each call's metadata is planned on the host in numpy (CPU) or with torch on the
        # device (CUDA; tests run that planner on CPU too): lowlatency_metadata.py.
        self.metadata_on_host = groups.device.type == "cpu"
        p, local, t, dev = groups.ep_size, self.num_local_experts, self.max_tokens, groups.device
        quantized = payload == "fp8"
        width, wire = (fp8.row_bytes(self.hidden), torch.uint8) if quantized else (self.hidden, dtype)
        # Each peer's block: T token rows, then a metadata tail of fp64 words (the header, then per
        # token row E_local expert flags and E_local weights), so one message per peer and direction
        # carries everything. Combine's blocks carry T rows and the header.
        self._words = HEADER_WORDS + 2 * t * local
        self._block = t + _rows_for(8 * self._words, width * wire.itemsize)
        self._back_block = t + _rows_for(8 * HEADER_WORDS, self.hidden * dtype.itemsize)
        # Every buffer comes from the dispatcher's Workspace (as the normal mode's), held for good.
        self.workspace = Workspace()

        def zeros(*shape, dtype):
            return self.workspace.empty(shape, dtype, dev).zero_()
        self._send = zeros(p * self._block, width, dtype=wire)
        self._recv = zeros(p * self._block, width, dtype=wire)
        # The experts' rows (+ a scratch row that unused pairs are written to on CUDA).
        packed_width, packed_dtype = (width, wire) if quantized and not dequantize else (self.hidden, dtype)
        self._packed = zeros(local * p * t + 1, packed_width, dtype=packed_dtype)
        self._back_send = zeros(p * self._back_block, self.hidden, dtype=dtype)
        self._back = zeros(p * self._back_block, self.hidden, dtype=dtype)
        # Views of each buffer's token rows (made once: the buffers never move).
        self._send_token_rows = self._send.view(p, self._block, -1)[:, :t]                 # [P, T, C]: row t = token t
        self._back_token_rows = self._back_send.view(p, self._back_block, -1)[:, :t]       # [P, T, H]: row t = token t
        # The receive row of each (peer, token row), and the row each (token row, local expert) pair would
        # take from the rows the experts' rows are gathered from (the receive buffer, or the
        # dequantized token rows); the packed rows' sources (_source_of_packed) are scattered from
        # them each call, and rows past an expert's count keep whatever row they last named.
        token_rows = torch.arange(p, device=dev).unsqueeze(1) * self._block + torch.arange(t, device=dev)
        self._token_rows = token_rows.reshape(-1)
        from_token_rows = quantized and dequantize
        pair_source = torch.arange(p * t, device=dev) if from_token_rows else self._token_rows
        self._pair_source = pair_source.repeat_interleave(local)
        self._source_of_packed = torch.zeros(local * p * t + 1, dtype=torch.int64, device=dev)
        # Where token t's row comes back from each rank: row t of every rank's combine block, in
        # rank order. Ranks a token skips send a zero row there (an empty sum), so the source
        # sums all P of them with no per-call plan: [T, P] positions and their bag form.
        back = CopyPositions.from_dense(torch.arange(p, device=dev) * self._back_block
                                        + torch.arange(t, device=dev).unsqueeze(1))
        self._back_dense, self._back_bags = back.dense(), (back.pos, back.copy, back.source, back.offsets)
        self._token_copies_of = {}                                            # n -> its CopyPositions
        self._calls = 0                                                       # dispatches made (LowLatencyResult.stale)
        self._where = f"lowlatency dispatch on EP rank {groups.ep_rank}"      # what its errors begin with
        # The metadata planners, on the byte views of every buffer's tail.
        tails = (self._tail(self._send, self._words), self._tail(self._recv, self._words),
                 self._tail(self._back_send, HEADER_WORDS), self._tail(self._back, HEADER_WORDS))
        plan_args = (self.num_experts, p, local, t, *tails, self._source_of_packed, self._pair_source)
        self._device_metadata = DeviceMetadata(*plan_args)
        self._host_metadata = HostMetadata(*plan_args) if dev.type == "cpu" else None

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> LowLatencyResult:
        """x [N, H] in ``dtype``, N <= T; topk_idx [N, K] int (-1: no expert); topk_weights
        [N, K] float. Collective over the EP group: a rank with invalid input makes every rank
        raise InvalidInputError once the exchange lands (it sends empty blocks meanwhile)."""
        recording = torch.is_grad_enabled()
        with guarded("lowlatency dispatch", self.groups), torch.no_grad():
            meta = self._metadata()
            self._calls += 1                                  # earlier results' rows are overwritten from here on
            # Row t of every peer's block holds token t; the metadata says which of the peer's
            # experts it is for (none: the peer skips it). An invalid rank sends no rows.
            message = meta.write(topk_idx, topk_weights, self._check(x, topk_idx, topk_weights, recording), self._where)
            if message is None:
                self._send_token_rows[:, :x.shape[0]] = fp8.quantize(x) if self.payload == "fp8" else x
            got = self._exchange(self._send, self._recv)
            wait_exchange("lowlatency dispatch", got.wait)
            failed, codes = meta.received_header()
            if message is None and meta.rejected is not None:
                message = self._verdict_on_ids(meta.rejected, topk_idx)
            if self.agree_on_errors:
                self._raise_if_any_failed(message, failed, "dispatch")
                self._check_weight_dtypes(codes, topk_weights.dtype)
            # Without agreement a rank in error still packs its peers' rows (its experts owe them
            # their outputs) and raises in its combine: one exchange each way on every rank.
            weights_dtype = topk_weights.dtype if message is None else self.dtype
            res = self._packed_rows(*meta.expansion(weights_dtype), self._token_copies(0 if message else x.shape[0]))
            res._error = message
            return res

    def _metadata(self):
        """This call's metadata: made on the host (numpy) or on the device (torch)."""
        return self._host_metadata if self.metadata_on_host else self._device_metadata

    def _token_copies(self, n: int) -> CopyPositions:
        """Where this rank's n tokens come back in combine: row t of every rank's block, in rank
        order (fixed positions, sliced to n; made once per n)."""
        if n not in self._token_copies_of:
            copies = n * self.groups.ep_size
            pos, copy, source, offsets = self._back_bags
            self._token_copies_of[n] = CopyPositions(n, self.groups.ep_size, dense=self._back_dense[:n],
                                                     bags=(pos[:copies], copy[:copies], source[:copies],
                                                           offsets[:n + 1]))
        return self._token_copies_of[n]

    def _packed_rows(self, copies: CopyPositions, row_weights: torch.Tensor, count: torch.Tensor,
                     token_copies: CopyPositions) -> LowLatencyResult:
        """The received rows packed per local expert [E_local, P * T, C] (by source, then token row):
        one gather of every packed row from ``_source_of_packed`` (no sizes on the host; rows
        past an expert's count take whatever row they last named)."""
        p, local, t = self.groups.ep_size, self.num_local_experts, self.max_tokens
        pt, scratch = p * t, local * p * t
        source = (fp8.dequantize(self._recv.index_select(0, self._token_rows), self.hidden, self.dtype)
                  if self.payload == "fp8" and self.dequantize else self._recv)
        torch.index_select(source, 0, self._source_of_packed[:scratch], out=self._packed[:scratch])
        rows, scales = self._packed[:scratch], None
        if self.payload == "fp8" and not self.dequantize:
            rows, scales = fp8.unpack(rows, self.hidden)
            scales = scales.view(local, pt, -1)
        return LowLatencyResult(rows.view(local, pt, self.hidden), count, scales, copies, row_weights,
                                token_copies, self.dtype, self, self._calls)

    # ------------------------------------------------------------------ combine
    def combine(self, expert_out: torch.Tensor, res: LowLatencyResult) -> torch.Tensor:
        """expert_out [E_local, P * T, H] (rows past each expert's count are ignored) -> y [N, H]
        in x's dtype: each received row's experts summed on this side, w * out in fp32 in local
        expert order and rounded to ``dtype``, then a token's rows from its ranks summed in rank
        order in fp32 (`dedup`'s combine: the same bits)."""
        recording = torch.is_grad_enabled()
        with guarded("lowlatency combine", self.groups), torch.no_grad():
            if not isinstance(res, LowLatencyResult):
                raise InvalidInputError(f"lowlatency combine: res must be the LowLatencyResult dispatch returned, "
                                        f"got {type(res).__name__}")
            p, local, t = self.groups.ep_size, self.num_local_experts, self.max_tokens
            message = None
            stale = res.stale() if res._owner is self else f"res is from another dispatcher, {res._owner!r}"
            if stale is not None:
                message = f"lowlatency combine on EP rank {self.groups.ep_rank}: {stale}"
            elif tuple(expert_out.shape) != (local, p * t, self.hidden) or not expert_out.is_floating_point():
                message = (f"lowlatency combine on EP rank {self.groups.ep_rank}: expert_out must be float "
                           f"[{local}, {p * t}, {self.hidden}] like res.tokens, got {tuple(expert_out.shape)} "
                           f"{expert_out.dtype}")
            elif expert_out.requires_grad and recording:
                message = (f"lowlatency combine on EP rank {self.groups.ep_rank}: expert_out.requires_grad=True, but "
                           "the lowlatency mode records no autograd (y would be cut from the graph): run the experts "
                           "under torch.no_grad() or torch.inference_mode(), or train through a normal-mode dispatcher")
            else:
                summed = kernels.reduce_copies(cast(expert_out.reshape(local * p * t, -1), self.dtype), res._expert_copies,
                                               res._row_weights, self.dtype)                    # [P*T, H]
                self._back_token_rows.copy_(summed.view(p, t, -1))
            meta = self._metadata()
            meta.write_back_header(message is not None)
            back = self._exchange(self._back_send, self._back)
            wait_exchange("lowlatency combine", back.wait)
            self._raise_if_any_failed(message, meta.back_failed(), "combine")
            if res._error is not None:                       # this rank's dispatch input, unagreed
                raise InvalidInputError(res._error)
            return cast(kernels.reduce_copies(self._back, res._token_copies, None, self.dtype), res._dtype)

    # ------------------------------------------------------------------ shared
    def _tail(self, buffer: torch.Tensor, words: int) -> torch.Tensor:
        """uint8 [P, 8 * words]: the first ``words`` fp64 words after the T token rows of every
        peer's block in ``buffer`` (a view)."""
        p = self.groups.ep_size
        start = self.max_tokens * buffer.shape[1] * buffer.element_size()
        return buffer.view(torch.uint8).view(p, -1)[:, start:start + 8 * words]

    def _exchange(self, rows: torch.Tensor, out: torch.Tensor):
        """Every peer's block of ``rows`` to it, theirs into ``out`` (posted, not waited): the
        EP channel's all-to-all of fixed equal blocks (`Channel.all_to_all_fixed`)."""
        return self.groups.ep_channel.all_to_all_fixed(rows, out=out)

    def _check(self, x, topk_idx, topk_weights, recording: bool) -> str | None:
        """The normal mode's input checks (`checks.input_problem`), then this mode's own: at
        most T tokens, x in the buffers' dtype, a supported weights dtype, nothing that needs
        gradients. The ids' values are checked with the metadata (on the host, or on the device)."""
        where = self._where
        _, message = input_problem(where, x, topk_idx, topk_weights, self.hidden, self.groups.device)
        if message is not None:
            return message
        if x.shape[0] > self.max_tokens:
            return (f"{where}: x has {x.shape[0]} tokens but max_tokens_per_rank={self.max_tokens}; build the "
                    "dispatcher with a larger max_tokens_per_rank or dispatch in parts")
        if x.dtype != self.dtype:
            return f"{where}: x is {x.dtype} but the dispatcher's buffers are {self.dtype}; pass x.to({self.dtype})"
        if topk_weights.dtype not in WEIGHT_DTYPES:
            return f"{where}: topk_weights must be one of {', '.join(map(str, WEIGHT_DTYPES))}, got {topk_weights.dtype}"
        if recording and (x.requires_grad or topk_weights.requires_grad):
            return (f"{where}: x.requires_grad={x.requires_grad}, topk_weights.requires_grad="
                    f"{topk_weights.requires_grad}, but the lowlatency mode records no autograd (its output would be "
                    "cut from the graph): run decode under torch.no_grad() or torch.inference_mode(), or train "
                    "through a normal-mode dispatcher (make_dispatcher('dedup', ...))")
        return None

    def _verdict_on_ids(self, rejected: torch.Tensor, topk_idx: torch.Tensor) -> str | None:
        """`DeviceMetadata`'s check of the ids' values (``rejected``, a device bool): read where
        the ranks agree on errors (or on CPU) and turned into this rank's message; elsewhere
        asserted on the device, which reads nothing on the host (a failed assert stops the
        CUDA stream rather than letting the rank's tokens go missing silently)."""
        if self.agree_on_errors or rejected.device.type == "cpu":
            return ids_problem(self._where, topk_idx, self.num_experts) if bool(rejected) else None
        torch._assert_async(~rejected, f"{self._where}: topk_idx values must be in [-1, {self.num_experts}) and "
                                       "differ within a token")
        return None

    def _raise_if_any_failed(self, message: str | None, failed: torch.Tensor, verb: str) -> None:
        """Raise on every rank when any rank flagged invalid input (``failed`` [P], a tensor or
        array, nonzero where a rank did, from the headers), or on this rank alone without
        ``agree_on_errors``."""
        if message is not None and not self.agree_on_errors:
            raise InvalidInputError(message)
        if self.agree_on_errors and bool(failed.any()):
            if message:
                raise InvalidInputError(message)
            bad = ", ".join(str(r) for r, flag in enumerate(failed.tolist()) if flag)
            raise InvalidInputError(f"lowlatency {verb} aborted on EP rank {self.groups.ep_rank}: invalid input on "
                                    f"EP rank(s) {bad}; see the error raised there")

    def _check_weight_dtypes(self, codes: torch.Tensor, mine: torch.dtype) -> None:
        """Every rank sees every rank's weights dtype (``codes`` [P], a tensor or array) and raises
        alike if they differ."""
        names = [str(WEIGHT_DTYPES[int(c)]) for c in codes.tolist()]
        if len(set(names)) > 1:
            raise InvalidInputError(f"{self._where}: topk_weights must have one "
                                    f"dtype on every EP rank, got {names} by rank; pass topk_weights.to({mine}) "
                                    "(or one common dtype) everywhere")

    def __repr__(self) -> str:
        return (f"LowLatencyDispatcher(ep_size={self.groups.ep_size}, num_experts={self.num_experts}, "
                f"max_tokens_per_rank={self.max_tokens}, hidden={self.hidden}, dtype={self.dtype}, "
                f"payload={self.payload!r})")


def _rows_for(nbytes: int, row_bytes: int) -> int:
    """Rows of ``row_bytes`` that hold ``nbytes``."""
    return -(-nbytes // row_bytes)
