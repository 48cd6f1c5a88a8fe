"""`expertrail balance`: balancedness before and after each rebalancing policy."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ConfigError, ExpertrailError
from .planner import balancedness, check_load, contiguous_balancedness, plan_placement, rank_loads, zipf_load


def load_loads(path: str, option: str = "--load") -> np.ndarray:
    """Expert loads [layers, experts] (or [experts]) from a .npy, .csv or .json file, checked:
    token counts, finite and >= 0, and every layer with at least one token (a layer of zeros
    has no balancedness: nothing was recorded for it). Raises ConfigError naming ``option``."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{option} {path!r}: file not found")
    if p.suffix not in (".npy", ".csv", ".json"):
        raise ConfigError(f"{option} {path!r}: use .npy, .csv or .json holding [layers, experts] token counts")
    try:
        if p.suffix == ".npy":
            data = np.load(p)
        elif p.suffix == ".csv":
            data = np.loadtxt(p, delimiter=",", ndmin=2)
        else:
            import json
            data = json.loads(p.read_text())
    except (OSError, ValueError) as err:         # json.JSONDecodeError is a ValueError
        raise ConfigError(f"{option} {path!r}: cannot read token counts from it: {err}") from None
    return check_loads(data, f"{option} {path!r}")


def check_loads(load, name: str) -> np.ndarray:
    """``load`` as float64 [layers, experts] for the report: `check_load`'s checks, then no
    layer all zero. Raises ConfigError starting with ``name`` (the option and its value)."""
    try:
        load = check_load(load, name)
    except ExpertrailError as err:
        raise ConfigError(str(err)) from None
    empty = np.nonzero(~load.any(1))[0]
    if len(empty) == len(load):
        raise ConfigError(f"{name}: every count is 0, so there is no load to balance; record the loads over at "
                          "least one step (LoadRecorder: call step() at the end of each step before load())")
    if len(empty):
        raise ConfigError(f"{name}: layer(s) {', '.join(map(str, empty[:8]))}{' ...' if len(empty) > 8 else ''} of "
                          f"{len(load)} have no tokens (every count 0), so their balancedness means nothing; "
                          "drop those rows or record more steps")
    return load


def recorded_loads(spec: str, experts: int, model: str) -> tuple | None:
    """Token counts [layers][experts] when a ``--routing`` spec (estimate's, plan --fit's
    --router) is a file of them (LoadRecorder's, as `load_loads` reads), not a topk_idx
    recording or a Routing name; else None. ``experts`` and ``model`` are the model's, whose
    expert count the file must have."""
    path = Path(spec)
    if path.suffix not in (".npy", ".csv", ".json"):
        return None
    if path.suffix == ".npy":                          # read once: counts, or a topk_idx recording
        try:
            data = np.load(path)
        except (OSError, ValueError) as err:           # missing, unreadable, or pickled objects
            raise ExpertrailError(f"--routing {spec!r}: cannot read it as .npy ({err})") from None
        if data.ndim == 3 or data.shape[-1] != experts:
            return None                                # topk_idx: its last axis is top-k, not the experts
        loads = check_loads(data, f"--routing {spec!r}")
    else:
        loads = load_loads(spec, "--routing")
    if loads.shape[-1] != experts:
        raise ExpertrailError(f"--routing {spec!r}: {loads.shape[-1]} experts' counts, but {model} has {experts}")
    return tuple(map(tuple, loads.tolist()))


def compare(load: np.ndarray, num_ranks: int, redundant: int, num_domains: int = 1,
            num_groups: int | None = None) -> dict:
    """Per policy: balancedness per layer (and mean, min), next to contiguous placement."""
    experts = load.shape[1]
    slots = experts + redundant
    out = {"contiguous": contiguous_balancedness(load, num_ranks)}
    out["global"] = balancedness(rank_loads(load, plan_placement(load, slots, num_ranks)))
    if num_domains > 1 or num_groups:
        placement = plan_placement(load, slots, num_ranks, "hierarchical", num_domains, num_groups)
        out["hierarchical"] = balancedness(rank_loads(load, placement))
    return {k: {"mean": float(v.mean()), "min": float(v.min()), "per_layer": v.tolist()} for k, v in out.items()}


def run(args) -> int:
    if args.load:
        load = load_loads(args.load)
    elif args.zipf is not None:
        if not args.experts:
            raise ConfigError("--zipf needs --experts")
        if not np.isfinite(args.zipf) or args.zipf < 0:
            raise ConfigError(f"--zipf {args.zipf}: give a finite exponent >= 0, e.g. --zipf 1.0")
        load = zipf_load(args.layers, args.experts, args.zipf, seed=args.seed)
    else:
        raise ConfigError("give --load FILE or --zipf ALPHA --experts E")
    if args.redundant < 0:
        raise ConfigError(f"--redundant {args.redundant}: give the number of extra slots, 0 or more")
    if load.shape[1] % args.ranks:
        raise ConfigError(f"{load.shape[1]} experts do not split over --ranks {args.ranks}")
    result = compare(load, args.ranks, args.redundant, args.domains, args.groups)
    if args.json:
        import json
        print(json.dumps(result, indent=2))
    else:
        print(f"{load.shape[0]} layer(s) x {load.shape[1]} experts on {args.ranks} ranks, {args.redundant} redundant "
              f"slots, {args.domains} domain(s); balancedness = mean / max tokens per rank")
        print(f"{'placement':<14}{'mean':>8}{'min':>8}")
        for name, r in result.items():
            print(f"{name:<14}{r['mean']:>8.3f}{r['min']:>8.3f}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name, r in result.items():
        ax.plot(range(len(r["per_layer"])), r["per_layer"], marker=".", label=f"{name} (mean {r['mean']:.2f})")
    ax.set_xlabel("layer")
    ax.set_ylabel("balancedness (mean / max per rank)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
