"""`expertrail plan`: a dispatcher, EP size and settings recommended with reasons; `--fit` the
parallel layouts that fit, fastest first (torch-free)."""
from __future__ import annotations

import argparse
import sys

from ...errors import ExpertrailError
from ..arguments import positive_int, workload_arguments


def add_parser(sub) -> None:
    from ...names import NAMES_HELP
    p = sub.add_parser("plan", help="recommend a dispatcher, EP size, SM counts and settings, with reasons",
                       description="Recommends the dispatcher (with predicted times of all alternatives), SM counts, "
                                   "the NVLink domain setting, EP size, EP-overlap / CUDA-graph / FP8 advice and "
                                   "pitfalls for a hardware and model; --emit prints a ready configuration that "
                                   "`expertrail validate` accepts as it is.",
                       epilog=NAMES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p)
    p.add_argument("--ep", type=positive_int(32), default=None,
                   help="EP size, at least 2 and dividing the experts (default: the largest EP the EP table does not "
                        "find communication-bound)")
    p.add_argument("--stage", choices=("bringup", "tune"), default="bringup",
                   help="bringup: library SM defaults, alltoall inside one NVLink domain, EP overlap off; tune: the "
                        "predicted fastest path, SM counts where its links saturate, overlap by the "
                        "communication / compute ratio (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (default: text)")
    p.add_argument("--emit", choices=("megatron", "bridge"),
                   help="print a ready configuration instead: Megatron-Core flags or Megatron-Bridge overrides "
                        "(default: the plan)")
    f = p.add_argument_group("layout search (--fit; docs/planner.md)")
    f.add_argument("--fit", action="store_true",
                   help="search the layouts (TP, CP, PP, VPP, EP, ETP, micro-batch, recompute) that fit --gpus GPUs, "
                        "fastest first "
                        "(default: plan the dispatcher)")
    f.add_argument("--gpus", type=positive_int(256), default=None,
                   help="GPUs of the run (needed by --fit; default without --fit: 256, for the memory check of the EP "
                        "sizes)")
    # Megatron's spellings too (--seq-length, --global-batch-size, --micro-batch-size), as estimate takes them.
    f.add_argument("--seq", "--seq-length", type=positive_int(4096), default=4096,
                   help="sequence length (default %(default)s)")
    f.add_argument("--global-batch", "--global-batch-size", type=positive_int(1024), default=None,
                   help="sequences per step (default: 1024, or the next multiple of DP x micro-batch)")
    f.add_argument("--micro-batch", "--micro-batch-size", type=positive_int(1), default=None,
                   help="sequences per micro-batch (default: search 1, 2, 4 and 8, up to 32768 tokens)")
    f.add_argument("--top", type=positive_int(5), default=5, help="layouts to print (default %(default)s)")
    f.add_argument("--router", default="forced", metavar="forced|natural|SPEC",
                   help="cost each layout with the routers forced to balance, as benchmarks and the published runs "
                        "do; with the model's trained router (natural), whose busiest EP rank waits longer at larger "
                        "EP (docs/cost-model.md, 'Natural routing'); or with a router's loads as estimate --routing "
                        "takes them (zipf:<alpha>, uniform, a recorded topk_idx or token counts file) "
                        "(default %(default)s)")


def _run_fit(args) -> int:
    """`plan --fit`: the fastest layouts that fit, or (--emit) the first one's flags."""
    from ...plan.architecture import load_architecture
    from ...plan.catalog import load_hardware
    from ...plan.output import dumps
    from ...plan.search import emit_layout, format_search, layout_fields, leanest, search
    from ...balance.report import recorded_loads
    if not args.gpus:
        raise ExpertrailError("--fit needs --gpus N, the GPUs of the run, e.g. --gpus 256")
    hw, arch = load_hardware(args.hardware), load_architecture(args.model)
    spec = None if args.router in ("forced", "natural") else args.router
    loads = recorded_loads(spec, arch.experts, arch.name) if spec else None
    if spec and loads is None:
        from ...errors import ConfigError
        from ...plan.cost import Routing
        try:                                        # a spec that samples no routing, refused before the search
            Routing(spec).sample(arch.moe_model(), 8)
        except ConfigError as err:
            raise ExpertrailError(f"--router {spec!r}: give forced, natural, or a router's loads as estimate "
                                  f"--routing takes them ({err})") from None
    found = search(arch, hw, args.gpus, args.seq, args.global_batch, micro_batch=args.micro_batch,
                   precision=args.precision, top=args.top, natural_routing=args.router != "forced",
                   routing=spec, expert_loads=loads)
    closest = None if found else leanest(arch, hw, args.gpus, args.seq, args.precision)
    if args.emit:
        if not found:
            raise ExpertrailError(format_search(found, arch, hw, args.gpus, closest))
        print(emit_layout(arch, hw, found[0][1], args.emit))
        if args.router == "forced":                 # said where a pasted configuration's reader sees it
            r = found[0][0]
            print(f"plan --fit: this layout's {r['step_time_s']:.2f} s a step is with the routers forced to balance, as "
                  "benchmarks run; the configuration trains the model's own router, which `expertrail estimate` "
                  "costs (or rank the layouts with --router natural)", file=sys.stderr)
    elif args.json:
        print(dumps([dict(r, fields=layout_fields(arch, lay, hw)) for r, lay in found]))
    else:
        print(format_search(found, arch, hw, args.gpus, closest))
    return 0 if found else 1


def run(args) -> int:
    from ...plan.advisor import emit, format_plan, plan
    from ...plan.catalog import load_hardware, load_model
    from ...plan.output import dumps
    if args.fit:
        return _run_fit(args)
    from ...plan.architecture import from_hf_config
    from ...plan.catalog import hf_config
    hw, model = load_hardware(args.hardware), load_model(args.model)
    found = hf_config(args.model)                  # a config.json: its whole shape, for the memory check
    result = plan(hw, model, args.tokens, args.ep, args.stage, args.precision, args.routing, gpus=args.gpus or 256,
                  arch=from_hf_config(*found) if found else None)
    if args.emit:
        print(emit(result, model, args.emit))
    elif args.json:
        print(dumps(result))
    else:
        print(format_plan(result))
    return 0
