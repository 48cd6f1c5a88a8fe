"""The published figures the planner's constants come from, in one place.

`TRAINING_RUNS` (published_runs.json beside this file): Megatron-Core MoE training runs, each
with its source, layout, published TFLOPS and tokens/s per GPU, its split ("fit" or
"held_out") and the error `expertrail estimate` is documented to have on it (docs/cost-model.md
shows the table, written from here). `fit` fits estimate.py's fitted constants on the fit rows
alone; `summary` gives each split's error, so a constant fitted to one row shows up as error on
the held-out rows. `KERNEL_FIGURES`: the published dispatch / combine kernel figures the cost
model is checked against. `FITTED_ON` names, for every constant of `cost.py` and `estimate.py`,
the rows it was fitted on, or says it is an assumption.
"""
from __future__ import annotations

import itertools
import json
import math
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

# Megatron-Bridge's measurement of optimizer CPU offloading (HybridDeviceOptimizer): one layout,
# its peak memory without offloading, the memory each offloaded fraction saved and the step time
# against none; what tests/test_estimate.py checks `estimate` against (held out: nothing is fitted
# on it).
OFFLOAD_FIGURES = {
    "source": "Megatron-Bridge skills/nemo-mbridge-perf-cpu-offloading (SKILL.md and card.yaml, validated "
              "2026-03-30, commit fb5743649 of NVIDIA-NeMo/Megatron-Bridge): Qwen3-30B-A3B pretraining on 2 H100 "
              "nodes, TP 2 x PP 2 x EP 4, the qwen3_30b_a3b_pretrain_config recipe of that commit (ETP 1, "
              "sequence parallel, full uniform recompute of 1 layer, the alltoall dispatcher, FP32 main grads and "
              "moments) with the skill's command (global batch 8, micro-batch 1, sequence 4096)",
    "flags": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
              "--expert-model-parallel-size", "4", "--expert-tensor-parallel-size", "1", "--global-batch-size", "8",
              "--micro-batch-size", "1", "--seq-length", "4096", "--bf16", "--moe-token-dispatcher-type",
              "alltoall", "--moe-router-force-load-balancing"],
    "recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "gpus": 16, "hardware": "h100", "model": "qwen3-30b-a3b",
    "peak_GB": 47.2,                                        # without offloading
    "saved_GB": {0.25: 3.8, 0.5: 7.6, 0.75: 11.5, 1.0: 15.3},
    "step_ratio": {0.25: 1.9, 0.5: 2.5, 0.75: 3.2, 1.0: 4.2},
    "step_ratio_overlapped": {1.0: 3.9},                    # with overlap_cpu_optimizer_d2h_h2d
    # Layer-level activation offloading (cpu_offloading) needs PP 1, and there it ran out of memory:
    # "OOM at 70.3 GB", the weights, gradients and optimizer states alone "~70 GB" (the card names PP 1
    # and the 2 nodes; the layout is the one above at PP 1).
    "pp1_static_GB": 70.0,
}

# Published peak memory of runs outside the table (their step times are not of the table's kind):
# Megatron-Bridge's matched activation-recompute study of Moonlight-16B-A3B (8 H100, TP 2 x EP 8,
# ETP 1, sequence parallel, BF16, sequence 4096, micro-batch 1, global batch 4, the
# alltoall dispatcher; the recipe's precision-aware optimizer with BF16 main gradients and
# moments; peak allocated after iteration 2), one figure per set of recomputed modules. The model
# is Moonlight's config.json (moonshotai/Moonlight-16B-A3B). The card writes "gb"; read as GB
# (as GiB they would be 7.4% more).
_MOONLIGHT = {"model_type": "deepseek_v3", "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
              "num_key_value_heads": 16, "intermediate_size": 11264, "moe_intermediate_size": 1408,
              "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
              "n_group": 1, "topk_group": 1, "vocab_size": 163840, "q_lora_rank": None, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
_MOONLIGHT_FLAGS = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "8",
                    "--expert-tensor-parallel-size", "1", "--global-batch-size", "4", "--micro-batch-size", "1",
                    "--seq-length", "4096", "--bf16", "--moe-token-dispatcher-type", "alltoall",
                    "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
                    "--exp-avg-sq-dtype", "bf16"]
MEMORY_FIGURES = {
    f"card h100 moonlight-16b 2/1/-/8 recompute {name}": {
        "source": "Megatron-Bridge skills/nemo-mbridge-perf-activation-recompute/card.yaml (validated 2026-08-12, "
                  "commit 067f987d of NVIDIA-NeMo/Megatron-Bridge), measured_results, Moonlight 16B, experiment "
                  f"{name}; the recipe moonlight_16b_pretrain_8gpu_h100_bf16_config of bridge commit 600d069b",
        "hf_config": _MOONLIGHT, "hardware": "h100", "gpus": 8,
        "flags": _MOONLIGHT_FLAGS + (["--recompute-granularity", "selective", "--recompute-modules", *modules]
                                     if modules else []),
        "published_peak_GB": peak}
    for name, modules, peak in (("empty_control", (), 36.618), ("core_attn", ("core_attn",), 36.614),
                                ("mla_up_proj", ("mla_up_proj",), 35.902),
                                ("moe_act", ("moe_act",), 35.941),
                                ("layernorm_plus_moe_act", ("layernorm", "moe_act"), 35.949))}

# A run published below OUTLIER_SHARE of the best throughput of its model on its system at its
# precision and sequence length (any container) is a release's regression (the same layout runs
# 1.7-3x faster in another release, or a recipe the table does not describe): it stays in the
# table and its split's error, but is not fitted. Runs under full-iteration CUDA graphs (from
# 26.06: sync-free MoE layers, the exchanges overlapped, the grouped MLP fused) are another
# program and are compared with each other only. The rule reads the published figures only,
# never a prediction.
OUTLIER_SHARE = 0.6


def _layout_key(run: dict) -> str:
    """A run's layout as a hashable key (the same layout in several containers shares it)."""
    return json.dumps(run["layout"], sort_keys=True)


def _best_published(key) -> dict:
    """{key(run): the best published tokens/s of the runs sharing that key}."""
    best = {}
    for run in TRAINING_RUNS.values():
        best[key(run)] = max(best.get(key(run), 0.0), run["published_tokens_per_s"])
    return best


def _outliers() -> set:
    def key(run):
        lay = run["layout"]
        return run["model"], run["system"], lay["precision"], lay["seq"], bool(lay.get("sync_free"))
    best = _best_published(key)
    return {rid for rid, run in TRAINING_RUNS.items()
            if run["published_tokens_per_s"] < OUTLIER_SHARE * best[key(run)]}


OUTLIERS = _outliers()
# The fit rows of `fit`: every router forced to balance; the natural router's fit row calibrates
# its load alone (`fit_natural_routing`).
_FIT_ROWS = [rid for rid, run in TRAINING_RUNS.items()
             if run["split"] == "fit" and rid not in OUTLIERS and not run["layout"].get("natural_routing")]
# The published pairs a natural router's load is calibrated on, by how the checkpoint's router
# was trained to balance (`Architecture.router_balance`): one layout run with forced balancing and
# dropless each (the ModelZoo's Qwen3-235B on 256 H100 at sequence 16k; its Mixtral-8x22B on 128
# H100); the other pairs are held out.
NATURAL_ROUTING_PAIRS = {
    "global_batch": ("modelzoo h100 qwen3-235b-a22b bf16 4/8/4/8 cp1 seq16384 mbs1 gbs256",
                     "modelzoo h100 qwen3-235b-a22b bf16 4/8/4/8 cp1 seq16384 mbs1 gbs256 dropless"),
    "micro_batch": ("modelzoo h100 mixtral-8x22b bf16 2/8/7/8 mbs1 gbs256",
                    "modelzoo h100 mixtral-8x22b bf16 2/8/7/8 mbs1 gbs256 dropless"),
}
FITTED_ON = {
    "cost.NVLINK_EFFICIENCY_DEFAULT": ["hybrid-ep b200 ep8"],
    "cost.NVLINK_EFFICIENCY['h800']": ["deepep h800 intranode ep8"],
    "cost.NIC_EFFICIENCY": ["deepep h800 internode", "hybrid-ep h100 internode"],
    "cost.SATURATING_SMS": "published SM counts: 8 fill NVLink on DGX H100, ~4 the 400 Gb/s NIC, 16 GB200 NVL36",
    "cost.STAGE_LATENCY_S": "assumption (kernel launch and synchronisation per stage)",
    "cost.FP8_ROW_OVERHEAD_S": ["hybrid-ep b200 ep8"],
    "estimate.GEMM_EFFICIENCY": _FIT_ROWS,
    "estimate.SYSTEM_SPEED": _FIT_ROWS,
    "estimate.SYNC_S_PER_MOE_LAYER": _FIT_ROWS,
    "estimate.FITTED_FP8_RECIPES": "the recipes of the fit rows' FP8 runs: tensorwise on H100, mxfp8 on Blackwell",
    "estimate.GEMM_HALF_DIM": _FIT_ROWS,
    "estimate.GROUPED_HALF_ROWS": "measured: benchmarks/gpu_gemm_efficiency.py on an H100 (docs/results/"
                                  "gpu-gemm-efficiency.json): the catalog's expert shapes reach half speed "
                                  "at 205-655 rows; the advisor's 256",
    "estimate.ATTENTION_EFFICIENCY": "assumption (fused attention)",
    "estimate.LINEAR_ATTENTION_EFFICIENCY": "measured: benchmarks/gpu_gated_delta_net.py on an H100 (docs/results/"
                                            "gpu-gated-delta-net.json): FLA's convolution and chunked delta rule at "
                                            "Qwen3-Next's shapes, 2.9-3.1% of the BF16 peak, over H100's system speed",
    "estimate.ATTENTION_HEAD_SPEED": "FlashAttention-3 paper (arXiv 2407.08608), cuDNN forward on H100 at sequence 4k by head dim",
    "estimate.ELEMENTWISE_PASSES": "assumption",
    "estimate.HOST_S_PER_LAYER['x86']": "launch_floor(): the launch-bound runs of the fit split",
    "estimate.HOST_S_PER_LAYER['grace']": "assumption",
    "estimate.GRAPHED_LAUNCH_SHARE": "assumption (Grace's 40 of 150 us per layer with CUDA graphs)",
    "estimate.LAUNCH_SHARES": "assumption (the kernels of each part of Megatron's Transformer Engine layer)",
    "estimate.TP_OVERLAP_HIDES": "assumption",
    "estimate.DP_EXPOSED": "assumption",
    "estimate.FRAMEWORK_CALL_FACTOR": ["hybrid-ep h100 internode"],
    "estimate.DEEPEP_NVLINK_PEERS": "DeepEP's NUM_MAX_NVL_PEERS (csrc/kernels/configs.cuh)",
    "estimate.DEEPEP_RACK_GBPS": "Megatron-LM docs/discussions/deepseek-v3-gb200-optimization, 2.2.1: DeepEP at EP 32 "
                                 "on GB200 NVL72, 24 SMs",
    "estimate.NATURAL_EXPERT_LOAD_CV": [pair[1] for pair in NATURAL_ROUTING_PAIRS.values()],
    "estimate.NATURAL_CALIBRATED_EXPERTS_PER_RANK": [pair[1] for pair in NATURAL_ROUTING_PAIRS.values()],
    "estimate.EP_OVERLAP_HIDES": "measured: expertrail's overlapped 1F1B, 2 emulated nodes x 1 rank "
                                 "(docs/results/overlap-train-2x1.json)",
    "estimate.OVERLAP_COMM_SMS": "Megatron's and DeepEP's default moe_deepep_num_sms (20), Hybrid-EP's 16",
    "estimate.HOST_LINK_GBPS": "datasheets (NVLink-C2C 900 GB/s both ways, PCIe Gen5 x16 64 GB/s), 80% achieved: assumption",
    "estimate.CPU_ADAM_PARAMS_PER_S": "assumption (a host Adam step over a GPU's share of the cores)",
}
# The constants `fit` fits: GEMM efficiency per precision, each system's speed against GB200's
# (GB200 = 1) and the GEMM width at half efficiency.
FITTED_SYSTEMS = ("gb300-nvl72", "b200", "b300", "h100")


def architecture_of(run: dict):
    """The `Architecture` a published run trained: its catalog model with the Megatron fields
    the row's ``model_fields`` set (Qwen3-Next's MTP layer in the ModelZoo's model file)."""
    from .architecture import ARCHITECTURES, from_fields
    return from_fields(ARCHITECTURES[run["model"]], run.get("model_fields", {}))


def layout_of(run: dict):
    """The `TrainingLayout` of a published run (unless the row says otherwise, Megatron's flex
    dispatcher, HybridEP on NVL72, DeepEP on 8-GPU nodes)."""
    from ..names import default_flex_backend
    from .catalog import HARDWARE
    from .layout import TrainingLayout
    fields = dict(run["layout"])
    for key in ("recompute_modules", "offload_modules", "graph_scopes"):
        fields[key] = tuple(fields.get(key, ()))
    fields.setdefault("dispatcher", "flex")
    if fields["dispatcher"] == "flex":
        fields.setdefault("flex_backend", default_flex_backend(HARDWARE[run["system"]].domain_size))
    return TrainingLayout(**fields)


# `fit`'s constants by their key in a constants dict, and their name in estimate.py.
FITTED_NAMES = {"gemm": "GEMM_EFFICIENCY", "speed": "SYSTEM_SPEED", "half_dim": "GEMM_HALF_DIM",
                "sync_s": "SYNC_S_PER_MOE_LAYER"}


def constants() -> dict:
    """The fitted constants as estimate.py holds them (the per-key tables copied)."""
    from . import estimate
    values = {key: getattr(estimate, name) for key, name in FITTED_NAMES.items()}
    return {key: dict(v) if isinstance(v, dict) else v for key, v in values.items()}


def _estimate(run_id: str, consts: dict | None = None) -> dict:
    """`estimate`'s result for the published run ``run_id``, with ``consts`` (`constants()`'s
    shape) in place of estimate.py's fitted constants while it runs."""
    from . import estimate as est
    from .catalog import HARDWARE
    run = TRAINING_RUNS[run_id]
    saved = {key: getattr(est, name) for key, name in FITTED_NAMES.items()}
    if consts is not None:
        for key, name in FITTED_NAMES.items():
            setattr(est, name, consts[key])
    try:
        return est.estimate(architecture_of(run), HARDWARE[run["system"]], layout_of(run))
    finally:
        for key, name in FITTED_NAMES.items():
            setattr(est, name, saved[key])


@lru_cache(maxsize=None)
def predicted(run_id: str) -> dict:
    """`estimate`'s result for the published run ``run_id``."""
    return _estimate(run_id)


def error_pct(run_id: str, result: dict | None = None) -> float:
    """The estimate's error on ``run_id``: predicted against published tokens per second per GPU,
    in percent (the same as TFLOPS in one FLOP count; Bridge's count of DeepSeek-V3 changed
    between containers, 249 to 260 GFLOPs per token, the tokens did not)."""
    published = TRAINING_RUNS[run_id]["published_tokens_per_s"]
    r = result or predicted(run_id)
    return float(100 * (r["tokens_per_s_per_gpu"] - published) / published)


def _decompose(run_id: str, consts: dict) -> tuple:
    """(precision, system, G, A, F, published step s, width, S) of a run at ``consts``: its
    predicted step is G / (efficiency x speed) + A / speed + F + S x sync, G the GEMM (and
    recomputed GEMM) seconds at efficiency and speed 1, A attention at speed 1, S the MoE host
    synchronisations of the step, F the rest (memory-bound work, exposed communication,
    bubble's share of those, optimizer); exact while the same rank stays the slowest and the
    GPU, not the host, sets the pace."""
    run = TRAINING_RUNS[run_id]
    r = _estimate(run_id, consts)
    st, parts = r["step"], r["step"]["micro_batch_parts_s"]
    precision = run["layout"]["precision"]
    arch = architecture_of(run)
    width = arch.hidden
    eff = consts["gemm"][precision] * width / (width + consts["half_dim"])
    speed = consts["speed"].get(run["system"], 1.0)
    scale = (st["micro_batches_s"] + st["bubble_s"]) / st["gpu_s"] if st["gpu_s"] >= st["host_s"] else 0.0
    gemm = scale * (parts["gemm"] + parts["recompute"]) * eff * speed
    attention = scale * parts["attention"] * speed
    syncs = scale * st["moe_syncs"]
    rest = r["step_time_s"] - gemm / (eff * speed) - attention / speed - syncs * consts["sync_s"]
    return precision, run["system"], gemm, attention, rest, _published_step_s(run_id, r), width, syncs


# A run is launch-bound when it took this much longer per layer than its GPUs' work (the host,
# not the GPU, set the pace), unless the same layout ran that much faster in another release.
LAUNCH_BOUND = 1.5


def _published_step_s(run_id: str, r: dict) -> float:
    """The published step time of ``run_id``: estimate ``r``'s step scaled by its predicted over
    the published throughput."""
    return r["step_time_s"] * r["tokens_per_s_per_gpu"] / TRAINING_RUNS[run_id]["published_tokens_per_s"]


def published_layer_s(run_id: str) -> float:
    """The published time of one layer's forward + backward for one micro-batch on the slowest
    pipeline rank: the published step over the micro-batches and the pipeline's fill, and that
    rank's layers."""
    r = predicted(run_id)
    lay = r["layout"]
    return _published_step_s(run_id, r) / (lay["micro_batches"] + (lay["pp"] - 1) / lay["vpp"]) / r["step"]["layers"]


def launch_floor() -> tuple:
    """(seconds, run ids): the host's eager launch time per layer on x86-hosted systems, as the
    fit split publishes it: the fastest published layer among the launch-bound fit runs (a layer
    the GPU model puts at under 1 / `LAUNCH_BOUND` of its published time, and that no release
    ran `LAUNCH_BOUND` times faster in the same layout), over the share of its launches the
    run's CUDA graphs left (`estimate.launch_share`). A floor is what the fastest of them
    reached; slower ones pay for other things too."""
    from .estimate import GRACE_HOSTED, HOST_S_PER_LAYER

    def key(run):
        return run["model"], run["system"], _layout_key(run)
    best_of_layout = _best_published(key)
    bound = []
    for rid, run in TRAINING_RUNS.items():
        if run["split"] != "fit" or run["system"] in GRACE_HOSTED:
            continue
        if best_of_layout[key(run)] > LAUNCH_BOUND * run["published_tokens_per_s"]:
            continue                                    # a release's regression, not the host
        r = predicted(rid)
        gpu_layer = r["step"]["gpu_s"] / r["step"]["layers"]
        if published_layer_s(rid) > LAUNCH_BOUND * gpu_layer:
            bound.append(rid)
    def eager(rid):
        st = predicted(rid)["step"]                  # host_s: the slowest rank's layers at their launch shares
        return published_layer_s(rid) * HOST_S_PER_LAYER["x86"] * st["layers"] / st["host_s"]
    return min(eager(rid) for rid in bound), bound


# The widths `fit` tries for estimate.GEMM_HALF_DIM (0: no width term), and the host
# synchronisations for estimate.SYNC_S_PER_MOE_LAYER (seconds; 0: none).
HALF_DIMS = (0.0, 64.0, 128.0, 256.0, 384.0, 512.0, 768.0, 1024.0, 1536.0, 2048.0, 3072.0, 4096.0)
SYNC_STALLS = tuple(ms * 1e-3 for ms in (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0))


def fit(run_ids=None, rounds: int = 3) -> dict:
    """GEMM efficiency per precision, each system's speed (`FITTED_SYSTEMS`, GB200 = 1), the
    GEMM width at half efficiency (one of `HALF_DIMS`) and the MoE layer's host synchronisation
    (one of `SYNC_STALLS`) that minimise the summed absolute log error of the predicted step
    over ``run_ids`` (the fit rows by default): least absolute deviations, so one run the model
    cannot explain does not drag a constant. Each round decomposes every run's step at the
    current constants (`_decompose`); on that decomposition every pair of a width and a
    synchronisation gets its best efficiencies and speeds by coordinate search (steps narrowing
    from 0.5 to 0.005 in log), and the pair with the smallest error wins; the next round
    decomposes again at the result."""
    import numpy as np
    ids = list(run_ids if run_ids is not None else _FIT_ROWS)
    consts = {"gemm": {"bf16": 0.5, "fp8": 0.3}, "speed": {"gb200-nvl72": 1.0, **{s: 1.0 for s in FITTED_SYSTEMS}},
              "half_dim": 0.0, "sync_s": 0.0}
    names = [("gemm", "bf16"), ("gemm", "fp8")] + [("speed", s) for s in FITTED_SYSTEMS]
    for _ in range(rounds):
        rows = [_decompose(rid, consts) for rid in ids]
        prec = np.array([r[0] for r in rows])
        system = np.array([r[1] for r in rows])
        g, a, f, pub, width, syncs = (np.array([r[i] for r in rows]) for i in (2, 3, 4, 5, 6, 7))
        masks = [system == s for s in FITTED_SYSTEMS]

        def loss(th, half):
            eff = np.where(prec == "fp8", np.exp(th[1]), np.exp(th[0])) * width / (width + half)
            speed = np.ones(len(rows))
            for i, mask in enumerate(masks):
                speed = np.where(mask, np.exp(th[2 + i]), speed)
            return float(np.abs(np.log((g / (eff * speed) + a / speed + f + syncs * sync) / pub)).sum())

        best = None
        for half, sync in itertools.product(HALF_DIMS, SYNC_STALLS):
            theta = np.log([consts[k][n] for k, n in names])
            for step in (0.5, 0.1, 0.02, 0.005):
                for _sweep in range(20):
                    before = loss(theta, half)
                    for i in range(len(theta)):
                        grid = theta[i] + step * np.linspace(-1, 1, 21)
                        values = []
                        for x in grid:
                            th = theta.copy()
                            th[i] = x
                            values.append(loss(th, half))
                        k = int(np.argmin(values))
                        if values[k] < values[10] - 1e-12:         # a constant no row moves stays put
                            theta[i] = grid[k]
                    if before - loss(theta, half) < 1e-9:
                        break
            value = loss(theta, half)
            if best is None or value < best[0] - 1e-9:
                best = (value, half, sync, theta)
        _, consts["half_dim"], consts["sync_s"], theta = best
        for (k, n), v in zip(names, np.exp(theta)):
            consts[k][n] = float(v)
    return consts


def memory_predicted(key: str) -> dict:
    """`estimate`'s result for a `MEMORY_FIGURES` entry."""
    from .architecture import from_hf_config
    from .catalog import HARDWARE
    from .estimate import estimate
    from .layout import TrainingLayout
    from .validate import load_config
    fig = MEMORY_FIGURES[key]
    layout = TrainingLayout.from_fields(load_config(None, fig["flags"]), fig["gpus"])
    return estimate(from_hf_config(fig["hf_config"], key), HARDWARE[fig["hardware"]], layout)


def published_peaks() -> dict:
    """{id: published peak memory, GB}: the table's runs that give one (``published_peak_GB``)
    and `MEMORY_FIGURES`."""
    return {**{rid: run["published_peak_GB"] for rid, run in TRAINING_RUNS.items() if run.get("published_peak_GB")},
            **{key: fig["published_peak_GB"] for key, fig in MEMORY_FIGURES.items()}}


def memory_errors() -> dict:
    """{id: predicted peak memory against the published one, in percent} for every published
    peak (`published_peaks`)."""
    def peak(key):
        return (predicted(key) if key in TRAINING_RUNS else memory_predicted(key))["peak_memory_GB"]
    return {key: 100 * (peak(key) - published) / published for key, published in published_peaks().items()}


def routing_pairs() -> list:
    """[(forced-balance run id, dropless run id)]: every published layout run both ways."""
    return [(rid[: -len(" dropless")], rid) for rid, run in TRAINING_RUNS.items()
            if run["layout"].get("natural_routing") and rid[: -len(" dropless")] in TRAINING_RUNS]


def routing_ratio(pair: tuple, cv: float | None = None) -> tuple:
    """(predicted, published) throughput of a pair's dropless run over its forced-balance run,
    the prediction at a natural router's load ``cv`` for the pair's model's router (default:
    estimate.py's). A ratio of two estimates of one layout: what both share (the GPU's speed, the
    GEMMs) cancels."""
    from . import estimate as est
    balance = architecture_of(TRAINING_RUNS[pair[1]]).router_balance
    saved = dict(est.NATURAL_EXPERT_LOAD_CV)
    if cv is not None:
        est.NATURAL_EXPERT_LOAD_CV[balance] = cv
    try:
        forced, dropless = (_estimate(rid)["tokens_per_s_per_gpu"] for rid in pair)
    finally:
        est.NATURAL_EXPERT_LOAD_CV.update(saved)
    return dropless / forced, (TRAINING_RUNS[pair[1]]["published_tokens_per_s"]
                               / TRAINING_RUNS[pair[0]]["published_tokens_per_s"])


def fit_natural_routing(balance: str = "global_batch") -> float:
    """estimate.NATURAL_EXPERT_LOAD_CV[balance] at which that router's calibrating pair
    (`NATURAL_ROUTING_PAIRS`) has its predicted dropless over forced-balance throughput equal to
    the published one (bisection: more variation, a slower dropless run)."""
    pair = NATURAL_ROUTING_PAIRS[balance]
    low, high = 0.0, 8.0
    for _ in range(40):
        mid = (low + high) / 2
        predicted_ratio, published_ratio = routing_ratio(pair, mid)
        low, high = (mid, high) if predicted_ratio > published_ratio else (low, mid)
    return (low + high) / 2


def summary(split: str, consts: dict | None = None) -> dict:
    """Runs of ``split`` ("fit" / "held_out"): how many, the share predicted within 25% and 15%
    of the published throughput, the median absolute error (%), how many predicted to fit."""
    ids = [rid for rid, run in TRAINING_RUNS.items() if run["split"] == split]
    results = {rid: (predicted(rid) if consts is None else _estimate(rid, consts)) for rid in ids}
    errors = sorted(abs(error_pct(rid, results[rid])) for rid in ids)
    n = len(errors)
    median = (errors[(n - 1) // 2] + errors[n // 2]) / 2
    return {"runs": n, "within_25": sum(e <= 25 for e in errors) / n, "within_15": sum(e <= 15 for e in errors) / n,
            "median_abs_pct": median, "fit": sum(results[rid]["fits"] for rid in ids)}


def errors_by_container(split: str) -> dict:
    """{container: (mean signed error of its ``split`` runs in percent, runs)}, Bridge's releases
    oldest first, then the other publications: positive is predicted faster than published.
    Software gets faster from release to release, so the error drifts from over- to
    under-prediction across the Bridge containers."""
    out = {}
    for rid, run in TRAINING_RUNS.items():
        if run["split"] == split:
            out.setdefault(run["container"], []).append(error_pct(rid))
    order = sorted(out, key=lambda where: (source_of({"container": where}) != "Bridge", where))
    return {where: (sum(out[where]) / len(out[where]), len(out[where])) for where in order}


def spearman(x: list, y: list) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return round(cov / (sx * sy), 12) if sx and sy else float("nan")      # 0.8 stays 0.8


def source_of(run: dict) -> str:
    """The publication a run comes from: "ModelZoo" (Megatron-MoE-ModelZoo), "Bridge card" (a
    Megatron-Bridge skill card's measurement, container "card <date>"), "MCore tracker" (the
    MCore release performance tracker's configurations a Bridge skill card lists, container
    "tracker <date>"), "NeMo" (the NeMo Framework's performance summaries, container "NeMo
    <release>") or "Bridge" (its performance summaries)."""
    if run["container"] == "ModelZoo":
        return "ModelZoo"
    if run["container"].startswith("NeMo"):
        return "NeMo"
    if run["container"].startswith("tracker"):
        return "MCore tracker"
    return "Bridge card" if run["container"].startswith("card") else "Bridge"


def _ranking_key(run: dict) -> tuple:
    """One job, laid out several ways: the model at one sequence length on one system, in one
    publication."""
    return run["model"], run["system"], source_of(run), run["layout"]["seq"]


def _table_key(run: dict) -> tuple:
    """One job within one container: `_ranking_key` with the container for the publication."""
    return run["model"], run["system"], run["container"], run["layout"]["seq"]


def _layouts_by_group(key=_ranking_key) -> dict:
    """{group key: {layout key: [run ids]}} over the runs not in OUTLIERS."""
    groups = {}
    for rid, run in TRAINING_RUNS.items():
        if rid not in OUTLIERS:
            groups.setdefault(key(run), {}).setdefault(_layout_key(run), []).append(rid)
    return groups


def _published_by_layout(layouts: dict) -> list:
    """Each layout's mean published tokens/s per GPU over the containers that publish it."""
    return [sum(TRAINING_RUNS[r]["published_tokens_per_s"] for r in ids) / len(ids) for ids in layouts.values()]


def ranking_groups(key=_ranking_key) -> dict:
    """{(model, system, source, seq): Spearman correlation of predicted and published
    throughput} over the distinct layouts of one model at one sequence length on one system in
    one publication (two or more; a layout published in several containers counts once, at its
    mean throughput; OUTLIERS left out). ``key=_table_key`` groups by container instead (for
    Bridge one release's table): (model, system, container, seq). NaN where the estimate puts
    every layout of a group at one throughput (a tie: no order to compare, `predicted_ties`)."""
    out = {}
    for group, layouts in _layouts_by_group(key).items():
        if len(layouts) >= 2:
            out[group] = spearman([predicted(ids[0])["tokens_per_s_per_gpu"] for ids in layouts.values()],
                                  _published_by_layout(layouts))
    return out


def predicted_ties(key=_ranking_key) -> dict:
    """{group key: the published spread (max over min - 1)} of the groups whose layouts the
    estimate predicts at one throughput (what tells them apart is not modelled, e.g. MXFP8
    against FP8 current scaling), which `ranking_groups` gives as NaN."""
    groups, ties = _layouts_by_group(key), {}
    for group, rho in ranking_groups(key).items():
        if math.isnan(rho):
            published = _published_by_layout(groups[group])
            ties[group] = max(published) / min(published) - 1
    return ties


def _rho_text(rho: float, spread: float | None) -> str:
    return f"tie, published {spread:.1%} apart" if math.isnan(rho) else f"{rho:+.2f}"


def _ranks_with_counts(key=_ranking_key) -> dict:
    groups = _layouts_by_group(key)
    return {k: (rho, len(groups[k])) for k, rho in ranking_groups(key).items()}


def table() -> str:
    """docs/cost-model.md's table of the published runs against the estimate (Markdown)."""
    names = {"gb200-nvl72": "GB200", "gb300-nvl72": "GB300", "h100": "H100", "b200": "B200", "b300": "B300"}
    models = {"deepseek-v3": "DeepSeek-V3", "qwen3-235b-a22b": "Qwen3-235B", "qwen3-30b-a3b": "Qwen3-30B",
              "kimi-k2": "Kimi-K2", "gpt-oss-120b": "GPT-OSS-120B", "qwen3-next-80b-a3b": "Qwen3-Next",
              "mixtral-8x22b": "Mixtral-8x22B", "mixtral-8x7b": "Mixtral-8x7B"}
    lines = ["| container | split | system | model | precision | layout (GPUs, GBS, MBS, TP/PP/VP/EP; CP and sequence "
             "where not 1 and 4096; dropless or token drop where the router is natural) | published TFLOPS "
             "| published tokens/s | predicted tokens/s | fits (GB / usable) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rid, run in TRAINING_RUNS.items():
        lay, r = run["layout"], predicted(rid)
        vp = lay["vpp"] if lay["vpp"] > 1 else "-"
        extra = (f", CP {lay['cp']}" if lay.get("cp", 1) > 1 else "") + (f", seq {lay['seq']}" if lay["seq"] != 4096 else "")
        if lay.get("natural_routing"):
            extra += ", token drop" if lay.get("pad_to_capacity") else ", dropless"
        lines.append(f"| {run['container']} | {run['split'].replace('_', '-')} | {names[run['system']]} | "
                     f"{models[run['model']]} | {run['precision']} | {lay['gpus']}, {lay['global_batch']}, "
                     f"{lay['micro_batch']}, {lay['tp']}/{lay['pp']}/{vp}/{lay['ep']}{extra} | {run['published_tflops']:.0f} | "
                     f"{run['published_tokens_per_s']:.0f} | {r['tokens_per_s_per_gpu']:.0f} ({error_pct(rid):+.0f}%) | "
                     f"{r['peak_memory_GB']:.0f} / {r['usable_memory_GB']:.0f} |")
    lines.append("")
    for split in ("fit", "held_out"):
        s = summary(split)
        n = s["runs"]        # counts, not a rounded share: 59 of 74 is 79.7%, not 80%
        lines.append(f"- {split.replace('_', '-')}: {n} runs, {round(s['within_25'] * n)} ({s['within_25']:.1%}) "
                     f"within 25% ({s['within_15']:.1%} within 15%), median absolute error {s['median_abs_pct']:.1f}%, "
                     f"{s['fit']} of {s['runs']} predicted to fit")
    lines.append("- held-out error by container, the mean of the signed errors (runs): " + ", ".join(
        f"{where} {mean:+.1f}% ({n})" for where, (mean, n) in errors_by_container("held_out").items()))
    memory, published = memory_errors(), published_peaks()
    lines.append(f"- peak memory, the {len(memory)} runs that publish it (the table's and calibration.MEMORY_FIGURES): "
                 + ", ".join(f"{rid} {published[rid]:.1f} GB, {err:+.0f}%" for rid, err in memory.items()))
    for what, key in (("layouts of one model at one sequence length on one system in one publication (Spearman)",
                       _ranking_key), ("within one container (for Bridge, one release's table)", _table_key)):
        ties = predicted_ties(key)
        lines.append(f"- ranking, {what}: " + ", ".join(
            f"{models[m]} {names[s]} ({where}, {n} layouts{'' if seq == 4096 else f', sequence {seq}'}) "
            f"{_rho_text(rho, ties.get((m, s, where, seq)))}"
            for (m, s, where, seq), (rho, n) in sorted(_ranks_with_counts(key).items())))
    return "\n".join(lines) + "\n"
