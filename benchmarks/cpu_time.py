"""CPU time of one dispatch + combine per rank, against the bare collectives moving its bytes.

    .venv/bin/python benchmarks/cpu_time.py [--dtype bf16] [--backends alltoall,dedup] [--hidden 1024] ...

On local gloo ranks (4 by default), each rank reports the median over the timed iterations of: wall time,
CPU time of the whole process (every thread, gloo's transport threads included) and CPU time
of the calling thread alone; then the same for `bench.bare_collectives` replaying the
backend's exchanges. With more ranks than cores, wall time follows total CPU time, so this
tells local work (calling thread) from transport (the rest).
"""
import statistics
import time

import torch.distributed as dist

import expertrail as er
from bar_options import bar_configuration
from expertrail.tools.bench import DTYPES, bare_collectives
from expertrail.emulation.launch import LocalRanks
from expertrail.tools.workload import make_routing, make_tokens


def _timed(step, iters: int, warmup: int) -> list:
    """Median (wall, process CPU, thread CPU) in ms of ``step()`` over ``iters`` runs."""
    samples = []
    for it in range(warmup + iters):
        dist.barrier()
        marks = (time.perf_counter(), time.process_time(), time.thread_time())
        step()
        if it >= warmup:
            now = (time.perf_counter(), time.process_time(), time.thread_time())
            samples.append([b - a for a, b in zip(marks, now)])
    return [statistics.median(column) * 1e3 for column in zip(*samples)]


def cpu_time(rank, world, args):
    groups = er.EPGroups.from_default(domain_size=args.domain_size)
    x = make_tokens(args.tokens, args.hidden, DTYPES[args.dtype], rank)
    idx, w = make_routing("uniform", args.tokens, args.experts, args.topk, rank, world)
    out = {}
    for backend in args.backends.split(","):
        d = er.make_dispatcher(backend, groups, num_experts=args.experts)
        last = {}

        def step():
            last["res"] = d.dispatch(x, idx, w)
            d.combine(last["res"].tokens, last["res"])
        mine = _timed(step, args.iters, args.warmup)
        bare = _timed(bare_collectives(last["res"], args.hidden * x.element_size(), groups.device), args.iters, 1)
        out[backend] = mine + bare
    return out


def main():
    p = bar_configuration(__doc__.splitlines()[0])
    p.add_argument("--backends", default="alltoall,dedup,hierarchical")
    args = p.parse_args()
    with LocalRanks(args.world) as ranks:
        rows = ranks.run(cpu_time, args)
    print(f"{args.dtype}, {args.world} ranks, {args.tokens} tokens/rank, H {args.hidden}, E {args.experts}, top-{args.topk}; "
          "ms per dispatch + combine, median")
    print(f"{'backend':<13}{'rank':>5}{'wall':>8}{'cpu all':>9}{'cpu main':>10}   |{'bare wall':>10}"
          f"{'cpu all':>9}{'cpu main':>10}")
    for backend in rows[0]:
        for rank, row in enumerate(rows):
            v = row[backend]
            print(f"{backend:<13}{rank:>5}{v[0]:>8.1f}{v[1]:>9.1f}{v[2]:>10.1f}   |{v[3]:>10.1f}{v[4]:>9.1f}{v[5]:>10.1f}")


if __name__ == "__main__":
    main()
