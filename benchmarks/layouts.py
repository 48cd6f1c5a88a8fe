"""The two layouts of the ``alltoall`` backend side by side: runs landing in place against one
block per peer plus a local permutation, over a range of run sizes, on 4 local gloo ranks.

    .venv/bin/python benchmarks/layouts.py [--dtype bf16] [--iters 10] [--shrink 1]

For each shape, the two dispatchers (``land_in_place=True`` / ``False``) alternate call by
call; the table gives the median over ranks of each rank's median wall time and process CPU
time of one dispatch + combine, the mean run (bytes per (source, destination, local expert))
that ``alltoall`` compares with `LANDING_MIN_RUN_BYTES`, and the layout a dispatcher left to
choose (``land_in_place=None``) took.
"""
import argparse
import statistics
import time

import torch.distributed as dist

import expertrail as er
from expertrail.tools.bench import DTYPES
from expertrail.dispatch.alltoall import LANDING_MIN_RUN_BYTES
from expertrail.emulation.launch import LocalRanks
from expertrail.tools.workload import make_routing, make_tokens

# (experts, hidden, top-k, tokens per rank): mean runs from 1 MiB down to 64 KiB in bf16.
SHAPES = [(16, 1024, 2, 4096), (64, 1024, 2, 4096), (128, 2048, 8, 1024), (64, 256, 4, 4096), (256, 1024, 8, 1024)]


def alternate(rank, world, args):
    (experts, hidden, topk, tokens), opts = args
    groups = er.EPGroups.from_default(domain_size=2)
    x = make_tokens(tokens, hidden, DTYPES[opts.dtype], rank)
    idx, w = make_routing("uniform", tokens, experts, topk, rank, world)
    ds = {m: er.make_dispatcher("alltoall", groups, num_experts=experts, land_in_place=m) for m in (True, False)}
    auto = er.make_dispatcher("alltoall", groups, num_experts=experts)       # the layout it chooses
    chosen = "runs" if auto.dispatch(x, idx, w).route.lands_in_place else "blocks"
    samples = {True: [], False: []}
    for it in range(2 * (opts.iters + opts.warmup)):
        mode = it % 2 == 0
        dist.barrier()
        start = (time.perf_counter(), time.process_time())
        res = ds[mode].dispatch(x, idx, w)
        ds[mode].combine(res.tokens, res)
        if it >= 2 * opts.warmup:
            samples[mode].append([(b - a) * 1e3 for a, b in zip(start, (time.perf_counter(), time.process_time()))])
    return {mode: [statistics.median(column) for column in zip(*s)] for mode, s in samples.items()}, chosen


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--shrink", type=int, default=1, help="divide every shape's tokens by this (a quick check)")
    args = p.parse_args()
    row_bytes = DTYPES[args.dtype].itemsize
    print(f"alltoall, {args.world} ranks, {args.dtype}: ms per dispatch + combine (process CPU ms); "
          f"threshold {LANDING_MIN_RUN_BYTES // 1024} KiB")
    print(f"{'experts':>7} {'hidden':>6} {'top-k':>5} {'tokens':>6} {'mean run':>9} {'runs':>15} {'blocks':>15} "
          f"{'blocks/runs':>11}  chosen")
    with LocalRanks(args.world) as ranks:
        for experts, hidden, topk, tokens in SHAPES:
            tokens = max(1, tokens // args.shrink)
            shape = (experts, hidden, topk, tokens)
            rows, chosen = zip(*ranks.run(alternate, (shape, args)))
            run = args.world * tokens * topk * hidden * row_bytes / (args.world * experts)
            wall = {m: statistics.median(r[m][0] for r in rows) for m in (True, False)}
            cpu = {m: statistics.median(r[m][1] for r in rows) for m in (True, False)}
            print(f"{experts:>7} {hidden:>6} {topk:>5} {tokens:>6} {run / 1024:>5.0f} KiB "
                  f"{wall[True]:>7.1f} ({cpu[True]:>4.1f}) {wall[False]:>7.1f} ({cpu[False]:>4.1f}) "
                  f"{wall[False] / wall[True]:>11.2f}  {chosen[0]}", flush=True)


if __name__ == "__main__":
    main()
