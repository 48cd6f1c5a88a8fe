"""`expertrail serve-sim`: the serving loop of `serving.py` on local ranks, with and without
rebalancing, as a table over time, JSON and a plot. No torch import at module level, so the
command line is built without it."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError


@dataclass
class ServeConfig:
    """Settings of a serving simulation (`expertrail serve-sim`)."""

    world: int = 4
    steps: int = 300
    tokens: int = 64               # tokens per rank per decode step
    hidden: int = 256
    ffn: int = 256
    experts: int = 32
    topk: int = 8
    redundant: int = 8             # extra physical slots for replicas (split evenly over ranks)
    zipf: float = 1.2
    drift_every: int = 100
    rebalance_every: int = 10
    window: int = 10               # steps in the load window
    window_seconds: float | None = None   # a window in seconds instead
    min_gain: float = 0.02         # least relief of the busiest rank worth moving weights for
    backend: str = "alltoall"
    seed: int = 0

    def check(self) -> None:
        for name in ("world", "steps", "tokens", "hidden", "ffn", "experts", "topk", "drift_every",
                     "rebalance_every", "window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")
        if self.topk > self.experts:
            raise ConfigError(f"--topk {self.topk} exceeds --experts {self.experts}")
        if self.experts % self.world:
            raise ConfigError(f"--experts {self.experts} must be a multiple of --world {self.world}")
        if self.redundant < 0 or (self.experts + self.redundant) % self.world:
            raise ConfigError(f"--redundant {self.redundant}: experts + redundant slots must split evenly over "
                              f"--world {self.world} ranks (e.g. --redundant {self.world})")
        if self.experts + self.redundant > self.experts * self.world:
            raise ConfigError(f"--redundant {self.redundant}: at most {self.experts * (self.world - 1)} "
                              "(one replica of an expert per rank)")
        if not 0 <= self.min_gain < 1:
            raise ConfigError(f"--min-gain {self.min_gain}: give a fraction in [0, 1)")
        if self.window_seconds is not None and self.window_seconds <= 0:
            raise ConfigError(f"--window-seconds {self.window_seconds}: must be positive")


def add_parser(sub) -> None:
    """Add `expertrail serve-sim` to the command's subparsers."""
    from ...names import BACKEND_NAMES
    d = ServeConfig()
    p = sub.add_parser("serve-sim", help="a decode loop that rebalances hot experts live, against the unreplicated one",
                       description="Serves decode steps of one expert-parallel MoE layer on --world local gloo ranks "
                                   "under drifting Zipf traffic (the hot experts reshuffled every --drift-every "
                                   "steps), twice side by side on the same tokens: unreplicated (contiguous "
                                   "experts), and on experts + --redundant slots re-planned from a rolling load "
                                   "window every --rebalance-every steps, weights migrated in the background. "
                                   "Prints balancedness (mean / max rows per rank) and step latency over time; "
                                   "exits 1 if the two layers' outputs differ beyond fp32 rounding.")
    p.add_argument("--world", type=int, default=d.world, help="local gloo ranks (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="decode steps (default %(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank per step (default %(default)s)")
    p.add_argument("--rebalance-every", type=int, default=d.rebalance_every,
                   help="steps between rebalances (default %(default)s)")
    p.add_argument("--window", type=int, default=d.window, help="steps in the load window (default %(default)s)")
    p.add_argument("--window-seconds", type=float, default=None,
                   help="a window of this many seconds instead of --window steps")
    p.add_argument("--min-gain", type=float, default=d.min_gain,
                   help="move weights only when the new placement relieves the busiest rank by this fraction of "
                        "its load (else only re-weight the replicas) (default %(default)s)")
    p.add_argument("--zipf", type=float, default=d.zipf, help="Zipf exponent of expert popularity (default %(default)s)")
    p.add_argument("--drift-every", type=int, default=d.drift_every,
                   help="steps between reshuffles of the hot experts (default %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="logical experts E (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size H (default %(default)s)")
    p.add_argument("--ffn", type=int, default=d.ffn, help="expert FFN width (default %(default)s)")
    p.add_argument("--topk", type=int, default=d.topk, help="experts per token K (default %(default)s)")
    p.add_argument("--redundant", type=int, default=d.redundant,
                   help="extra physical slots for replicas, a multiple of --world in total with --experts "
                        "(default %(default)s)")
    p.add_argument("--backend", choices=BACKEND_NAMES, default=d.backend, help="dispatcher (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="write the configuration, per-step figures and summary as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="plot balancedness and step latency over time")


def run(args) -> int:
    from ...emulation.launch import LocalRanks
    from ..serving import serve_rank
    cfg = ServeConfig(**{k: getattr(args, k) for k in ServeConfig.__dataclass_fields__})
    cfg.check()
    with LocalRanks(cfg.world) as ranks:
        result = ranks.run(serve_rank, cfg)[0]
    print_report(result)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0 if result["summary"]["outputs_match"] else 1


def print_report(result: dict) -> None:
    cfg, steps, s = result["config"], result["steps"], result["summary"]
    total, drift = len(steps["event"]), cfg["drift_every"]
    every = cfg["rebalance_every"]
    bucket = every * max(1, -(-total // (24 * every)))          # whole rebalance periods, at most ~24 rows
    window = f"{cfg['window_seconds']} s" if cfg["window_seconds"] else f"{cfg['window']}-step"
    print(f"expertrail serve-sim: world {cfg['world']}, {cfg['tokens']} tokens/rank/step, {cfg['experts']} experts "
          f"+ {cfg['redundant']} redundant slots, top-{cfg['topk']}, hidden {cfg['hidden']}, zipf {cfg['zipf']} "
          f"reshuffled every {drift} steps, rebalance every {cfg['rebalance_every']} steps from a {window} window")
    print(f"{'steps':<11}{'balancedness':>24}{'p50 step ms':>24}  events")
    print(f"{'':<11}{'static':>12}{'rebalanced':>12}{'static':>12}{'rebalanced':>12}")
    for lo in range(0, total, bucket):
        hi = min(lo + bucket, total)
        b = {m: float(np.mean(v[lo:hi])) for m, v in steps["balancedness"].items()}
        t = {m: 1e3 * statistics.median(v[lo:hi]) for m, v in steps["seconds"].items()}
        marks = [f"hot experts reshuffled@{d}" for d in range(-(-lo // drift) * drift, hi, drift) if d]
        marks += [f"{e}@{i}" for i, e in enumerate(steps["event"][lo:hi], lo) if e in ("migrate", "reweight")]
        print(f"{lo:>4}-{hi - 1:<6}{b['static']:>12.3f}{b['rebalanced']:>12.3f}{t['static']:>12.2f}"
              f"{t['rebalanced']:>12.2f}  {', '.join(marks)}")
    p50 = {k: "-" if v is None else f"{1e3 * v:.2f}" for k, v in s["rebalanced_step_p50_s"].items()}
    top = {k: "-" if v is None else f"{1e3 * v:.2f}" for k, v in s["rebalanced_step_max_s"].items()}
    print(f"time-averaged balancedness: static {s['balancedness_mean']['static']:.3f}, "
          f"rebalanced {s['balancedness_mean']['rebalanced']:.3f}")
    print(f"p50 step ms: static {1e3 * s['step_p50_s']['static']:.2f}, rebalanced {1e3 * s['step_p50_s']['rebalanced']:.2f}; "
          f"rebalanced layer, p50 (max): normal {p50['normal']} ({top['normal']}), migrate {p50['migrate']} "
          f"({top['migrate']}), switch {p50['switch']} ({top['switch']}), reweight {p50['reweight']} ({top['reweight']})")
    print(f"{s['migrations']} migrations ({s['slots_moved']} expert slots moved), {s['reweights']} re-weightings; "
          "outputs " + ("match" if s["outputs_match"] else "DIFFER FROM") + " the unreplicated layer's at every step "
          f"(max |diff| {s['max_abs_diff']:.2e}, bitwise on {s['bitwise_equal_steps']} of {total} steps)")


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfg, steps, s = result["config"], result["steps"], result["summary"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    x = np.arange(len(steps["event"]))
    for m in steps["balancedness"]:
        top.plot(x, steps["balancedness"][m], lw=1, label=f"{m} (mean {s['balancedness_mean'][m]:.3f})")
        bottom.plot(x, 1e3 * np.asarray(steps["seconds"][m]), lw=1, label=m)
    for kind, marker in (("migrate", "o"), ("switch", "s"), ("reweight", "x")):
        at = [i for i, e in enumerate(steps["event"]) if e == kind]
        bottom.scatter(at, [1e3 * steps["seconds"]["rebalanced"][i] for i in at], s=14, marker=marker, zorder=3,
                       label=f"{kind} steps")
    for ax in (top, bottom):
        for d in range(cfg["drift_every"], len(x), cfg["drift_every"]):
            ax.axvline(d, color="grey", lw=0.6, ls="--")
    top.set_ylabel("balancedness\n(mean / max rows per rank)")
    top.set_ylim(0, 1.05)
    top.legend(fontsize=8, loc="lower right")
    bottom.set_ylabel("step latency (ms, slowest rank)")
    bottom.set_yscale("log")
    bottom.set_xlabel("decode step (dashed: hot experts reshuffled)")
    bottom.legend(fontsize=8, loc="upper right")
    top.set_title(f"{cfg['world']} ranks, {cfg['experts']} experts + {cfg['redundant']} slots, top-{cfg['topk']}, "
                  f"zipf {cfg['zipf']}, rebalance every {cfg['rebalance_every']} steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
