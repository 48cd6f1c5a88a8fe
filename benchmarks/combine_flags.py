"""What combine's cross-rank agreement costs: ``Dispatcher.combine`` (rows plus one small flags
message per peer) against the same combine whose flags are not exchanged, on 4 local gloo ranks.

    .venv/bin/python benchmarks/combine_flags.py [--dtype bf16|fp32] [--backend alltoall] [--iters 20]

The two variants alternate call by call on the same dispatch result (this machine is shared
and noisy); a third column times the flags exchange alone (after a barrier, so it also holds
the ranks' skew on leaving it). The table gives the median over
ranks of each rank's median wall time (ms).
"""
import statistics
import time

import torch
import torch.distributed as dist

import expertrail as er
from bar_options import bar_configuration
from expertrail.tools.bench import DTYPES
from expertrail.comm.transport import Transfer
from expertrail.emulation.launch import LocalRanks
from expertrail.tools.workload import make_routing, make_tokens


def alternate(rank, world, args):
    groups = er.EPGroups.from_default(domain_size=args.domain_size)
    x = make_tokens(args.tokens, args.hidden, DTYPES[args.dtype], rank)
    idx, w = make_routing("uniform", args.tokens, args.experts, args.topk, rank, world)
    d = er.make_dispatcher(args.backend, groups, num_experts=args.experts)
    res = d.dispatch(x, idx, w)
    # The same combine, its flags row handed to itself instead of exchanged: everything else
    # (checks, stats, autograd wrapper, the agreement's reading) stays as it is.
    unexchanged = er.make_dispatcher(args.backend, groups, num_experts=args.experts)
    unexchanged.agreement.start_combine = lambda error, grad: Transfer(
        torch.tensor([[error, int(grad)]]).expand(groups.ep_size, -1))
    variants = {
        "combine": lambda: d.combine(res.tokens, res),
        "no flags": lambda: unexchanged.combine(res.tokens, res),
        "flags alone": lambda: d.agreement.finish_combine(d.agreement.start_combine(0, False), None),
    }
    samples = {name: [] for name in variants}
    for it in range(args.warmup + args.iters):
        for name, run in variants.items():
            dist.barrier()
            start = time.perf_counter()
            run()
            if it >= args.warmup:
                samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def main():
    p = bar_configuration(__doc__.splitlines()[0])
    p.add_argument("--backend", default="alltoall", choices=sorted(er.BACKENDS))
    args = p.parse_args()
    with LocalRanks(args.world) as ranks:
        rows = ranks.run(alternate, args)
    median = {name: statistics.median(r[name] for r in rows) for name in rows[0]}
    print(f"{args.backend} {args.dtype}: {args.world} ranks, {args.tokens} tokens/rank, H {args.hidden}, "
          f"E {args.experts}, top-{args.topk}; median ms per combine")
    print(f"{'combine':>10} {'no flags':>10} {'flags alone':>12} {'combine / no flags':>19}")
    print(f"{median['combine']:>10.2f} {median['no flags']:>10.2f} {median['flags alone']:>12.3f} "
          f"{median['combine'] / median['no flags']:>19.3f}")


if __name__ == "__main__":
    main()
