"""`expertrail bench`: every dispatcher side by side on real ranks, checked and timed; `--decode`
the decode latency of the normal and low-latency modes."""
from __future__ import annotations

import os
import sys

from ...errors import ConfigError
from ..arguments import ROUTING_HELP, backend_list, check_experts, cluster_arguments, given
from ..ranks import Ranks, note_emulated, on_cluster, under_torchrun

DECODE_ITERS = 100


def add_parser(sub) -> None:
    from ..configs import DTYPE_NAMES, BenchConfig
    d = BenchConfig()
    p = sub.add_parser("bench", help="every dispatcher side by side on real ranks, checked and timed",
                       description="Runs every backend on identical inputs on local CPU ranks (gloo), or on the "
                                   "ranks of torchrun when launched by it; checks each against the single-process "
                                   "reference, then times dispatch, combine and the bare collectives.")
    p.add_argument("--world", type=int, default=d.world, help="local ranks to spawn (default %(default)s)")
    p.add_argument("--domain-size", type=int, default=d.domain_size, help="ranks per fast-link domain (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size H (default %(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank (default %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts E (default %(default)s)")
    p.add_argument("--topk", type=int, default=d.topk, help="experts per token K (default %(default)s)")
    p.add_argument("--backends", default=",".join(d.backends), help="comma-separated (default: all)")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=d.dtype)
    p.add_argument("--routing", default=d.routing, help=ROUTING_HELP)
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed rounds; each runs every backend, then its bare collectives (default {d.iters}; "
                        f"{DECODE_ITERS} decode steps with --decode)")
    p.add_argument("--decode", action="store_true",
                   help="decode latency instead: dispatch+combine of 1, 8, 32 and 128 tokens per rank, the normal "
                        "mode vs the fixed-shape lowlatency mode vs the bare collectives of its buffers, p50 and p99 "
                        "(--hidden, --experts, --topk, --dtype, --payload apply; --json writes "
                        "results[mode][tokens_per_rank])")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="untimed iterations per backend (at least 1: the first is checked against the reference)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chunks", type=int, default=d.chunks,
                   help="also time dispatch -> expert MLP -> combine unchunked vs in this many overlapped chunks")
    p.add_argument("--expert-ffn", type=int, default=d.expert_ffn,
                   help="width of the expert MLP used with --chunks (the expert cost; default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the configuration as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot time per backend and bytes per link class")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--pipeline-chunks", type=int, default=d.pipeline_chunks,
                   help="hierarchical: pieces each rail-hop block travels in, each forwarded inside the domain "
                        "as it lands (1: no pipeline; default: the backend's)")
    p.add_argument("--payload", choices=("native", "fp8"), default=d.payload,
                   help="dispatch rows in the tokens' dtype, or as fp8 e4m3 with one fp32 scale per 128 values "
                        "(combine stays in the tokens' dtype) (default %(default)s)")
    p.add_argument("--malloc-heap", action="store_true",
                   help="set glibc on every rank to keep large blocks on its heap (process-wide mallopt; off by "
                        "default: the ranks run with the allocator a user's process has)")
    c = cluster_arguments(p, "ranks per node; the domain size unless --domain-size is given")
    c.add_argument("--emit-hardware", metavar="PATH.yaml",
                   help="write the measured links as a planner hardware entry (`expertrail plan --hardware PATH`)")


def config_of(args):
    """`bench`'s BenchConfig from its arguments (--backends checked)."""
    from ..configs import BenchConfig
    return BenchConfig(world=args.world, domain_size=args.domain_size, hidden=args.hidden, tokens=args.tokens,
                       experts=args.experts, topk=args.topk, backends=backend_list(args.backends), dtype=args.dtype,
                       routing=args.routing,
                       iters=args.iters or (DECODE_ITERS if args.decode else BenchConfig.iters),
                       warmup=args.warmup, seed=args.seed,
                       chunks=args.chunks, expert_ffn=args.expert_ffn, payload=args.payload,
                       pipeline_chunks=args.pipeline_chunks,
                       malloc_heap=args.malloc_heap, progress=not args.no_progress and sys.stderr.isatty())


def check(cfg, world: int, domain: int, ranks: str, decode: bool = False) -> None:
    """Everything about a `bench` run that can be checked before a rank starts; raises
    ConfigError naming the option and the fix. ``world`` ranks with ``domain`` per fast-link
    domain; ``ranks`` says where the rank count came from (``--world 4``, ``--nodes 2 x
    --ranks-per-node 3``)."""
    if world < 1:
        raise ConfigError(f"{ranks}: give at least 1 rank")
    if domain < 1 or world % domain:
        sizes = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ConfigError(f"--domain-size {domain} must divide the {world} ranks ({ranks}): give one of {sizes}")
    check_experts(cfg.experts, cfg.topk, world, ranks)
    for option, value, least in (("--hidden", cfg.hidden, 1), ("--iters", cfg.iters, 1), ("--chunks", cfg.chunks, 1),
                                 *(() if decode else (("--tokens", cfg.tokens, 1),)),
                                 *((("--expert-ffn", cfg.expert_ffn, 1),) if cfg.chunks > 1 else ())):
        if value < least:
            raise ConfigError(f"{option} {value}: give a whole number >= {least}")
    if not decode:
        _check_routing(cfg.routing)


def _check_routing(spec: str) -> None:
    """--routing: uniform, balanced, zipf:<alpha> or an existing file (read by the ranks)."""
    if spec in ("uniform", "balanced"):
        return
    if spec.startswith("zipf:"):
        try:
            float(spec.split(":", 1)[1])
            return
        except ValueError:
            raise ConfigError(f"--routing {spec!r}: write zipf:<alpha>, e.g. zipf:1.2") from None
    if not os.path.isfile(spec):
        raise ConfigError(f"--routing {spec!r}: not uniform, zipf:<alpha>, balanced, nor an existing file")


def run(args) -> int:
    cfg = config_of(args)
    if not under_torchrun():          # check what can be checked before a rank (or a cluster) starts
        if args.nodes:
            world = args.nodes * args.ranks_per_node
            ranks = f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node}"
            domain = args.domain_size if given(args, "--domain-size") else args.ranks_per_node
        else:
            world, domain, ranks = args.world, args.domain_size, f"--world {args.world}"
        check(cfg, world, domain, ranks, decode=args.decode)
        if args.nodes:
            return on_cluster(args)
    if args.decode:
        return _run_decode(args, cfg)
    from ..bench import bench_rank
    with Ranks(cfg.world, cuda=True, malloc_heap=args.malloc_heap) as ranks:
        cfg.world = ranks.world
        report = ranks.run(bench_rank, cfg)
        if ranks.torchrun and (os.environ.get("EXPERTRAIL_CLUSTER") or args.emit_hardware):
            _measure_and_predict(report, cfg, args)
        if ranks.reports:
            _report(report, args)
    return 0


def _run_decode(args, cfg) -> int:
    """`bench --decode`: the decode latency of each mode per token count (rank 0 reports)."""
    import json

    from ..bench_decode import decode_rank, format_decode
    with Ranks(cfg.world) as ranks:
        cfg.world = ranks.world
        report = ranks.run(decode_rank, cfg)
        if ranks.reports:
            note_emulated(report)
            print(format_decode(report))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=2)
                print(f"wrote {args.json}")
    return 0


def _measure_and_predict(report: dict, cfg, args) -> None:
    """Under torchrun: measure this run's links, add the planner's predictions (and with
    --emit-hardware write the hardware entry). Collective."""
    import torch.distributed as dist

    from ..bench import DTYPES, predict_backends
    from ...emulation.links import measure_links, measure_local_passes, measured_hardware, write_hardware
    from ...comm.topology import EPGroups
    groups = EPGroups.from_default(domain_size=cfg.domain_size)
    links = measure_links(groups)
    report["links"] = links
    report["local_passes"] = local = measure_local_passes(groups.device, DTYPES[cfg.dtype], hidden=cfg.hidden)
    note_emulated(report, nodes=int(os.environ.get("EXPERTRAIL_NODES", cfg.world // groups.domain_size)),
                  ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", groups.domain_size)))
    predict_backends(report, links, local)
    if args.emit_hardware and dist.get_rank() == 0:
        write_hardware(measured_hardware(links, cfg.domain_size, local=local), args.emit_hardware)
        print(f"wrote {args.emit_hardware}")


def _report(report, args) -> None:
    from ..bench import format_links, format_overlap, format_table, write_json, write_plot
    print(format_table(report))
    links = format_links(report)
    if links:
        print(links)
    overlap = format_overlap(report)
    if overlap:
        print(overlap)
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
