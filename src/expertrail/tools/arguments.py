"""Argument types and option groups the commands share: whole numbers, lists, backend names,
link specs, the emulated-cluster options, Megatron-style config entries, the experts check."""
from __future__ import annotations

import argparse

from ..errors import ConfigError, ExpertrailError
from ..names import BACKEND_NAMES as BACKENDS

ROUTING_HELP = "uniform | zipf:<alpha> | balanced | <file with topk_idx [world, N, K] (.pt or .npy)>"


def positive_int(example: int):
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


def int_list(option: str):
    """An argparse type: ``8,16,32`` or ``8..64:8`` (see `plan.simulate.parse_ints`)."""
    def parse(text: str) -> list:
        from ..plan.simulate import parse_ints
        try:
            return parse_ints(text, option)
        except ExpertrailError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(option).strip()) from None
    return parse


def backend_list(text: str) -> list:
    """``--backends a,b`` -> names, each checked."""
    backends = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ExpertrailError(f"--backends: unknown {unknown}; choose from {sorted(BACKENDS)}")
    return backends


def link_spec(text: str):
    """An argparse type: ``--inter-link SPEC`` as a `cluster.LinkSpec`, so a bad spec (``1gbps``,
    ``fast``) stops the command while its arguments are parsed, before any namespace exists."""
    from ..emulation.cluster import LinkSpec
    try:
        return LinkSpec.parse(text)
    except ExpertrailError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--inter-link").lstrip(": ")) from None


def inter_link_argument(parser) -> None:
    parser.add_argument("--inter-link", type=link_spec, default="1gbit",
                        help="each node's link, both directions: RATE[,loss=P][,delay=T][,queue=T], e.g. "
                             "200mbit,loss=1%% (loss needs nftables; a delay needs the kernel's netem; queue: how long "
                             "a packet may wait in the shaper's FIFO, default 50ms); RATE in bit units (kbit, mbit, "
                             "gbit), not tc's byte units (kbps, mbps, gbps) (default %(default)s)")


def cluster_arguments(parser, ranks_per_node_help: str):
    """The options that run a command on an emulated cluster (`on_cluster`); returns their group."""
    c = parser.add_argument_group("on an emulated multi-node cluster (docs/emulated-cluster.md; needs root)")
    c.add_argument("--nodes", type=positive_int(2), default=None,
                   help="run on this many emulated nodes, launched by torchrun per node (default: local ranks)")
    c.add_argument("--ranks-per-node", type=positive_int(2), default=2,
                   help=f"{ranks_per_node_help} (default %(default)s)")
    inter_link_argument(c)
    return c


class ConfigArguments(argparse.ArgumentParser):
    """`validate`'s parser: every argument it does not declare is a config entry, kept in order, so
    Megatron's own flags (``--num-experts 256``, ``--moe-grouped-gemm``) pass through as written."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.config = list(getattr(namespace, "config", None) or []) + list(extras)
        return namespace, []


def given(args, option: str) -> bool:
    """Whether ``option`` was on the command line (not left at its default)."""
    return option in {a.split("=", 1)[0] for a in args.argv_seen}


def check_experts(experts: int, topk: int, world: int, ranks: str) -> None:
    """Experts that split evenly over ``world`` ranks, and a top-k they can serve."""
    if experts < 1 or experts % world:
        up, down = -(-max(experts, 1) // world) * world, experts // world * world
        other = f" (or {down})" if down >= world and down != up else ""
        raise ConfigError(f"--experts {experts} must be a multiple of the {world} ranks ({ranks}): every rank holds "
                          f"the same number of experts; give --experts {up}{other}, or a rank count that divides "
                          f"{experts}")
    if not 1 <= topk <= experts:
        raise ConfigError(f"--topk {topk} must be between 1 and --experts {experts}")


def workload_arguments(p) -> None:
    """The hardware / model / traffic options shared by `simulate` and `plan`."""
    from ..plan.architecture import MODELS
    from ..plan.catalog import HARDWARE
    p.add_argument("--hardware", required=True, metavar="NAME|FILE",
                   help=f"GPU system: one of {', '.join(HARDWARE)} (any case; gb200 and gb300, as Megatron-Bridge "
                        "names them, are the NVL72 racks), or a YAML/JSON file with the Hardware fields (required)")
    p.add_argument("--model", required=True, metavar="NAME|FILE|DIR",
                   help=f"MoE model: one of {', '.join(MODELS)}, a YAML/JSON file with the MoEModel fields, "
                        "a Hugging Face config.json or model directory, or ORG/NAME in the local Hugging Face cache "
                        "(required)")
    p.add_argument("--tokens", type=positive_int(4096), default=4096,
                   help="tokens per rank per micro-batch (default %(default)s)")
    p.add_argument("--routing", default="uniform",
                   help="uniform | zipf:<alpha> (hot experts at low ids) | grouped (DeepSeek-V3 group-limited) | "
                        "a .npy file of recorded topk_idx [N, K] or [world, N, K] (default %(default)s)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"),
                   help="dispatch precision: fp8 sends FP8 rows with scales, combine stays BF16 (default %(default)s)")
