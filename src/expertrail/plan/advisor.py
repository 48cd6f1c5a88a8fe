"""`expertrail plan`: which dispatcher, EP size, SM counts and settings, each with its reason.

Built on the cost model (`cost.py`) and the field's guidance in the reference documents: the
recommendation is the algorithm the model predicts fastest on this topology; SM counts start
at the libraries' defaults (bring-up) or at the count that saturates the bottleneck link
(tuning); the EP table weighs the predicted dispatch + combine against the expert GEMMs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .catalog import Hardware, MoEModel
from .cost import SATURATING_SMS, Layout, Routing, predict
from .simulate import domain_for

ALGORITHMS = ("alltoall", "dedup", "hierarchical")
DEFAULT_SMS = {"deepep": 20, "hybridep": 16}
GEMM_EFFICIENCY = 0.75          # of dense peak, reached by grouped GEMMs with many rows per expert
GEMM_HALF_ROWS = 256            # rows per expert at which grouped GEMMs reach half of that


@dataclass
class Advice:
    topic: str
    value: object
    reason: str


def megatron_dispatcher(algorithm: str, hw: Hardware) -> tuple:
    """(moe_token_dispatcher_type, flex backend or None) that implements ``algorithm``."""
    if algorithm == "alltoall":
        return "alltoall", None
    if algorithm == "hierarchical" and hw.domain_size > 8:
        return "flex", "hybridep"              # NVLink-domain-aware two-level path (NVL36/NVL72)
    return "flex", "deepep"                    # DeepEP: intranode dedup, internode two-level


def expert_gemm_seconds(hw: Hardware, model: MoEModel, tokens: int, ep: int, precision: str) -> float:
    """Forward time of this rank's routed-expert GEMMs (gate/up and down: 6 x rows x H x F FLOPs)."""
    rows_per_expert = tokens * model.topk * ep / model.num_experts
    flops = 6.0 * tokens * model.topk * model.hidden * model.moe_ffn
    peak = (hw.fp8_TFLOPS if precision == "fp8" else hw.bf16_TFLOPS) * 1e12
    efficiency = GEMM_EFFICIENCY * rows_per_expert / (rows_per_expert + GEMM_HALF_ROWS)
    return flops / (peak * efficiency)


def verdict(comm: float, compute: float) -> str:
    ratio = comm / compute
    if ratio < 0.3:
        return "compute-bound"
    return "sweet spot" if ratio <= 1.0 else "communication-bound"


def candidate_eps(model: MoEModel, hw: Hardware) -> list:
    return [ep for ep in (4, 8, 16, 32, 64, 128, 256) if ep <= model.num_experts and model.num_experts % ep == 0]


def best(hw, model, tokens, ep, topk_idx, precision, sms):
    layout = Layout(ep, domain_for(hw, ep))
    preds = {a: predict(hw, model, layout, a, topk_idx, sms, precision) for a in ALGORITHMS}
    name = min(preds, key=lambda a: preds[a].dispatch_s + preds[a].combine_s)
    return name, preds


def plan(hw: Hardware, model: MoEModel, tokens: int = 4096, ep: int | None = None, stage: str = "bringup",
         precision: str = "bf16", routing: str = "uniform") -> dict:
    """Everything `expertrail plan` prints, as data."""
    if stage not in ("bringup", "tune"):
        raise ConfigError(f"stage={stage!r}; choose bringup or tune")
    if precision not in ("bf16", "fp8"):
        raise ConfigError(f"precision={precision!r}; choose bf16 or fp8")
    topk_idx = Routing(routing).sample(model, tokens)
    sms_start = {"blackwell": 16}.get(hw.arch, 20)
    table = []
    for e in candidate_eps(model, hw):
        name, preds = best(hw, model, tokens, e, topk_idx, precision, sms_start)
        comm = preds[name].dispatch_s + preds[name].combine_s
        compute = expert_gemm_seconds(hw, model, tokens, e, precision)
        table.append({"ep": e, "tokens_per_expert": tokens * model.topk * e / model.num_experts,
                      "best_algorithm": name, "dispatch_us": preds[name].dispatch_s * 1e6,
                      "dispatch_combine_us": comm * 1e6, "expert_gemm_us": compute * 1e6,
                      "verdict": verdict(comm, compute)})
    if not table:
        raise ConfigError(f"{model.name} has {model.num_experts} experts: no EP size of 4..256 divides them")
    advice = []
    if ep is None:
        fitting = [r for r in table if r["verdict"] != "communication-bound"]
        row = fitting[-1] if fitting else table[0]
        ep = row["ep"]
        advice.append(Advice("EP size", ep, f"the largest EP whose predicted dispatch + combine "
                             f"({row['dispatch_combine_us']:.0f} us) does not exceed the expert GEMMs "
                             f"({row['expert_gemm_us']:.0f} us): {row['verdict']}; more EP means fewer experts per "
                             "GPU (memory) and more rows per expert (GEMM efficiency)"))
    elif model.num_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide the {model.num_experts} experts of {model.name}")
    domain = domain_for(hw, ep)
    name, preds = best(hw, model, tokens, ep, topk_idx, precision, sms_start)
    dispatcher, backend = megatron_dispatcher(name, hw)
    ranked = sorted(preds, key=lambda a: preds[a].dispatch_s + preds[a].combine_s)
    bottleneck = preds[name].bottleneck
    if stage == "bringup" and ep <= 8 and hw.domain_size >= ep:
        advice.append(Advice("dispatcher", "alltoall", "bring-up inside one NVLink domain: the dispatcher choice is "
                             "second-order at small EP and alltoall is the easiest path to correctness; "
                             f"switch to {name} ({backend or dispatcher}) when tuning"))
        dispatcher, backend = "alltoall", None
    else:
        others = ", ".join(f"{a} {(preds[a].dispatch_s + preds[a].combine_s) * 1e6:.0f} us" for a in ranked[1:])
        advice.append(Advice("dispatcher", f"{dispatcher}" + (f" + {backend}" if backend else ""),
                             f"{name} is predicted fastest: dispatch + combine "
                             f"{(preds[name].dispatch_s + preds[name].combine_s) * 1e6:.0f} us (vs {others}); "
                             f"bottleneck: {bottleneck}"))
    if backend:
        # The kernels drive every link the route uses: NVLink always, the NIC once EP spans domains.
        links = SATURATING_SMS.get(hw.arch, SATURATING_SMS["hopper"])
        saturating = max(links["nvlink"], links["nic"] if domain < ep else 0)
        start = DEFAULT_SMS[backend] if stage == "bringup" else max(saturating, 4)
        sweep = (16, 32) if backend == "hybridep" else (max(4, saturating // 2), 2 * max(DEFAULT_SMS[backend], saturating))
        advice.append(Advice("SM count", {"start": start, "sweep": sweep},
                             f"{backend} default {DEFAULT_SMS[backend]} is a sane start but rarely optimal; the "
                             f"links this route drives saturate near {saturating} SMs on {hw.arch}, so sweep "
                             f"{sweep[0]}..{sweep[1]} (fewer SMs leave more for the GEMMs)"))
    advice.append(Advice("domain size", {"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": domain},
                         f"{hw.name} joins {hw.domain_size} GPUs per NVLink domain; the largest divisor of EP {ep} "
                         "that fits one domain; a mismatch costs performance and sometimes correctness"))
    row = next((r for r in table if r["ep"] == ep), None)
    comm = preds[name].dispatch_s + preds[name].combine_s
    compute = expert_gemm_seconds(hw, model, tokens, ep, precision)
    overlap = comm > 0.2 * compute
    advice.append(Advice("EP overlap", overlap,
                         (f"dispatch + combine ({comm * 1e6:.0f} us) is {comm / compute:.0%} of the expert GEMMs; "
                          "overlap_moe_expert_parallel_comm with delay_wgrad_compute can hide it (needs alltoall or "
                          "flex, BF16/FP16, VPP when PP > 1, no full recompute, shared-expert overlap off)")
                         if overlap else f"communication is only {comm / compute:.0%} of the expert GEMMs: "
                                         "not worth the constraints overlap brings"))
    advice.append(Advice("CUDA graphs", "attn moe_router moe_preprocess",
                         "for dropless MoE, partial TE-scoped graphs keep the dynamic expert work outside the graph; "
                         "full-iteration graphs only for drop-and-pad / static shapes; budget a few GB of memory"))
    recipe = "MXFP8" if hw.arch == "blackwell" else "FP8 blockwise"
    advice.append(Advice("FP8 recipe", recipe, f"the starting recipe for {hw.arch}; keep the router in FP32; "
                         "FP8 raises the share of communication and host overhead"))
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
            "stage": stage, "precision": precision, "routing": routing, "algorithm": name,
            "dispatcher": dispatcher, "flex_backend": backend, "ep_overlap": overlap,
            "predictions": {a: {"dispatch_us": p.dispatch_s * 1e6, "combine_us": p.combine_s * 1e6,
                                "bottleneck": p.bottleneck, "bytes": p.bytes} for a, p in preds.items()},
            "ep_table": table, "advice": [a.__dict__ for a in advice], "pitfalls": pitfalls,
            "sms": next((a.value for a in advice if a.topic == "SM count"), None), "expert_row": row}


def emit(result: dict, model: MoEModel, style: str) -> str:
    """A ready configuration: Megatron-Core command-line flags or Megatron-Bridge overrides."""
    fields = {"expert_model_parallel_size": result["ep"], "num_moe_experts": model.num_experts,
              "moe_router_topk": model.topk, "moe_token_dispatcher_type": result["dispatcher"],
              "moe_grouped_gemm": True, "bf16": True}
    if result["flex_backend"]:
        fields["moe_flex_dispatcher_backend"] = result["flex_backend"]
        fields[f"moe_{result['flex_backend']}_num_sms"] = result["sms"]["start"]
    if model.num_groups:
        fields.update(moe_router_num_groups=model.num_groups, moe_router_group_topk=model.group_topk,
                      moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    overlap = {}
    if result["ep_overlap"] and result["dispatcher"] in ("alltoall", "flex") and result["ep"] > 1:
        overlap = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True}
        fields["moe_shared_expert_overlap"] = False
    env = f"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN={result['domain']}"
    if style == "megatron":
        flags = []
        for k, v in {**fields, **overlap}.items():
            flag = "--" + k.replace("_", "-").replace("num-moe-experts", "num-experts")
            if v is not False:                  # false switches are Megatron's defaults
                flags.append(flag if v is True else f"{flag} {v}")
        return f"{env} \\\n  " + " \\\n  ".join(flags)
    if style == "bridge":
        lines = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in fields.items()]
        lines += [f"comm_overlap.{k}={str(v).lower()}" for k, v in overlap.items()]
        return f"# environment: {env}\n" + "\n".join(lines)
    raise ConfigError(f"--emit {style!r}; choose megatron or bridge")


def format_plan(result: dict) -> str:
    lines = [f"plan: {result['model']} on {result['hardware']}, {result['tokens']} tokens/rank, EP {result['ep']} "
             f"(domain {result['domain']}), {result['precision']}, {result['routing']} routing, stage {result['stage']}",
             "", "predicted per rank:"]
    for a, p in sorted(result["predictions"].items(), key=lambda kv: kv[1]["dispatch_us"] + kv[1]["combine_us"]):
        mark = " <- recommended" if a == result["algorithm"] else ""
        lines.append(f"  {a:<13} dispatch {p['dispatch_us']:8.1f} us  combine {p['combine_us']:8.1f} us  "
                     f"bottleneck {p['bottleneck']}{mark}")
    lines += ["", "recommendations:"]
    for a in result["advice"]:
        lines.append(f"  {a['topic']}: {a['value']}\n      because {a['reason']}")
    lines += ["", "EP choice (best algorithm per EP):",
              f"  {'EP':>4} {'tokens/expert':>14} {'algorithm':>13} {'dispatch us':>12} {'d+c us':>9} "
              f"{'expert GEMM us':>15}  verdict"]
    for r in result["ep_table"]:
        lines.append(f"  {r['ep']:>4} {r['tokens_per_expert']:>14.0f} {r['best_algorithm']:>13} {r['dispatch_us']:>12.1f} "
                     f"{r['dispatch_combine_us']:>9.1f} {r['expert_gemm_us']:>15.1f}  {r['verdict']}")
    lines += ["", "pitfalls:"] + [f"  - {p}" for p in result["pitfalls"]]
    return "\n".join(lines)
