"""Where the time of one dispatch + combine goes, phase by phase, on 4 local gloo ranks.

    .venv/bin/python benchmarks/phases.py [--dtype bf16|fp32] [--backend alltoall] [--tokens 4096] ...

Each rank times the phases of its own dispatch and combine (after a barrier, no overlap
between iterations) and the table shows the mean per rank over the timed iterations. The
phases are those of `Dispatcher.dispatch` / `combine` run step by step. ``--clock wall``
(default) includes waiting for peers and for a core; ``--clock thread`` counts only the CPU
time of the calling thread (the work this rank does itself, not gloo's transport threads).
"""
import time

import torch.distributed as dist

import expertrail as er
from bar_options import bar_configuration
from expertrail.tools.bench import DTYPES
from expertrail.dispatch.checks import dispatch_problem
from expertrail.dispatch.header import Header
from expertrail.emulation.launch import LocalRanks
from expertrail.tools.workload import make_routing, make_tokens

PHASES = ["barrier", "check+plan", "gather rows", "control exchange", "route planning", "post rows",
          "rows arrive (+ later hops)", "combine: expert side + post", "combine: arrive + reduce"]


def phases(rank, world, args):
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    dtype = DTYPES[args.dtype]
    groups = er.EPGroups.from_default(domain_size=args.domain_size)
    x = make_tokens(args.tokens, args.hidden, dtype, rank)
    idx, w = make_routing("uniform", args.tokens, args.experts, args.topk, rank, world)
    d = er.make_dispatcher(args.backend, groups, num_experts=args.experts)
    totals = dict.fromkeys(PHASES, 0.0)
    for it in range(args.warmup + args.iters):
        marks = [clock()]
        dist.barrier(); marks.append(clock())
        dispatch_problem("phases", x, idx, w, None, groups.device, args.experts)
        outgoing = d._outgoing(idx); marks.append(clock())
        control = d.agreement.start(outgoing.counts, Header.of(x, idx, w, 0).pack())
        sent = d._gather_first(x, outgoing); marks.append(clock())
        recv_counts, headers = d.agreement.finish_dispatch(control, None); marks.append(clock())
        route = d._route(w, outgoing, recv_counts, headers); marks.append(clock())
        transfer = route.forward(x, async_op=True, sent=sent); marks.append(clock())
        tokens = transfer.wait(); marks.append(clock())
        weights = route.expert_weights()
        flags = d.agreement.start_combine(0, False)     # as combine does: its agreement beside the rows
        back = route.transpose_async(tokens, weights, at_source=d.weights_at == "source",
                                     agree=lambda: d.agreement.finish_combine(flags, None)); marks.append(clock())
        back.wait(); marks.append(clock())
        if it >= args.warmup:
            for name, a, b in zip(PHASES, marks, marks[1:]):
                totals[name] += (b - a) * 1e3 / args.iters
    return totals


def main():
    p = bar_configuration(__doc__.splitlines()[0])
    p.add_argument("--backend", default="alltoall", choices=sorted(er.BACKENDS))
    p.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = p.parse_args()
    with LocalRanks(args.world) as ranks:
        rows = ranks.run(phases, args)
    print(f"{args.backend} {args.dtype}: {args.world} ranks, {args.tokens} tokens/rank, H {args.hidden}, "
          f"E {args.experts}, top-{args.topk}; ms per iteration ({args.clock} clock)")
    print(f"{'phase':<30}" + "".join(f"{'rank ' + str(r):>9}" for r in range(args.world)))
    for name in PHASES:
        print(f"{name:<30}" + "".join(f"{row[name]:>9.2f}" for row in rows))
    print(f"{'total':<30}" + "".join(f"{sum(row.values()) - row['barrier']:>9.2f}" for row in rows))


if __name__ == "__main__":
    main()
