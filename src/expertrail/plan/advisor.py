"""`expertrail plan`: which dispatcher, EP size, SM counts and settings, each with its reason.

Built on the cost model (`cost.py`) and the field's guidance in the reference documents: the
recommendation is the algorithm the model predicts fastest on this topology; SM counts start
at the libraries' defaults (bring-up) or at the count that saturates the bottleneck link
(tuning); the EP table weighs the predicted dispatch + combine against the expert GEMMs.

One recommendation (`plan`'s ``algorithm``) decides everything printed: the table's mark, the
dispatcher, the SM counts, the environment, the emitted flags and the advice text.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from ..names import both_names, field_name
from .catalog import Hardware, MoEModel
from .cost import SATURATING_SMS, EPLayout, Routing, predict
from .estimate import EP_OVERLAP_HIDES, GROUPED_HALF_ROWS, OVERLAP_COMM_SMS
from .layout import FUSED_BY_RECIPES
from .search import architecture_of, fitting_pp
from .simulate import domain_for

ALGORITHMS = ("alltoall", "dedup", "hierarchical")
GEMM_EFFICIENCY = 0.75          # of dense peak, reached by grouped GEMMs with many rows per expert
COMFORTABLE_PP = 4              # EP sizes that fit only with a deeper pipeline are not chosen
OVERLAP_WORTH = 0.2             # below this share of the expert GEMMs, EP overlap is not worth its constraints
DOMAIN_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"     # read by HybridEP only
FP8_RECIPE = {"hopper": "blockwise", "blackwell": "mxfp8"}  # Megatron's --fp8-recipe values
MEGATRON_FLAG = {"num_moe_experts": "--num-experts", "fp8": "--fp8-format"}   # flags not named as their field


@dataclass
class Advice:
    topic: str
    value: object           # JSON value
    text: str               # the same value as printed
    reason: str


def megatron_dispatcher(algorithm: str, hw: Hardware) -> tuple:
    """(moe_token_dispatcher_type, flex backend or None) that implements ``algorithm``."""
    if algorithm in ("alltoall", "allgather"):
        return algorithm, None
    return "flex", field_name(algorithm, hw.domain_size)     # deepep, or hybridep on NVL36/NVL72 racks


def expert_gemm_seconds(hw: Hardware, model: MoEModel, tokens: int, ep: int, precision: str) -> float:
    """Forward time of this rank's routed-expert GEMMs (gate/up and down: 6 x rows x H x F FLOPs)."""
    rows_per_expert = tokens * model.topk * ep / model.num_experts
    flops = 6.0 * tokens * model.topk * model.hidden * model.moe_ffn
    peak = (hw.fp8_TFLOPS if precision == "fp8" else hw.bf16_TFLOPS) * 1e12
    efficiency = GEMM_EFFICIENCY * rows_per_expert / (rows_per_expert + GROUPED_HALF_ROWS)
    return flops / (peak * efficiency)


def verdict(comm: float, compute: float) -> str:
    ratio = comm / compute
    if ratio < 0.3:
        return "compute-bound"
    return "sweet spot" if ratio <= 1.0 else "communication-bound"


def candidate_eps(model: MoEModel, hw: Hardware) -> list:
    return [ep for ep in (4, 8, 16, 32, 64, 128, 256) if ep <= model.num_experts and model.num_experts % ep == 0]


def valid_eps(model: MoEModel) -> list:
    """Every EP size a model can use: at least 2, dividing the experts."""
    return [ep for ep in range(2, model.num_experts + 1) if model.num_experts % ep == 0]


def best(hw, model, tokens, ep, topk_idx, precision, sms):
    layout = EPLayout(ep, domain_for(hw, ep))
    preds = {a: predict(hw, model, layout, a, topk_idx, sms, precision) for a in ALGORITHMS}
    name = min(preds, key=lambda a: preds[a].dispatch_s + preds[a].combine_s)
    return name, preds


def _check_ep(model: MoEModel, ep: int) -> None:
    if ep in valid_eps(model):
        return
    sizes = valid_eps(model)
    shown = ", ".join(map(str, sizes if len(sizes) <= 12 else sizes[:6] + ["..."] + sizes[-2:]))
    why = ("expert parallelism needs at least 2 ranks" if ep < 2
           else f"does not divide the {model.num_experts} experts of {model.name}")
    raise ConfigError(f"--ep {ep}: {why}; give one of {shown}, or leave --ep out to let the plan choose")


def overlap_advice(stage: str, comm: float, compute: float) -> tuple:
    """(turn EP overlap on?, reason): consistent with the predicted comm / compute ratio.

    Overlap hides communication only behind compute that runs beside it (Megatron's combined
    1F1B schedule runs one micro-batch's dispatch / combine beside another's compute), so the
    claim follows the ratio: all of it below 100% of the expert GEMMs, only part above. The
    predicted gain per layer is (comm + compute) / max(comm, compute) at best, when neither side
    waits for the other, and what `expertrail.comm.schedule` measurably reaches: it hides
    `EP_OVERLAP_HIDES` of the hideable time (docs/overlap.md)."""
    ratio = comm / compute
    gain = (comm + compute) / max(comm, compute)     # a layer's time, one micro-batch alone vs two in flight
    measured = (comm + compute) / (comm + compute - EP_OVERLAP_HIDES * min(comm, compute))
    share = (f"dispatch + combine ({comm * 1e6:.0f} us) is {ratio:.0%} of the expert GEMMs "
             f"({compute * 1e6:.0f} us); with two micro-batches in flight a layer takes the larger of the two "
             f"instead of their sum, {gain:.2f}x faster at best, about {measured:.2f}x as expertrail's own "
             f"schedule measures (it hid {EP_OVERLAP_HIDES:.0%} of what it could)")
    if ratio < OVERLAP_WORTH:
        on, claim = False, f"{share}: too little to be worth the constraints overlap brings"
    elif ratio <= 1.0:
        on, claim = True, f"{share}: overlap_moe_expert_parallel_comm can hide it behind another micro-batch's compute"
    else:
        on, claim = True, (f"{share}: more than the expert GEMMs can cover, so overlap hides at most {1 / ratio:.0%} "
                           f"of it and about {(comm - compute) * 1e6:.0f} us per layer stay exposed unless the "
                           "attention compute (not modelled) covers them; overlap still helps, but a smaller EP or "
                           "faster links help more")
    if stage == "bringup":
        return False, f"bring-up: leave it off until the run is correct (it constrains the schedule); for tuning: {claim}"
    needs = ("needs alltoall or flex, BF16/FP16, VPP when PP > 1, no full recompute, shared-expert overlap off; "
             "with delay_wgrad_compute")
    return on, f"{claim} ({needs})" if on else claim


def plan(hw: Hardware, model: MoEModel, tokens: int = 4096, ep: int | None = None, stage: str = "bringup",
         precision: str = "bf16", routing: str = "uniform", gpus: int = 256, arch=None) -> dict:
    """Everything `expertrail plan` prints, as data. EP sizes are checked for memory with the
    estimator (`search.fitting_pp`: the fewest pipeline stages with which a reference run on
    ``gpus`` GPUs fits) when the catalog knows the whole model."""
    if stage not in ("bringup", "tune"):
        raise ConfigError(f"--stage {stage!r}; choose bringup or tune")
    if precision not in ("bf16", "fp8"):
        raise ConfigError(f"--precision {precision!r}; choose bf16 or fp8")
    if precision == "fp8" and not hw.fp8_TFLOPS:
        raise ConfigError(f"--precision fp8: {hw.name} has no FP8 (fp8_TFLOPS 0); use --precision bf16")
    if ep is not None:
        _check_ep(model, ep)
    topk_idx = Routing(routing).sample(model, tokens)
    sms_start = {"blackwell": 16}.get(hw.arch, 20)
    table = []
    for e in candidate_eps(model, hw):
        name, preds = best(hw, model, tokens, e, topk_idx, precision, sms_start)
        comm = preds[name].dispatch_s + preds[name].combine_s
        compute = expert_gemm_seconds(hw, model, tokens, e, precision)
        table.append({"ep": e, "tokens_per_expert": tokens * model.topk * e / model.num_experts,
                      "best_algorithm": name, "field_name": field_name(name, hw.domain_size, e),
                      "dispatch_us": preds[name].dispatch_s * 1e6, "dispatch_combine_us": comm * 1e6,
                      "expert_gemm_us": compute * 1e6, "verdict": verdict(comm, compute)})
    arch = arch or architecture_of(model)          # a catalog model's, or the one given (a config.json's)
    for row in table:
        row["fits_at_pp"], row["memory_GB"], row["largest_pp"] = None, None, None
        if arch is not None and gpus % row["ep"] == 0:
            pp, est = fitting_pp(arch, hw, row["ep"], precision, gpus)
            row["fits_at_pp"], row["memory_GB"] = pp, est["peak_memory_GB"] if est else None
            row["largest_pp"] = est["layout"]["pp"] if est else None
    memory_known = arch is not None and any(r["memory_GB"] is not None for r in table)
    if not table and ep is None:
        raise ConfigError(f"{model.name} has {model.num_experts} experts: no EP size of 4..256 divides them; "
                          "give --ep")
    advice = []
    if ep is None:
        fits = [r for r in table if r["fits_at_pp"] is not None] if memory_known else table
        if fits and memory_known:       # a deep pipeline only to hold the experts costs bubbles: prefer shallow
            least = min(r["fits_at_pp"] for r in fits)
            fits = [r for r in fits if r["fits_at_pp"] <= max(least, COMFORTABLE_PP)]
        if not fits:
            advice.append(Advice("memory", None, "no EP size fits",
                                 f"{model.name} fits on {gpus} x {hw.name} at none of the EP sizes "
                                 f"{', '.join(str(r['ep']) for r in table)} (the estimator's reference run, PP up to 16, "
                                 "full recompute included): more GPUs (--gpus), GPUs with more memory, or "
                                 "`expertrail plan --fit` to search the whole layout; the EP below is chosen on "
                                 "communication alone"))
            fits = table
        fitting = [r for r in fits if r["verdict"] != "communication-bound"]
        row = fitting[-1] if fitting else fits[0]
        ep = row["ep"]
        if memory_known and fits[0] is not table[0]:
            smaller = ", ".join(f"EP {r['ep']} " + (f"needs PP {r['fits_at_pp']}" if r["fits_at_pp"] else "does not fit")
                                for r in table if r["ep"] < fits[0]["ep"])
            advice.append(Advice("memory", fits[0]["ep"], f"EP >= {fits[0]['ep']}",
                                 f"smaller EP leaves too many experts per GPU on {gpus} x {hw.name}: {smaller} "
                                 f"(the estimator's reference run; more than PP {COMFORTABLE_PP} only to hold the "
                                 "experts costs pipeline bubbles)"))
        if fitting:
            why = (f"the largest EP whose predicted dispatch + combine ({row['dispatch_combine_us']:.0f} us) does not "
                   f"exceed the expert GEMMs ({row['expert_gemm_us']:.0f} us): {row['verdict']}; more EP means fewer "
                   "experts per GPU (memory) and more rows per expert (GEMM efficiency)")
        else:
            why = (f"every EP size {'that fits ' if memory_known else 'of the table '}is communication-bound; the "
                   f"smallest, EP {ep}, exposes the least "
                   f"(dispatch + combine {row['dispatch_combine_us']:.0f} us vs expert GEMMs "
                   f"{row['expert_gemm_us']:.0f} us)")
        advice.append(Advice("EP size", ep, f"--expert-model-parallel-size {ep}", why))
    chosen_row = next((r for r in table if r["ep"] == ep), None)
    if memory_known and chosen_row is not None and chosen_row["memory_GB"] is not None:
        if chosen_row["fits_at_pp"] is None:
            advice.insert(0, Advice("memory", False, f"EP {ep} does not fit",
                                    f"at EP {ep} each GPU holds {model.num_experts // ep} experts of each of the "
                                    f"{model.layers} MoE layers; on {gpus} x {hw.name} no pipeline split up to PP "
                                    f"{chosen_row['largest_pp']} fits ({chosen_row['memory_GB']:.0f} GB at PP "
                                    f"{chosen_row['largest_pp']} against {hw.hbm_GB:.0f} GB): "
                                    "raise EP, or run `expertrail plan --fit` for a whole layout"))
        else:
            advice.insert(0, Advice("memory", True, f"fits from PP {chosen_row['fits_at_pp']}",
                                    f"with EP {ep} a reference run on {gpus} x {hw.name} (micro-batch 1, light "
                                    f"selective recompute) fits from PP {chosen_row['fits_at_pp']} "
                                    f"({chosen_row['memory_GB']:.0f} GB on the busiest rank); `expertrail estimate` "
                                    "checks your own configuration"))
    domain = domain_for(hw, ep)
    fastest, preds = best(hw, model, tokens, ep, topk_idx, precision, sms_start)
    total = {a: (p.dispatch_s + p.combine_s) for a, p in preds.items()}
    ranked = sorted(preds, key=total.get)

    # The one recommendation: everything below is derived from `algorithm`.
    bringup_single_domain = stage == "bringup" and ep <= 8 and hw.domain_size >= ep
    algorithm = "alltoall" if bringup_single_domain else fastest
    dispatcher, backend = megatron_dispatcher(algorithm, hw)
    chosen = both_names(algorithm, hw.domain_size, ep)
    if bringup_single_domain:
        why = ("bring-up inside one NVLink domain: the dispatcher choice is second-order at small EP and alltoall "
               "is the easiest path to correctness")
        if fastest != algorithm:
            fast_disp, fast_backend = megatron_dispatcher(fastest, hw)
            why += (f"; {both_names(fastest, hw.domain_size, ep)} is predicted fastest ({total[fastest] * 1e6:.0f} us vs "
                    f"{total[algorithm] * 1e6:.0f} us): switch to {fast_disp}"
                    + (f" + {fast_backend}" if fast_backend else "") + " with --stage tune")
    else:
        others = ", ".join(f"{both_names(a, hw.domain_size, ep)} {total[a] * 1e6:.0f} us" for a in ranked
                           if a != algorithm)
        why = (f"{chosen} is predicted fastest: dispatch + combine {total[algorithm] * 1e6:.0f} us "
               f"(vs {others}); bottleneck: {preds[algorithm].bottleneck}")
    shown = dispatcher + (f" + {backend}" if backend else "")
    advice.append(Advice("dispatcher", shown, f"{shown} ({algorithm})" if shown != algorithm else shown, why))

    sms = None
    if backend:
        # The kernels drive every link the route uses: NVLink always, the NIC once EP spans domains.
        links = SATURATING_SMS.get(hw.arch, SATURATING_SMS["hopper"])
        saturating = max(links["nvlink"], links["nic"] if domain < ep else 0)
        start = OVERLAP_COMM_SMS[backend] if stage == "bringup" else max(saturating, 4)
        sweep = ([16, 32] if backend == "hybridep"
                 else [max(4, saturating // 2), 2 * max(OVERLAP_COMM_SMS[backend], saturating)])
        sms = {"start": start, "sweep": sweep}
        advice.append(Advice("SM count", sms, f"start {start}, sweep {sweep[0]}..{sweep[1]} (moe_{backend}_num_sms)",
                             f"{backend} default {OVERLAP_COMM_SMS[backend]} is a sane start but rarely optimal; the "
                             f"links this route drives saturate near {saturating} SMs on {hw.arch}, so sweep "
                             f"{sweep[0]}..{sweep[1]} (fewer SMs leave more for the GEMMs)"))
    env = {}
    if backend == "hybridep":
        env[DOMAIN_ENV] = domain
        advice.append(Advice("NVLink domain", domain, f"{DOMAIN_ENV}={domain}",
                             f"HybridEP reads the domain size from this variable; {hw.name} joins {hw.domain_size} "
                             f"GPUs per NVLink domain and {domain} is the largest divisor of EP {ep} that fits one; "
                             "a mismatch costs performance and sometimes correctness"))
    elif backend == "deepep" and ep > domain:
        advice.append(Advice("NVLink domain", domain, f"{domain} (nothing to set)",
                             f"DeepEP's internode kernels take each {hw.domain_size}-GPU node as the NVLink domain "
                             f"and read no domain setting ({DOMAIN_ENV} is HybridEP's)"))
    row = next((r for r in table if r["ep"] == ep), None)
    comm = total[algorithm]
    compute = expert_gemm_seconds(hw, model, tokens, ep, precision)
    overlap, reason = overlap_advice(stage, comm, compute)
    advice.append(Advice("EP overlap", overlap, "on" if overlap else "off", reason))
    advice.append(Advice("CUDA graphs", ["attn", "moe_router", "moe_preprocess"],
                         "cuda_graph_modules attn moe_router moe_preprocess",
                         "for dropless MoE, partial TE-scoped graphs keep the dynamic expert work outside the graph "
                         "(cuda_graph_scope before Megatron-LM's May 2026 rename); whole MoE layers in graphs need "
                         "drop-and-pad; budget a few GB of memory"))
    recipe = FP8_RECIPE.get(hw.arch, "tensorwise")
    if precision == "fp8":
        advice.append(Advice("FP8", {"format": "e4m3", "recipe": recipe, "router_dtype": "fp32"},
                             f"--fp8-format e4m3 --fp8-recipe {recipe} --moe-router-dtype fp32",
                             f"{recipe} is the starting recipe on {hw.arch}; keep the router in FP32; FP8 dispatch "
                             "halves the dispatch bytes but raises the share of communication and host overhead"))
    else:
        advice.append(Advice("FP8 recipe", recipe, f"{recipe} (for a later --precision fp8)",
                             f"the starting recipe on {hw.arch}; keep the router in FP32; FP8 raises the share of "
                             "communication and host overhead"))
    pitfalls = [
        "compare dispatchers on one stack: container, routing mode, PP layout and CUDA-graph scope move results "
        "as much as the dispatcher",
        "keep the routing mode fixed when comparing (force-balanced vs dropless are different baselines; "
        "force balance is the safer benchmark default)",
        "tune the SM count: defaults (DeepEP 20, HybridEP 16) are starting points, rarely optimal",
    ]
    if backend == "hybridep" and hw.domain_size <= 8:
        pitfalls.append("HybridEP is topology-sensitive: outside NVL36/NVL72 racks it is not a universal win")
    return {"hardware": hw.name, "model": model.name, "tokens": tokens, "ep": ep, "domain": domain,
            "stage": stage, "precision": precision, "routing": routing, "algorithm": algorithm,
            "field_name": field_name(algorithm, hw.domain_size, ep), "fastest_algorithm": fastest,
            "dispatcher": dispatcher, "flex_backend": backend, "ep_overlap": bool(overlap),
            "comm_compute_ratio": comm / compute, "env": env, "sms": sms,
            "fp8": {"format": "e4m3", "recipe": recipe} if precision == "fp8" else None,
            "predictions": {a: {"dispatch_us": p.dispatch_s * 1e6, "combine_us": p.combine_s * 1e6,
                                "field_name": field_name(a, hw.domain_size, ep), "bottleneck": p.bottleneck,
                                "bytes": p.bytes, "recommended": a == algorithm, "fastest": a == fastest}
                            for a, p in preds.items()},
            "ep_table": table, "advice": [a.__dict__ for a in advice], "pitfalls": pitfalls, "expert_row": row}


def config_fields(result: dict, model: MoEModel) -> tuple:
    """(model fields, overlap fields) of the recommended Megatron-Core configuration."""
    fields = {"expert_model_parallel_size": result["ep"], "num_moe_experts": model.num_experts,
              "moe_router_topk": model.topk, "moe_token_dispatcher_type": result["dispatcher"],
              "moe_grouped_gemm": True, "bf16": True, **dict.fromkeys(FUSED_BY_RECIPES, True)}
    if result["flex_backend"]:
        fields["moe_flex_dispatcher_backend"] = result["flex_backend"]
        fields[f"moe_{result['flex_backend']}_num_sms"] = result["sms"]["start"]
    if result.get("fp8"):
        fields.update(fp8=result["fp8"]["format"], fp8_recipe=result["fp8"]["recipe"], moe_router_dtype="fp32")
    fields.update(model.router_fields())
    if model.num_groups:                        # DeepSeek-V3's router: sigmoid scores, balanced by expert biases
        fields.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    overlap = {}
    if result["ep_overlap"] and result["dispatcher"] in ("alltoall", "flex") and result["ep"] > 1:
        overlap = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
        fields["moe_shared_expert_overlap"] = False
    return fields, overlap


def emit(result: dict, model: MoEModel, style: str) -> str:
    """A ready configuration: Megatron-Core command-line flags or Megatron-Bridge overrides.
    The environment line appears only when the chosen backend reads it (HybridEP)."""
    fields, overlap = config_fields(result, model)
    env = [f"{k}={v}" for k, v in result.get("env", {}).items()]
    if style == "megatron":
        flags = []
        for k, v in {**fields, **overlap}.items():
            flag = MEGATRON_FLAG.get(k, "--" + k.replace("_", "-"))
            if v is not False:                  # false switches are Megatron's defaults
                flags.append(flag if v is True else f"{flag} {v}")
        return " \\\n  ".join(env + flags)
    if style == "bridge":
        lines = [f"# environment: {e}" for e in env]
        lines += [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
        lines += [f"comm_overlap.{k}={str(v).lower()}" for k, v in overlap.items()]
        return "\n".join(lines)
    raise ConfigError(f"--emit {style!r}; choose megatron or bridge")


def format_plan(result: dict) -> str:
    label = {a: (f"{a} ({p['field_name']})" if p["field_name"] != a else a) for a, p in result["predictions"].items()}
    width = max(map(len, label.values()))
    lines = [f"plan: {result['model']} on {result['hardware']}, {result['tokens']} tokens/rank, EP {result['ep']} "
             f"(domain {result['domain']}), {result['precision']}, {result['routing']} routing, stage {result['stage']}",
             "", "predicted per rank:"]
    for a, p in sorted(result["predictions"].items(), key=lambda kv: kv[1]["dispatch_us"] + kv[1]["combine_us"]):
        mark = " <- recommended" if p["recommended"] else ""
        if p["fastest"] and not p["recommended"]:
            mark = " (fastest; for --stage tune)"
        lines.append(f"  {label[a]:<{width}}  dispatch {p['dispatch_us']:8.1f} us  combine {p['combine_us']:8.1f} us  "
                     f"bottleneck {p['bottleneck']}{mark}")
    lines += ["", "recommendations:"]
    for a in result["advice"]:
        lines.append(f"  {a['topic']}: {a['text']}\n      because {a['reason']}")
    algo = [f"{r['best_algorithm']} ({r['field_name']})" if r["field_name"] != r["best_algorithm"]
            else r["best_algorithm"] for r in result["ep_table"]]
    w = max([len("algorithm"), *map(len, algo)])
    lines += ["", "EP choice (fastest algorithm per EP):",
              f"  {'EP':>4} {'tokens/expert':>14} {'algorithm':>{w}} {'dispatch us':>12} {'d+c us':>9} "
              f"{'expert GEMM us':>15}  {'memory':<10}  verdict"]
    for r, name in zip(result["ep_table"], algo):
        fit = ("-" if r.get("memory_GB") is None else
               f"PP >= {r['fits_at_pp']}" if r["fits_at_pp"] is not None else "no fit")
        lines.append(f"  {r['ep']:>4} {r['tokens_per_expert']:>14.0f} {name:>{w}} {r['dispatch_us']:>12.1f} "
                     f"{r['dispatch_combine_us']:>9.1f} {r['expert_gemm_us']:>15.1f}  {fit:<10}  {r['verdict']}")
    lines += ["", "pitfalls:"] + [f"  - {p}" for p in result["pitfalls"]]
    return "\n".join(lines)
