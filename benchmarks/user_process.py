"""expertrail as a user's own script runs it: plain spawned processes, the default allocator.

4 gloo ranks started with ``torch.multiprocessing.spawn`` (no launcher settings: glibc's default
malloc, ``torch.set_num_threads(1)``), each calling dispatch -> a per-expert scale -> combine,
beside the bare ``all_to_all_single`` of the same rows out and back (buffers allocated once)
and the ``floor``: the least any dispatcher moving one row per (token, expert) must do for the
same call (`_floor`). Backends and the bare collectives alternate round by round, so the machine's noise falls on
all alike. Prints the mean time per call and its ratio to the bare collectives.

``--soak N`` instead runs N calls with token counts changing every call and prints the
resident memory (RSS) when the dispatcher's buffer pool last grew (its high-water mark), at
fractions of the calls and at the end, and the growth since the pool's last growth.

    .venv/bin/python benchmarks/user_process.py [--dtype fp32|bf16] [--tokens 4096] [--soak 1000] [--json PATH]

``--json PATH`` writes the record docs/results/ keeps (the command, the machine, the date, the
code's commit and changed files, the arguments, every rank's results and the summary printed); ``python -m expertrail.tools.records``
prints the same tables from it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from expertrail.tools.records import code, machine, now


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _inputs(rank, tokens, hidden, experts, topk, dtype, seed):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, topk, dtype=torch.int64)
    w = torch.rand(tokens, topk, generator=g).to(dtype)
    return x, idx, w


def _moe(d, x, idx, w, scale):
    res = d.dispatch(x, idx, w)
    per_row = torch.repeat_interleave(scale, res.tokens_per_expert, output_size=res.tokens.shape[0])
    return d.combine(res.tokens * per_row.unsqueeze(1), res)


def _floor(x, idx, w, scale, world):
    """The least work any one-row-per-(token, expert) dispatcher does for the same call: the
    counts exchange, the gather into per-rank order, the rows out, a scale (one pass into a
    fresh tensor, as the user's per-expert scale), the rows back and the weighted sum. A lower
    bound: the routing is sorted once outside the call, buffers are allocated once, nothing is
    checked, and the received rows stay source-major (experts need them expert-major). Its time
    over the bare collectives' is what the algorithm itself costs on this machine."""
    n, k = idx.shape
    experts = scale.numel() * world
    order = torch.argsort(idx.reshape(-1), stable=True)
    at = torch.empty_like(order)
    at[order] = torch.arange(order.numel())
    token = order // k
    send_counts = torch.bincount(idx.reshape(-1), minlength=experts).view(world, -1)
    gathered = torch.empty(n * k, x.shape[1], dtype=x.dtype)
    back = torch.empty_like(gathered)
    recv_counts = torch.empty_like(send_counts)
    received = torch.empty(n * k * world, x.shape[1], dtype=x.dtype)     # room for any split

    def floor():
        dist.all_to_all_single(recv_counts, send_counts)
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        torch.index_select(x, 0, token, out=gathered)
        rows = received[:sum(recv_splits)]
        dist.all_to_all_single(rows, gathered, recv_splits, send_splits)
        expert_out = rows * scale[0]        # a fresh tensor, as the user's scale makes
        dist.all_to_all_single(back, expert_out, send_splits, recv_splits)
        return torch.nn.functional.embedding_bag(at.view(n, k), back, per_sample_weights=w, mode="sum")
    return floor


def _worker(rank, world, port, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import expertrail as er
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    groups = er.EPGroups.from_default(domain_size=2)
    dispatchers = {b: er.make_dispatcher(b, groups, num_experts=args.experts) for b in args.backends}
    scale = torch.linspace(0.5, 1.5, args.experts // world).to(dtype)
    x, idx, w = _inputs(rank, args.tokens, args.hidden, args.experts, args.topk, dtype, 0)
    if args.soak:
        d = dispatchers[args.backends[0]]
        rss, grew = [], []
        for i in range(args.soak):
            n = args.tokens - (i * 7919 + rank * 104729) % (args.tokens // 2)   # changes every call
            before = d.workspace.allocated
            _moe(d, x[:n], idx[:n], w[:n], scale)
            rss.append(_rss_bytes())
            grew.append(d.workspace.allocated != before)
        high_water_call = max([i for i, g in enumerate(grew) if g], default=0)   # the pool's last growth
        result = {"rss_at_high_water": rss[high_water_call], "rss_end": rss[-1], "high_water_call": high_water_call,
                  "growth_after_high_water": rss[-1] / rss[high_water_call] - 1,
                  "pool_MB": d.workspace.high_water_bytes / 2**20,
                  "rss_at": {f"{q}%": rss[len(rss) * q // 100 - 1] for q in (10, 25, 50, 75, 100)}}
    else:
        rows = args.tokens * args.topk
        send = x.repeat(args.topk, 1)
        recv, back = torch.empty_like(send), torch.empty_like(send)
        splits = [rows // world] * world
        splits[-1] += rows - sum(splits)

        def bare():
            dist.all_to_all_single(recv, send, splits, splits)
            dist.all_to_all_single(back, recv, splits, splits)
        calls = {"bare": bare, "floor": _floor(x, idx, w, scale, world),
                 **{b: (lambda d=d: _moe(d, x, idx, w, scale)) for b, d in dispatchers.items()}}
        times = {name: [] for name in calls}
        for name, fn in calls.items():           # warm-up
            fn()
        for _ in range(args.iters):
            for name, fn in calls.items():
                dist.barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        result = {name: statistics.mean(t) for name, t in times.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def run(args) -> dict:
    """Spawn the 4 ranks and return the record: the command, machine, date, arguments, every
    rank's results and the summary the script prints."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fd, out_path = tempfile.mkstemp(prefix="user_process_", suffix=".json")
    os.close(fd)
    try:
        mp.spawn(_worker, args=(4, port, args, out_path), nprocs=4)
        with open(out_path) as f:
            per_rank = json.load(f)
    finally:
        os.unlink(out_path)
    record = {"command": " ".join(shlex.quote(a) for a in [".venv/bin/python", "benchmarks/user_process.py",
                                                            *(args.argv or [])]),
              "machine": machine(), "date": now(), "code": code(),
              "args": {k: v for k, v in vars(args).items() if k not in ("json", "argv")}, "world": 4,
              "per_rank": per_rank}
    if not args.soak:       # the slowest rank sets the pace
        mean = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
        record["summary"] = {"mean_s": mean, "ratio_to_bare": {name: t / mean["bare"] for name, t in mean.items()},
                             "ratio_to_floor": {name: t / mean["floor"] for name, t in mean.items()}}
    return record


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backends", nargs="+", default=["alltoall", "dedup", "hierarchical"])
    p.add_argument("--soak", type=int, default=0, help="calls with changing token counts; report RSS")
    p.add_argument("--json", help="write the record (command, machine, date, arguments, per-rank results, summary) "
                                  "here")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    record = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
    from expertrail.tools.records import user_process_soak_table, user_process_table
    print(user_process_soak_table(record) if args.soak else user_process_table(record), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
