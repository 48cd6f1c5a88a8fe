"""`expertrail bench`: every dispatcher on identical inputs on real ranks, checked and timed.

Each backend first has its rows and combine output checked against the single-process
reference, then dispatch and combine are timed over ``iters`` iterations (the time of an
iteration is the slowest rank's). Next to them the bench times the *bare collectives*: the
same exchanges with the same per-peer byte counts on preallocated buffers, with no local work,
which is the transport limit of this machine for that backend's traffic.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .dispatch import BACKENDS, make_dispatcher
from .dispatch.route import LINK_CLASSES
from .errors import ExpertrailError
from .reference import reference_dispatch, reference_moe
from .topology import EPGroups, all_gather_single
from .workload import make_routing, make_tokens

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class BenchCheckError(ExpertrailError):
    """A backend's output differs from the single-process reference."""


@dataclass
class BenchConfig:
    """What `expertrail bench` runs. Sizes are per rank; defaults follow the Hybrid-EP test
    (uniform top-8 routing, BF16 tokens) at a size a 2-core CPU finishes in about a minute."""

    world: int = 4
    domain_size: int = 2
    hidden: int = 2048
    tokens: int = 1024
    experts: int = 16
    topk: int = 8
    backends: list = field(default_factory=lambda: sorted(BACKENDS))
    dtype: str = "bf16"
    routing: str = "uniform"
    iters: int = 10
    warmup: int = 2
    seed: int = 0
    progress: bool = True


def _stats(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def _slowest_rank(times: list, group) -> list:
    """Per-iteration max over ranks of this rank's times [iters] (seconds)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _agree_ok(ok: bool, group) -> bool:
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.item() == 0


def bare_collectives(res, x_bytes_per_row: int):
    """A function replaying ``res``'s exchanges (same peers, same byte counts, one collective
    per hop and direction) on preallocated buffers with no local work."""
    plans = []
    for hop in (h for h in res.route.hops if not h.local):
        row = x_bytes_per_row + hop.meta_bytes
        if hop.gathered:
            most = max(hop.recv_splits)
            send = torch.empty(most * row, dtype=torch.uint8)
            recv = torch.empty(len(hop.recv_splits) * most * row, dtype=torch.uint8)
        else:
            send = torch.empty(sum(hop.send_splits) * row, dtype=torch.uint8)
            recv = torch.empty(sum(hop.recv_splits) * row, dtype=torch.uint8)
        back_send = torch.empty(sum(hop.recv_splits) * x_bytes_per_row, dtype=torch.uint8)
        back_recv = torch.empty(sum(hop.send_splits) * x_bytes_per_row, dtype=torch.uint8)
        plans.append((hop, row, send, recv, back_send, back_recv))

    def run():
        for hop, row, send, recv, _, _ in plans:
            if len(hop.peers) == 1:
                continue
            if hop.gathered:
                all_gather_single(recv, send, group=hop.group)
            else:
                dist.all_to_all_single(recv, send, [s * row for s in hop.recv_splits],
                                       [s * row for s in hop.send_splits], group=hop.group)
        t_dispatch = time.perf_counter()
        for hop, row, _, _, back_send, back_recv in reversed(plans):
            if len(hop.peers) == 1:
                continue
            dist.all_to_all_single(back_recv, back_send, [s * x_bytes_per_row for s in hop.send_splits],
                                   [s * x_bytes_per_row for s in hop.recv_splits], group=hop.group)
        return t_dispatch
    return run


def bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict:
    """Run the benchmark on this rank (collective over the default group); returns the results
    (the same on every rank)."""
    torch.manual_seed(cfg.seed)
    dtype = DTYPES[cfg.dtype]
    groups = EPGroups.from_default(domain_size=cfg.domain_size)
    inputs = [(make_tokens(cfg.tokens, cfg.hidden, dtype, r, cfg.seed),
               *make_routing(cfg.routing, cfg.tokens, cfg.experts, cfg.topk, r, world, cfg.seed))
              for r in range(world)]
    x, idx, w = inputs[rank]
    xs, idxs, ws = zip(*inputs)
    ref_tokens = reference_dispatch(xs, idxs, ws, cfg.experts, world)[rank][0]
    ref_y = reference_moe([x], [idx], [w], lambda rows, e: rows, cfg.experts)[0]
    del inputs, xs, idxs, ws

    progress = _progress(rank == 0 and cfg.progress, len(cfg.backends) * (2 * cfg.iters + cfg.warmup + 1))
    results = {}
    for backend in cfg.backends:
        d = make_dispatcher(backend, groups, num_experts=cfg.experts, hidden=cfg.hidden)
        disp, comb = [], []
        for it in range(cfg.warmup + cfg.iters):
            dist.barrier()
            t0 = time.perf_counter()
            res = d.dispatch(x, idx, w)
            t1 = time.perf_counter()
            y = d.combine(res.tokens, res)
            t2 = time.perf_counter()
            if it == 0:
                _check(backend, res, y, ref_tokens, ref_y, dtype, rank)
            elif it >= cfg.warmup:
                disp.append(t1 - t0)
                comb.append(t2 - t1)
            progress.advance()
        replay = bare_collectives(res, cfg.hidden * x.element_size())
        bare_d, bare_c = [], []
        for _ in range(cfg.iters):
            dist.barrier()
            t0 = time.perf_counter()
            t1 = replay()
            t2 = time.perf_counter()
            bare_d.append(t1 - t0)
            bare_c.append(t2 - t1)
            progress.advance()
        disp, comb = _slowest_rank(disp, None), _slowest_rank(comb, None)
        bare_d, bare_c = _slowest_rank(bare_d, None), _slowest_rank(bare_c, None)
        total = [a + b for a, b in zip(disp, comb)]
        bare = [a + b for a, b in zip(bare_d, bare_c)]
        logical = _logical_bytes(res, cfg, x.element_size(), groups)
        results[backend] = {
            "dispatch_s": _stats(disp), "combine_s": _stats(comb), "total_s": _stats(total),
            "bare_dispatch_s": _stats(bare_d), "bare_combine_s": _stats(bare_c), "bare_total_s": _stats(bare),
            "ratio_to_bare": statistics.median(total) / statistics.median(bare) if statistics.median(bare) else None,
            "dispatch_bytes": _sum_over_ranks(res.stats.bytes, groups),
            "combine_bytes": _sum_over_ranks(res.combine_stats.bytes, groups),
            "algorithm_bandwidth_GBps": logical / statistics.median(total) / 1e9,
            "check": "passed",
        }
    progress.close()
    return {"config": asdict(cfg), "results": results,
            "machine": {"torch": torch.__version__, "backend": dist.get_backend(), "threads": torch.get_num_threads()}}


def _logical_bytes(res, cfg, element_size, groups) -> int:
    """Rows x hidden x element size summed over ranks, each (token, destination rank) once, out and back."""
    rows = torch.tensor([sum(res.stats.rows.values())], dtype=torch.float64)
    dist.all_reduce(rows)
    return int(rows.item()) * cfg.hidden * element_size * 2


def _sum_over_ranks(per_class: dict, groups) -> dict:
    t = torch.tensor([per_class[c] for c in LINK_CLASSES], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(LINK_CLASSES, (int(v) for v in t.tolist())))


def _check(backend, res, y, ref_tokens, ref_y, dtype, rank) -> None:
    problem = None
    if not torch.equal(res.tokens, ref_tokens):
        problem = "dispatched rows differ from the reference"
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = (y.double() - ref_y.double()).abs().max().item() if y.numel() else 0.0
        if err > tol * max(1.0, ref_y.double().abs().max().item() if y.numel() else 1.0):
            problem = f"combine differs from the reference by {err:.3g}"
    if not _agree_ok(problem is None, None):
        raise BenchCheckError(f"backend {backend!r} failed its correctness check"
                              + (f" on rank {rank}: {problem}" if problem else " on another rank"))


class _NoProgress:
    def advance(self):
        pass

    def close(self):
        pass


class _RichProgress:
    def __init__(self, total):
        from rich.progress import Progress
        self._p = Progress(transient=True)
        self._p.start()
        self._task = self._p.add_task("bench", total=total)

    def advance(self):
        self._p.advance(self._task)

    def close(self):
        self._p.stop()


def _progress(enabled: bool, total: int):
    if not enabled:
        return _NoProgress()
    try:
        return _RichProgress(total)
    except ImportError:
        return _NoProgress()


def format_table(report: dict) -> str:
    """A plain-text table of the bench results (times in ms)."""
    cfg = report["config"]
    head = (f"expertrail bench: world {cfg['world']}, domain {cfg['domain_size']}, {cfg['tokens']} tokens/rank, "
            f"hidden {cfg['hidden']}, {cfg['experts']} experts, top-{cfg['topk']}, {cfg['dtype']}, "
            f"routing {cfg['routing']}, {cfg['iters']} iters (slowest rank per iter)")
    cols = ["backend", "dispatch ms", "combine ms", "total ms (min-max)", "bare ms", "x bare",
            "self MB", "intra MB", "inter MB", "algo GB/s", "check"]
    rows = []
    for name, r in report["results"].items():
        b = r["dispatch_bytes"]
        rows.append([name, f"{r['dispatch_s']['median'] * 1e3:.2f}", f"{r['combine_s']['median'] * 1e3:.2f}",
                     f"{r['total_s']['median'] * 1e3:.2f} ({r['total_s']['min'] * 1e3:.1f}-{r['total_s']['max'] * 1e3:.1f})",
                     f"{r['bare_total_s']['median'] * 1e3:.2f}", f"{r['ratio_to_bare']:.2f}",
                     f"{b['self'] / 1e6:.1f}", f"{b['intra'] / 1e6:.1f}", f"{b['inter'] / 1e6:.1f}",
                     f"{r['algorithm_bandwidth_GBps']:.2f}", r["check"]])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(cells, widths)))
    return "\n".join([head, line(cols), line(["-" * wd for wd in widths]), *map(line, rows),
                      "MB: dispatch bytes handed to collectives, all ranks, per link class; "
                      "x bare: total / bare collectives moving the same bytes"])


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
