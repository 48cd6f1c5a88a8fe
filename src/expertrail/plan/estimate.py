"""`expertrail estimate`: does a training configuration fit, how long is a step, how many TFLOPS.

Memory comes from `memory.py`; the step from the time one micro-batch spends on each
pipeline rank, the busiest rank setting the pace:

    step = (micro-batches + (PP - 1) / VPP) x micro-batch time of the busiest rank
           + exposed data-parallel communication + optimizer step

A micro-batch's time on a rank is, per layer, GEMMs at an achievable fraction of the GPU's
dense peak (`GEMM_EFFICIENCY`, times `width_factor` for the model's hidden size and
the system's sustained speed `SYSTEM_SPEED`; routed experts lose more with few rows per
expert), core attention in BF16 (`ATTENTION_EFFICIENCY`, slower for narrow heads), memory-bound work (norms,
activations, permutes: `ELEMENTWISE_PASSES` over the layer's activations at HBM speed),
recomputed forwards, and the communication left exposed: dispatch + combine from the cost
model (`cost.predict`, forward and backward), of which EP overlap hides a measured share of what
the other micro-batch's compute chunks cover (`ep_overlap_exposed`, `unpaired_share`), TP's all-gathers / reduce-scatters,
CP's key-value exchange beyond the attention it hides behind, Megatron-FSDP's per-layer
collectives beyond the layer's compute (`fsdp_seconds`), activation offloading's copies beyond
it, and the pipeline's sends, and each MoE layer's host synchronisation (`SYNC_S_PER_MOE_LAYER`).
A host that launches kernels more slowly than the GPU runs them sets the pace instead
(`HOST_S_PER_LAYER`). `terms_s` splits the step into these terms.

TFLOPS per GPU are model FLOPs (`Architecture.flops_per_token`, Megatron-Core's count) per
step over the step time and the GPUs. The fitted constants come from `calibration.fit` on the
fit rows of docs/cost-model.md's published runs; the held-out rows show their error.
"""
from __future__ import annotations

from functools import lru_cache

from ..errors import ConfigError
from .architecture import Architecture
from .catalog import Hardware, gpu_twin
from .cost import NCCL_ALGORITHMS, EPLayout, Routing, link_bandwidth, predict
from .layout import DEEPEP_LIKE, TrainingLayout, stage_layers
from . import layout as layout_fields
from .memory import GB, cpu_offloaded_layers, layer_activation_bytes, memory, offloaded_bytes, usable_GB
from .simulate import domain_for

GEMM_EFFICIENCY = {"bf16": 0.78, "fp8": 0.46}   # of the dense peak of that precision, before width_factor (calibration.fit)
# Sustained speed of a system's tensor cores against GB200's at the same datasheet peak (clocks under its
# power limit, Blackwell Ultra's faster softmax exponentials): scales GEMMs and attention (calibration.fit).
# Systems not named here (measured machines, user catalogs) run at 1.0.
SYSTEM_SPEED = {"gb200-nvl72": 1.0, "gb300-nvl72": 1.17, "b200": 0.73, "b300": 0.82, "h100": 0.94}
GEMM_HALF_DIM = 2048.0                           # a model's GEMMs run at d / (d + this) of it, d its hidden size (calibration.fit)
# Rows per expert at which a grouped GEMM reaches half of its many-rows speed: measured on an H100
# (benchmarks/gpu_gemm_efficiency.py, the catalog's five expert shapes, forward + backward): 205 to
# 655 rows, median 285 (docs/cost-model.md, "The constants against the kernels"). The advisor's curve too.
GROUPED_HALF_ROWS = 256
# A dropless MoE layer's host synchronisation, once per micro-batch in its forward (and again in
# a recomputed one): the token counts go to the host to size the grouped GEMM's splits, and the
# GPU idles while the host launches what follows (NVIDIA's fused MoE kernels remove it as a main
# bottleneck, "sync-free MoE execution"). calibration.fit; full-iteration CUDA graphs run sync-free.
SYNC_S_PER_MOE_LAYER = 1.25e-3
ATTENTION_EFFICIENCY = 0.45                      # fused attention, forward and backward, of the BF16 peak
# Fused attention's speed at a head width against 128-wide heads (64: 0.67): cuDNN's forward on
# H100 at sequence 4k in FlashAttention-3's paper (arXiv 2407.08608, Fig. 5), 408 TFLOPS at head
# dim 64 against 609 at 128; wider heads run as fast as 128 (FlashAttention-3: 612 at 256, 638 at 128).
ATTENTION_HEAD_SPEED = {64: 0.67, 128: 1.0}
# Gated DeltaNet's core (the depthwise convolution and the chunked delta rule, Flash Linear
# Attention's Triton kernels as Megatron-LM calls them), forward and backward, of the BF16 peak on
# Megatron's FLOPs count (`Architecture.linear_core_flops`), times the system speed: measured on an
# H100 at Qwen3-Next's shapes, 2.9-3.1% of its peak (GPU busy time, 4096-16384 tokens a call;
# benchmarks/gpu_gated_delta_net.py), over H100's 0.94. Small per-chunk products and a state
# handed from chunk to chunk keep it far below a GEMM's share.
LINEAR_ATTENTION_EFFICIENCY = 0.032
ELEMENTWISE_PASSES = 6                           # HBM passes over a layer's activations, forward + backward
# The host's time to launch one layer's forward + backward of one micro-batch (kernels, the
# dispatcher's host synchronisations) eagerly; a micro-batch runs no faster. x86 hosts of 8-GPU
# nodes: the fastest layer of the fit split's launch-bound runs (`calibration.launch_floor`: 8.8 ms,
# Qwen3-30B-A3B on one B200 node at micro-batch 1). Grace hosts (GB200 / GB300): no published run
# pins it (their fastest layers take 7.5 ms), so the assumption stands.
GRACE_HOSTED = ("gb200-nvl72", "gb300-nvl72", "gb200-nvl36")
HOST_S_PER_LAYER = {"x86": 8.8e-3, "grace": 150e-6}
# A part of a layer launched as a CUDA graph costs the host this share of its eager launches
# (assumption: 40 of 150 us per layer on Grace).
GRAPHED_LAUNCH_SHARE = 40 / 150
# The parts of a layer's eager launches that cuda_graph_scope's parts capture (assumption, from the
# kernels Megatron's Transformer Engine layer launches: attention's norms, projections, RoPE, fused
# attention and residual; on a MoE layer's MLP side the fused router, the preprocess, then, after
# the host synchronisation, the dispatch, permutation, expert GEMMs, activation and combine). The
# fit runs that pin the x86 floor captured the router and the preprocess, and runs without graphs
# on x86 hosts lay no slower per layer, so those two parts carry no share apart from the rest.
LAUNCH_SHARES = {"moe": {"attn": 0.4, "moe": 0.6}, "dense": {"attn": 0.5, "mlp": 0.5}}
TP_OVERLAP_HIDES = 0.6                           # share of TP collectives tp_comm_overlap hides
DP_EXPOSED = {True: 0.1, False: 1.0}             # share of gradient / parameter traffic left after the last backward
# A DeepEP or Hybrid-EP dispatch or combine as a framework calls it (layout pass, host
# synchronisation) against the kernel alone, across NVLink domains: Hybrid-EP's H100 EP16/32/64
# "Torch API" vs "kernel only" figures are 1.17-1.33x apart (the cost model's cross-domain stages
# match the kernel figures; inside a domain it is calibrated on Torch-API figures already).
# NCCL's all-to-all and all-gather are costed at NCCL's achieved bandwidth, a call's cost counted in.
FRAMEWORK_CALL_FACTOR = 1.25
# DeepEP's normal kernels were written for 8 NVLink peers (NUM_MAX_NVL_PEERS); across an NVL72
# rack at EP 32 they reach about 400 GB/s of algorithm bandwidth in dispatch and 190 GB/s in
# combine with 24 SMs (Megatron-LM docs/discussions/deepseek-v3-gb200-optimization, "2.2.1
# DeepEP"), far below the rack's NVLink: the most a DeepEP exchange gets beyond 8 peers in a rack.
DEEPEP_NVLINK_PEERS = 8
DEEPEP_RACK_GBPS = {"dispatch": 400.0, "combine": 190.0}
ROUTING_SAMPLE = 1024
# EP overlap: SMs the dispatcher's kernels hold while the other micro-batch computes beside them
# (DeepEP's and Megatron's default moe_deepep_num_sms 20, Hybrid-EP's 16; NCCL's all-to-all about as many).
OVERLAP_COMM_SMS = {"deepep": 20, "ncclep": 20, "hybridep": 16, None: 20}
# EP overlap: the share of an exchange's time beside a compute chunk that overlap hides, as
# expertrail's own overlapped 1F1B measured it with one rank per core (docs/results/
# overlap-train-2x1.json: (2435 - 1456) / (2435 - 1232) ms, the step without overlap, with it,
# and the overlapped step's CPU floor): streams are not free to run side by side all the time
# (each chunk pair ends in a wait, and the next chunk's launch follows it). Not fitted; the
# published pairs with and without Megatron's EP overlap check it (docs/cost-model.md, "EP overlap").
EP_OVERLAP_HIDES = 0.81
# A natural (dropless) router's load: how much one expert's share of a micro-batch's routed rows
# varies around the mean, as a coefficient of variation, by how the checkpoint's router was
# trained to balance (`Architecture.router_balance`). Each MoE layer
# waits for its busiest EP rank, so the experts' GEMMs and the exchange take that rank's rows
# (`routing_imbalance`). Each is calibrated on one ModelZoo layout published with forced
# balancing and dropless (calibration.fit_natural_routing): Qwen3-235B at sequence 16k for a
# router balanced over the whole batch (its three longer sequence pairs held out), Mixtral-8x22B
# for one balanced within each micro-batch. moe_router_force_load_balancing gives every rank its
# even share.
NATURAL_EXPERT_LOAD_CV = {"global_batch": 1.48, "micro_batch": 0.05}
# The experts a rank held in each calibrating pair (128 over EP 8; 8 over EP 8).
NATURAL_CALIBRATED_EXPERTS_PER_RANK = {"global_batch": 16, "micro_batch": 1}
IMBALANCE_SAMPLES = 2000
# Host link per GPU, each way, for activation and optimizer offloading: NVLink-C2C on Grace
# systems (900 GB/s both ways), PCIe Gen5 x16 (64 GB/s) elsewhere; 80% of it achieved.
HOST_LINK_GBPS = {**{name: 360.0 for name in GRACE_HOSTED}, None: 50.0}
CPU_ADAM_PARAMS_PER_S = 1e9                      # host Adam step, parameters per second per GPU's share of the cores


def comm_sms(layout: TrainingLayout) -> int:
    """SMs the dispatcher's kernels hold: the configuration's count, else the backend's default."""
    return layout.dispatcher_sms or OVERLAP_COMM_SMS.get(layout.flex_backend, OVERLAP_COMM_SMS[None])


def host_link_Bps(hw: Hardware) -> float:
    """Bytes per second each way between a GPU and its host (`HOST_LINK_GBPS`)."""
    return HOST_LINK_GBPS.get(hw.name, HOST_LINK_GBPS[None]) * 1e9


def algorithm_for(layout: TrainingLayout, domain: int) -> str:
    """The cost model's algorithm for Megatron's dispatcher settings."""
    if layout.dispatcher in ("alltoall", "allgather"):
        return layout.dispatcher
    if layout.flex_backend in DEEPEP_LIKE and layout.ep <= domain:
        return "dedup"
    return "hierarchical"


@lru_cache(maxsize=64)
def _routing(arch: Architecture, tokens: int):
    """``tokens`` tokens' expert choices as Megatron's router makes them under forced balance
    (random scores): group-limited where the model has expert groups (DeepSeek-V3's 4 of 8),
    each group's experts contiguous, so on fewer ranks and nodes than uniform choices."""
    grouped = (arch.num_groups or 1) > 1 and arch.group_topk
    return Routing("grouped" if grouped else "uniform").sample(arch.moe_model(), tokens)


def dispatch_seconds(arch: Architecture, hw: Hardware, layout: TrainingLayout) -> tuple:
    """(dispatch + combine of one MoE layer and one micro-batch, forward + backward, on the busiest
    EP rank (`routing_imbalance`); algorithm)."""
    if layout.ep <= 1:
        return 0.0, None
    domain = domain_for(hw, layout.ep)
    algorithm = algorithm_for(layout, domain)
    sms = comm_sms(layout)
    # Rows grow with the tokens: a sample of at most ROUTING_SAMPLE tokens, scaled, keeps large EP fast.
    tokens = layout.tokens_per_gpu
    sample = min(tokens, ROUTING_SAMPLE)
    # The dispatch's rows travel in FP8 under an FP8 recipe with DeepEP and HybridEP; NCCL EP as
    # moe_dispatch_fwd_dtype says.
    fp8_rows = layout.fp8_wire if layout.fp8_wire is not None else layout.precision == "fp8" and layout.flex_backend
    dispatch, combine, bandwidth = _exchange_seconds(arch, hw, layout.ep, domain, algorithm, sample, sms,
                                                     "fp8" if fp8_rows else "bf16")
    if layout.flex_backend in DEEPEP_LIKE and domain > DEEPEP_NVLINK_PEERS:   # an EP group beyond 8 in one rack
        logical_GB = bandwidth * dispatch                          # the rows' bytes, as algorithm bandwidth counts them
        dispatch = max(dispatch, logical_GB / DEEPEP_RACK_GBPS["dispatch"])
        combine = max(combine, logical_GB / DEEPEP_RACK_GBPS["combine"])
    framework = FRAMEWORK_CALL_FACTOR if domain < layout.ep and algorithm not in NCCL_ALGORITHMS else 1.0
    # The busiest rank receives (dispatch) and sends back (combine) its imbalance times the mean
    # rows; an all-gather moves every token to every rank whatever the routing.
    load = routing_imbalance(arch, layout) if algorithm != "allgather" else 1.0
    return 2 * (dispatch + combine) * framework * load * tokens / sample, algorithm


@lru_cache(maxsize=512)
def _exchange_seconds(arch: Architecture, hw: Hardware, ep: int, domain: int, algorithm: str, tokens: int,
                      sms: int, dtype: str) -> tuple:
    """(dispatch s, combine s, algorithm bandwidth GB/s) of ``tokens`` tokens a rank, routed as
    `_routing` routes them (cached: `plan --fit` costs the same exchange for many layouts)."""
    p = predict(hw, arch.moe_model(), EPLayout(ep, domain), algorithm, _routing(arch, tokens), sms, dtype)
    return p.dispatch_s, p.combine_s, p.algo_bandwidth_GBps


def routing_imbalance(arch: Architecture, layout: TrainingLayout) -> float:
    """The busiest EP rank's routed rows over the mean in one MoE layer and micro-batch, which
    every rank waits for: 1 where each rank gets its even share (moe_router_force_load_balancing,
    or EP 1); under a natural router, the expected largest of the EP ranks' loads over their mean,
    a rank's load the sum of its experts' and an expert's a lognormal share of the rows with
    `NATURAL_EXPERT_LOAD_CV` (more ranks, fewer experts each: a larger excess). A capacity factor
    c (moe_expert_capacity_factor) caps each expert at c times its even share, the rest dropped;
    padded to capacity (moe_pad_expert_input_to_capacity) every expert takes exactly that."""
    cap = layout.capacity_factor
    if layout.pad_to_capacity:
        return float(cap)
    if not layout.natural_routing or layout.ep <= 1:
        return 1.0 if cap is None else min(1.0, cap)
    if layout.expert_loads:
        return _recorded_busiest(layout.expert_loads, layout.ep, cap)
    if layout.routing:
        return _routed_busiest(arch, layout.ep, layout.routing, layout.tokens_per_gpu * layout.ep, cap)
    return _expected_busiest(arch.experts, layout.ep, NATURAL_EXPERT_LOAD_CV[arch.router_balance], cap)


def _busiest_share(loads, cap: float | None) -> float:
    """The busiest rank's rows over the ranks' mean, averaged over the leading axis, from loads
    [..., ranks, experts a rank]; ``cap``: each expert keeps at most that times the experts' mean
    (a capacity factor; the rest dropped), the mean staying the routed rows before dropping."""
    import numpy as np
    loads = np.asarray(loads, dtype=float)
    mean = loads.mean(axis=(-2, -1), keepdims=True)
    if cap is not None:
        loads = np.minimum(loads, cap * mean)
    ranks, mean = loads.sum(axis=-1), mean[..., 0, 0] * loads.shape[-1]
    keep = mean > 0
    return float((ranks.max(axis=-1)[keep] / mean[keep]).mean()) if keep.any() else 1.0


def _recorded_busiest(loads: tuple, ep: int, cap: float | None = None) -> float:
    """The busiest of ``ep`` ranks' rows over the mean, from recorded token counts
    [layers][experts] (each rank holding its experts in order), averaged over the layers."""
    import numpy as np
    return _busiest_share(np.asarray(loads, dtype=float).reshape(len(loads), ep, -1), cap)


# Tokens a `--routing` spec is sampled at for the busiest rank's share: enough that a uniform
# router's noise is under 2% of a rank's rows at EP 64, few enough to stay fast.
ROUTED_SAMPLE = 65536


@lru_cache(maxsize=64)
def _routed_busiest(arch: Architecture, ep: int, spec: str, tokens: int, cap: float | None = None) -> float:
    """The busiest of ``ep`` ranks' routed rows over the mean under ``spec`` (cost.Routing's forms;
    a recorded .npy counts every rank's tokens in it), each rank holding ``experts / ep``
    consecutive experts as Megatron places them."""
    import numpy as np
    routing = Routing(spec)
    idx = routing.recorded(arch.moe_model(), every_rank=True) if spec.endswith(".npy") else \
        routing.sample(arch.moe_model(), min(tokens, ROUTED_SAMPLE))
    rows = np.bincount(idx[idx >= 0].ravel(), minlength=arch.experts).reshape(ep, -1)
    return _busiest_share(rows, cap)


@lru_cache(maxsize=256)
def _expected_busiest(experts: int, ep: int, cv: float, cap: float | None = None) -> float:
    """E[max over ``ep`` ranks of a rank's load / the ranks' mean], ``experts / ep`` experts a
    rank, each expert's load lognormal with mean 1 and coefficient of variation ``cv`` (a fixed
    seed: the same answer every call); ``cap`` as `_busiest_share`'s."""
    import numpy as np
    sigma2 = float(np.log1p(cv * cv))
    rng = np.random.default_rng(0)
    return _busiest_share(rng.lognormal(-sigma2 / 2, sigma2 ** 0.5, size=(IMBALANCE_SAMPLES, ep, experts // ep)), cap)


def fitted_speed(hw: Hardware) -> float | None:
    """The system's fitted speed, or that of the system whose GPU it runs (`catalog.gpu_twin`);
    None for a system no published run calibrates."""
    return SYSTEM_SPEED.get(hw.name, SYSTEM_SPEED.get(gpu_twin(hw.name)))


def _speed(hw: Hardware) -> float:
    """`fitted_speed`, else 1 (GB200's)."""
    speed = fitted_speed(hw)
    return 1.0 if speed is None else speed


def speed_assumption(hw: Hardware) -> list:
    """The assumed line's note for a system no published run calibrates (A100, a user's catalog
    file): its GEMMs and attention run at GB200's sustained share of the datasheet peak."""
    if fitted_speed(hw) is not None:
        return []
    return [f"{hw.name}'s sustained speed 1.0 of its datasheet peak, GB200's (no published run on it calibrates "
            f"one; the fitted systems run at {', '.join(f'{k} {v:g}' for k, v in SYSTEM_SPEED.items())})"]


def width_factor(arch: Architecture) -> float:
    """The share of GEMM_EFFICIENCY a model's GEMMs reach for their width: d / (d + GEMM_HALF_DIM),
    d the hidden size, which every GEMM of a layer has as its inner or outer dimension (the
    projections' and the experts' inputs and outputs): DeepSeek-V3's 7168 run closer to the
    peak than Qwen3-235B's 4096, GPT-OSS's 2880 and Qwen3-30B's 2048."""
    return arch.hidden / (arch.hidden + GEMM_HALF_DIM)


def attention_speed(arch: Architecture) -> float:
    """Fused attention's speed at the model's query-key head width against 128-wide heads
    (`ATTENTION_HEAD_SPEED`, linear in between, 1 from 128 on)."""
    width = (arch.qk_nope + arch.qk_rope) if arch.mla else arch.head_dim
    (narrow, slow), (wide, fast) = sorted(ATTENTION_HEAD_SPEED.items())
    share = min(1.0, max(0.0, (width - narrow) / (wide - narrow)))
    return slow + share * (fast - slow)


def _gemm_seconds(flops: float, hw: Hardware, precision: str, rows_per_expert: float | None = None,
                  width: float = 1.0) -> float:
    peak = (hw.fp8_TFLOPS if precision == "fp8" and hw.fp8_TFLOPS else hw.bf16_TFLOPS) * 1e12 * _speed(hw)
    eff = GEMM_EFFICIENCY[precision if hw.fp8_TFLOPS else "bf16"] * width
    if rows_per_expert is not None:
        eff *= rows_per_expert / (rows_per_expert + GROUPED_HALF_ROWS)
    return flops / (peak * eff)


def layer_seconds(arch: Architecture, hw: Hardware, layout: TrainingLayout, moe: bool, ep_comm: float) -> dict:
    """Time of one layer for one micro-batch (forward + backward) on one GPU, by part."""
    t = layout.tokens_per_gpu
    f = arch.layer_flops(layout.seq, moe)
    load = routing_imbalance(arch, layout) if moe else 1.0      # the busiest EP rank's rows over the mean
    rows = t * arch.topk * layout.etp * layout.ep / arch.experts * load
    w = width_factor(arch)
    attn_gemm = _gemm_seconds(3 * t * f["attention_gemm"], hw, layout.precision, width=w)
    dense_mlp = _gemm_seconds(3 * t * f["dense_mlp"], hw, layout.precision, width=w)
    dense = attn_gemm + dense_mlp
    experts = _gemm_seconds(3 * t * f["experts"] * load, hw, layout.precision, rows, width=w) if moe else 0.0
    softmax = 3 * t * f["attention_core"] / (hw.bf16_TFLOPS * 1e12 * ATTENTION_EFFICIENCY * attention_speed(arch) * _speed(hw))
    core = softmax + 3 * t * f["linear_core"] / (hw.bf16_TFLOPS * 1e12 * LINEAR_ATTENTION_EFFICIENCY * _speed(hw))
    full_acts = sum(layer_activation_bytes(arch, _no_recompute(layout), moe).values())
    elementwise = ELEMENTWISE_PASSES * full_acts / (hw.hbm_TBps * 1e12)
    compute = dense + experts + core + elementwise
    # Recomputation: one more forward of what is recomputed.
    drop = set(layout.recompute_modules) if layout.recompute == "selective" else set()
    recompute = 0.0
    syncs = moe_syncs(layout) if moe else 0
    if layout.recompute == "full":
        recompute = compute / 3 + (ep_comm / 2 if moe else 0.0)
    else:
        if "mla_up_proj" in drop and arch.mla:
            up = 2 * t * (arch.q_lora * arch.heads * (arch.qk_nope + arch.qk_rope)
                          + arch.kv_lora * arch.heads * (arch.qk_nope + arch.v_head))
            recompute += _gemm_seconds(up, hw, layout.precision, width=w)
        if "core_attn" in drop:                  # softmax attention's core; Gated DeltaNet's is not in the module
            recompute += softmax / 3
        if "gdn_norm_out" in drop and arch.linear_layers:
            # Gated DeltaNet's gated norm again: its input and gate read, its output written.
            recompute += arch.linear_share * 3 * arch.linear_v_heads * arch.linear_v_dim * 2 * t / (hw.hbm_TBps * 1e12)
        if moe and "moe" in drop:
            recompute += experts / 3 + ep_comm / 2
        if moe and "moe_act" in drop:
            recompute += elementwise / ELEMENTWISE_PASSES / 3
        if "layernorm" in drop:
            recompute += elementwise / ELEMENTWISE_PASSES / 4
        if not moe and "mlp" in drop:
            recompute += _gemm_seconds(t * f["dense_mlp"], hw, layout.precision, width=w)
        if moe and "shared_experts" in drop and arch.shared_ffn:
            recompute += _gemm_seconds(t * 6 * arch.hidden * arch.shared_ffn, hw, layout.precision, width=w)
    comm = {}
    if syncs:
        comm["host_sync"] = syncs * SYNC_S_PER_MOE_LAYER
    if moe and ep_comm:
        if layout.ep_overlap and layout.micro_batches >= 2:
            attention_side = attn_gemm + core + elementwise / 2 + recompute
            mlp_side = experts + dense_mlp + elementwise / 2
            paired = ep_overlap_exposed(ep_comm, attention_side, mlp_side, layout.delay_wgrad,
                                        comm_sms(layout) / hw.sms)
            alone = unpaired_share(layout)
            comm["ep"] = alone * ep_comm + (1 - alone) * paired
        elif layout.shared_expert_overlap and arch.shared_ffn:
            shared = _gemm_seconds(3 * t * 6 * arch.hidden * arch.shared_ffn, hw, layout.precision, width=w)
            comm["ep"] = shared_overlap_exposed(ep_comm, shared, comm_sms(layout) / hw.sms)
        else:
            comm["ep"] = ep_comm
    if layout.fsdp:
        comm["fsdp"] = max(0.0, fsdp_seconds(arch, hw, layout, moe) - compute - recompute)
    if layout.offload_modules:
        moved = offloaded_bytes(arch, layout, moe) / host_link_Bps(hw)
        comm["offload"] = max(0.0, moved - (compute + recompute) / 3) + max(0.0, moved - 2 * (compute + recompute) / 3)
    if layout.tp > 1:
        link = "nvlink" if layout.tp <= hw.domain_size else "nic"
        size = layout.seq * layout.micro_batch / layout.cp * arch.hidden * 2
        collectives = 6 if moe and layout.etp == 1 else 12
        tp = collectives * (layout.tp - 1) / layout.tp * size / link_bandwidth(hw, link, None)
        comm["tp"] = tp * (1 - TP_OVERLAP_HIDES if layout.tp_comm_overlap else 1.0)
    if layout.cp > 1:
        kv_dim = arch.heads * (arch.qk_nope + arch.qk_rope + arch.v_head) if arch.mla else 2 * arch.kv_heads * arch.head_dim
        link = "nvlink" if layout.tp * layout.cp <= hw.domain_size else "nic"
        cp = 3 * (layout.cp - 1) * t * layout.tp * kv_dim * 2 / layout.tp / link_bandwidth(hw, link, None)
        comm["cp"] = max(0.0, cp - core)
    return {"gemm": dense + experts, "attention": core, "elementwise": elementwise, "recompute": recompute, **comm}


def cpu_offload_seconds(arch: Architecture, hw: Hardware, layout: TrainingLayout, dense_layers: int,
                        moe_layers: int, moe_layer: dict, dense_layer: dict) -> float:
    """Layer-level cpu_offloading's exposed copies for one micro-batch: each offloaded layer
    (`memory.cpu_offloaded_layers`) sends its saved activations to the host beside the next
    layer's forward and brings them back beside the backward before it; what a copy takes
    beyond that compute is exposed."""
    total = 0.0
    dense_off, moe_off = cpu_offloaded_layers(layout, dense_layers, moe_layers)
    for count, moe, part in ((dense_off, False, dense_layer), (moe_off, True, moe_layer)):
        moved = sum(layer_activation_bytes(arch, layout, moe).values()) / host_link_Bps(hw)
        compute = part["gemm"] + part["attention"] + part["elementwise"]
        total += count * (max(0.0, moved - compute / 3) + max(0.0, moved - 2 * compute / 3))
    return total


def launch_share(layout: TrainingLayout, moe: bool) -> float:
    """The share of a layer's eager launch time the host spends under ``layout``'s CUDA graphs:
    each captured part (`LAUNCH_SHARES`; a MoE layer's MLP side only with the ``moe`` scope) at
    `GRAPHED_LAUNCH_SHARE` of its eager launches."""
    shares = LAUNCH_SHARES["moe" if moe else "dense"]
    captured = sum(share for part, share in shares.items() if part in layout.graph_scopes)
    return 1.0 - captured * (1.0 - GRAPHED_LAUNCH_SHARE)


def moe_syncs(layout: TrainingLayout) -> int:
    """Host synchronisations of one MoE layer and micro-batch: its forward's, and its recomputed
    forward's under full recompute or the ``moe`` module recomputed; none with full-iteration
    CUDA graphs (sync-free MoE), nor padded to capacity (moe_pad_expert_input_to_capacity: every
    expert's row count is known on the host, so Megatron's dispatchers copy nothing back)."""
    if layout.sync_free or layout.pad_to_capacity:
        return 0
    recomputed = layout.recompute == "full" or (layout.recompute == "selective" and "moe" in layout.recompute_modules)
    return 1 + recomputed


def unpaired_share(layout: TrainingLayout) -> float:
    """Share of a step's micro-batch chunks that EP overlap cannot pair: combined 1F1B pairs a
    forward with another micro-batch's backward only in the steady phase, so the first pipeline
    rank's warm-up forwards (one without pipelining; ``2 (PP - 1) + (VPP - 1) PP`` in Megatron's
    interleaved schedule) and as many cool-down backwards run alone, their exchanges exposed."""
    chunks = layout.micro_batches * layout.vpp
    warmup = 1 if layout.pp == 1 else 2 * (layout.pp - 1) + (layout.vpp - 1) * layout.pp
    return min(1.0, warmup / chunks)


def ep_overlap_exposed(ep_comm: float, attention: float, mlp: float, delay_wgrad: bool, sm_share: float) -> float:
    """What EP overlap leaves of a layer's dispatch + combine (forward and backward, ``ep_comm``)
    in Megatron's combined 1F1B, the forward of one micro-batch beside the backward of another:
    each of the four exchanges runs beside one compute chunk of the other micro-batch (forward
    dispatch beside the backward MLP; backward combine beside the forward attention; backward
    dispatch beside the forward MLP; forward combine beside the backward attention). A forward
    chunk is a third of that side's compute, a backward two thirds; ``delay_wgrad`` moves the
    experts' weight gradients (a third) from beside the forward dispatch to beside the backward
    one. What a chunk cannot cover stays exposed; of what it can, overlap hides `EP_OVERLAP_HIDES`,
    and while they overlap the compute runs on the SMs the exchange leaves it (``sm_share`` of
    them held by the dispatcher's kernels)."""
    q = ep_comm / 4
    chunks = (mlp / 3 if delay_wgrad else 2 * mlp / 3, attention / 3,
              2 * mlp / 3 if delay_wgrad else mlp / 3, 2 * attention / 3)
    return sum(pair_exposed(q, chunk, sm_share) for chunk in chunks)


def shared_overlap_exposed(ep_comm: float, shared: float, sm_share: float) -> float:
    """What moe_shared_expert_overlap leaves of a layer's dispatch + combine (forward and
    backward, ``ep_comm``): Megatron runs the shared experts (``shared`` seconds, forward +
    backward) on a side stream, their first projection beside the dispatch and their second
    beside the combine, in the forward (a third of their time) and again in the backward (two
    thirds); each of the four exchanges beside one such chunk, as `pair_exposed` costs it."""
    q = ep_comm / 4
    return sum(pair_exposed(q, chunk, sm_share) for chunk in (shared / 6, shared / 6, shared / 3, shared / 3))


def pair_exposed(comm: float, chunk: float, sm_share: float) -> float:
    """What overlap leaves of one exchange (``comm`` seconds) beside one compute chunk: the part
    the chunk cannot cover, the part of the rest overlap does not hide (1 - `EP_OVERLAP_HIDES`),
    and the compute slowed on the SMs the exchange leaves it (``sm_share`` held) while they overlap."""
    covered = min(comm, chunk)
    hidden = EP_OVERLAP_HIDES * covered
    return max(0.0, comm - chunk) + covered - hidden + hidden * sm_share / (1 - sm_share)


def fsdp_seconds(arch: Architecture, hw: Hardware, layout: TrainingLayout, moe: bool) -> float:
    """Megatron-FSDP's collectives of one layer and micro-batch: the weights all-gathered for the
    forward and again for the backward (``optim_grads_params``), the gradients reduce-scattered
    (``optim_grads`` and ``optim_grads_params``), over DP x CP for dense parameters and expert-DP
    for the routed experts (each split over the optimizer instances: HSDP); the link is the NIC
    once the group leaves the NVLink domain."""
    shards = layout_fields.FSDP_SHARDS.get(layout.fsdp, ())
    dense = (arch.moe_layer_dense_params() if moe else arch.dense_layer_params()) / layout.tp
    experts = arch.experts // layout.ep * arch.expert_params() / layout.etp if moe else 0.0
    dense_group, expert_group = layout.shard_groups
    moved = dense * (1 - 1 / dense_group) + experts * (1 - 1 / expert_group)
    per_param = (2 * 2 if "weights" in shards else 0) + (layout.grad_reduce_bytes if "gradients" in shards else 0)
    link = "nic" if layout.gpus // layout.pp > hw.domain_size else "nvlink"
    return moved * per_param / link_bandwidth(hw, link, None)


def _no_recompute(layout: TrainingLayout) -> TrainingLayout:
    from dataclasses import replace
    return replace(layout, recompute=None, recompute_modules=())


def estimate(arch: Architecture, hw: Hardware, layout: TrainingLayout) -> dict:
    """Everything `expertrail estimate` prints, as data."""
    layout = layout.for_model(arch.layers, arch.mtp_layers, arch.output_layers_worth(layout.seq))
    problems = layout.problems(arch.experts, arch.layers) + arch.split_problems(layout.tp, layout.etp)
    if layout.precision == "fp8" and not hw.fp8_TFLOPS:
        problems.append(f"FP8 on {hw.name}, which has no FP8 tensor cores (fp8_TFLOPS 0; Transformer Engine raises): "
                        "train in bf16")
    if layout.recompute == "selective":
        problems += arch.recompute_problems(layout.recompute_modules)
    if problems:
        raise ConfigError("; ".join(problems))
    domain = domain_for(hw, layout.ep) if layout.ep > 1 else 1
    ranks = memory(arch, layout, domain)
    busiest = max(ranks, key=lambda s: s.total_GB)
    usable = usable_GB(hw.hbm_GB)
    ep_comm, algorithm = dispatch_seconds(arch, hw, layout)
    moe_layer = layer_seconds(arch, hw, layout, True, ep_comm)
    dense_layer = layer_seconds(arch, hw, layout, False, 0.0)
    t = layout.tokens_per_gpu
    output_s = _gemm_seconds(3 * t * 2 * arch.embedding_params() / 1, hw, "bf16", width=width_factor(arch))
    host_layer = HOST_S_PER_LAYER["grace" if hw.name in GRACE_HOSTED else "x86"]
    host_moe, host_dense = host_layer * launch_share(layout, True), host_layer * launch_share(layout, False)
    pp_link = "nic" if layout.gpus // layout.pp >= hw.domain_size and layout.gpus > hw.domain_size else "nvlink"
    pp_send = 2 * t * arch.hidden * 2 / link_bandwidth(hw, pp_link, None) * layout.vpp if layout.pp > 1 else 0.0
    per_rank = []
    stages = stage_layers(layout, arch.layers, arch.mtp_layers, arch.dense_layers)
    for rank, (layers, dense_n, emb, out, mtp) in enumerate(stages):
        moe_n = layers - dense_n + mtp
        parts = {}
        for share, part in ((moe_n, moe_layer), (dense_n, dense_layer)):
            for k, v in part.items():
                parts[k] = parts.get(k, 0.0) + share * v
        if out:
            parts["gemm"] += output_s * (1 + mtp)
        if layout.cpu_offload_layers and rank == 0:
            parts["offload"] = parts.get("offload", 0.0) + cpu_offload_seconds(arch, hw, layout, dense_n,
                                                                                layers - dense_n, moe_layer, dense_layer)
        parts["pipeline"] = pp_send
        gpu = sum(parts.values())
        host = host_moe * moe_n + host_dense * dense_n
        per_rank.append({"rank": rank, "gpu_s": gpu, "host_s": host, "micro_batch_s": max(gpu, host), "parts": parts,
                         "layers": layers + mtp, "moe_syncs": moe_n * moe_syncs(layout)})
    slowest = max(per_rank, key=lambda r: r["micro_batch_s"])
    m = layout.micro_batches
    bubble = (layout.pp - 1) / layout.vpp * slowest["micro_batch_s"]
    # Data-parallel traffic of the busiest rank: reduce-scatter of FP32 gradients, all-gather of BF16 weights.
    dense_params = (busiest.weights_GB * GB / 2)
    expert_share = _expert_share(arch, layout, stages[busiest.rank])
    dp_link = "nic" if layout.gpus > hw.domain_size else "nvlink"
    bw = link_bandwidth(hw, dp_link, None)
    # With several optimizer instances each shard group is DP / n, and the n replicas of a shard
    # all-reduce its gradients with each other.
    dense_group, expert_group = layout.shard_groups
    n = layout.optimizer_instances
    within = dense_params * ((1 - expert_share) * (1 - 1 / dense_group) + expert_share * (1 - 1 / expert_group))
    across = dense_params * ((1 - expert_share) / dense_group + expert_share / expert_group) * 2 * (n - 1) / n
    if "gradients" in layout_fields.FSDP_SHARDS.get(layout.fsdp, ()):
        within = 0.0                                  # reduce-scattered every micro-batch (the fsdp part)
    dp_bytes = within * (layout.grad_reduce_bytes + 2) + across * layout.grad_reduce_bytes
    dp_s = dp_bytes / bw * DP_EXPOSED[layout.overlap_grad_reduce]
    state_bytes = 4 + layout.optimizer_state_bytes                  # FP32 main weight and the moments
    optimizer_s = busiest.optimizer_params * (1 - layout.optimizer_offload) * state_bytes * 3 / (hw.hbm_TBps * 1e12)
    offload_optimizer_s = 0.0
    host = host_link_Bps(hw)
    if layout.optimizer_offload:
        # The host's share (HybridDeviceOptimizer): gradients down, the updated FP32 main weights
        # back up into the GPU's copy, and the host's Adam step.
        params = busiest.optimizer_params * layout.optimizer_offload
        copies, step = params * (layout.main_grad_bytes + 4) / host, params / CPU_ADAM_PARAMS_PER_S
        # overlap_cpu_optimizer_d2h_h2d runs the host's step beside the copies, bucket by bucket.
        offload_optimizer_s = max(copies, step) if layout.optimizer_offload_overlap else copies + step
    if layout.optimizer_state_offload:
        # Kept on the host between updates: back for the update and out again after it, counted exposed.
        offload_optimizer_s = 2 * busiest.optimizer_params * layout.optimizer_state_offload * state_bytes / host
    optimizer_s += offload_optimizer_s
    step = m * slowest["micro_batch_s"] + bubble + dp_s + optimizer_s
    tokens = m * layout.micro_batch * layout.seq * layout.dp
    model_flops = tokens * arch.flops_per_token(layout.seq)
    tflops = model_flops / step / layout.gpus / 1e12
    fits = busiest.total_GB <= usable
    parts = slowest["parts"]
    # The step by term: each micro-batch part over every micro-batch, then the bubble, the
    # host's excess over the GPU where launches set the pace, data-parallel traffic, optimizer.
    terms = {k: m * parts.get(k, 0.0) for k in dict.fromkeys(MICRO_BATCH_TERMS + tuple(parts))}
    terms["pp_bubble"] = bubble
    terms["host_bound"] = m * max(0.0, slowest["host_s"] - slowest["gpu_s"])
    terms["dp"] = dp_s
    terms["optimizer"] = optimizer_s - offload_optimizer_s
    terms["optimizer_offload"] = offload_optimizer_s
    terms = {k: float(v) for k, v in terms.items()}
    result = {
        "model": arch.name, "hardware": hw.name, "gpus": layout.gpus,
        "layout": {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp, "cp": layout.cp, "dp": layout.dp,
                   "ep": layout.ep, "etp": layout.etp, "edp": layout.edp, "micro_batch": layout.micro_batch,
                   "global_batch": m * layout.micro_batch * layout.dp, "micro_batches": m, "seq": layout.seq,
                   "precision": layout.precision, "recompute": layout.recompute,
                   "recompute_modules": list(layout.recompute_modules), "dispatcher": layout.dispatcher,
                   "flex_backend": layout.flex_backend, "algorithm": algorithm, "ep_overlap": layout.ep_overlap,
                   "delay_wgrad": layout.delay_wgrad, "graph_scopes": list(layout.graph_scopes),
                   "fsdp": layout.fsdp, "optimizer_instances": layout.optimizer_instances,
                   "routing_imbalance": routing_imbalance(arch, layout)},
        "assumed": list(arch.assumed) + list(layout.assumed) + routing_assumption(arch, layout)
                   + recipe_assumption(hw, layout) + speed_assumption(hw),
        "not_modelled": list(layout.not_modelled) + list(arch.not_modelled),
        "fits": fits, "peak_memory_GB": busiest.total_GB, "usable_memory_GB": usable, "hbm_GB": hw.hbm_GB,
        "memory": {"busiest_rank": busiest.rank, "weights_GB": busiest.weights_GB,
                   "gradients_GB": busiest.gradients_GB, "optimizer_GB": busiest.optimizer_GB,
                   "activations_GB": busiest.activations_GB, "dispatcher_GB": busiest.dispatcher_GB,
                   "in_flight_layers_per_layer": busiest.in_flight,
                   "per_rank_GB": [s.total_GB for s in ranks],
                   "activation_per_layer_GB": {k: v / GB for k, v in
                                               layer_activation_bytes(arch, layout, True).items()}},
        "step_time_s": step, "tflops_per_gpu": tflops, "tokens_per_s_per_gpu": tokens / step / layout.gpus,
        "model_flops_per_token": arch.flops_per_token(layout.seq),
        "step": {"micro_batches_s": m * slowest["micro_batch_s"], "bubble_s": bubble, "dp_exposed_s": dp_s,
                 "optimizer_s": optimizer_s, "slowest_rank": slowest["rank"],
                 "micro_batch_parts_s": dict(parts), "host_s": slowest["host_s"], "gpu_s": slowest["gpu_s"],
                 "layers": slowest["layers"], "moe_syncs": slowest["moe_syncs"], "ep_comm_per_layer_s": ep_comm},
        "terms_s": terms,
    }
    result["wall"], result["wall_reason"] = wall(result, busiest, usable)
    return result


# A micro-batch's parts, as `layer_seconds` and the pipeline rank add them: every one is a key of
# `terms_s` (0.0 where the layout has none), so --json has one shape whatever the layout.
MICRO_BATCH_TERMS = ("gemm", "attention", "elementwise", "recompute", "host_sync", "ep", "tp", "cp", "pipeline",
                     "fsdp", "offload")


def routing_assumption(arch: Architecture, layout: TrainingLayout) -> list:
    """The assumed line's note on a natural router: the busiest EP rank's share it is costed at
    (none when every expert is padded to its capacity: the rows are set, not routed)."""
    if not layout.natural_routing or layout.ep <= 1 or layout.pad_to_capacity:
        return []
    if layout.expert_loads:
        source = "the recorded loads"
    elif layout.routing:
        source = f"--routing {layout.routing}"
    else:
        trained = {"global_batch": "a router balanced over the whole batch, as Qwen3's and DeepSeek-V3's",
                   "micro_batch": "a router balanced within each micro-batch, as Mixtral's and Megatron's aux_loss"}
        source = (f"{trained[arch.router_balance]}; docs/cost-model.md, 'Natural routing'; --routing gives your "
                  "router's loads")
        per_rank, calibrated = arch.experts // layout.ep, NATURAL_CALIBRATED_EXPERTS_PER_RANK[arch.router_balance]
        if per_rank != calibrated:
            experts = "expert" if calibrated == 1 else "experts"
            source = (f"calibrated at {calibrated} {experts} a rank, so at {per_rank} the load model's extrapolation; "
                      f"{source}")
    capped = (f", at most {layout.capacity_factor:g}x its even share an expert (moe_expert_capacity_factor; the "
              "rest dropped)") if layout.capacity_factor is not None else ""
    return [f"a natural router's loads{capped}: the busiest of {layout.ep} EP ranks takes "
            f"{routing_imbalance(arch, layout):.2f}x the mean rows in each MoE layer ({source}; "
            "moe_router_force_load_balancing=true gives every rank its even share)"]


# The FP8 recipes the fit rows ran, by GPU generation: GEMM_EFFICIENCY["fp8"] is theirs.
FITTED_FP8_RECIPES = {"hopper": "tensorwise", "blackwell": "mxfp8"}


def recipe_assumption(hw: Hardware, layout: TrainingLayout) -> list:
    """The assumed line's note when an FP8 run uses a recipe the fit rows did not run on its
    GPU generation (FP8 current scaling on Hopper, MXFP8 on Blackwell): its GEMMs are costed at
    the fitted recipe's efficiency (NVFP4 too: ``fp4``). Megatron's default recipe is delayed scaling."""
    if layout.precision != "fp8" or hw.arch not in FITTED_FP8_RECIPES:
        return []
    if layout.fp8_recipe == "nvfp4":
        return [f"fp4 (NVFP4 GEMMs) costed at the FP8 efficiency fitted on {FITTED_FP8_RECIPES[hw.arch]} runs: no "
                "published NVFP4 run of a MoE model calibrates its speed"]
    recipe, fitted = layout.fp8_recipe or "delayed", FITTED_FP8_RECIPES[hw.arch]
    if recipe == fitted:
        return []
    return [f"fp8_recipe={recipe} costed at the efficiency fitted on {fitted} runs ({hw.arch})"]


def _expert_share(arch: Architecture, layout: TrainingLayout, stage: tuple) -> float:
    layers, dense_n, emb, out, mtp = stage
    moe = layers - dense_n + mtp
    experts = moe * arch.experts / layout.ep * arch.expert_params() / layout.etp
    dense = (layers * arch.moe_layer_dense_params() + (emb + out) * arch.embedding_params()) / layout.tp
    return experts / (experts + dense) if experts + dense else 0.0


# A micro-batch's parts that are data movement left exposed beside the compute.
EXPOSED_PARTS = ("ep", "tp", "cp", "fsdp", "offload", "pipeline")


def wall(result: dict, busiest, usable: float) -> tuple:
    """(memory | communication | host | compute, why): the limit this configuration runs into."""
    mem = result["memory"]
    if not result["fits"]:
        top = max(("weights", "gradients", "optimizer", "activations", "dispatcher"), key=lambda k: mem[f"{k}_GB"])
        return "memory", (f"rank {busiest.rank} needs {result['peak_memory_GB']:.1f} GB of {usable:.1f} usable "
                          f"({result['hbm_GB']:.0f} GB HBM less the reserve); the largest part is {top} "
                          f"({mem[top + '_GB']:.1f} GB)")
    step = result["step"]
    parts = step["micro_batch_parts_s"]
    comm = sum(parts.get(k, 0.0) for k in EXPOSED_PARTS) + step["dp_exposed_s"] / max(
        1, result["layout"]["micro_batches"])
    if step["host_s"] >= step["gpu_s"]:
        scopes = result["layout"]["graph_scopes"]
        fix = "CUDA graphs or larger micro-batches" if not scopes else \
            "larger micro-batches" if set(layout_fields.WHOLE_LAYER) <= set(scopes) else \
            f"more of each layer in CUDA graphs (now {', '.join(scopes)}) or larger micro-batches"
        return "host", (f"kernel launches take {step['host_s'] * 1e3:.1f} ms per micro-batch against "
                        f"{step['gpu_s'] * 1e3:.1f} ms of GPU work: {fix}")
    if comm > 0.25 * step["gpu_s"]:
        biggest = max(EXPOSED_PARTS, key=lambda k: parts.get(k, 0.0))
        return "communication", (f"{comm / step['gpu_s']:.0%} of a micro-batch is exposed communication, most of it "
                                 f"{biggest} ({parts.get(biggest, 0.0) * 1e3:.1f} ms)")
    headroom = usable - result["peak_memory_GB"]
    if headroom < 0.1 * usable:
        return "memory", (f"fits with {headroom:.1f} GB to spare: a larger micro-batch or less recompute will not")
    return "compute", (f"GEMMs and attention take {(parts['gemm'] + parts['attention']) / step['gpu_s']:.0%} of a "
                       "micro-batch; exposed communication is small")


def format_estimate(r: dict) -> str:
    lay, mem, st = r["layout"], r["memory"], r["step"]
    lines = [f"estimate: {r['model']} on {r['gpus']} x {r['hardware']}: TP {lay['tp']} PP {lay['pp']} VPP {lay['vpp']} "
             f"CP {lay['cp']} DP {lay['dp']} | EP {lay['ep']} ETP {lay['etp']} EDP {lay['edp']}, micro-batch "
             f"{lay['micro_batch']} x {lay['micro_batches']}, seq {lay['seq']}, {lay['precision']}, recompute "
             f"{lay['recompute'] or 'none'}" + (f" ({', '.join(lay['recompute_modules'])})" if lay['recompute_modules'] else "")
             + f", dispatcher {lay['dispatcher']}" + (f" + {lay['flex_backend']}" if lay['flex_backend'] else "")
             + (", EP overlap" + (" + delayed wgrad" if lay["delay_wgrad"] else "") if lay["ep_overlap"] else "")
             + (f", Megatron-FSDP {lay['fsdp']}" if lay["fsdp"] else "")
             + (f", {lay['optimizer_instances']} optimizer instances" if lay["optimizer_instances"] > 1 else ""),
             ""]
    verdict = "fits" if r["fits"] else "DOES NOT FIT"
    lines.append(f"memory, busiest pipeline rank ({mem['busiest_rank']}): {r['peak_memory_GB']:.1f} GB of "
                 f"{r['usable_memory_GB']:.1f} usable ({r['hbm_GB']:.0f} GB HBM less the reserve): {verdict}")
    for k in ("weights", "gradients", "optimizer", "activations", "dispatcher"):
        lines.append(f"  {k:<12} {mem[k + '_GB']:8.1f} GB")
    lines.append(f"  (activations: {mem['in_flight_layers_per_layer']:.2f} micro-batches in flight per layer; per MoE "
                 "layer and micro-batch " + ", ".join(f"{k} {v:.2f}" for k, v in mem["activation_per_layer_GB"].items())
                 + " GB)")
    lines += ["", f"step: {r['step_time_s']:.2f} s = {lay['micro_batches']} micro-batches "
                  f"{st['micro_batches_s']:.2f} s + bubble {st['bubble_s']:.2f} s + exposed DP {st['dp_exposed_s']:.2f} s "
                  f"+ optimizer {st['optimizer_s']:.2f} s",
              "  one micro-batch on the slowest rank: " + ", ".join(
                  f"{k} {v * 1e3:.1f} ms" for k, v in st["micro_batch_parts_s"].items() if v > 0)]
    lines.append(f"throughput: {r['tflops_per_gpu']:.0f} TFLOPS per GPU (model FLOPs, Megatron's count), "
                 f"{r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU")
    lines.append(f"wall: {r['wall']}: {r['wall_reason']}")
    if r["assumed"]:
        lines.append(f"assumed (not in the configuration): {', '.join(r['assumed'])}")
    if r.get("not_modelled"):
        lines.append(f"not modelled (set, but the estimate leaves them out): {', '.join(r['not_modelled'])}")
    return "\n".join(lines)
