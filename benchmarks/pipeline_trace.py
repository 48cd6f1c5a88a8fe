"""One hierarchical dispatch + combine, piece by piece: when each rail-hop piece lands and moves on.

Runs on the ranks of a torchrun launch (the emulated cluster: ``expertrail cluster run``). For
each ``--chunks`` value it builds the hierarchical dispatcher with that ``pipeline_chunks``, and
alltoall beside them; times ``--iters`` rounds of one dispatch + combine call each, in turn (the
slowest rank's time each call; median), then traces one more call of each on rank 0 (`route.tracing`): ms from the call's start at which the rail
hop's pieces from the other domain land, each is sent on inside the domain, dispatch returns,
each piece's partial sums go back (combine) and combine returns. Rank 0 prints both and, with
``--json``, writes them with the configuration, command, machine and date.

    expertrail cluster run --nodes 2 --ranks-per-node 2 --inter-link 1gbit -- \\
        benchmarks/pipeline_trace.py --tokens 1024 --hidden 2048 --experts 32 --topk 8 --chunks 1 4
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import expertrail as er
from expertrail.dispatch.route import tracing
from expertrail.tools.workload import make_routing


def _one_call(d, x, idx, w):
    res = d.dispatch(x, idx, w)
    return d.combine(res.tokens, res)


def _timed(d, x, idx, w, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        start = time.perf_counter()
        _one_call(d, x, idx, w)
        took = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(took.item())
    return statistics.median(times)


def _traced(d, x, idx, w) -> list:
    dist.barrier()
    with tracing() as events:
        start = time.perf_counter()
        res = d.dispatch(x, idx, w)
        events.append((time.perf_counter(), "dispatch returned"))
        d.combine(res.tokens, res)
        events.append((time.perf_counter(), "combine returned"))
    return [(round(1e3 * (t - start), 2), what) for t, what in events]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 4])
    p.add_argument("--min-rows", type=int, default=None, help="pipeline_min_rows (default: the backend's)")
    p.add_argument("--domain-size", type=int, default=None,
                   help="ranks per domain (default: the ranks of a node, torchrun's LOCAL_WORLD_SIZE)")
    p.add_argument("--json", help="write the figures here (rank 0)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = er.EPGroups.from_default(domain_size=args.domain_size)
    idx, w = make_routing("uniform", args.tokens, args.experts, args.topk, rank, world, 0)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    rows = {} if args.min_rows is None else {"pipeline_min_rows": args.min_rows}
    dispatchers = {str(c): er.make_dispatcher("hierarchical", groups, num_experts=args.experts, pipeline_chunks=c,
                                              **rows) for c in args.chunks}
    dispatchers["alltoall"] = er.make_dispatcher("alltoall", groups, num_experts=args.experts)
    times = {name: [] for name in dispatchers}
    for _ in range(2):                                       # warm-up: buffers, planning caches
        for d in dispatchers.values():
            _one_call(d, x, idx, w)
    for _ in range(args.iters):                              # alternating: the machine's noise falls on all
        for name, d in dispatchers.items():
            times[name].append(_timed(d, x, idx, w, 1))
    runs = {name: {"median_s": statistics.median(t)} for name, t in times.items()}
    for c in args.chunks:
        runs[str(c)]["trace_ms"] = _traced(dispatchers[str(c)], x, idx, w)
        runs[str(c)]["vs_alltoall"] = runs["alltoall"]["median_s"] / runs[str(c)]["median_s"]
    if rank == 0:
        from expertrail.tools import records
        record = {"command": " ".join(["benchmarks/pipeline_trace.py", *sys.argv[1:]]),
                  "date": time.strftime("%Y-%m-%d"), "machine": records.machine(), "code": records.code(),
                  "config": vars(args) | {"world": world, "domain_size": groups.domain_size}, "runs": runs}
        print(records.render("pipeline", record).strip().strip("`").strip())
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
