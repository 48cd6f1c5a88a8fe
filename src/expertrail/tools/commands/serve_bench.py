"""`expertrail serve-bench`: a Hugging Face MoE model served expert parallel (tools/serve_bench.py),
with decode buckets and live rebalancing against the same model without them, on local ranks or
an emulated cluster. No torch import at module level, so the command line is built without it."""
from __future__ import annotations

import json
import os

from ...errors import ConfigError
from ..arguments import cluster_arguments


def add_parser(sub) -> None:
    """Add `expertrail serve-bench` to the command's subparsers."""
    from ..serve_bench import ServeBenchConfig
    d = ServeBenchConfig()
    p = sub.add_parser("serve-bench", help="generate from a Hugging Face MoE model expert parallel: decode buckets "
                                           "and live rebalancing against the plain model",
                       description="Generates greedily from a stream of prompts whose topic moves, with the same "
                                   "model patched three ways on --ep ranks: the normal mode at every step; decode "
                                   "steps through the low-latency mode by token-count bucket; buckets plus hot "
                                   "experts replicated and migrated while generate runs. Reports per-step latency "
                                   "p50/p99 per mode, tokens/s and balancedness over time; exits 1 if the buckets "
                                   "change a token.")
    p.add_argument("--model", default=d.model, metavar="DIR|tiny",
                   help="a checkpoint directory (expertrail.hf.from_pretrained), or tiny: a tiny random Qwen3-MoE "
                        "(default %(default)s)")
    p.add_argument("--ep", type=int, default=d.ep, help="local ranks, all one EP group (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch,
                   help="prompts per rank: tokens per rank at each decode step (default %(default)s)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="tokens per prompt (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="tokens generated per prompt (default %(default)s)")
    p.add_argument("--rounds", type=int, default=d.rounds, help="batches of prompts, one generate each (default %(default)s)")
    p.add_argument("--topic-every", type=int, default=d.topic_every, help="rounds per topic (default %(default)s)")
    p.add_argument("--buckets", default=",".join(map(str, d.buckets)),
                   help="low-latency buckets, most tokens per rank, comma separated; more tokens run the normal "
                        "mode (default %(default)s)")
    p.add_argument("--redundant", type=int, default=d.redundant, help="extra slots per block for replicas "
                                                                       "(default %(default)s)")
    p.add_argument("--rebalance-every", type=int, default=d.rebalance_every,
                   help="model forwards between plans (default %(default)s)")
    p.add_argument("--window", type=int, default=d.window, help="forwards in the load window (default %(default)s)")
    p.add_argument("--skew", type=float, default=d.skew,
                   help="forced routing drift: each router's logits get skew * log p(e), p a Zipf popularity "
                        "reshuffled per topic; 0: the model's own routing (default %(default)s)")
    for name in ("layers", "hidden", "experts", "topk", "vocab"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name), help=f"tiny model's {name} (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="write the configuration, per-step figures and summary as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot balancedness and forward latency over time")
    cluster_arguments(p, "ranks per emulated node; --nodes x this must equal --ep")


def config_of(args):
    from ..serve_bench import ServeBenchConfig
    try:
        buckets = [int(b) for b in args.buckets.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(f"--buckets {args.buckets!r}: give token counts separated by commas, e.g. 8,32,128") from None
    cfg = ServeBenchConfig(model=args.model, ep=args.ep, batch=args.batch, prompt_len=args.prompt_len,
                           new_tokens=args.new_tokens, rounds=args.rounds, topic_every=args.topic_every,
                           buckets=buckets, redundant=args.redundant, rebalance_every=args.rebalance_every,
                           window=args.window, skew=args.skew, layers=args.layers, hidden=args.hidden,
                           experts=args.experts, topk=args.topk, vocab=args.vocab, seed=args.seed)
    cfg.check()
    from ...moe.bucketed import check_buckets
    check_buckets(cfg.buckets)
    return cfg


def run(args) -> int:
    from ..ranks import Ranks, note_emulated, on_cluster, under_torchrun
    cfg = config_of(args)
    if args.nodes and not under_torchrun():
        if args.nodes * args.ranks_per_node != cfg.ep:
            raise ConfigError(f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node} must equal --ep {cfg.ep}")
        return on_cluster(args)
    from ..records import machine, now
    from ..serve_bench import plot, serve_bench_rank, summary_lines
    with Ranks(cfg.ep) as ranks:
        result = ranks.run(serve_bench_rank, cfg)
        if not ranks.reports:
            return 0
    print("\n".join(summary_lines(result)))
    if args.json:
        result = {"command": "expertrail serve-bench " + " ".join(args.argv_seen), "machine": machine(), "date": now(),
                  **result}
        note_emulated(result, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result["tokens_identical_detail"]["buckets_vs_normal"] else 1
