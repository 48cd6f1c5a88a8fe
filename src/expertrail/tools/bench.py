"""`expertrail bench`: every dispatcher on identical inputs on real ranks, checked and timed.

Each backend first has its rows and combine output checked against the single-process
reference (first warm-up iteration), then dispatch and combine are timed over ``iters``
rounds (the time of an iteration is the slowest rank's). Next to them the bench times the
*bare collectives*: the same exchanges with the same per-peer byte counts on preallocated
buffers, with no local work, which is the transport limit of this machine for that backend's
traffic. Each round runs every backend and then its bare collectives, so every figure and
ratio comes from the same moments of a shared machine.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..kernels import fp8
from .configs import BenchConfig
from ..dispatch import make_dispatcher
from ..comm.transport import LINK_CLASSES
from ..errors import ExpertrailError
from ..dispatch.reference import reference_dispatch, reference_moe
from ..comm.topology import EPGroups, all_gather_single
from .workload import make_routing, make_tokens

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


class BenchCheckError(ExpertrailError):
    """A backend's output differs from the single-process reference."""


def _stats(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def _reduce_over_ranks(values: list, op=dist.ReduceOp.SUM) -> list:
    """All-reduce a list of floats over the default group (on the device its backend uses:
    NCCL reduces CUDA tensors only)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _slowest_rank(times: list) -> list:
    """Per-iteration max over ranks of this rank's times [iters] (seconds)."""
    return _reduce_over_ranks(times, dist.ReduceOp.MAX)


def _agree_ok(ok: bool) -> bool:
    return _reduce_over_ranks([0.0 if ok else 1.0], dist.ReduceOp.MAX)[0] == 0.0


def bare_collectives(res, x_bytes_per_row: int, device, wire_bytes_per_row: int | None = None):
    """A function replaying ``res``'s exchanges (same peers, same byte counts, one collective
    per hop and direction) on preallocated buffers with no local work. Dispatch rows are
    ``wire_bytes_per_row`` (fp8 rows; default: as combine's, ``x_bytes_per_row``)."""
    plans = []
    for hop in res.route.exchanges():
        row = (wire_bytes_per_row or x_bytes_per_row) + hop.meta_bytes
        if hop.kind == "all-gather":
            most = max(hop.recv_splits)
            send = torch.empty(most * row, dtype=torch.uint8, device=device)
            recv = torch.empty(len(hop.recv_splits) * most * row, dtype=torch.uint8, device=device)
        else:
            send = torch.empty(sum(hop.send_splits) * row, dtype=torch.uint8, device=device)
            recv = torch.empty(sum(hop.recv_splits) * row, dtype=torch.uint8, device=device)
        back_send = torch.empty(sum(hop.recv_splits) * x_bytes_per_row, dtype=torch.uint8, device=device)
        back_recv = torch.empty(sum(hop.send_splits) * x_bytes_per_row, dtype=torch.uint8, device=device)
        plans.append((hop, row, send, recv, back_send, back_recv))

    def run():
        for hop, row, send, recv, _, _ in plans:
            if hop.kind == "all-gather":
                all_gather_single(recv, send, group=hop.channel.group)
            else:
                dist.all_to_all_single(recv, send, [s * row for s in hop.recv_splits],
                                       [s * row for s in hop.send_splits], group=hop.channel.group)
        t_dispatch = time.perf_counter()
        for hop, row, _, _, back_send, back_recv in reversed(plans):
            dist.all_to_all_single(back_recv, back_send, [s * x_bytes_per_row for s in hop.send_splits],
                                   [s * x_bytes_per_row for s in hop.recv_splits], group=hop.channel.group)
        return t_dispatch
    return run


def _clock(device: torch.device) -> float:
    """perf_counter after the device has finished queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def bench_rank(rank: int, world: int, cfg: BenchConfig) -> dict:
    """Run the benchmark on this rank (collective over the default group); returns the results
    (the same on every rank)."""
    torch.manual_seed(cfg.seed)
    dtype = DTYPES[cfg.dtype]
    groups = EPGroups.from_default(domain_size=cfg.domain_size)
    dev = groups.device
    inputs = [(make_tokens(cfg.tokens, cfg.hidden, dtype, r, cfg.seed),
               *make_routing(cfg.routing, cfg.tokens, cfg.experts, cfg.topk, r, world, cfg.seed))
              for r in range(world)]
    xs, idxs, ws = zip(*inputs)
    if cfg.payload == "fp8":          # the reference of fp8 rows: the same quantization, then exact
        xs = [fp8.dequantize(fp8.quantize(t), cfg.hidden, dtype) for t in xs]
    ref_tokens = reference_dispatch(xs, idxs, ws, cfg.experts, world)[rank][0]
    ref_y = reference_moe([xs[rank]], [idxs[rank]], [ws[rank]], lambda rows, e: rows, cfg.experts)[0]
    x, idx, w = (t.to(dev) for t in inputs[rank])
    del inputs, xs, idxs, ws

    warmup = max(1, cfg.warmup)                     # the first iteration is the correctness check
    steps = warmup + 2 * cfg.iters + (2 * (cfg.iters + 1) if cfg.chunks > 1 else 0)
    progress = _progress(rank == 0 and cfg.progress, len(cfg.backends) * steps)
    # fp8: rows arrive as fp8 values and scales, as FP8 experts take them (DeepEP's and
    # Hybrid-EP's FP8 dispatch); the identity experts' output is their dequantization, made once.
    options = {"payload": "fp8", "dequantize": False} if cfg.payload == "fp8" else {}
    pipeline = {"hierarchical": {"pipeline_chunks": getattr(cfg, "pipeline_chunks", None)}}
    dispatchers = {b: make_dispatcher(b, groups, num_experts=cfg.experts, hidden=cfg.hidden, **options,
                                      **pipeline.get(b, {}))
                   for b in cfg.backends}
    wire_row = fp8.row_bytes(cfg.hidden) if cfg.payload == "fp8" else None
    last, replays, expert_out = {}, {}, {}
    for backend, d in dispatchers.items():           # check, warm up, and record each backend's exchanges
        for it in range(warmup):
            res = d.dispatch(x, idx, w)
            if it == 0:
                expert_out[backend] = _rows(res)
            y = d.combine(expert_out[backend], res)
            if it == 0:
                _check(backend, expert_out[backend], y, ref_tokens, ref_y, dtype, rank)
            progress.advance()
        last[backend] = res
        replays[backend] = bare_collectives(res, cfg.hidden * x.element_size(), dev, wire_row)
    # Timed rounds: each round runs every backend once, then its bare collectives, so that all
    # of them see the same moments of a shared, noisy machine.
    times = {b: ([], [], [], []) for b in cfg.backends}
    for _ in range(cfg.iters):
        for backend, d in dispatchers.items():
            disp, comb, bare_d, bare_c = times[backend]
            dist.barrier()
            t0 = _clock(dev)
            res = d.dispatch(x, idx, w)
            t1 = _clock(dev)
            d.combine(expert_out[backend], res)
            t2 = _clock(dev)
            disp.append(t1 - t0)
            comb.append(t2 - t1)
            progress.advance()
            dist.barrier()
            t0 = _clock(dev)
            t1 = replays[backend]()
            t2 = _clock(dev)
            bare_d.append(t1 - t0)
            bare_c.append(t2 - t1)
            progress.advance()
    results = {}
    for backend, d in dispatchers.items():
        res = last[backend]
        disp, comb, bare_d, bare_c = (_slowest_rank(t) for t in times[backend])
        total = [a + b for a, b in zip(disp, comb)]
        bare = [a + b for a, b in zip(bare_d, bare_c)]
        logical = _logical_bytes(res, cfg, x.element_size())
        results[backend] = {
            "dispatch_s": _stats(disp), "combine_s": _stats(comb), "total_s": _stats(total),
            "bare_dispatch_s": _stats(bare_d), "bare_combine_s": _stats(bare_c), "bare_total_s": _stats(bare),
            # None when nothing crosses a rank boundary (one rank): no transport to compare with.
            "ratio_to_bare": statistics.median(total) / statistics.median(bare) if res.route.exchanges() else None,
            "dispatch_bytes": _sum_over_ranks(res.stats.bytes),
            "dispatch_rows": _sum_over_ranks(res.stats.rows),
            "combine_bytes": _sum_over_ranks(res.combine_stats.bytes),
            "algorithm_bandwidth_GBps": logical / statistics.median(total) / 1e9,
            # whether received rows landed straight in place (alltoall's runs) or were permuted
            "lands_in_place": res.route.lands_in_place,
            "check": "passed",
        }
        if cfg.chunks > 1:
            results[backend]["overlap"] = _bench_overlap(d, x, idx, w, cfg, groups, progress)
    progress.close()
    return {"config": asdict(cfg), "results": results,
            "machine": {"torch": torch.__version__, "backend": dist.get_backend(), "threads": torch.get_num_threads()}}


def _bench_overlap(d, x, idx, w, cfg, groups, progress) -> dict:
    """dispatch -> expert MLP -> combine, unchunked and in ``cfg.chunks`` overlapped chunks."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    # fp32 weights: CPUs without bf16 matrix units run bf16 GEMMs tens of times slower.
    w1 = (torch.randn(cfg.hidden, cfg.expert_ffn, generator=g) / cfg.hidden ** 0.5).to(x.device)
    w2 = (torch.randn(cfg.expert_ffn, cfg.hidden, generator=g) / cfg.expert_ffn ** 0.5).to(x.device)

    def experts(tokens, tokens_per_expert):    # the same cost per row on every expert
        return (torch.relu(tokens.float() @ w1) @ w2).to(tokens.dtype)

    out = {}
    for chunks in (1, cfg.chunks):
        times = []
        for it in range(cfg.iters + 1):
            dist.barrier()
            t0 = _clock(x.device)
            y = d.moe(x, idx, w, experts, num_chunks=chunks)
            times.append(_clock(x.device) - t0)
            progress.advance()
        out[chunks] = (statistics.median(_slowest_rank(times[1:])), y)
    (t1, y1), (tc, yc) = out[1], out[cfg.chunks]
    diff = (y1.float() - yc.float()).abs().max().item() if y1.numel() else 0.0
    diff = _reduce_over_ranks([diff], dist.ReduceOp.MAX)[0]
    return {"chunks": cfg.chunks, "expert_ffn": cfg.expert_ffn, "unchunked_s": t1, "chunked_s": tc,
            "speedup": t1 / tc, "max_abs_diff": diff, "identical": diff == 0.0}


def _logical_bytes(res, cfg, element_size) -> int:
    """Rows x hidden x element size summed over ranks, each (token, destination rank) once, out and back."""
    rows = _reduce_over_ranks([sum(res.stats.rows.values())])[0]
    return int(rows) * cfg.hidden * element_size * 2


def _sum_over_ranks(per_class: dict) -> dict:
    return dict(zip(LINK_CLASSES, (int(v) for v in _reduce_over_ranks([per_class[c] for c in LINK_CLASSES]))))


def _rows(res) -> torch.Tensor:
    """The dispatched rows in the tokens' dtype (fp8 rows dequantized with their scales)."""
    return res.tokens if res.scales is None else fp8.dequantize_values(res.tokens, res.scales, res.dtype)


def _check(backend, tokens, y, ref_tokens, ref_y, dtype, rank) -> None:
    problem = None
    tokens, y = tokens.cpu(), y.cpu()
    if not torch.equal(tokens, ref_tokens):
        problem = "dispatched rows differ from the reference"
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = (y.double() - ref_y.double()).abs().max().item() if y.numel() else 0.0
        if err > tol * max(1.0, ref_y.double().abs().max().item() if y.numel() else 1.0):
            problem = f"combine differs from the reference by {err:.3g}"
    if not _agree_ok(problem is None):
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
            f"routing {cfg['routing']}, {cfg['iters']} iters (slowest rank per iter); payload "
            f"{cfg.get('payload', 'native')}, allocator {'glibc heap (--malloc-heap)' if cfg.get('malloc_heap') else 'default' if 'malloc_heap' in cfg else 'not recorded'}")
    cols = ["backend", "dispatch ms", "combine ms", "total ms (min-max)", "bare ms", "x bare",
            "self MB", "intra MB", "inter MB", "algo GB/s", "check"]
    rows = []
    for name, r in report["results"].items():
        b = r["dispatch_bytes"]
        rows.append([name, f"{r['dispatch_s']['median'] * 1e3:.2f}", f"{r['combine_s']['median'] * 1e3:.2f}",
                     f"{r['total_s']['median'] * 1e3:.2f} ({r['total_s']['min'] * 1e3:.1f}-{r['total_s']['max'] * 1e3:.1f})",
                     f"{r['bare_total_s']['median'] * 1e3:.2f}",
                     "-" if r["ratio_to_bare"] is None else f"{r['ratio_to_bare']:.2f}",
                     f"{b['self'] / 1e6:.1f}", f"{b['intra'] / 1e6:.1f}", f"{b['inter'] / 1e6:.1f}",
                     f"{r['algorithm_bandwidth_GBps']:.2f}", r["check"]])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(wd) if i else c.ljust(wd) for i, (c, wd) in enumerate(zip(cells, widths)))
    return "\n".join([head, line(cols), line(["-" * wd for wd in widths]), *map(line, rows),
                      "MB: dispatch bytes handed to collectives, all ranks, per link class; "
                      "x bare: total / bare collectives moving the same bytes"])


def predict_backends(report: dict, links: dict, local: dict | None = None) -> None:
    """Add to every backend of ``report`` the planner's predicted times on this machine (its
    measured links and local pass figures, ``local``, as a `Hardware` entry, this run's shape,
    layout and rank 0's routing) and its count of this run's dispatch rows and bytes per link
    class from every rank's routing
    (`plan.cost.rows_by_link`), to set beside what the engine sent: ``predicted_dispatch_s``,
    ``predicted_combine_s``, ``predicted_total_s``, ``planner_rows``, ``planner_bytes``,
    ``planner_bytes_match``."""
    from ..emulation.links import measured_hardware
    from ..plan.catalog import MoEModel
    from ..plan.cost import EPLayout, metadata_bytes, predict, row_bytes, rows_by_link
    cfg = report["config"]
    idx = [make_routing(cfg["routing"], cfg["tokens"], cfg["experts"], cfg["topk"], r, cfg["world"],
                        cfg["seed"])[0].numpy() for r in range(cfg["world"])]
    hw = measured_hardware(links, cfg["domain_size"], local=local)
    layout = EPLayout(cfg["world"], cfg["domain_size"])
    model = MoEModel("bench", cfg["hidden"], cfg["experts"], cfg["topk"], cfg["expert_ffn"], 1)
    precision = "fp32" if cfg["dtype"] == "fp32" else "bf16"        # fp16 rows are as wide as bf16
    if cfg.get("payload") == "fp8":
        precision = "fp8"            # the planner's fp8: fp8 dispatch rows, bf16 combine rows
    from ..dispatch.hierarchical import DEFAULT_PIPELINE_CHUNKS
    pieces = cfg.get("pipeline_chunks") or DEFAULT_PIPELINE_CHUNKS
    for name, r in report["results"].items():
        # this engine: a route's hops run in turn, except hierarchical's, whose domain hop
        # forwards each piece of the rail hop as it lands; rows carry its metadata, and its
        # local passes take the measured time
        pipelined = pieces if name == "hierarchical" else False
        p = predict(hw, model, layout, name, idx[0], precision=precision, pipelined=pipelined, engine=True)
        rows = rows_by_link(idx, cfg["experts"], layout, name)
        row = row_bytes(model, precision, "dispatch") + metadata_bytes(name, cfg["topk"])
        planner_bytes = {link: n * row for link, n in rows.items()}
        r.update(predicted_dispatch_s=p.dispatch_s, predicted_combine_s=p.combine_s,
                 predicted_total_s=p.dispatch_s + p.combine_s, planner_rows=rows,
                 planner_bytes=planner_bytes, planner_bytes_match=planner_bytes == r["dispatch_bytes"])


def format_links(report: dict) -> str:
    """The emulated links as set and as measured, and measured against predicted time."""
    lines = []
    emulated = report.get("emulated")
    if emulated:
        lines.append(f"links emulated: {emulated['nodes']} nodes x {emulated['ranks_per_node']} ranks (network "
                     f"namespaces on this machine, cluster {emulated['cluster']}); inside a node: loopback; "
                     f"between nodes: veth shaped by tc tbf to {emulated['inter_link']} each way")
    for name, link in report.get("links", {}).items():
        lines.append(f"measured {name}-{'node' if emulated else 'domain'} link: {link['GBps']:.3f} GB/s per rank each "
                     f"way, latency {link['latency_us']:.0f} us (bare all-to-all as the engine sends it, "
                     f"{', '.join(f'{b / 1e6:.2f}' for b in link['bytes_per_rank'])} MB per rank)")
    local = report.get("local_passes")
    if local:
        lines.append(f"measured local passes: copy {local['copy_GBps']:.2f} GB/s, weighted sum "
                     f"{local['reduce_GBps']:.2f} GB/s per rank, every rank at once ({local['rows']} rows of "
                     f"{local['hidden']} {local['dtype']})")
    rows = [(n, r) for n, r in report["results"].items() if "predicted_total_s" in r]
    if rows:
        lines.append(f"{'backend':<14}{'measured ms':>12}{'predicted ms':>13}{'predicted/measured':>20}"
                     f"  planner bytes = engine bytes")
        for name, r in rows:
            measured = r["total_s"]["median"]
            lines.append(f"{name:<14}{measured * 1e3:>12.1f}{r['predicted_total_s'] * 1e3:>13.1f}"
                         f"{r['predicted_total_s'] / measured:>20.2f}  "
                         + ("yes" if r["planner_bytes_match"] else f"NO: {r['planner_bytes']} vs {r['dispatch_bytes']}"))
    return "\n".join(lines)


def format_overlap(report: dict) -> str:
    rows = [(name, r["overlap"]) for name, r in report["results"].items() if "overlap" in r]
    if not rows:
        return ""
    o = rows[0][1]
    lines = [f"overlap: dispatch -> expert MLP (ffn {o['expert_ffn']}) -> combine, 1 vs {o['chunks']} chunks",
             f"{'backend':<14}{'1 chunk ms':>12}{'chunked ms':>12}{'speedup':>9}  identical"]
    for name, o in rows:
        lines.append(f"{name:<14}{o['unchunked_s'] * 1e3:>12.2f}{o['chunked_s'] * 1e3:>12.2f}{o['speedup']:>9.2f}  "
                     f"{'yes' if o['identical'] else 'max diff %.2g' % o['max_abs_diff']}")
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def write_plot(report: dict, path: str) -> None:
    """PNG: time per backend split into bare communication and local work; bytes per link class."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(report["results"])
    res = report["results"]
    total = [res[n]["total_s"]["median"] * 1e3 for n in names]
    comm = [min(res[n]["bare_total_s"]["median"] * 1e3, t) for n, t in zip(names, total)]
    local = [t - c for t, c in zip(total, comm)]
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_t.bar(names, comm, label="communication (bare collectives)", color="#4c72b0")
    ax_t.bar(names, local, bottom=comm, label="local work and waiting", color="#dd8452")
    ax_t.set_ylabel("dispatch + combine, ms (median)")
    ax_t.set_title("time per backend")
    ax_t.legend(fontsize=8)
    width = 0.27
    for i, link in enumerate(LINK_CLASSES):
        ax_b.bar([j + (i - 1) * width for j in range(len(names))],
                 [res[n]["dispatch_bytes"][link] / 1e6 for n in names], width, label=link)
    ax_b.set_xticks(range(len(names)), names)
    ax_b.set_ylabel("dispatch MB, all ranks")
    ax_b.set_title("bytes per link class")
    ax_b.legend(fontsize=8)
    if all("predicted_total_s" in res[n] for n in names):
        predicted = [res[n]["predicted_total_s"] * 1e3 for n in names]
        ax_t.scatter(names, predicted, marker="_", s=900, color="black", zorder=3, label="planner's prediction")
        ax_t.set_ylim(0, 1.35 * max(total + predicted))           # room for the legend above the bars
        ax_t.legend(fontsize=8)
    cfg = report["config"]
    emulated = report.get("emulated")
    where = (f"; emulated: {emulated['nodes']} nodes x {emulated['ranks_per_node']} ranks, inter-node link "
             f"{emulated['inter_link']} (tc tbf), intra-node loopback" if emulated else "")
    fig.suptitle(f"expertrail bench: {cfg['world']} ranks, domain {cfg['domain_size']}, {cfg['tokens']} tokens/rank, "
                 f"H {cfg['hidden']}, E {cfg['experts']}, top-{cfg['topk']}, {cfg['dtype']}, {cfg['routing']}{where}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
