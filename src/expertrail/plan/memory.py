"""GPU memory of a training run, per pipeline rank: weights, gradients, optimizer states,
activations of the in-flight micro-batches, dispatcher buffers; the busiest rank decides.

Counted per parameter (Megatron-Core, BF16 training): BF16 weights (2 bytes), FP32 main
gradients (4; ``main_grads_dtype`` with the precision-aware optimizer), and with the
distributed optimizer FP32 main weights and Adam's two moments (4 + 8, or the precision-aware
optimizer's dtypes) sharded over the data-parallel group: DP x CP for dense parameters,
expert-DP (GPUs / (PP x EP x ETP)) for the routed experts. Without it every rank keeps all 18.

Activations are what a layer keeps for its backward, per token, counted tensor by tensor
(`layer_activation_bytes`), with sequence parallelism sharding them over TP; routed-expert
rows are K per token. GEMM inputs are kept in FP8 (1 byte) under an FP8 recipe. Selective
recompute drops the tensors of its modules, full recompute keeps each checkpointed layer's
input. The interleaved 1F1B schedule keeps on pipeline rank r, before its first backward,
(PP - r - 1) x 2 + (VPP - 1) x PP + 1 chunks of micro-batches (each chunk a 1/VPP share of
the rank's layers); without VPP, min(micro-batches, PP - r) whole micro-batches.

Megatron-FSDP (``data_parallel_sharding_strategy``) keeps 1/DP of what it shards (optimizer
states; with ``optim_grads`` the gradients; with ``optim_grads_params`` the weights too), DP
being DP x CP for dense parameters and expert-DP for the routed experts, plus the unsharded
working set: two layers' weights (the one computing and the one prefetched) and one layer's
gradients before their reduce-scatter. Layer-level ``cpu_offloading`` (PP 1, no recompute) keeps
the saved activations of the model's first ``cpu_offloading_num_layers`` layers on the host but
for the layer in transit. Fine-grained activation offloading moves the tensors of
its ``offload_modules`` to the host; two layers' worth stay on the GPU (one going out, one
coming back). ``optimizer_cpu_offload`` keeps its share of the Adam moments on the host, where
Megatron's HybridDeviceOptimizer steps them; the FP32 main weights stay on the GPU (measured:
a third of the optimizer's memory stays, docs/cost-model.md, "CPU offloading"). ``chunked_optimizer_state_offload`` keeps its share there
between updates: the update, after the step's activations are freed, brings the main weights
back whole and the moments through a window of ``optimizer_state_offload_chunk_size_mb`` (all
at once at 0), so they count only where they exceed the activations.
"""
from __future__ import annotations

from dataclasses import dataclass

from .architecture import Architecture
from .layout import DEEPEP_LIKE, FSDP_SHARDS, TrainingLayout, stage_layers

GB = 1e9
RESERVE_FIXED_GB = 2.0          # CUDA context, NCCL communicators and their buffers
RESERVE_FRACTION = 0.03         # allocator fragmentation (expandable segments) and transient workspaces
DEEPEP_BUFFER_GB = 1.0          # NVLink + RDMA buffers DeepEP's size hints give at these sizes
LOGITS_BYTES = 6                # BF16 logits and their FP32 softmax / gradient, per vocab entry


def usable_GB(hbm_GB: float) -> float:
    """What a run may fill: HBM less the stated reserve."""
    return hbm_GB * (1 - RESERVE_FRACTION) - RESERVE_FIXED_GB


def layer_activation_bytes(arch: Architecture, layout: TrainingLayout, moe: bool) -> dict:
    """Bytes one layer keeps for its backward per micro-batch on one GPU, by part."""
    h, t = arch.hidden, layout.tokens_per_gpu
    gemm_in = 1 if layout.precision == "fp8" else 2
    drop = set(layout.recompute_modules) if layout.recompute == "selective" else set()
    parts = {"norms": 2 * h * 2 * t}                                    # both RMSNorm inputs (the residual stream)
    if "layernorm" not in drop:
        parts["norm_outputs"] = 2 * h * gemm_in * t
    if arch.mla:
        latents = (arch.q_lora + arch.kv_lora) * (2 + gemm_in) + arch.qk_rope * 2
        up = arch.heads * (2 * (arch.qk_nope + arch.qk_rope) + arch.v_head) * 2
        parts["attention"] = latents * t + (0 if "mla_up_proj" in drop else up * t) \
            + arch.heads * (arch.v_head * gemm_in + 4) * t
    else:
        qkv = (arch.heads + 2 * arch.kv_heads) * arch.head_dim * 2
        gate = arch.heads * arch.head_dim * 2 if arch.attention_gate else 0       # the output gate's input
        parts["attention"] = (qkv + gate + arch.heads * (arch.head_dim * gemm_in + 4)) * t
    if arch.linear_layers:
        # Gated DeltaNet, averaged in by its share of the layers: the input projection's outputs,
        # the convolution's, the gated norm's input and gate, the output projection's input (the
        # gated norm's output, which recompute_modules gdn_norm_out recomputes instead).
        qk, v, in_proj, conv = arch.linear_widths()
        linear = ((in_proj + conv + 2 * v) * 2 + (0 if "gdn_norm_out" in drop else v * gemm_in)) * t
        parts["attention"] = (1 - arch.linear_share) * parts["attention"] + arch.linear_share * linear
    if moe:
        if "moe" not in drop:
            rows = arch.topk * t * (layout.capacity_factor if layout.pad_to_capacity else 1)
            ffn = 2 * arch.moe_ffn * 2 + (0 if "moe_act" in drop else arch.moe_ffn * gemm_in)
            # Each of the ETP ranks of an expert keeps the whole input row and 1/ETP of its FFN.
            parts["experts"] = rows * (layout.etp * h * gemm_in + ffn + 4) + arch.experts * 4 * t
        if arch.shared_ffn and not drop & {"shared_experts", "moe"}:
            parts["shared_expert"] = (2 * arch.shared_ffn * 2 + arch.shared_ffn * gemm_in) * t
    elif "mlp" not in drop:
        parts["mlp"] = (2 * arch.ffn * 2 + arch.ffn * gemm_in) * t
    return parts


def offloaded_bytes(arch: Architecture, layout: TrainingLayout, moe: bool) -> float:
    """Bytes of one layer's saved activations (per micro-batch, one GPU) that fine-grained
    activation offloading moves to the host: each of ``offload_modules`` takes its tensors of
    `layer_activation_bytes` (norm inputs, QKV input, core attention's inputs, the output
    projection's input, expert FC1's input, the activation function's input)."""
    if not layout.offload_modules:
        return 0.0
    h, t = arch.hidden, layout.tokens_per_gpu
    gemm_in = 1 if layout.precision == "fp8" else 2
    parts = layer_activation_bytes(arch, layout, moe)
    drop = set(layout.recompute_modules) if layout.recompute == "selective" else set()
    proj_in = arch.heads * ((arch.v_head if arch.mla else arch.head_dim) * gemm_in + 4) * t
    out = 0.0
    for module in layout.offload_modules:
        if module in ("attn_norm", "mlp_norm"):
            out += parts["norms"] / 2
        elif module == "qkv_linear":
            out += parts.get("norm_outputs", 0.0) / 2
        elif module == "core_attn":
            out += max(0.0, parts["attention"] - proj_in)
        elif module == "attn_proj":
            out += proj_in
        elif module == "expert_fc1" and moe and "experts" in parts:
            out += arch.topk * t * layout.etp * h * gemm_in
        elif module == "moe_act" and moe and "experts" in parts and "moe_act" not in drop:
            out += arch.topk * t * 2 * arch.moe_ffn * 2
    return out


def cpu_offloaded_layers(layout: TrainingLayout, dense_layers: int, moe_layers: int) -> tuple:
    """(dense, MoE) layers whose activations layer-level cpu_offloading keeps on the host: the
    model's first ``cpu_offloading_num_layers`` layers, the dense ones first."""
    dense = min(layout.cpu_offload_layers, dense_layers)
    return dense, min(layout.cpu_offload_layers - dense, moe_layers)


def in_flight_chunks(layout: TrainingLayout, rank: int) -> float:
    """Layers' worth of activations rank ``rank`` holds at its peak, per layer it owns."""
    pp, vpp, m = layout.pp, layout.vpp, layout.micro_batches
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(min(m, pp - rank))
    chunks = min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)
    return chunks / vpp


@dataclass
class StageMemory:
    rank: int
    layers: int
    weights_GB: float
    gradients_GB: float
    optimizer_GB: float
    activations_GB: float
    dispatcher_GB: float
    in_flight: float
    optimizer_params: float = 0.0   # parameters whose optimizer states this rank keeps (before CPU offload)

    @property
    def total_GB(self) -> float:
        return self.weights_GB + self.gradients_GB + self.optimizer_GB + self.activations_GB + self.dispatcher_GB


def stage_memory(arch: Architecture, layout: TrainingLayout, rank: int, stage: tuple, domain: int) -> StageMemory:
    layers, dense_layers, has_embedding, has_output, mtp = stage
    moe_layers = layers - dense_layers
    moe_share = moe_layers / layers if layers else 0.0
    dense = (dense_layers * arch.dense_layer_params() + moe_layers * arch.moe_layer_dense_params()) / layout.tp
    tables = has_embedding + has_output - (arch.tied_embeddings and has_embedding and has_output)   # tied: one
    dense += tables * arch.embedding_params() / layout.tp
    experts = (moe_layers + mtp) * (arch.experts // layout.ep) * arch.expert_params() / layout.etp
    dense += mtp * (arch.moe_layer_dense_params() + 2 * arch.hidden * arch.hidden) / layout.tp
    main = 4 + layout.optimizer_state_bytes
    shards = FSDP_SHARDS.get(layout.fsdp, ()) if layout.fsdp else ()
    dense_dp, expert_dp = layout.shard_groups
    if layout.distributed_optimizer or "optimizer" in shards:
        dense_opt, expert_opt = layout.optimizer_groups
        optimizer = dense * main / dense_opt + experts * main / expert_opt
    else:
        optimizer = (dense + experts) * main
    optimizer_params = optimizer / main
    optimizer -= optimizer_params * layout.optimizer_state_bytes * layout.optimizer_offload
    # Kept on the host between updates (chunked_optimizer_state_offload): the update brings the
    # FP32 main weights back whole and the moments through a window of optimizer_state_chunk_MB.
    away = optimizer * layout.optimizer_state_offload
    optimizer -= away
    staged = 0.0
    if away:
        master, moments = away * 4 / main, away * layout.optimizer_state_bytes / main
        chunk = layout.optimizer_state_chunk_MB * 1e6
        staged = master + (min(moments, chunk) if chunk else moments)
    # One layer's parameters (for FSDP's unsharded working set).
    per_layer = (arch.moe_layer_dense_params() / layout.tp + arch.experts // layout.ep * arch.expert_params() / layout.etp
                 if moe_layers else arch.dense_layer_params() / layout.tp)
    if "weights" in shards:
        weights = (dense / dense_dp + experts / expert_dp + 2 * per_layer) * 2
    else:
        weights = (dense + experts) * 2
    if "gradients" in shards:
        gradients = (dense / dense_dp + experts / expert_dp + per_layer) * layout.main_grad_bytes
    else:
        gradients = (dense + experts) * layout.main_grad_bytes
    per_moe = sum(layer_activation_bytes(arch, layout, True).values())
    per_dense = sum(layer_activation_bytes(arch, layout, False).values())
    flight = in_flight_chunks(layout, rank)
    if layout.offload_modules and layout.recompute != "full":
        # Offloaded tensors leave the GPU but for two layers' worth (one going out, one coming back).
        off_moe, off_dense = offloaded_bytes(arch, layout, True), offloaded_bytes(arch, layout, False)
        kept_layers = flight * (moe_layers + dense_layers + mtp)
        per_moe -= off_moe * max(0.0, 1 - 2 / kept_layers) if kept_layers else 0.0
        per_dense -= off_dense * max(0.0, 1 - 2 / kept_layers) if kept_layers else 0.0
    if layout.cpu_offload_layers:
        # cpu_offloading (PP 1, no recompute): the offloaded layers keep their saved activations
        # on the host but for the one in transit.
        dense_off, moe_off = cpu_offloaded_layers(layout, dense_layers, moe_layers)
        away = dense_off * per_dense + moe_off * per_moe
        act_offloaded = away - (per_dense if moe_off == 0 else per_moe)
    else:
        act_offloaded = 0.0
    if layout.recompute == "full":
        kept = layout.tokens_per_gpu * arch.hidden * 2
        if layout.recompute_method == "block":
            full = max(0, layers - layout.recompute_layers * layout.vpp)
            act = flight * (full * (moe_share * per_moe + (1 - moe_share) * per_dense)
                            + (layers - full) * kept)
        else:
            act = flight * layers * kept / max(1, layout.recompute_layers) \
                + layout.recompute_layers * (moe_share * per_moe + (1 - moe_share) * per_dense)
    else:
        act = flight * (moe_layers * per_moe + dense_layers * per_dense) - max(0.0, act_offloaded)
    act += mtp * per_moe * flight
    if has_embedding:
        act += flight * layout.tokens_per_gpu * arch.hidden * 2
    if has_output:
        act += (1 + mtp) * layout.seq * layout.micro_batch / layout.cp * arch.vocab / layout.tp * LOGITS_BYTES
    # The update runs once the step's activations are freed: its staged states count where they exceed them.
    optimizer += max(0.0, staged - act)
    return StageMemory(rank, layers, weights / GB, gradients / GB, optimizer / GB, act / GB,
                       dispatcher_GB(arch, layout, domain), flight, optimizer_params)


def dispatcher_GB(arch: Architecture, layout: TrainingLayout, domain: int) -> float:
    """Buffers the dispatcher holds besides the activations: DeepEP (and NCCL EP, costed as
    DeepEP) its registered NVLink / RDMA buffers; HybridEP one buffer sized for the worst case,
    every token of its NVLink domain landing on one rank; the NCCL dispatchers one layer's rows
    in flight. ``moe_expert_rank_capacity_factor`` bounds HybridEP's and NCCL EP's receive buffer
    at that many times the rows a rank receives on average (a token's rows to distinct ranks)."""
    rows = layout.tokens_per_gpu * arch.hidden * 2
    if layout.ep <= 1:
        return 0.0
    budget = layout.rank_capacity * min(arch.topk, layout.ep) * rows if layout.rank_capacity else None
    if layout.flex_backend == "hybridep":
        worst = min(layout.ep, domain) * rows
        return (min(worst, budget) if budget else worst) / GB
    if layout.flex_backend in DEEPEP_LIKE:
        return max(DEEPEP_BUFFER_GB, budget / GB) if budget else DEEPEP_BUFFER_GB
    return 2 * arch.topk * rows / GB


def memory(arch: Architecture, layout: TrainingLayout, domain: int) -> list:
    """StageMemory of every pipeline rank, first to last."""
    layout = layout.for_model(arch.layers, arch.mtp_layers, arch.output_layers_worth(layout.seq))
    stages = stage_layers(layout, arch.layers, arch.mtp_layers, arch.dense_layers)
    return [stage_memory(arch, layout, r, s, domain) for r, s in enumerate(stages)]
