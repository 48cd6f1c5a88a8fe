"""`expertrail simulate`: predicted dispatch / combine of every algorithm at cluster scale."""
from __future__ import annotations

from ..errors import ConfigError
from ..names import field_name
from .catalog import Hardware, MoEModel
from .cost import ALGORITHMS, EPLayout, Routing, predict

NCCL_ALGORITHMS = ("allgather", "alltoall")      # NCCL collectives: the SM count is not theirs to set


def parse_ints(text: str, name: str = "value") -> list:
    """``8,16,32`` or a range ``8..32`` (step 8, or ``8..32:4``); ``name`` is the option, for errors."""
    out = []
    try:
        for part in str(text).split(","):
            part = part.strip()
            if ".." in part:
                span, _, step = part.partition(":")
                lo, hi = (int(v) for v in span.split(".."))
                step = int(step) if step else 8
                if step < 1 or hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1, step))
            elif part:
                out.append(int(part))
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ConfigError(f"{name} {text!r}: give positive integers, e.g. 8,16,32 or a range 8..64:8 (lo..hi:step)")
    return list(dict.fromkeys(out))


def domain_for(hw: Hardware, ep: int) -> int:
    """The domain size matching the topology: the largest divisor of EP within one NVLink domain."""
    return max(d for d in range(1, min(ep, hw.domain_size) + 1) if ep % d == 0)


def usable_eps(model: MoEModel, eps: list, domain_size: int | None = None) -> tuple:
    """(EP sizes the model can use, [(EP, why not)] for the others): EP must be at least 2, divide
    the experts, and be a multiple of a given domain size."""
    ok, skipped = [], []
    for ep in eps:
        if ep < 2:
            skipped.append((ep, "expert parallelism needs at least 2 ranks"))
        elif model.num_experts % ep:
            skipped.append((ep, f"not a divisor of the {model.num_experts} experts of {model.name}"))
        elif domain_size and ep % domain_size:
            skipped.append((ep, f"not a multiple of --domain-size {domain_size}"))
        else:
            ok.append(ep)
    return ok, skipped


def simulate(hw: Hardware, model: MoEModel, tokens: int, eps: list, sms_list: list, algorithms=ALGORITHMS,
             routing: str = "uniform", precision: str = "bf16", domain_size: int | None = None, seed: int = 0) -> list:
    """One row per (EP, algorithm, SM count): predicted times, bytes per link class, bottleneck.

    Every EP size must be usable (`usable_eps`); the command line skips the others with a note."""
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise ConfigError(f"--backends {','.join(algorithms)!r}: " + (f"unknown {', '.join(unknown)}; " if unknown else "")
                          + f"give a comma-separated list of {', '.join(ALGORITHMS)}")
    if precision not in ("bf16", "fp8"):
        raise ConfigError(f"--precision {precision!r}; choose bf16 or fp8")
    if domain_size is not None and domain_size < 1:
        raise ConfigError(f"--domain-size {domain_size}: give a positive number of ranks per NVLink domain")
    _, skipped = usable_eps(model, eps, domain_size)
    if skipped:
        ep, why = skipped[0]
        raise ConfigError(f"--ep {ep}: {why}")
    if min(sms_list) < 1:
        raise ConfigError(f"--sms {min(sms_list)}: give SM counts >= 1")
    topk_idx = Routing(routing).sample(model, tokens, seed)
    rows = []
    for ep in eps:
        domain = domain_size or domain_for(hw, ep)
        for algorithm in algorithms:
            for sms in ([None] if algorithm in NCCL_ALGORITHMS else sms_list):
                p = predict(hw, model, EPLayout(ep, domain), algorithm, topk_idx, sms, precision)
                rows.append({"ep": ep, "domain": domain, "algorithm": algorithm,
                             "field_name": field_name(algorithm, hw.domain_size, ep), "sms": sms,
                             "dispatch_us": p.dispatch_s * 1e6, "combine_us": p.combine_s * 1e6,
                             "bytes": p.bytes, "rows": p.rows, "bottleneck": p.bottleneck,
                             "algo_bandwidth_GBps": p.algo_bandwidth_GBps, "slow_link_GBps": p.slow_link_GBps})
    return rows


def format_rows(rows: list, hw: Hardware, model: MoEModel, tokens: int, routing: str, precision: str) -> str:
    head = (f"{model.name} on {hw.name}: {tokens} tokens/rank, hidden {model.hidden}, {model.num_experts} experts, "
            f"top-{model.topk}, {routing} routing, {precision} dispatch; per rank, predicted")
    cols = ["EP", "domain", "algorithm", "SMs", "dispatch us", "combine us", "intra MB", "inter MB", "bottleneck",
            "algo GB/s"]
    table = [[str(r["ep"]), str(r["domain"]),
              r["algorithm"] if r["field_name"] == r["algorithm"] else f"{r['algorithm']} ({r['field_name']})",
              "-" if r["sms"] is None else str(r["sms"]),
              f"{r['dispatch_us']:.1f}", f"{r['combine_us']:.1f}", f"{r['bytes']['intra'] / 1e6:.1f}",
              f"{r['bytes']['inter'] / 1e6:.1f}", r["bottleneck"], f"{r['algo_bandwidth_GBps']:.0f}"] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    return "\n".join([head, line(cols), line(["-" * w for w in widths]), *map(line, table)])


def plot_rows(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for algorithm in dict.fromkeys(r["algorithm"] for r in rows):
        mine = [r for r in rows if r["algorithm"] == algorithm]
        best = {}
        for r in mine:                       # the best SM count per EP
            if r["ep"] not in best or r["dispatch_us"] < best[r["ep"]]["dispatch_us"]:
                best[r["ep"]] = r
        eps = sorted(best)
        other = mine[0].get("field_name", algorithm)
        label = algorithm if other == algorithm else f"{algorithm} ({other})"
        ax_t.plot(eps, [best[e]["dispatch_us"] + best[e]["combine_us"] for e in eps], marker="o", label=label)
        ax_b.plot(eps, [best[e]["bytes"]["inter"] / 1e6 for e in eps], marker="o", label=label)
    for ax, label in ((ax_t, "dispatch + combine, us"), (ax_b, "inter-domain MB per rank")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("EP size")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
