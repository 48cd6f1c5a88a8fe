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
"""
from __future__ import annotations

from dataclasses import dataclass

from .architecture import Architecture
from .layout import TrainingLayout, stage_layers

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
        parts["attention"] = (qkv + arch.heads * (arch.head_dim * gemm_in + 4)) * t
    if moe:
        if "moe" not in drop:
            rows = arch.topk * t
            ffn = 2 * arch.moe_ffn * 2 + (0 if "moe_act" in drop else arch.moe_ffn * gemm_in)
            # Each of the ETP ranks of an expert keeps the whole input row and 1/ETP of its FFN.
            parts["experts"] = rows * (layout.etp * h * gemm_in + ffn + 4) + arch.experts * 4 * t
        if arch.shared_ffn and not drop & {"shared_experts", "moe"}:
            parts["shared_expert"] = (2 * arch.shared_ffn * 2 + arch.shared_ffn * gemm_in) * t
    elif "mlp" not in drop:
        parts["mlp"] = (2 * arch.ffn * 2 + arch.ffn * gemm_in) * t
    return parts


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

    @property
    def total_GB(self) -> float:
        return self.weights_GB + self.gradients_GB + self.optimizer_GB + self.activations_GB + self.dispatcher_GB


def stage_memory(arch: Architecture, layout: TrainingLayout, rank: int, stage: tuple, domain: int) -> StageMemory:
    layers, dense_layers, has_embedding, has_output, mtp = stage
    moe_layers = layers - dense_layers
    moe_share = moe_layers / layers if layers else 0.0
    dense = (dense_layers * arch.dense_layer_params() + moe_layers * arch.moe_layer_dense_params()) / layout.tp
    dense += (has_embedding + has_output) * arch.embedding_params() / layout.tp
    experts = (moe_layers + mtp) * (arch.experts // layout.ep) * arch.expert_params() / layout.etp
    dense += mtp * (arch.moe_layer_dense_params() + 2 * arch.hidden * arch.hidden) / layout.tp
    main = 4 + layout.optimizer_state_bytes
    if layout.distributed_optimizer:
        optimizer = dense * main / (layout.dp * layout.cp) + experts * main / layout.edp
    else:
        optimizer = (dense + experts) * main
    per_moe = sum(layer_activation_bytes(arch, layout, True).values())
    per_dense = sum(layer_activation_bytes(arch, layout, False).values())
    flight = in_flight_chunks(layout, rank)
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
        act = flight * (moe_layers * per_moe + dense_layers * per_dense)
    act += mtp * per_moe * flight
    if has_embedding:
        act += flight * layout.tokens_per_gpu * arch.hidden * 2
    if has_output:
        act += (1 + mtp) * layout.seq * layout.micro_batch / layout.cp * arch.vocab / layout.tp * LOGITS_BYTES
    return StageMemory(rank, layers, (dense + experts) * 2 / GB, (dense + experts) * layout.main_grad_bytes / GB,
                       optimizer / GB, act / GB, dispatcher_GB(arch, layout, domain), flight)


def dispatcher_GB(arch: Architecture, layout: TrainingLayout, domain: int) -> float:
    """Buffers the dispatcher holds besides the activations: DeepEP its registered NVLink /
    RDMA buffers; HybridEP one buffer sized for the worst case, every token of its NVLink
    domain landing on one rank; the NCCL dispatchers one layer's rows in flight."""
    rows = layout.tokens_per_gpu * arch.hidden * 2
    if layout.ep <= 1:
        return 0.0
    if layout.flex_backend == "hybridep":
        return min(layout.ep, domain) * rows / GB
    if layout.flex_backend == "deepep":
        return DEEPEP_BUFFER_GB
    return 2 * arch.topk * rows / GB


def memory(arch: Architecture, layout: TrainingLayout, domain: int) -> list:
    """StageMemory of every pipeline rank, first to last."""
    layout = layout.for_model(arch.layers)
    stages = stage_layers(layout, arch.layers, arch.mtp_layers, arch.dense_layers)
    return [stage_memory(arch, layout, r, s, domain) for r, s in enumerate(stages)]
