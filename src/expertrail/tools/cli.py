"""The `expertrail` command."""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import ConfigError, ExpertrailError
from ..names import BACKEND_NAMES as BACKENDS


ROUTING_HELP = "uniform | zipf:<alpha> | balanced | <file with topk_idx [world, N, K] (.pt or .npy)>"


DECODE_ITERS = 100


def _bench_parser(sub) -> None:
    from .configs import DTYPE_NAMES, BenchConfig
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
    p.add_argument("--payload", choices=("native", "fp8"), default=d.payload,
                   help="dispatch rows in the tokens' dtype, or as fp8 e4m3 with one fp32 scale per 128 values "
                        "(combine stays in the tokens' dtype) (default %(default)s)")
    p.add_argument("--malloc-heap", action="store_true",
                   help="set glibc on every rank to keep large blocks on its heap (process-wide mallopt; off by "
                        "default: the ranks run with the allocator a user's process has)")
    c = _cluster_arguments(p, "ranks per node; the domain size unless --domain-size is given")
    c.add_argument("--emit-hardware", metavar="PATH.yaml",
                   help="write the measured links as a planner hardware entry (`expertrail plan --hardware PATH`)")


def _cluster_arguments(parser, ranks_per_node_help: str):
    """The options that run a command on an emulated cluster (`_on_cluster`); returns their group."""
    c = parser.add_argument_group("on an emulated multi-node cluster (docs/emulated-cluster.md; needs root)")
    c.add_argument("--nodes", type=_positive_int(2), default=None,
                   help="run on this many emulated nodes, launched by torchrun per node (default: local ranks)")
    c.add_argument("--ranks-per-node", type=_positive_int(2), default=2,
                   help=f"{ranks_per_node_help} (default %(default)s)")
    _inter_link_argument(c)
    return c


def _inter_link_argument(parser) -> None:
    parser.add_argument("--inter-link", type=_link_spec, default="1gbit",
                        help="each node's link, both directions: RATE[,loss=P][,delay=T][,queue=T], e.g. "
                             "200mbit,loss=1%% (loss needs nftables; a delay needs the kernel's netem; queue: how long "
                             "a packet may wait in the shaper's FIFO, default 50ms); RATE in bit units (kbit, mbit, "
                             "gbit), not tc's byte units (kbps, mbps, gbps) (default %(default)s)")


def _link_spec(text: str):
    """An argparse type: ``--inter-link SPEC`` as a `cluster.LinkSpec`, so a bad spec (``1gbps``,
    ``fast``) stops the command while its arguments are parsed, before any namespace exists."""
    from ..emulation.cluster import LinkSpec
    try:
        return LinkSpec.parse(text)
    except ExpertrailError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--inter-link").lstrip(": ")) from None


_CLUSTER_OPTIONS = ("--nodes", "--ranks-per-node", "--inter-link")


def _on_cluster(args, argv: list) -> int:
    """`bench` / `train` with ``--nodes N``: bring an emulated cluster up, run this same
    command on it under torchrun (one launcher per node), tear it down."""
    from ..emulation.cluster import Cluster
    inner, skip = [], False
    for arg in argv:                      # the same options, less the cluster's own
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _CLUSTER_OPTIONS:
            skip = "=" not in arg
            continue
        inner.append(arg)
    if args.command == "bench" and not _given(args, "--domain-size"):
        inner += ["--domain-size", str(args.ranks_per_node)]
    cluster = Cluster(args.nodes, args.inter_link)
    try:
        with cluster:
            cluster.run(["-m", "expertrail", args.command, *inner,
                         *(["--no-progress"] if args.command == "bench" else [])], args.ranks_per_node)
    except KeyboardInterrupt:
        raise _after_interrupt(cluster) from None
    return 0


def _given(args, option: str) -> bool:
    """Whether ``option`` was on the command line (not left at its default)."""
    return option in {a.split("=", 1)[0] for a in args.argv_seen}


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C during a cluster run, saying what became of the cluster; `main` prints it as one
    line and exits 130."""


def _after_interrupt(cluster, kept: bool = False) -> _Interrupted:
    """What Ctrl-C left of ``cluster``: torn down (checked), or with ``kept`` (a cluster of
    `cluster up`) still up, its run's processes ended."""
    from ..emulation import cluster as cl
    if kept:
        return _Interrupted(f"the command's ranks were stopped; cluster {cluster.prefix} is still up "
                            f"(`expertrail cluster down {cluster.prefix}` removes it)")
    if not cluster.prefix:
        return _Interrupted("no cluster was brought up")
    if cluster.prefix in cl.list_clusters() or any(n.startswith(cluster.prefix) for n in cl.leftovers()):
        return _Interrupted(f"cluster {cluster.prefix} was not fully removed: run `expertrail cluster down "
                            f"{cluster.prefix}`")
    return _Interrupted(f"cluster {cluster.prefix} torn down")


def _check_bench(cfg, world: int, domain: int, ranks: str, decode: bool = False) -> None:
    """Everything about a `bench` run that can be checked before a rank starts; raises
    ConfigError naming the option and the fix. ``world`` ranks with ``domain`` per fast-link
    domain; ``ranks`` says where the rank count came from (``--world 4``, ``--nodes 2 x
    --ranks-per-node 3``)."""
    if world < 1:
        raise ConfigError(f"{ranks}: give at least 1 rank")
    if domain < 1 or world % domain:
        sizes = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise ConfigError(f"--domain-size {domain} must divide the {world} ranks ({ranks}): give one of {sizes}")
    _check_experts(cfg.experts, cfg.topk, world, ranks)
    for option, value, least in (("--hidden", cfg.hidden, 1), ("--iters", cfg.iters, 1), ("--chunks", cfg.chunks, 1),
                                 *(() if decode else (("--tokens", cfg.tokens, 1),)),
                                 *((("--expert-ffn", cfg.expert_ffn, 1),) if cfg.chunks > 1 else ())):
        if value < least:
            raise ConfigError(f"{option} {value}: give a whole number >= {least}")
    if not decode:
        _check_routing(cfg.routing)


def _check_experts(experts: int, topk: int, world: int, ranks: str) -> None:
    """Experts that split evenly over ``world`` ranks, and a top-k they can serve."""
    if experts < 1 or experts % world:
        up, down = -(-max(experts, 1) // world) * world, experts // world * world
        other = f" (or {down})" if down >= world and down != up else ""
        raise ConfigError(f"--experts {experts} must be a multiple of the {world} ranks ({ranks}): every rank holds "
                          f"the same number of experts; give --experts {up}{other}, or a rank count that divides "
                          f"{experts}")
    if not 1 <= topk <= experts:
        raise ConfigError(f"--topk {topk} must be between 1 and --experts {experts}")


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


def _check_train(cfg, world: int, ranks: str) -> None:
    """Everything about a `train` run that can be checked before a rank starts (as `_check_bench`)."""
    _check_experts(cfg.experts, cfg.topk, world, ranks)
    if cfg.hidden < cfg.heads or cfg.hidden % cfg.heads:
        raise ConfigError(f"--hidden {cfg.hidden} must be a positive multiple of the model's {cfg.heads} attention "
                          f"heads, e.g. --hidden {max(cfg.heads, cfg.hidden // cfg.heads * cfg.heads)}")
    for option, value in (("--steps", cfg.steps), ("--layers", cfg.layers), ("--ffn", cfg.ffn), ("--seq", cfg.seq),
                          ("--batch", cfg.batch)):
        if value < 1:
            raise ConfigError(f"{option} {value}: give a whole number >= 1")
    if not cfg.tolerance >= 0:
        raise ConfigError(f"--tolerance {cfg.tolerance}: give a number >= 0, e.g. 1e-4")


def _check_cluster_command(command: list, nodes: int, ranks_per_node: int) -> None:
    """`cluster run`'s command, before the cluster comes up: the script, module or program
    exists here (every node runs it from this directory, with this Python), and ``expertrail
    bench`` / ``train`` get the checks they would get with ``--nodes``."""
    import importlib.util
    import shutil
    head = command[0]
    if head == "-m":
        if len(command) < 2:
            raise ConfigError("-m needs a module, e.g. expertrail cluster run -- -m expertrail bench")
        if importlib.util.find_spec(command[1].split(".")[0]) is None:
            raise ConfigError(f"-m {command[1]}: no module {command[1].split('.')[0]!r} in {sys.executable}")
        inner = command[2:] if command[1] == "expertrail" else None
    elif head.endswith(".py"):
        if not os.path.isfile(head):
            raise ConfigError(f"{head}: no such script (each node runs it from {os.getcwd()})")
        inner = None
    elif shutil.which(head) is None:
        raise ConfigError(f"{head!r}: not a program on PATH nor a .py script; give a script, -m module or program "
                          "after --")
    else:
        inner = command[1:] if os.path.basename(head) == "expertrail" else None
    if inner and inner[0] in ("bench", "train"):
        sub = _parser().parse_args(inner)
        world, ranks = nodes * ranks_per_node, f"--nodes {nodes} x --ranks-per-node {ranks_per_node}"
        try:
            if sub.command == "bench":
                _check_bench(_bench_config(sub), world, sub.domain_size, ranks, decode=sub.decode)
            else:
                _check_train(_train_config(sub), world, ranks)
        except ConfigError as err:
            note = ""
            if str(err).startswith("--domain-size") and "--domain-size" not in {a.split("=", 1)[0] for a in inner}:
                note = (f" (bench's default; `bench --nodes` sets it to the ranks per node, here give "
                        f"--domain-size {ranks_per_node})")
            raise ConfigError(f"{' '.join(command[:3])}: {err}{note}") from None


def _train_parser(sub) -> None:
    from .configs import TrainConfig
    d = TrainConfig()
    p = sub.add_parser("train", help="train a tiny MoE language model with expert parallelism on local ranks",
                       description="Trains a tiny MoE LM (random Markov-rule tokens made on the fly) with each "
                                   "backend over --world local gloo ranks, and the same model on one process "
                                   "without a dispatcher; prints the per-step losses and exits 1, naming the "
                                   "backend and the first step, if a backend's loss differs from the "
                                   "single-process run by more than --tolerance, raises, or does not fall.")
    p.add_argument("--world", type=int, default=4, help="local gloo ranks, all in one EP group (default %(default)s)")
    p.add_argument("--backends", default=",".join(sorted(BACKENDS)),
                   help="comma-separated dispatchers to train with (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="SGD steps (default %(default)s)")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer layers, each with an MoE (default %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts per MoE layer (default %(default)s)")
    p.add_argument("--topk", type=int, default=d.topk, help="experts per token (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="model width (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="SGD learning rate (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and the token rule (default %(default)s)")
    p.add_argument("--tolerance", type=float, default=d.tolerance,
                   help="largest |loss - single-process loss| allowed at any step (default %(default)s; "
                        "measured differences are about 5e-7 in fp32)")
    p.add_argument("--ffn", type=int, default=d.ffn, help="expert (and shared expert) FFN width (default %(default)s)")
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per micro-batch (default %(default)s)")
    p.add_argument("--micro-batches", type=_positive_int(1), default=None,
                   help="micro-batches per step, gradients accumulated (default 1; 4 with --overlap)")
    p.add_argument("--overlap", action="store_true",
                   help="also train with two micro-batches in flight (1F1B: one's forward beside the other's "
                        "backward, taking turns at every dispatch and combine, the weight gradients of the experts, "
                        "shared expert and attention delayed; "
                        "docs/overlap.md), step by step beside the run without; the losses must be identical")
    p.add_argument("--timeline", metavar="PATH.png",
                   help="draw rank 0's compute and exchanges over one step of each run (with --overlap)")
    p.add_argument("--json", metavar="PATH",
                   help="write per backend the per-step losses, step_time_s and cpu_floor_s (medians), and the "
                        "reference")
    _cluster_arguments(p, "ranks per node, the EP domain size")


class _ConfigArguments(argparse.ArgumentParser):
    """`validate`'s parser: every argument it does not declare is a config entry, kept in order, so
    Megatron's own flags (``--num-experts 256``, ``--moe-grouped-gemm``) pass through as written."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.config = list(getattr(namespace, "config", None) or []) + list(extras)
        return namespace, []


def _validate_parser(sub) -> None:
    from ..names import NAMES_HELP
    p = sub.add_parser(
        "validate", help="check a Megatron-Core / Megatron-Bridge MoE config before launch",
        usage="%(prog)s [-h] [--json] [--strict] [CONFIG.yaml] [key=value | --megatron-flag [VALUE]] ...",
        description="Checks a YAML/JSON config (Megatron-Core or Megatron-Bridge field names), key=value overrides "
                    "and Megatron command-line arguments against the EP-overlap and MoE rules and the fields' "
                    "types and choices; prints each violation with its fields and fix, and warns about unknown "
                    "fields (with the closest known name).",
        epilog="config entries, in any order (at most one file):\n"
               "  CONFIG.yaml, CONFIG.json     flat, or nested as Megatron-Bridge's model: / comm_overlap: sections\n"
               "  key=value                    model.expert_model_parallel_size=8 (section, dashes, case ignored)\n"
               "  --flag VALUE, --flag=VALUE   Megatron's arguments as written: --expert-model-parallel-size 8,\n"
               "                               --num-experts 256 (= num_moe_experts), --fp8-format e4m3 (= fp8)\n"
               "  --switch                     boolean flags: --moe-grouped-gemm, --no-gradient-accumulation-fusion\n"
               "  expertrail's own fields      hardware=h100, world_size=64 (or num_nodes, gpus_per_node),\n"
               "                               torch_version=2.6.0, NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8\n"
               "exit status: 0 valid; 1 a rule or a field value violated (with --strict, also an unknown field);\n"
               "             2 unusable arguments (no config, two files, unreadable file)\n"
               "example: expertrail validate $(expertrail plan --hardware h100 --model deepseek-v3 --ep 32 "
               "--emit megatron)\n\n" + NAMES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.__class__ = _ConfigArguments
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: text)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1) on unknown fields too (default: warn about them)")
    p.set_defaults(config=[])


def _positive_int(example: int):
    """An argparse type: a whole number >= 1 (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one >= 1, e.g. {example}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value}: give a whole number >= 1, e.g. {example}")
        return value
    return parse


def _int_list(option: str):
    """An argparse type: ``8,16,32`` or ``8..64:8`` (see `plan.simulate.parse_ints`)."""
    def parse(text: str) -> list:
        from ..plan.simulate import parse_ints
        try:
            return parse_ints(text, option)
        except ExpertrailError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(option).strip()) from None
    return parse


def _workload_args(p) -> None:
    """The hardware / model / traffic options shared by `simulate` and `plan`."""
    from ..plan.catalog import HARDWARE, MODELS
    p.add_argument("--hardware", required=True, metavar="NAME|FILE",
                   help=f"GPU system: one of {', '.join(HARDWARE)}, or a YAML/JSON file with the Hardware fields "
                        "(required)")
    p.add_argument("--model", required=True, metavar="NAME|FILE|DIR",
                   help=f"MoE model: one of {', '.join(MODELS)}, a YAML/JSON file with the MoEModel fields, "
                        "a Hugging Face config.json or model directory (required)")
    p.add_argument("--tokens", type=_positive_int(4096), default=4096,
                   help="tokens per rank per micro-batch (default %(default)s)")
    p.add_argument("--routing", default="uniform",
                   help="uniform | zipf:<alpha> (hot experts at low ids) | grouped (DeepSeek-V3 group-limited) | "
                        "a .npy file of recorded topk_idx [N, K] or [world, N, K] (default %(default)s)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="dispatch precision: fp8 sends FP8 rows with scales, combine stays BF16 (default %(default)s)")


def _simulate_parser(sub) -> None:
    from ..names import FIELD_NAMES, NAMES_HELP
    p = sub.add_parser("simulate", help="predict dispatch / combine of every algorithm at cluster scale",
                       description="Cost model (docs/cost-model.md): bytes per link class counted from a sampled "
                                   "routing, time from the links' SM-dependent bandwidth. No GPU, no torch. "
                                   "EP sizes that do not divide the experts are skipped with a note.",
                       epilog=NAMES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_args(p)
    p.add_argument("--ep", type=_int_list("--ep"), default="8,16,32,64",
                   help="EP sizes: 8,16,32 or a range 8..64:8 (lo..hi:step, step 8 if left out); sizes that do not "
                        "divide the experts are skipped with a note (default %(default)s)")
    p.add_argument("--sms", type=_int_list("--sms"), default="20",
                   help="SM counts for the SM-driven kernels (dedup, hierarchical, deepep-ll; NCCL's alltoall and "
                        "allgather take none): 20, 8,16 or 8..32:4 (default %(default)s)")
    p.add_argument("--backends", default=None, metavar="A,B",
                   help=f"comma-separated algorithms among {', '.join(FIELD_NAMES)} (default: all)")
    p.add_argument("--domain-size", type=_positive_int(8), default=None,
                   help="ranks per NVLink domain (default: the largest divisor of each EP within the hardware's "
                        "NVLink domain)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (default: a table)")
    p.add_argument("--plot", metavar="PATH.png", help="also plot time and inter-domain bytes against EP (default: no plot)")


def _run_simulate(args) -> int:
    from ..plan.catalog import load_hardware, load_model
    from ..plan.cost import ALGORITHMS
    from ..plan.output import dumps
    from ..plan.simulate import format_rows, plot_rows, simulate, usable_eps
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


def _plan_parser(sub) -> None:
    from ..names import NAMES_HELP
    p = sub.add_parser("plan", help="recommend a dispatcher, EP size, SM counts and settings, with reasons",
                       description="Recommends the dispatcher (with predicted times of all alternatives), SM counts, "
                                   "the NVLink domain setting, EP size, EP-overlap / CUDA-graph / FP8 advice and "
                                   "pitfalls for a hardware and model; --emit prints a ready configuration that "
                                   "`expertrail validate` accepts as it is.",
                       epilog=NAMES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _workload_args(p)
    p.add_argument("--ep", type=_positive_int(32), default=None,
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
                   help="search the layouts (TP, CP, PP, VPP, EP, ETP, recompute) that fit --gpus GPUs, fastest first "
                        "(default: plan the dispatcher)")
    f.add_argument("--gpus", type=_positive_int(256), default=None,
                   help="GPUs of the run (needed by --fit; default without --fit: 256, for the memory check of the EP "
                        "sizes)")
    f.add_argument("--seq", type=_positive_int(4096), default=4096, help="sequence length (default %(default)s)")
    f.add_argument("--global-batch", type=_positive_int(1024), default=None,
                   help="sequences per step (default: 1024, or DP x micro-batch when more)")
    f.add_argument("--top", type=_positive_int(5), default=5, help="layouts to print (default %(default)s)")


def _run_fit(args) -> int:
    """`plan --fit`: the fastest layouts that fit, or (--emit) the first one's flags."""
    from ..plan.architecture import load_architecture
    from ..plan.catalog import load_hardware
    from ..plan.output import dumps
    from ..plan.search import emit_layout, format_search, layout_fields, search
    if not args.gpus:
        raise ExpertrailError("--fit needs --gpus N, the GPUs of the run, e.g. --gpus 256")
    hw, arch = load_hardware(args.hardware), load_architecture(args.model)
    found = search(arch, hw, args.gpus, args.seq, args.global_batch, precision=args.precision, top=args.top)
    if args.emit:
        if not found:
            raise ExpertrailError(format_search(found, arch, hw, args.gpus))
        print(emit_layout(arch, hw, found[0][1], args.emit))
    elif args.json:
        print(dumps([dict(r, fields=layout_fields(arch, lay, hw)) for r, lay in found]))
    else:
        print(format_search(found, arch, hw, args.gpus))
    return 0 if found else 1


def _run_plan(args) -> int:
    from ..plan.advisor import emit, format_plan, plan
    from ..plan.catalog import load_hardware, load_model
    from ..plan.output import dumps
    if args.fit:
        return _run_fit(args)
    hw, model = load_hardware(args.hardware), load_model(args.model)
    result = plan(hw, model, args.tokens, args.ep, args.stage, args.precision, args.routing, gpus=args.gpus or 256)
    if args.emit:
        print(emit(result, model, args.emit))
    elif args.json:
        print(dumps(result))
    else:
        print(format_plan(result))
    return 0


def _estimate_parser(sub) -> None:
    from ..plan.architecture import ARCHITECTURES
    p = sub.add_parser(
        "estimate", help="does a training configuration fit; step time, TFLOPS per GPU and the wall it hits",
        usage="%(prog)s [-h] --hardware NAME --gpus N [--model NAME] [--json PATH] [CONFIG.yaml] "
              "[key=value | --megatron-flag [VALUE]] ...",
        description="Reads a Megatron-Core / Megatron-Bridge training configuration (the forms `expertrail validate` "
                    "reads) and predicts memory per GPU on the busiest pipeline rank, the step time, per-GPU TFLOPS "
                    "(model FLOPs, Megatron's count) and the wall the run hits (docs/planner.md). Torch-free.",
        allow_abbrev=False)
    p.__class__ = _ConfigArguments
    _fit_arguments(p, ARCHITECTURES)
    p.add_argument("--json", metavar="PATH", help="also write the estimate as JSON (fits, peak_memory_GB, "
                                                  "step_time_s, tflops_per_gpu and the breakdowns)")
    p.set_defaults(config=[])


def _fit_arguments(p, architectures) -> None:
    """--hardware / --gpus / --model, shared by `estimate` and `plan --fit`."""
    p.add_argument("--hardware", required=True, metavar="NAME|FILE", help="GPU system (as for plan)")
    p.add_argument("--gpus", type=_positive_int(256), required=True, help="GPUs of the run")
    p.add_argument("--model", metavar="NAME", default=None,
                   help=f"model shape: one of {', '.join(architectures)}; fields such as num_layers or hidden_size in "
                        "the configuration override it (default: the configuration spells the model out)")


def _estimate_inputs(args, config: list) -> tuple:
    """(architecture, hardware, layout fields, validate violations) from --model and config entries."""
    from ..plan.architecture import from_fields, load_architecture
    from ..plan.catalog import load_hardware
    from ..plan.validate import read_file, split_arguments, validate
    files, pairs = split_arguments(config)
    if len(files) > 1:
        raise ExpertrailError(f"give at most one config file, got {files}")
    values = read_file(files[0]) if files else {}
    values.update(pairs)
    hw = load_hardware(args.hardware)
    arch = from_fields(load_architecture(args.model), values)
    values.setdefault("num_moe_experts", arch.experts)
    values.setdefault("moe_router_topk", arch.topk)
    checked = dict(values, hardware=hw.name if not args.hardware.endswith((".yaml", ".yml", ".json")) else args.hardware,
                   world_size=args.gpus)
    return arch, hw, values, validate(checked)


def _run_estimate(args) -> int:
    from ..plan.estimate import estimate, format_estimate
    from ..plan.layout import TrainingLayout
    from ..plan.output import dumps
    arch, hw, values, violations = _estimate_inputs(args, args.config)
    result = estimate(arch, hw, TrainingLayout.from_fields(values, args.gpus))
    result["violations"] = [v.__dict__ for v in violations]
    print(format_estimate(result))
    for v in violations:
        print(f"validate: {v.format()}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(dumps(result, fallback=str))
        print(f"wrote {args.json}")
    return 0


def _balance_parser(sub) -> None:
    p = sub.add_parser("balance", help="balancedness before and after replicating hot experts",
                       description="Plans replicas and placement for measured (--load) or Zipf expert loads and "
                                   "prints balancedness (mean / max tokens per rank) for contiguous placement and "
                                   "each policy. Torch-free.")
    p.add_argument("--load", help="token counts [layers, experts] in .npy, .csv or .json")
    p.add_argument("--zipf", type=float, help="Zipf exponent of synthetic loads")
    p.add_argument("--experts", type=_positive_int(64))
    p.add_argument("--layers", type=_positive_int(1), default=1)
    p.add_argument("--ranks", type=_positive_int(8), required=True)
    p.add_argument("--redundant", type=int, default=0, help="extra physical slots for replicas")
    p.add_argument("--domains", type=_positive_int(2), default=1)
    p.add_argument("--groups", type=_positive_int(8), default=None, help="expert groups for the hierarchical policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PATH.png")


def _run_validate(args) -> int:
    from ..plan.output import dumps
    from ..plan.validate import RULES, read_file, split_arguments, unknown_fields, validate
    if not args.config:
        raise ExpertrailError("nothing to validate: give a YAML/JSON file, key=value overrides or Megatron flags, "
                              "e.g. expertrail validate --expert-model-parallel-size 8 --num-experts 64")
    files, pairs = split_arguments(args.config)
    if len(files) > 1:
        raise ExpertrailError(f"give at most one config file, got {files} (a bare word is read as a file: write "
                              "key=value or --flag VALUE for the others)")
    values = read_file(files[0]) if files else {}
    values.update(pairs)
    violations = validate(values)
    warnings = unknown_fields(values)
    failed = bool(violations) or (args.strict and bool(warnings))
    if args.json:
        print(dumps({"valid": not failed, "rules_checked": len(RULES), "fields_checked": len(values),
                     "warnings": warnings, "violations": [v.__dict__ for v in violations]}, fallback=str))
        return 1 if failed else 0
    for w in warnings:
        print(f"warning: {w['message']}")
    if violations:
        print(f"{len(violations)} rule(s) violated:")
        for v in violations:
            print(v.format())
    elif failed:
        print(f"not valid with --strict: {len(warnings)} unknown field(s)")
    else:
        print(f"valid: {len(RULES)} rules and {len(values)} field value(s) checked, none violated"
              + (f"; {len(warnings)} warning(s) above" if warnings else ""))
    return 1 if failed else 0


def _backend_list(text: str) -> list:
    """``--backends a,b`` -> names, each checked."""
    backends = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ExpertrailError(f"--backends: unknown {unknown}; choose from {sorted(BACKENDS)}")
    return backends


def _train_config(args):
    """`train`'s TrainConfig from its arguments (--backends and --micro-batches checked)."""
    from .configs import TrainConfig
    _backend_list(args.backends)
    micro_batches = args.micro_batches or (4 if args.overlap else 1)
    if args.overlap and micro_batches < 2:
        raise ConfigError(f"--overlap needs at least 2 micro-batches per step (got --micro-batches {micro_batches}): "
                          "overlap runs one micro-batch's forward beside another's backward")
    return TrainConfig(steps=args.steps, layers=args.layers, experts=args.experts, topk=args.topk, hidden=args.hidden,
                       ffn=args.ffn, seq=args.seq, batch=args.batch, micro_batches=micro_batches, overlap=args.overlap,
                       lr=args.lr, seed=args.seed, tolerance=args.tolerance)


def _run_train(args) -> int:
    backends = _backend_list(args.backends)
    cfg = _train_config(args)
    if _under_torchrun():                                       # launched by torchrun (e.g. on a cluster)
        return _train_under_torchrun(args, cfg, backends)
    if args.nodes:                     # checked before the cluster comes up (local runs report per backend)
        _check_train(cfg, args.nodes * args.ranks_per_node,
                     f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node}")
        return _on_cluster(args, list(args.argv_seen))
    from ..emulation.launch import LocalRanks, RankError
    from .train import timeline_spans, train_rank, train_reference
    reference = train_reference(cfg, args.world)
    runs, crashed, spans = {}, {}, None
    with LocalRanks(args.world) as ranks:
        for b in backends:
            try:
                runs[b] = ranks.run(train_rank, cfg, b)[0]
            except RankError as err:          # report it, go on with the other backends
                first = err.errors[min(err.errors)]
                crashed[b] = f"raised on rank(s) {sorted(err.errors)}: {first[0]}"
        if args.timeline and runs:
            spans = ranks.run(timeline_spans, cfg, next(iter(runs)))[0]
    return _train_report(cfg, reference, runs, crashed, spans, args, args.world)


def _train_under_torchrun(args, cfg, backends: list) -> int:
    """`train` as one rank of a torchrun launch: every backend trained, rank 0 reports."""
    import torch.distributed as dist

    from .train import timeline_spans, train_rank, train_reference
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    domain = int(os.environ.get("LOCAL_WORLD_SIZE", max(1, world // 2)))
    runs, crashed, spans = {}, {}, None
    for b in backends:
        try:
            runs[b] = train_rank(rank, world, cfg, b, domain_size=domain)
        except ExpertrailError as err:        # raised on every rank alike: go on with the others
            crashed[b] = f"raised: {err}"
    if args.timeline and runs:
        spans = timeline_spans(rank, world, cfg, next(iter(runs)), domain_size=domain)
    rc = 0
    if rank == 0:
        rc = _train_report(cfg, train_reference(cfg, world), runs, crashed, spans, args, world)
    dist.barrier()              # tear down together: a rank that leaves early aborts its peers' gloo threads
    dist.destroy_process_group()
    return rc


def _train_report(cfg, reference: list, runs: dict, crashed: dict, spans, args, world: int) -> int:
    """Print the losses (and with --overlap the step times), write --json / --timeline;
    1 if a backend failed."""
    import json

    from .train import summarize, write_timeline
    report = summarize(cfg, reference, runs)
    rows = report["backends"]
    print(f"tiny MoE LM: {cfg.layers} layers, {cfg.experts} experts, top-{cfg.topk}, hidden {cfg.hidden}, "
          f"ffn {cfg.ffn}, {world} ranks x {cfg.micro_batches} micro-batch(es) x {cfg.batch} sequences of "
          f"{cfg.seq}; loss per step")
    print(f"{'step':>4}  {'1 process':>10}" + "".join(f"  {b:>12}" for b in rows))
    for step, ref in enumerate(reference):
        print(f"{step:>4}  {ref:>10.6f}" + "".join(f"  {rows[b]['losses'][step]:>12.6f}" for b in rows))
    failures = [f"{b} {message}" for b, message in crashed.items()]
    for b, r in rows.items():
        print(f"{b}: max |loss - single process| = {r['max_abs_diff']:.2e}, loss {r['losses'][0]:.3f} -> "
              f"{r['losses'][-1]:.3f}, step {1e3 * r['step_time_s']:.1f} ms")
        if cfg.overlap:
            without = r["without_overlap"]
            print(f"{b}: step {1e3 * without['step_time_s']:.1f} ms without overlap, {1e3 * r['step_time_s']:.1f} ms "
                  f"with ({r['overlap_speedup']:.2f}x); losses identical: {'yes' if r['same_losses'] else 'NO'}")
            if r.get("overlap_ceiling"):
                print(f"{b}: CPU floor {1e3 * r['cpu_floor_s']:.1f} ms (all ranks' CPU time per step over the host's "
                      f"cores): overlap can gain at most {r['overlap_ceiling']:.2f}x on this machine")
            if not r["same_losses"]:
                failures.append(f"{b}: the overlapped run's losses differ from the run without overlap")
        if not r["matches_reference"]:
            step = r["first_bad_step"]
            failures.append(f"{b}: at step {step} the loss is {r['losses'][step]:.6g}, the single-process run's "
                            f"{reference[step]:.6g} (tolerance {cfg.tolerance:g})")
        elif not r["loss_fell"]:
            failures.append(f"{b}: the loss did not fall by 10% ({r['losses'][0]:.4f} -> {r['losses'][-1]:.4f})")
    if args.json:
        report["crashed"] = crashed
        if os.environ.get("EXPERTRAIL_CLUSTER"):
            report["emulated"] = {"cluster": os.environ["EXPERTRAIL_CLUSTER"],
                                  "inter_link": os.environ.get("EXPERTRAIL_INTER_LINK", "?"),
                                  "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", 0))}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if spans is not None:
        write_timeline(spans, args.timeline)
        print(f"wrote {args.timeline}")
    for line in failures:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0


def _bench_config(args):
    """`bench`'s BenchConfig from its arguments (--backends checked)."""
    from .configs import BenchConfig
    return BenchConfig(world=args.world, domain_size=args.domain_size, hidden=args.hidden, tokens=args.tokens,
                       experts=args.experts, topk=args.topk, backends=_backend_list(args.backends), dtype=args.dtype,
                       routing=args.routing,
                       iters=args.iters or (DECODE_ITERS if args.decode else BenchConfig.iters),
                       warmup=args.warmup, seed=args.seed,
                       chunks=args.chunks, expert_ffn=args.expert_ffn, payload=args.payload,
                       malloc_heap=args.malloc_heap, progress=not args.no_progress and sys.stderr.isatty())


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_bench(args) -> int:
    cfg = _bench_config(args)
    if not _under_torchrun():          # check what can be checked before a rank (or a cluster) starts
        if args.nodes:
            world = args.nodes * args.ranks_per_node
            ranks = f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node}"
            domain = args.domain_size if _given(args, "--domain-size") else args.ranks_per_node
        else:
            world, domain, ranks = args.world, args.domain_size, f"--world {args.world}"
        _check_bench(cfg, world, domain, ranks, decode=args.decode)
    if args.decode:
        return _run_decode(args, cfg)
    from .bench import bench_rank
    if _under_torchrun():                                       # launched by torchrun
        import torch
        import torch.distributed as dist
        use_nccl = torch.cuda.is_available()
        if use_nccl:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if use_nccl else "gloo")
        if args.malloc_heap:
            from ..emulation.launch import use_heap_for_large_buffers
            use_heap_for_large_buffers()
        cfg.world = dist.get_world_size()
        report = bench_rank(dist.get_rank(), cfg.world, cfg)
        if os.environ.get("EXPERTRAIL_CLUSTER") or args.emit_hardware:
            _measure_and_predict(report, cfg, args)
        if dist.get_rank() == 0:
            _report(report, args)
        dist.barrier()              # tear down together: a rank that leaves early aborts its peers' gloo threads
        dist.destroy_process_group()
        return 0
    if args.nodes:
        return _on_cluster(args, list(args.argv_seen))
    import torch
    from ..emulation.launch import LocalRanks
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world else "gloo"
    with LocalRanks(cfg.world, backend=backend, malloc_heap=args.malloc_heap) as ranks:
        report = ranks.run(bench_rank, cfg)[0]
    _report(report, args)
    return 0


def _run_decode(args, cfg) -> int:
    """`bench --decode` on local ranks, under torchrun, or (``--nodes``) on an emulated cluster."""
    from .bench_decode import decode_rank, format_decode
    if _under_torchrun():
        import torch.distributed as dist
        dist.init_process_group("gloo")
        cfg.world = dist.get_world_size()
        report = decode_rank(dist.get_rank(), cfg.world, cfg)
        if dist.get_rank() == 0:
            _decode_report(report, args, format_decode)
        dist.barrier()
        dist.destroy_process_group()
        return 0
    if args.nodes:
        return _on_cluster(args, list(args.argv_seen))
    from ..emulation.launch import LocalRanks
    with LocalRanks(cfg.world) as ranks:
        report = ranks.run(decode_rank, cfg)[0]
    _decode_report(report, args, format_decode)
    return 0


def _decode_report(report: dict, args, format_decode) -> None:
    import json
    if os.environ.get("EXPERTRAIL_CLUSTER"):
        report["emulated"] = {"cluster": os.environ["EXPERTRAIL_CLUSTER"],
                              "inter_link": os.environ.get("EXPERTRAIL_INTER_LINK", "?")}
    print(format_decode(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


def _measure_and_predict(report: dict, cfg, args) -> None:
    """Under torchrun: measure this run's links, add the planner's predictions (and with
    --emit-hardware write the hardware entry). Collective."""
    import torch.distributed as dist

    from .bench import DTYPES, predict_backends
    from ..emulation.links import measure_links, measure_local_passes, measured_hardware, write_hardware
    from ..comm.topology import EPGroups
    groups = EPGroups.from_default(domain_size=cfg.domain_size)
    links = measure_links(groups)
    report["links"] = links
    report["local_passes"] = local = measure_local_passes(groups.device, DTYPES[cfg.dtype], hidden=cfg.hidden)
    if os.environ.get("EXPERTRAIL_CLUSTER"):
        report["emulated"] = {"cluster": os.environ["EXPERTRAIL_CLUSTER"],
                              "inter_link": os.environ.get("EXPERTRAIL_INTER_LINK", "?"),
                              "nodes": int(os.environ.get("EXPERTRAIL_NODES", cfg.world // groups.domain_size)),
                              "ranks_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", groups.domain_size))}
    predict_backends(report, links, local)
    if args.emit_hardware and dist.get_rank() == 0:
        write_hardware(measured_hardware(links, cfg.domain_size, local=local), args.emit_hardware)
        print(f"wrote {args.emit_hardware}")


def _report(report, args) -> None:
    from .bench import format_links, format_overlap, format_table, write_json, write_plot
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


def _cluster_parser(sub) -> None:
    p = sub.add_parser("cluster", help="an emulated multi-node cluster on this machine (network namespaces, "
                                       "shaped links)",
                       description="N emulated nodes: network namespaces joined by veth links to a bridge, the "
                                   "inter-node links shaped with tc (token bucket) in both directions; ranks of a "
                                   "node share its loopback. Needs root (CAP_NET_ADMIN) and iproute2. See "
                                   "docs/emulated-cluster.md.")
    verbs = p.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="bring a cluster up and leave it up (until `cluster down`)")
    run = verbs.add_parser("run", help="run a command on every node under torchrun's multi-node launch",
                           description="Runs `torchrun --nnodes N --node-rank i --nproc-per-node R --rdzv-endpoint "
                                       "<node 0>:PORT COMMAND` inside each node's namespace (a python script, "
                                       "-m module, or any program). Without --name, a cluster is brought up for "
                                       "the run and torn down after it, also on failure or Ctrl-C.")
    for q in (up, run):
        q.add_argument("--nodes", type=_positive_int(2), default=2, help="emulated nodes (default %(default)s)")
        _inter_link_argument(q)
    run.add_argument("--ranks-per-node", type=_positive_int(2), default=2,
                     help="ranks per node (torchrun --nproc-per-node; the EP domain size by default) "
                          "(default %(default)s)")
    run.add_argument("--name", help="run on this cluster (from `cluster up`) instead of a new one")
    run.add_argument("--port", type=_positive_int(29400), default=29400,
                     help="rendezvous port on node 0 (default %(default)s)")
    run.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped (default: none)")
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                     help="the command each rank runs, after --")
    down = verbs.add_parser("down", help="remove clusters: the named ones, or with --all every one (also "
                                         "what a killed run left behind)")
    down.add_argument("names", nargs="*", help="cluster names, as `cluster status` lists them")
    down.add_argument("--all", action="store_true", help="every emulated cluster on this machine")
    verbs.add_parser("status", help="list the emulated clusters on this machine")


def _run_cluster(args) -> int:
    from ..emulation import cluster as cl
    if args.verb == "status":
        records = cl.list_clusters()
        for name, r in sorted(records.items()):
            owner = r.get("owner_pid")
            state = "kept up" if owner == 0 else (f"owned by pid {owner}" if cl.process_alive(int(owner or -1))
                                                  else "left behind (owner gone)")
            link = cl.LinkSpec(**r["inter_link"]) if "inter_link" in r else "?"
            print(f"{name}: {r.get('nodes', '?')} nodes {', '.join(r.get('address', []))}, inter-link {link}, {state}")
        stray = sorted(cl.leftover_prefixes() - set(records))
        for name in stray:
            print(f"{name}: namespaces or links with no record (remove with `expertrail cluster down {name}`)")
        if not records and not stray:
            print("no emulated cluster")
        return 0
    if args.verb == "down":
        names = sorted(set(cl.list_clusters()) | cl.leftover_prefixes()) if args.all else args.names
        if not names:
            raise ConfigError("name the clusters to remove (see `expertrail cluster status`), or give --all")
        for name in names:
            removed = cl.teardown(name)
            print(f"{name}: removed {len(removed)} namespaces, links and records" if removed else f"{name}: nothing left")
        return 0
    link = args.inter_link                # a LinkSpec: parsed (and checked) with the arguments
    if args.verb == "up":
        c = cl.Cluster(args.nodes, link).up(keep=True)
        print(f"{c.prefix}: {c.nodes} nodes ({', '.join(c.address)}), inter-link {link}; "
              f"run with `expertrail cluster run --name {c.prefix} -- ...`, remove with `expertrail cluster down {c.prefix}`")
        return 0
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        raise ConfigError("give the command after --, e.g. expertrail cluster run -- my_script.py --steps 10")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout {args.timeout:g}: give the seconds the run may take, > 0 (or leave it out)")
    if args.port > 65535:
        raise ConfigError(f"--port {args.port}: give a TCP port, 1..65535")
    cluster = cl.Cluster.attach(args.name) if args.name else cl.Cluster(args.nodes, link)
    _check_cluster_command(command, cluster.nodes, args.ranks_per_node)     # before anything starts
    try:
        if args.name:
            cluster.run(command, args.ranks_per_node, args.timeout, args.port)
            return 0
        with cluster as c:
            print(f"cluster {c.prefix}: {c.nodes} nodes x {args.ranks_per_node} ranks, inter-link {link} (emulated)",
                  file=sys.stderr)
            c.run(command, args.ranks_per_node, args.timeout, args.port)
    except KeyboardInterrupt:
        raise _after_interrupt(cluster, kept=bool(args.name)) from None
    return 0


def main(argv=None) -> int:
    """The `expertrail` command. A reader that leaves early (``expertrail plan ... | head -1``)
    ends it quietly: no traceback, the command's own status if it had finished, else 141 (128 +
    SIGPIPE, what the shell reports for a writer whose reader left)."""
    rc = 141
    try:
        rc = _main(argv)
        sys.stdout.flush()                  # a closed pipe shows here, not at interpreter exit
        return rc
    except KeyboardInterrupt as err:        # Ctrl-C: one line (what became of a cluster), no traceback
        print(f"expertrail: interrupted{f'; {err}' if str(err) else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:                                # later writes (the interpreter's final flush) go nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass                            # stdout is not a file (captured in tests)
        return rc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertrail", description="Expert-parallel dispatch and combine for MoE.")
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    _train_parser(sub)
    _validate_parser(sub)
    _simulate_parser(sub)
    _plan_parser(sub)
    _estimate_parser(sub)
    _balance_parser(sub)
    from .serve_sim import add_parser as _serve_sim_parser
    _serve_sim_parser(sub)
    _cluster_parser(sub)
    return parser


def _main(argv=None) -> int:
    args = _parser().parse_args(argv)
    args.argv_seen = list(sys.argv[1:] if argv is None else argv)[1:]     # after the command's name
    try:
        if args.command == "bench":
            return _run_bench(args)
        if args.command == "train":
            return _run_train(args)
        if args.command == "validate":
            return _run_validate(args)
        if args.command == "simulate":
            return _run_simulate(args)
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "estimate":
            return _run_estimate(args)
        if args.command == "balance":
            from ..balance.report import run
            return run(args)
        if args.command == "serve-sim":
            from .serve_sim import run
            return run(args)
        if args.command == "cluster":
            return _run_cluster(args)
    except ExpertrailError as err:
        print(f"expertrail {args.command}: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if type(err).__name__ == "RankError":
            first = min(err.errors)
            exc = err.errors[first][2]
            if isinstance(exc, ExpertrailError):
                print(f"expertrail {args.command}: rank {first}: {exc}", file=sys.stderr)
                return 2
        raise
    return 1
