"""Bucketed dispatch: each step through the low-latency mode or the normal mode, by token count.

Decode and prefill want different exchanges. At a few tokens per rank the normal mode's costs
are per call (a count round trip, a plan made on the host), and the fixed-shape
`LowLatencyDispatcher` wins; at prefill sizes its fixed blocks and packed gathers grow faster
than the rows they carry, and its buffers would have to be sized for the longest prompt.
`BucketedDispatch` holds both: the normal-mode dispatcher (``dedup``, whose arithmetic the
low-latency mode reproduces, so outputs are the same bits whichever runs) and one
low-latency dispatcher per bucket (``buckets``, most tokens per rank, e.g. 8 / 32 / 128),
built on first use. Each step it picks:

- the smallest bucket holding the largest token count of any rank of the EP group, when no
  rank records gradients (the low-latency mode records no autograd);
- the normal mode otherwise (more tokens than the largest bucket, or training).

The choice must be the same on every rank (each mode's exchange is collective), so it is made
from an all-reduce(MAX) of two ints (tokens, needs gradients) over the EP group. A standalone
layer agrees at every call; a patched model agrees once per forward (`attach_step`: its
top-level forward posts the all-reduce of its input's token count, which travels while the
embeddings and the first attention run; the first MoE block reads it, the others read that).

Default buckets: ``docs/benchmarks.md`` ("Decode: the low-latency mode") measured the
low-latency mode ahead of the normal mode at 1, 8, 32 and 128 tokens per rank (2.4x at 8,
1.3x at 128 on loopback; 1.03x at 128 over a 1 Gbit/s emulated link), so the default buckets
stop at 128; pass ``buckets=`` to change them (``()`` or None: the normal mode only).

Bit-for-bit: the experts see the received rows packed as the normal mode packs them (each
local expert's rows, by source rank then token, concatenated), so their GEMMs have the same
shapes and give the same bits; the combine sums as the normal mode does (`lowlatency`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..dispatch import LowLatencyDispatcher
from ..errors import ConfigError
from ..comm.topology import EPGroups, guarded

DEFAULT_BUCKETS = (8, 32, 128)
NORMAL = "normal"


def check_buckets(buckets) -> tuple[int, ...]:
    """``buckets`` as a sorted tuple of distinct positive ints (None or empty: ()); ConfigError
    naming the bad value otherwise. Local: `BucketedDispatch` then checks every rank has the same."""
    if buckets is None:
        return ()
    if isinstance(buckets, (int, str)) or not hasattr(buckets, "__iter__"):
        raise ConfigError(f"buckets={buckets!r}: give a list of token counts per rank, e.g. [8, 32, 128]")
    values = list(buckets)
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in values):
        raise ConfigError(f"buckets={values}: every bucket must be a positive int (most tokens per rank)")
    if len(set(values)) != len(values):
        raise ConfigError(f"buckets={values}: a bucket is listed twice")
    return tuple(sorted(values))


class StepTokens:
    """What one forward of a patched model agreed on, shared by its MoE blocks: ``agreed`` is
    None outside a forward or before its first block, else (largest tokens per rank, any rank
    needs grad); ``pending``: the all-reduce the forward posted at its start, not yet read."""

    def __init__(self):
        self.open, self.agreed, self.pending = False, None, None


def _step_tokens(module: nn.Module, args, kwargs) -> tuple[int, bool] | None:
    """(tokens, needs grad) of a causal LM forward from its ``input_ids`` [B, S] or
    ``inputs_embeds`` [B, S, H] (a decoder's MoE blocks see B * S tokens); None if it has neither."""
    ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
    embeds = kwargs.get("inputs_embeds")
    if ids is None and embeds is None:
        return None
    tokens = ids.numel() if ids is not None else embeds.shape[:-1].numel()
    grad = torch.is_grad_enabled() and (any(p.requires_grad for p in module.parameters())
                                        or (embeds is not None and embeds.requires_grad))
    return tokens, grad


def attach_step(model: nn.Module, blocks: list) -> StepTokens:
    """Make ``model``'s forward agree on the step once. Its forward pre-hook posts the all-reduce
    of the step's tokens (from ``input_ids`` / ``inputs_embeds``) without waiting, so that it
    travels while the embeddings and the first attention run; the first of ``blocks`` (their
    `BucketedDispatch`) reads it (or agrees itself, for a forward without either input) and the
    others read that; a forward hook closes the step. Returns the shared `StepTokens` (also at
    ``model._expertrail_step``). If a block sees more tokens than its rank posted (not a plain
    decoder), the low-latency dispatcher's own check raises on every rank."""
    step = StepTokens()
    groups = blocks[0].groups

    def opened(module, args, kwargs):
        step.open, step.agreed, step.pending = True, None, None
        mine = _step_tokens(module, args, kwargs)
        if mine is not None:
            t = torch.tensor([mine[0], int(mine[1])], dtype=torch.int64, device=groups.device)
            with guarded("bucketed dispatch's token count all-reduce", groups):
                step.pending = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.ep_group, async_op=True), t)

    def closed(module, args, output):
        step.open, step.agreed, step.pending = False, None, None
    for b in blocks:
        b.step = step
    model._expertrail_step = step
    model._expertrail_step_hooks = (model.register_forward_pre_hook(opened, with_kwargs=True),
                                    model.register_forward_hook(closed))
    return step


def detach_step(model: nn.Module) -> None:
    """Remove `attach_step`'s hooks from ``model`` (nothing if it has none)."""
    for hook in vars(model).pop("_expertrail_step_hooks", ()):
        hook.remove()
    vars(model).pop("_expertrail_step", None)


class BucketedDispatch:
    """The normal-mode dispatcher and low-latency ones per bucket, for one MoE layer.

    Args:
        groups: the EP group.
        normal: the layer's normal-mode dispatcher; its backend must be ``dedup`` (the mode the
            low-latency one reproduces bit for bit).
        buckets: most tokens per rank of each low-latency bucket (checked: the same on every rank).
    Collective to build (one small all-gather). ``modes``: how many calls ran in each mode
    (``"normal"`` or the bucket), ``last``: the last call's mode.
    """

    def __init__(self, groups: EPGroups, normal, buckets=DEFAULT_BUCKETS):
        mine = check_buckets(buckets)
        problem = None
        if getattr(normal, "name", None) != "dedup":
            problem = (f"buckets need the normal mode whose arithmetic the low-latency mode reproduces: pass "
                       f"backend='dedup' (got {getattr(normal, 'name', type(normal).__name__)!r})")
        groups.check_same({"buckets": list(mine), "normal backend": getattr(normal, "name", "?")}, "bucketed dispatch")
        if problem:
            raise ConfigError(problem)
        self.groups, self.normal, self.buckets = groups, normal, mine
        self.step: StepTokens | None = None
        self._lowlatency: dict = {}
        self._out: dict = {}
        self._rows_of: dict = {}
        self.modes: dict = {}
        self.last = None

    def choose(self, tokens: int, needs_grad: bool):
        """The mode for a step whose largest rank holds ``tokens``: a bucket, or "normal"."""
        if needs_grad:
            return NORMAL
        return next((b for b in self.buckets if tokens <= b), NORMAL)

    def agree(self, tokens: int, needs_grad: bool) -> tuple[int, bool]:
        """(largest tokens per rank, any rank needs grad) over the EP group: one all-reduce(MAX)
        of two ints. In a step opened by `attach_step`, the first call agrees and later ones read it."""
        step, g = self.step, self.groups
        if step is not None and step.agreed is None and step.pending is not None:
            work, t = step.pending
            with guarded("bucketed dispatch's token count all-reduce", g):
                work.wait()
            step.agreed, step.pending = (int(t[0]), bool(t[1])), None
        if step is not None and step.agreed is not None:
            return step.agreed
        t = torch.tensor([tokens, int(needs_grad)], dtype=torch.int64, device=g.device)
        with guarded("bucketed dispatch's token count all-reduce", g):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g.ep_group)
        agreed = (int(t[0]), bool(t[1]))
        if self.step is not None and self.step.open:
            self.step.agreed = agreed
        return agreed

    def _row_index(self, rows: int) -> torch.Tensor:
        """int64 [rows]: 0 .. rows - 1 (made once per size)."""
        index = self._rows_of.get(rows)
        if index is None:
            index = self._rows_of[rows] = torch.arange(rows, device=self.groups.device)
        return index

    def _dispatcher(self, bucket: int, hidden: int, dtype: torch.dtype) -> LowLatencyDispatcher:
        key = (bucket, hidden, dtype)
        if key not in self._lowlatency:      # collective: built at the same call on every rank (the same choice)
            n = self.normal
            self._lowlatency[key] = LowLatencyDispatcher(self.groups, n.num_experts, bucket, hidden, dtype,
                                                         payload=n.config.payload)
        return self._lowlatency[key]

    def moe(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts,
            shared=None, num_chunks: int = 1) -> torch.Tensor:
        """`layer.expert_parallel_moe` through the mode this step agreed on: x [T, H],
        topk_idx / topk_weights [T, K] (slots, if replicated) -> [T, H]. ``num_chunks`` applies
        to the normal mode (a decode step is too small to split); the shared experts run after
        the low-latency dispatch, which returns once its rows have landed."""
        from .layer import expert_parallel_moe
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in experts.parameters()))
        tokens, grad = self.agree(x.shape[0], needs_grad)
        mode = self.choose(tokens, grad)
        self.modes[mode] = self.modes.get(mode, 0) + 1
        self.last = mode
        if mode == NORMAL:
            return expert_parallel_moe(self.normal, x, topk_idx, topk_weights, experts, shared, num_chunks)
        ll = self._dispatcher(mode, x.shape[-1], x.dtype)
        res = ll.dispatch(x, topk_idx, topk_weights)
        shared_out = None if shared is None else shared()
        count, tokens = res.count, res.tokens                     # [E_local], [E_local, P * T, H]
        real = self._row_index(tokens.shape[1]) < count.unsqueeze(1)    # [E_local, P * T]: the real rows
        done = experts(tokens[real], count)      # the normal mode's packing: by expert, then source rank and token
        out = self._out.get(ll)
        if out is None or out.dtype != done.dtype:
            out = self._out[ll] = torch.zeros_like(tokens, dtype=done.dtype)
        out[real] = done
        y = ll.combine(out, res)
        return y if shared_out is None else y + shared_out


def bucketed_or_none(groups: EPGroups, normal, buckets) -> BucketedDispatch | None:
    """A `BucketedDispatch` for ``buckets``, or None for None (no collective) and for ``()``
    (collective, like any other value). Malformed or differing ``buckets`` raise ConfigError on
    every rank: the ranks first agree on whether each rank's are valid, then on their values."""
    if buckets is None:
        return None
    try:
        check_buckets(buckets)
        problem = None
    except ConfigError as err:
        problem = str(err)
    from ..comm.topology import all_gather_ints
    with guarded("bucketed dispatch's settings check", groups):
        flags = all_gather_ints([problem is not None], groups.ep_group, groups.device)
    bad = [r for r, (flag,) in enumerate(flags) if flag]
    if bad:
        raise ConfigError(problem or f"bucketed dispatch: EP rank(s) {bad} were given invalid buckets; see the error "
                                     "raised there")
    if not check_buckets(buckets):
        groups.check_same({"buckets": [], "normal backend": getattr(normal, "name", "?")}, "bucketed dispatch")
        return None
    return BucketedDispatch(groups, normal, buckets)
