"""`expertrail bench --decode`: the per-step latency of decode-sized dispatch + combine.

For each size in ``DECODE_TOKENS`` (tokens per rank), three ways of moving the same tokens,
alternating step by step so the machine's noise falls on all alike:

- ``normal``: the `dedup` backend (the arithmetic lowlatency reproduces bit for bit), planned on
  the host from a counts round each call;
- ``lowlatency``: `LowLatencyDispatcher`, fixed buffers, one exchange each way;
- ``bare``: the bare collectives that move lowlatency's fixed blocks out and back
  (``all_to_all_single`` of the same bytes, buffers allocated once): the floor for that traffic.

A step's latency is the slowest rank's (a decode step waits for every rank); the report gives
its p50 and p99 per mode and size, checks lowlatency's output against the normal mode's, and
with ``--json`` writes ``results[mode][tokens_per_rank] = {"p50_s", "p99_s"}``.
"""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .bench import DTYPES, _clock, _slowest_rank
from .configs import BenchConfig
from ..dispatch import LowLatencyDispatcher, make_dispatcher
from ..comm.topology import EPGroups

DECODE_TOKENS = (1, 8, 32, 128)
MODES = ("normal", "lowlatency", "bare")


def _percentile(values: list, q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def decode_rank(rank: int, world: int, cfg: BenchConfig, sizes=DECODE_TOKENS) -> dict:
    """Run on every rank; returns the report (the same on every rank)."""
    groups = EPGroups.from_default(domain_size=cfg.domain_size)
    dtype, device = DTYPES[cfg.dtype], groups.device
    normal = make_dispatcher("dedup", groups, num_experts=cfg.experts, hidden=cfg.hidden)
    results = {mode: {} for mode in MODES}
    checked = True
    for tokens in sizes:
        ll = LowLatencyDispatcher(groups, num_experts=cfg.experts, max_tokens_per_rank=tokens,
                             hidden=cfg.hidden, dtype=dtype, payload=cfg.payload)
        g = torch.Generator().manual_seed(cfg.seed * 1009 + rank * 31 + tokens)
        x = torch.randn(tokens, cfg.hidden, generator=g).to(dtype).to(device)
        idx = torch.stack([torch.randperm(cfg.experts, generator=g)[:cfg.topk] for _ in range(tokens)]).to(device)
        w = torch.rand(tokens, cfg.topk, generator=g).to(device)
        send, recv = torch.zeros_like(ll._send), torch.zeros_like(ll._recv)       # lowlatency's fixed blocks
        back_send, back = torch.zeros_like(ll._back_send), torch.zeros_like(ll._back)

        def run_normal():
            res = normal.dispatch(x, idx, w)
            return normal.combine(res.tokens, res)

        def run_lowlatency():
            res = ll.dispatch(x, idx, w)
            return ll.combine(res.tokens, res)

        def run_bare():
            dist.all_to_all_single(recv, send, group=groups.ep_group)
            dist.all_to_all_single(back, back_send, group=groups.ep_group)

        calls = {"normal": run_normal, "lowlatency": run_lowlatency, "bare": run_bare}
        for fn in calls.values():
            for _ in range(max(1, cfg.warmup)):
                fn()
        if cfg.payload == "native":            # fp8 rows differ from the normal mode's bf16 rows by design
            checked &= bool(torch.equal(run_lowlatency(), run_normal()))
        times = {mode: [] for mode in MODES}
        for _ in range(cfg.iters):
            for mode, fn in calls.items():
                dist.barrier(group=groups.ep_group)
                start = _clock(device)
                fn()
                times[mode].append(_clock(device) - start)
        for mode in MODES:
            slowest = _slowest_rank(times[mode])
            results[mode][tokens] = {"p50_s": _percentile(slowest, 0.5), "p99_s": _percentile(slowest, 0.99),
                                     "mean_s": statistics.mean(slowest)}
    return {"config": {"world": world, "domain_size": cfg.domain_size, "hidden": cfg.hidden, "experts": cfg.experts,
                       "topk": cfg.topk, "dtype": cfg.dtype, "payload": cfg.payload, "iters": cfg.iters,
                       "tokens_per_rank": list(sizes)},
            "results": results, "lowlatency_equals_normal": checked if cfg.payload == "native" else None}


def format_decode(report: dict) -> str:
    """The report as a table: p50 / p99 per mode and size, and lowlatency's speed-up."""
    c, r = report["config"], report["results"]
    lines = [f"decode: {c['world']} ranks, hidden {c['hidden']}, {c['experts']} experts, top-{c['topk']}, "
             f"{c['dtype']}, payload {c['payload']}; per-step dispatch+combine of the slowest rank, "
             f"{c['iters']} steps",
             f"{'tokens/rank':>11}  {'normal p50/p99 ms':>18}  {'lowlatency p50/p99 ms':>22}  {'bare p50/p99 ms':>16}  "
             f"{'normal/ll':>9}  {'ll/bare':>7}"]
    for tokens in c["tokens_per_rank"]:
        cell = {m: r[m][tokens] for m in MODES}
        lines.append(f"{tokens:>11}  " + "  ".join(
            f"{1e3 * cell[m]['p50_s']:>{w - 8}.2f} / {1e3 * cell[m]['p99_s']:>5.2f}" for m, w in
            (("normal", 18), ("lowlatency", 22), ("bare", 16)))
            + f"  {cell['normal']['p50_s'] / cell['lowlatency']['p50_s']:>8.2f}x"
            + f"  {cell['lowlatency']['p50_s'] / cell['bare']['p50_s']:>6.2f}x")
    if report.get("lowlatency_equals_normal") is not None:
        lines.append(f"lowlatency output equals the normal mode's: {'yes' if report['lowlatency_equals_normal'] else 'NO'}")
    return "\n".join(lines)
