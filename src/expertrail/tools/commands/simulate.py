"""`expertrail simulate`: every dispatch algorithm's traffic and time at cluster scale, from
the cost model (torch-free)."""
from __future__ import annotations

import argparse
import sys

from ...errors import ExpertrailError
from ..arguments import int_list, positive_int, workload_arguments


def add_parser(sub) -> None:
    from ...names import FIELD_NAMES, NAMES_HELP
    p = sub.add_parser("simulate", help="predict dispatch / combine of every algorithm at cluster scale",
                       description="Cost model (docs/cost-model.md): bytes per link class counted from a sampled "
                                   "routing, time from the links' SM-dependent bandwidth. No GPU, no torch. "
                                   "EP sizes that do not divide the experts are skipped with a note.",
                       epilog=NAMES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--ep", type=int_list("--ep"), default="8,16,32,64",
                   help="EP sizes: 8,16,32 or a range 8..64:8 (lo..hi:step, step 8 if left out); sizes that do not "
                        "divide the experts are skipped with a note (default %(default)s)")
    p.add_argument("--sms", type=int_list("--sms"), default="20",
                   help="SM counts for the SM-driven kernels (dedup, hierarchical, deepep-ll; NCCL's alltoall and "
                        "allgather take none): 20, 8,16 or 8..32:4 (default %(default)s)")
    p.add_argument("--backends", default=None, metavar="A,B",
                   help=f"comma-separated algorithms among {', '.join(FIELD_NAMES)} (default: all)")
    p.add_argument("--domain-size", type=positive_int(8), default=None,
                   help="ranks per NVLink domain (default: the largest divisor of each EP within the hardware's "
                        "NVLink domain)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (default: a table)")
    p.add_argument("--plot", metavar="PATH.png", help="also plot time and inter-domain bytes against EP (default: no plot)")


def run(args) -> int:
    from ...plan.catalog import load_hardware, load_model
    from ...plan.cost import ALGORITHMS
    from ...plan.output import dumps
    from ...plan.simulate import format_rows, plot_rows, simulate, usable_eps
    hw, model = load_hardware(args.hardware), load_model(args.model)
    algorithms = tuple(a.strip() for a in args.backends.split(",") if a.strip()) if args.backends else ALGORITHMS
    eps, skipped = usable_eps(model, args.ep, args.domain_size)
    if not eps:
        raise ExpertrailError(f"--ep {','.join(map(str, args.ep))}: no usable EP size ({skipped[0][0]}: "
                              f"{skipped[0][1]}); give EP sizes >= 2 that divide the {model.num_experts} experts, "
                              f"e.g. --ep {','.join(str(e) for e in (8, 16, 32, 64) if model.num_experts % e == 0) or 2}")
    for why in dict.fromkeys(why for _, why in skipped):
        sizes = ", ".join(str(ep) for ep, w in skipped if w == why)
        print(f"note: skipped EP {sizes}: {why}", file=sys.stderr)
    rows = simulate(hw, model, args.tokens, eps, args.sms, algorithms, args.routing, args.precision, args.domain_size)
    if args.json:
        print(dumps({"hardware": hw.__dict__, "model": model.__dict__, "tokens": args.tokens, "routing": args.routing,
                     "precision": args.precision, "skipped": [{"ep": ep, "reason": why} for ep, why in skipped],
                     "rows": rows}))
    else:
        print(format_rows(rows, hw, model, args.tokens, args.routing, args.precision))
    if args.plot:
        plot_rows(rows, args.plot, f"{model.name} on {hw.name}, {args.tokens} tokens/rank, {args.routing}")
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
