"""`expertrail train`: a tiny MoE language model trained expert parallel with every backend,
against the same model on one process; `--overlap` beside the run without."""
from __future__ import annotations

import os
import sys

from ...errors import ConfigError
from ...names import BACKEND_NAMES as BACKENDS
from ..arguments import backend_list, check_experts, cluster_arguments, positive_int
from ..ranks import Ranks, note_emulated, on_cluster, under_torchrun


def overlap_lines(name: str, r: dict) -> list[str]:
    """What `train --overlap` prints of one backend's result ``r``: the step without and with
    overlap and, when measured, the CPU floor's ceiling (docs/ records render them alike)."""
    without = r["without_overlap"]
    lines = [f"{name}: step {1e3 * without['step_time_s']:.1f} ms without overlap, {1e3 * r['step_time_s']:.1f} ms "
             f"with ({r['overlap_speedup']:.2f}x); losses identical: {'yes' if r['same_losses'] else 'NO'}"]
    if r.get("overlap_ceiling"):
        lines.append(f"{name}: CPU floor {1e3 * r['cpu_floor_s']:.1f} ms (the CPU time per step of the ranks on a set of "
                     f"cores over those cores, the busiest set): overlap can gain at most {r['overlap_ceiling']:.2f}x "
                     f"on this machine")
    return lines


def add_parser(sub) -> None:
    from ..configs import TrainConfig
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
    p.add_argument("--micro-batches", type=positive_int(1), default=None,
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
    cluster_arguments(p, "ranks per node, the EP domain size")


def config_of(args):
    """`train`'s TrainConfig from its arguments (--backends and --micro-batches checked)."""
    from ..configs import TrainConfig
    backend_list(args.backends)
    micro_batches = args.micro_batches or (4 if args.overlap else 1)
    if args.overlap and micro_batches < 2:
        raise ConfigError(f"--overlap needs at least 2 micro-batches per step (got --micro-batches {micro_batches}): "
                          "overlap runs one micro-batch's forward beside another's backward")
    return TrainConfig(steps=args.steps, layers=args.layers, experts=args.experts, topk=args.topk, hidden=args.hidden,
                       ffn=args.ffn, seq=args.seq, batch=args.batch, micro_batches=micro_batches, overlap=args.overlap,
                       lr=args.lr, seed=args.seed, tolerance=args.tolerance)


def check(cfg, world: int, ranks: str) -> None:
    """Everything about a `train` run that can be checked before a rank starts (as `_check_bench`)."""
    check_experts(cfg.experts, cfg.topk, world, ranks)
    if cfg.hidden < cfg.heads or cfg.hidden % cfg.heads:
        raise ConfigError(f"--hidden {cfg.hidden} must be a positive multiple of the model's {cfg.heads} attention "
                          f"heads, e.g. --hidden {max(cfg.heads, cfg.hidden // cfg.heads * cfg.heads)}")
    for option, value in (("--steps", cfg.steps), ("--layers", cfg.layers), ("--ffn", cfg.ffn), ("--seq", cfg.seq),
                          ("--batch", cfg.batch)):
        if value < 1:
            raise ConfigError(f"{option} {value}: give a whole number >= 1")
    if not cfg.tolerance >= 0:
        raise ConfigError(f"--tolerance {cfg.tolerance}: give a number >= 0, e.g. 1e-4")


def run(args) -> int:
    backends = backend_list(args.backends)
    cfg = config_of(args)
    if args.nodes and not under_torchrun():     # checked before the cluster comes up (local runs report per backend)
        check(cfg, args.nodes * args.ranks_per_node, f"--nodes {args.nodes} x --ranks-per-node {args.ranks_per_node}")
        return on_cluster(args)
    from ..train import timeline_spans, train_rank, train_reference
    runs, crashed, spans, rc = {}, {}, None, 0
    reference = None if under_torchrun() else train_reference(cfg, args.world)
    with Ranks(args.world) as ranks:
        domain = ranks.ranks_per_node
        for b in backends:            # a backend that raises is reported; the others go on
            result, failure = ranks.attempt(train_rank, cfg, b, domain_size=domain)
            if failure is None:
                runs[b] = result
            else:
                crashed[b] = failure
        if args.timeline and runs:
            spans = ranks.run(timeline_spans, cfg, next(iter(runs)), domain_size=domain)
        if ranks.reports:
            rc = _train_report(cfg, reference or train_reference(cfg, ranks.world), runs, crashed, spans, args,
                               ranks.world)
    return rc


def _train_report(cfg, reference: list, runs: dict, crashed: dict, spans, args, world: int) -> int:
    """Print the losses (and with --overlap the step times), write --json / --timeline;
    1 if a backend failed."""
    import datetime
    import json

    from ..train import summarize, write_timeline
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
            print("\n".join(overlap_lines(b, r)))
            if not r["same_losses"]:
                failures.append(f"{b}: the overlapped run's losses differ from the run without overlap")
        if not r["matches_reference"]:
            step = r["first_bad_step"]
            failures.append(f"{b}: at step {step} the loss is {r['losses'][step]:.6g}, the single-process run's "
                            f"{reference[step]:.6g} (tolerance {cfg.tolerance:g})")
        elif not r["loss_fell"]:
            failures.append(f"{b}: the loss did not fall by 10% ({r['losses'][0]:.4f} -> {r['losses'][-1]:.4f})")
    if args.json:
        from .. import records
        report["crashed"] = crashed
        note_emulated(report, ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
        report.update(command=" ".join(["expertrail", "train", *getattr(args, "argv_seen", sys.argv[2:])]),
                      date=str(datetime.date.today()), machine=records.machine(), code=records.code())
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if spans is not None:
        write_timeline(spans, args.timeline)
        print(f"wrote {args.timeline}")
    for line in failures:
        print(f"FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0
