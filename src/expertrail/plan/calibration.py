"""The published figures the planner's constants come from, in one place.

`TRAINING_RUNS` (published_runs.json beside this file): Megatron-Core MoE training runs, each
with its layout, the published TFLOPS per GPU and the error `expertrail estimate` is documented
to have on it (docs/cost-model.md shows the table, written from here). `KERNEL_FIGURES`: the
published dispatch / combine kernel figures the cost model is checked against. `FITTED_ON`
names, for every constant of `cost.py` and `estimate.py`, the rows it was fitted on, or says it
is an assumption: a constant fitted to one row shows up as that row's error only, so the rows
a constant was not fitted on are its held-out check.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

_DATA = json.loads(Path(__file__).with_name("published_runs.json").read_text())
TRAINING_RUNS = {run["id"]: run for run in _DATA["runs"]}

# Published kernel figures (GB/s), by row id: what tests/test_cost_model.py checks predict against.
KERNEL_FIGURES = {
    "deepep h800 intranode ep8": {"source": "DeepEP README, normal kernels, H800 EP8, 4096 tokens, hidden 7168, "
                                            "top-4 groups / top-8 experts, FP8 dispatch / BF16 combine, 20 SMs",
                                  "dispatch_GBps": 153, "combine_GBps": 158},
    "hybrid-ep b200 ep8": {"source": "Hybrid-EP (DeepEP hybrid-ep branch README), B200 EP8, 16 SMs, 4096 tokens, "
                                     "hidden 7168, top-8 uniform; algorithm bandwidth",
                           "bf16_dispatch_GBps": 535.94, "fp8_dispatch_GBps": 409.71, "combine_GBps": 530.86},
    "deepep h800 internode": {"source": "DeepEP V1 README, normal kernels, H800 + CX7 400 Gb/s, 4096 tokens, "
                                        "hidden 7168, 256 experts, top-8, grouped by node; RDMA GB/s (dispatch, combine)",
                              "by_ep": {16: (43, 43), 32: (58, 57), 64: (51, 50)}},
    "hybrid-ep h100 internode": {"source": "Hybrid-EP README, DGX H100 + CX7, 4096 tokens, hidden 7168, top-8, "
                                           "8 SMs, kernel time; GB/s (FP8 dispatch, BF16 dispatch, BF16 combine)",
                                 "by_ep": {16: (62.00, 76.80, 68.00), 32: (51.30, 54.50, 56.40),
                                           64: (46.63, 50.55, 51.03)}},
}

_GB_GH = [rid for rid, run in TRAINING_RUNS.items() if run["system"] in ("gb200-nvl72", "gb300-nvl72", "h100")]
FITTED_ON = {
    "cost.NVLINK_EFFICIENCY_DEFAULT": ["hybrid-ep b200 ep8"],
    "cost.NVLINK_EFFICIENCY['h800']": ["deepep h800 intranode ep8"],
    "cost.NIC_EFFICIENCY": ["deepep h800 internode", "hybrid-ep h100 internode"],
    "cost.SATURATING_SMS": "published SM counts: 8 fill NVLink on DGX H100, ~4 the 400 Gb/s NIC, 16 GB200 NVL36",
    "cost.STAGE_LATENCY_S": "assumption (kernel launch and synchronisation per stage)",
    "cost.FP8_ROW_OVERHEAD_S": ["hybrid-ep b200 ep8"],
    "estimate.GEMM_EFFICIENCY": _GB_GH,
    "estimate.GROUPED_HALF_ROWS": "the shape of the advisor's expert-GEMM curve",
    "estimate.ATTENTION_EFFICIENCY": "assumption (fused attention)",
    "estimate.ELEMENTWISE_PASSES": "assumption",
    "estimate.HOST_S_PER_LAYER": "assumption",
    "estimate.TP_OVERLAP_HIDES": "assumption",
    "estimate.DP_EXPOSED": "assumption",
    "estimate.FRAMEWORK_CALL_FACTOR": ["hybrid-ep h100 internode"],
}


def layout_of(run: dict):
    """The `TrainingLayout` of a published run (Megatron's flex dispatcher, HybridEP on NVL72,
    DeepEP on 8-GPU nodes)."""
    from .catalog import HARDWARE
    from .layout import TrainingLayout
    fields = dict(run["layout"])
    fields["recompute_modules"] = tuple(fields.get("recompute_modules", ()))
    backend = "hybridep" if HARDWARE[run["system"]].domain_size > 8 else "deepep"
    return TrainingLayout(dispatcher="flex", flex_backend=backend, **fields)


@lru_cache(maxsize=None)
def predicted(run_id: str) -> dict:
    """`estimate`'s result for the published run ``run_id``."""
    from .architecture import ARCHITECTURES
    from .catalog import HARDWARE
    from .estimate import estimate
    run = TRAINING_RUNS[run_id]
    return estimate(ARCHITECTURES[run["model"]], HARDWARE[run["system"]], layout_of(run))


def error_pct(run_id: str) -> float:
    """The estimate's error on ``run_id``, in percent of the published TFLOPS."""
    published = TRAINING_RUNS[run_id]["published_tflops"]
    return 100 * (predicted(run_id)["tflops_per_gpu"] - published) / published


def table() -> str:
    """docs/cost-model.md's table of the published runs against the estimate (Markdown)."""
    names = {"gb200-nvl72": "GB200", "gb300-nvl72": "GB300", "h100": "H100", "b200": "B200"}
    models = {"deepseek-v3": "DeepSeek-V3", "qwen3-235b-a22b": "Qwen3-235B"}
    lines = ["| system | model | precision | layout (GBS, MBS, TP/PP/VP/EP) | published | predicted | fits (GB / usable) |",
             "|---|---|---|---|---|---|---|"]
    for rid, run in TRAINING_RUNS.items():
        lay, r = run["layout"], predicted(rid)
        vp = lay["vpp"] if lay["vpp"] > 1 else "-"
        lines.append(f"| {names[run['system']]} | {models[run['model']]} | {run['precision']} | {lay['global_batch']}, "
                     f"{lay['micro_batch']}, {lay['tp']}/{lay['pp']}/{vp}/{lay['ep']} | {run['published_tflops']} | "
                     f"{r['tflops_per_gpu']:.0f} ({error_pct(rid):+.0f}%) | {r['peak_memory_GB']:.0f} / "
                     f"{r['usable_memory_GB']:.0f} |")
    return "\n".join(lines) + "\n"
