"""A training run's parallel layout and settings, read from Megatron-Core / Megatron-Bridge fields.

`TrainingLayout.from_fields` takes the flat field dict `validate.load_config` reads (YAML,
JSON, ``key=value``, Megatron flags) and the GPU count. Parallel folding: attention layers
run TP x CP x DP x PP, MoE layers ETP x EP x EDP x PP over the same GPUs. Fields a
configuration leaves out take Megatron-Core's defaults, except where Megatron-Bridge's MoE
recipes all set them (`RECIPE_DEFAULTS`: the distributed optimizer, sequence parallelism
with TP, gradient-reduce / parameter-gather overlap), which the estimate says it assumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import ConfigError
from .megatron_fields import LIST_CHOICES, flex_backend

# Kernel fusions off by Megatron's default that every calibrating run turns on (Bridge's recipes, the
# ModelZoo's launch script): the estimate costs the fused kernels, and says so where a configuration
# leaves them out; one set false is named as not modelled, as are the fusions on by default
# (masked_softmax_fusion is not among them: it fuses the unfused attention's softmax, a path the
# fused attention the estimate costs does not take).
FUSED_BY_RECIPES = ("moe_permute_fusion", "moe_router_fusion", "cross_entropy_loss_fusion")
FUSED_BY_DEFAULT = ("gradient_accumulation_fusion", "bias_swiglu_fusion", "apply_rope_fusion",
                    "bias_dropout_fusion")
RECIPE_DEFAULTS = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True,
                   "sequence_parallel": True, "moe_grouped_gemm": True, **dict.fromkeys(FUSED_BY_RECIPES, True)}
# Megatron-LM's optimizers with one state a parameter beside the FP32 main weight (Adam keeps two).
ONE_MOMENT_OPTIMIZERS = ("muon", "dist_muon", "adaptive_muon", "sgd")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts", "gdn_norm_out")
# Megatron-LM's recompute_modules of features the estimate does not cost (GatedDeltaProduct layers,
# hyper-connections): accepted, recomputing nothing, and named as not modelled.
RECOMPUTE_NOT_MODELLED = ("gdp_in_proj", "gdp_qkv", "mhc")
PIPELINE_STAGE_MARKS = {"E": "embedding", "t": "layer", "m": "mtp", "L": "loss"}
# Fields that change a run's memory or time which the estimate does not model: named in its
# output when a configuration sets them, never silently ignored.
NOT_MODELLED = ("cpu_offloading_weights", "cpu_offloading_double_buffering", "moe_router_dtype",
                "experimental_attention_variant",
                "fp8_param_gather", "fp8_param", "fp4_param", "fp4_param_gather", "fp8_dot_product_attention",
                # an FP8 / FP4 run's first and last layers in BF16 (costed at the run's precision)
                "first_last_layers_bf16",
                "fp8_wgrad", "moe_token_dropping",
                "moe_latent_size", "use_torch_fsdp2", "hybrid_context_parallel",
                "overlap_dispatch_backward_with_experts_wgrad", "activation_offload_fraction",
                "main_params_dtype", "distribute_saved_activations",
                "megatron_fsdp_main_params_dtype", "use_torch_optimizer_for_cpu_offload", "moe_paged_stash",
                "moe_ncclep_zero_copy", "moe_combine_bwd_dtype",
                # kernel fusions, streams and buffers of Megatron-Bridge's performance recipes (the
                # first six after its 26.04 container, so after every run the constants were fitted on)
                "moe_mlp_glu_interleave_size", "fp8_output_proj", "moe_permute_fusion_into_hybridep",
                "moe_hybridep_num_sms_preprocessing", "high_priority_a2a_comm_stream", "deallocate_pipeline_outputs",
                "use_transformer_engine_op_fuser", "overlap_param_gather_with_optimizer_step", "nccl_ub",
                "keep_fp8_transpose_cache", "disable_parameter_transpose_cache", "fsdp_double_buffer",
                # model and schedule features of Megatron-LM the estimate does not cost: Mamba hybrids,
                # hyper-connections, non-gated MLPs, weights sharded past TP (GTP), other CP exchanges,
                # unfused attention, FP8 attention projections, layer-wise optimizers, schedule knobs
                "is_hybrid_model", "hybrid_layer_pattern", "hybrid_override_pattern", "enable_mhc_connections",
                "gated_linear_unit", "gtp_weight_remat_size", "tensor_parallel_num_weight_shards",
                "expert_gtp_weight_remat_size", "expert_tensor_parallel_num_weight_shards", "cp_comm_type",
                "attention_backend", "fp8_multi_head_attention", "use_layer_wise_distributed_optimizer",
                "microbatch_group_size_per_vp_stage", "num_microbatches_with_partial_activation_checkpoints",
                # sliding-window attention (GPT-OSS's), costed as full attention: an upper bound
                "window_size",
                # the experts one GEMM after another (Megatron-LM's SequentialMLP, its default without
                # moe_grouped_gemm): every published run groups them
                "moe_grouped_gemm", *FUSED_BY_RECIPES, *FUSED_BY_DEFAULT)
# Values of those fields that leave the run as the estimate costs it: nothing to name. A field
# with its own default there is named whenever set to another value.
UNSET = (None, False, "no_shard", "none", [])
# moe_router_dtype=fp32 is what the estimate costs: Transformer Engine's GEMM takes the router's
# BF16 inputs and writes FP32 logits, which the layer keeps (`memory.layer_activation_bytes`).
NOT_MODELLED_DEFAULTS = {"main_params_dtype": "fp32",
                         "megatron_fsdp_main_params_dtype": "fp32", "moe_combine_bwd_dtype": "bf16",
                         "fp8_wgrad": True, "activation_offload_fraction": 1.0, "moe_router_dtype": "fp32",
                         "gated_linear_unit": True, "gtp_weight_remat_size": 1, "expert_gtp_weight_remat_size": 1,
                         "moe_grouped_gemm": True, **dict.fromkeys(FUSED_BY_RECIPES + FUSED_BY_DEFAULT, True)}
# Megatron-FSDP's data_parallel_sharding_strategy: what each rank keeps 1/DP of.
FSDP_SHARDS = {"no_shard": (), "optim": ("optimizer",), "optim_grads": ("optimizer", "gradients"),
               "optim_grads_params": ("optimizer", "gradients", "weights")}
# Megatron-FSDP's outer_dp_sharding_strategy under HSDP (num_distributed_optimizer_instances > 1):
# the replicas keep whole copies of their shards, or shard the optimizer among themselves too.
OUTER_SHARDING = ("no_shard", "optim")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# The parts of a layer Megatron's CUDA graphs capture (cuda_graph_scope): a layer's attention
# (``attn``); a dense layer's MLP (``mlp``); a MoE layer's whole MLP side (``moe``, drop-and-pad
# only), or its router with the shared experts when they are not overlapped (``moe_router``) and the
# dispatcher's preprocess before the token counts reach the host (``moe_preprocess``).
GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess")
WHOLE_LAYER = ("attn", "mlp", "moe")
# Megatron's other cuda_graph_scope values: Mamba layers (none in the models costed here) and the
# whole-iteration graphs (sync-free); "full" is the older spelling of a whole layer.
OTHER_GRAPH_SCOPES = ("mamba", "full_iteration", "full_iteration_inference", "full")
# cuda_graph_modules left at Megatron's default (whole layers): cuda_graph_scope may name the parts.
GRAPH_MODULES_DEFAULTS = (None, "full", "", [], ())


def name_list(value) -> list:
    """The names a list-valued field gives (cuda_graph_modules / cuda_graph_scope,
    recompute_modules, offload_modules): a list, or a string of names split by spaces or commas,
    in brackets or not (Megatron-LM's functional-test configs write ``"[moe_act layernorm]"``)."""
    if isinstance(value, str):
        return [w.strip("'\"") for w in value.strip().removeprefix("[").removesuffix("]").replace(",", " ").split()]
    return [str(v) for v in value or ()]


def graph_modules(scope, modules):
    """The parts of a layer a configuration puts in CUDA graphs, from Megatron-LM's
    ``cuda_graph_modules`` (its name since May 2026) or ``cuda_graph_scope`` (the name before,
    which it still reads); setting both is refused, as Megatron-LM asserts."""
    if scope is not None and modules not in GRAPH_MODULES_DEFAULTS:
        raise ConfigError(f"cuda_graph_scope={scope!r} and cuda_graph_modules={modules!r} are both set (Megatron-LM "
                          "raises): keep cuda_graph_modules, cuda_graph_scope's newer name")
    return modules if scope is None else scope


def graph_scopes(impl, scope, enabled: bool = False) -> tuple:
    """(the parts of each layer captured in CUDA graphs, whether the whole iteration is: no host
    synchronisation) for Megatron's ``cuda_graph_impl`` and ``cuda_graph_modules`` /
    ``cuda_graph_scope`` (`graph_modules`: a list, or a string of names split by spaces or
    commas); ``enabled``: the deprecated ``enable_cuda_graph``
    / ``external_cuda_graph`` switches. No scope (or ``full``) captures whole layers, as Megatron
    does; ``full_iteration`` (a scope of ``cuda_graph_impl=local``, or Bridge's older
    ``cuda_graph_impl=full_iteration``) captures everything."""
    if impl in (None, "none") and not enabled:
        return (), False
    names = name_list(scope)
    unknown = [n for n in names if n not in GRAPH_SCOPES + OTHER_GRAPH_SCOPES]
    if unknown:
        raise ConfigError(f"cuda_graph_modules (cuda_graph_scope) {unknown[0]!r}: choose among "
                          f"{', '.join(GRAPH_SCOPES + OTHER_GRAPH_SCOPES)} (or leave it out: whole layers)")
    if impl == "full_iteration" or any(n.startswith("full_iteration") for n in names):
        return WHOLE_LAYER, True
    captured = [n for n in names if n in GRAPH_SCOPES]
    if not names or "full" in names:
        captured = list(WHOLE_LAYER)
    return tuple(n for n in GRAPH_SCOPES if n in captured), False


# Flex backends costed as DeepEP's kernels: NCCL EP has no published figures.
DEEPEP_LIKE = ("deepep", "ncclep")


# Values of those fields the estimate does cost: Gated DeltaNet's linear attention
# (`architecture.linear_layers_of`; DeepSeek's sparse attention, dsa, is not), CP's ring of
# key-value sends (p2p, Megatron's default), fused attention kernels.
MODELLED_VALUES = {"experimental_attention_variant": ("gated_delta_net", "gdn", "gdn2"),
                   "cp_comm_type": ("p2p", ["p2p"]), "attention_backend": ("auto", "flash", "fused")}


def _set_away_from_default(name: str, value) -> bool:
    """Whether a NOT_MODELLED field's value changes the run from what the estimate costs."""
    if name in MODELLED_VALUES and value in MODELLED_VALUES[name]:
        return False
    if name in NOT_MODELLED_DEFAULTS:
        return value is not None and value != NOT_MODELLED_DEFAULTS[name]
    return value not in UNSET


def stage_override(values: dict, end: str) -> int | None:
    """The decoder layers of the first / last pipeline rank (``end``): Megatron-LM's
    ``decoder_{end}_pipeline_num_layers`` or Megatron-Core's (and Bridge's) name for the same,
    ``num_layers_in_{end}_pipeline_stage``; refused when both are given and differ."""
    args, core = values.get(f"decoder_{end}_pipeline_num_layers"), values.get(f"num_layers_in_{end}_pipeline_stage")
    if args is not None and core is not None and args != core:
        raise ConfigError(f"decoder_{end}_pipeline_num_layers={args} and num_layers_in_{end}_pipeline_stage={core} "
                          "name the same split: give one")
    return args if args is not None else core


def fsdp_gradient_bytes(values: dict, assumed: list) -> tuple:
    """(bytes per kept gradient, bytes per reduced gradient or None for as kept) under Megatron-FSDP.

    Megatron-FSDP keeps its own gradient buffer in ``megatron_fsdp_main_grads_dtype`` and reduces in
    ``megatron_fsdp_grad_comm_dtype``; "auto" (the default) keeps the parameters' dtype (BF16, as
    the estimate costs the parameters; Megatron-Core's MixedPrecisionPolicy) and reduces as kept.
    ``grad_reduce_in_bf16`` sets both to BF16. Unset fields are named in ``assumed``. (Megatron-Core
    before its Megatron-FSDP dtype options, 2026-03, kept and reduced FP32 gradients unless
    ``grad_reduce_in_bf16``: give ``megatron_fsdp_main_grads_dtype=fp32`` for such a run.)"""
    chosen = {}
    for name in ("megatron_fsdp_main_grads_dtype", "megatron_fsdp_grad_comm_dtype"):
        dtype = values.get(name, "bf16" if values.get("grad_reduce_in_bf16") else None)
        if dtype is None:
            dtype = "auto"
            kept_as = "BF16" if name.endswith("main_grads_dtype") else "as the main gradients"
            assumed.append(f"{name}=auto ({kept_as})")
        if dtype != "auto" and dtype not in DTYPE_BYTES:
            raise ConfigError(f"{name}={dtype!r}: choose among auto, {', '.join(DTYPE_BYTES)}")
        chosen[name] = dtype
    kept = DTYPE_BYTES.get(chosen["megatron_fsdp_main_grads_dtype"], 2)
    return kept, DTYPE_BYTES.get(chosen["megatron_fsdp_grad_comm_dtype"])


# Fine-grained activation offloading's offload_modules: the tensors of layer_activation_bytes each moves to the host.
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")


@dataclass(frozen=True)
class TrainingLayout:
    gpus: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch: int = 1
    global_batch: int | None = None
    seq: int = 4096
    precision: str = "bf16"                 # bf16 | fp8 (NVFP4 costed as FP8)
    fp8_recipe: str | None = None           # Megatron's fp8_recipe, or "nvfp4" for fp4
    recompute: str | None = None            # None | "selective" | "full"
    recompute_modules: tuple = ()
    recompute_method: str | None = None     # full: "uniform" | "block"
    recompute_layers: int = 1
    dispatcher: str = "alltoall"            # Megatron moe_token_dispatcher_type
    flex_backend: str | None = None
    dispatcher_sms: int | None = None
    # moe_expert_rank_capacity_factor (HybridEP, NCCL EP): each EP rank's receive budget, in expected
    # rows; None: unbounded (HybridEP then sizes its buffer for the worst case).
    rank_capacity: float | None = None
    # moe_expert_capacity_factor: each expert takes at most this times its even share of the rows
    # (the rest dropped); moe_pad_expert_input_to_capacity pads every expert up to exactly that.
    capacity_factor: float | None = None
    pad_to_capacity: bool = False
    # moe_shared_expert_overlap: the shared experts run on a side stream beside the dispatch and combine
    shared_expert_overlap: bool = False
    fp8_wire: bool | None = None            # NCCL EP's moe_dispatch_fwd_dtype=mxfp8 (None: the backend's own rule)
    # A natural router's loads (Megatron's default); False: every EP rank its even share, as
    # moe_router_force_load_balancing gives (the published benchmark runs).
    natural_routing: bool = False
    # The natural router's loads as a cost.Routing spec (zipf:<alpha>, or a .npy of recorded
    # topk_idx), or as recorded token counts per layer and expert (LoadRecorder's [layers][experts]);
    # neither: the calibrated model of a natural router (estimate.routing_imbalance).
    routing: str | None = None
    expert_loads: tuple | None = field(default=None, compare=False)
    ep_overlap: bool = False
    delay_wgrad: bool = False               # delay_wgrad_compute: expert weight gradients beside the dispatch's backward
    tp_comm_overlap: bool = False
    distributed_optimizer: bool = True
    # num_distributed_optimizer_instances: the data-parallel ranks split into this many replicas of
    # the sharded optimizer, each sharding over DP / n (and expert-DP / n); with Megatron-FSDP
    # (HSDP) outer_dp_sharding_strategy=optim shards the optimizer across the replicas as well
    optimizer_instances: int = 1
    optimizer_outer_shard: bool = False
    overlap_grad_reduce: bool = True
    precision_aware_optimizer: bool = False
    optimizer_state_bytes: int = 8          # Adam's two moments, per parameter
    main_grad_bytes: int = 4
    grad_comm_bytes: int | None = None      # grad_reduce_in_bf16: gradients reduced in BF16 (else as kept)
    first_stage_layers: int | None = None   # decoder layers on the first / last pipeline rank (all its
    last_stage_layers: int | None = None    # virtual stages), Megatron's decoder_first/last_pipeline_num_layers
    embedding_in_split: bool = False        # account_for_embedding_in_pipeline_split: the embedding takes a layer's slot
    loss_in_split: bool = False             # account_for_loss_in_pipeline_split: the loss takes a layer's slot
    layers_per_virtual_stage: int | None = None   # num_layers_per_virtual_pipeline_stage (sets VPP)
    layout_string: str | None = None
    graph_scopes: tuple = ()                # the parts of each layer in CUDA graphs (GRAPH_SCOPES)
    sync_free: bool = False                 # whole-iteration CUDA graphs: MoE layers without a host synchronisation
    fsdp: str | None = None                 # Megatron-FSDP's data_parallel_sharding_strategy (None: not FSDP)
    offload_modules: tuple = ()             # fine-grained activation offloading's modules
    # cpu_offloading (layer-level activation offloading, PP 1 only): cpu_offloading_num_layers, the
    # first layers of the model, whose saved activations wait on the host for their backward.
    cpu_offload_layers: int = 0
    optimizer_offload: float = 0.0          # optimizer_cpu_offload: share of the Adam moments on the host
    optimizer_offload_overlap: bool = False  # overlap_cpu_optimizer_d2h_h2d: the host's step beside the copies
    # chunked_optimizer_state_offload (or its alias offload_optimizer_states): the share of the optimizer
    # states and FP32 main weights kept on the host between updates, and the GPU window (MB; 0: all
    # at once) its moments come back through for the update.
    optimizer_state_offload: float = 0.0
    optimizer_state_chunk_MB: int = 0
    assumed: tuple = field(default=(), compare=False)
    not_modelled: tuple = field(default=(), compare=False)   # NOT_MODELLED fields the configuration sets

    @property
    def grad_reduce_bytes(self) -> int:
        """Bytes per gradient in the data-parallel reduce (BF16 with grad_reduce_in_bf16)."""
        return self.grad_comm_bytes or self.main_grad_bytes

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.gpus // (self.pp * self.ep * self.etp)

    def _split_over(self, replicas: int) -> tuple:
        """(dense, expert) ranks of one of ``replicas`` copies: DP x CP and expert-DP over them."""
        return max(1, self.dp * self.cp // replicas), max(1, self.edp // replicas)

    @property
    def shard_groups(self) -> tuple:
        """(dense, expert) ranks the sharded state (distributed optimizer, Megatron-FSDP) is split
        over: DP x CP and expert-DP, each over `optimizer_instances` replicas."""
        return self._split_over(self.optimizer_instances)

    @property
    def optimizer_groups(self) -> tuple:
        """(dense, expert) ranks the optimizer state is split over: `shard_groups`, or the whole
        DP x CP and expert-DP when HSDP shards it across the replicas too (``optim``)."""
        return self._split_over(1 if self.optimizer_outer_shard else self.optimizer_instances)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank."""
        gbs = self.global_batch or self.micro_batch * self.dp
        return max(1, gbs // (self.micro_batch * self.dp))

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens of one micro-batch on one GPU once TP (sequence parallel) and CP split them."""
        return max(1, self.seq * self.micro_batch // (self.tp * self.cp))

    def problems(self, experts: int, layers: int) -> list:
        """Why this layout cannot run, each with its fix (empty when it can)."""
        out = []
        if self.optimizer_offload and self.optimizer_state_offload:
            out.append("optimizer_cpu_offload and chunked_optimizer_state_offload (offload_optimizer_states) exclude "
                       "each other (Megatron-Core asserts): keep one")
        if self.cpu_offload_layers:
            # Megatron-Core's TransformerConfig refuses these (validate's cpu-offload-* rules).
            if self.pp > 1:
                out.append("cpu_offloading does not support pipeline parallelism (Megatron-Core raises): set "
                           "pipeline_model_parallel_size=1 or use fine_grained_activation_offloading")
            if self.recompute:
                out.append("cpu_offloading does not work with activation recomputation (Megatron-Core raises): "
                           "leave recompute_granularity unset or drop cpu_offloading")
            if not 0 <= self.cpu_offload_layers < layers:
                out.append(f"cpu_offloading_num_layers={self.cpu_offload_layers} must be from 0 to {layers - 1} "
                           "(below the model's layers)")
        model = self.tp * self.pp * self.cp
        if self.gpus % model:
            out.append(f"TP {self.tp} x PP {self.pp} x CP {self.cp} = {model} does not divide {self.gpus} GPUs: "
                       "choose sizes whose product divides --gpus")
        if self.gpus % (self.pp * self.ep * self.etp):
            out.append(f"PP {self.pp} x EP {self.ep} x ETP {self.etp} does not divide {self.gpus} GPUs: choose "
                       "expert_model_parallel_size x expert_tensor_parallel_size dividing GPUs / PP")
        if experts % self.ep:
            out.append(f"EP {self.ep} does not divide the {experts} experts: choose a divisor")
        out += list(sequence_split_problems(self.seq, self.cp, self.tp).values())
        out += pipeline_split_problems(layers, self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers,
                                       self.embedding_in_split, self.loss_in_split, self.layout_string)
        n = self.optimizer_instances
        if n > 1 and ((self.dp * self.cp) % n or self.edp % n):
            out.append(f"num_distributed_optimizer_instances={n} must divide DP x CP {self.dp * self.cp} and the "
                       f"expert-DP size {self.edp} (Megatron-Core asserts): choose a common divisor")
        if self.global_batch and self.dp and self.global_batch % (self.micro_batch * max(1, self.dp)):
            out.append(f"global_batch_size {self.global_batch} is not a multiple of micro_batch_size "
                       f"{self.micro_batch} x DP {self.dp}: choose a multiple")
        return out

    @classmethod
    def from_fields(cls, values: dict, gpus: int) -> "TrainingLayout":
        if gpus < 1:
            raise ConfigError(f"--gpus {gpus}: give the number of GPUs of the run, e.g. --gpus 256")
        v = {k: val for k, val in values.items() if val is not None}
        assumed = []

        def get(name, default):
            if name in v:
                return v[name]
            if name in RECIPE_DEFAULTS:
                assumed.append(f"{name}={str(RECIPE_DEFAULTS[name]).lower()}")
                return RECIPE_DEFAULTS[name]
            return default

        def size(name, default=1):
            value = get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r}: give a whole number >= 1")
            return value

        tp = size("tensor_model_parallel_size")
        if tp > 1:
            get("sequence_parallel", True)  # MoE with TP needs it (validate's moe-tp-needs-sp): costed with it
        fp8 = v.get("fp8")
        # NVFP4 (Megatron's fp4 / --fp4-format): no published MoE run calibrates its GEMMs, so they
        # are costed as FP8's (recipe "nvfp4", named in the estimate's assumed line).
        fp4 = v.get("fp4") not in (None, False, "none")
        precision = "fp8" if fp4 or fp8 not in (None, False, "none") else "bf16"
        if precision == "bf16" and not (v.get("bf16") or v.get("fp16")):
            # Megatron trains in FP32 without bf16 / fp16; no MoE recipe does, and none is costed.
            assumed.append("bf16=true (the configuration names no precision, and Megatron without bf16 or fp16 "
                           "trains in FP32, which the estimate does not cost)")
        get("moe_grouped_gemm", True)       # the experts' grouped GEMM; Megatron-LM's SequentialMLP is not costed
        for fusion in FUSED_BY_RECIPES:
            get(fusion, True)
        recipe = "nvfp4" if fp4 else get("fp8_recipe", None) if fp8 else None
        granularity = get("recompute_granularity", None)
        modules = get("recompute_modules", None)
        modules = None if modules is None else name_list(modules)
        # Megatron-LM's older switches, read as Megatron-LM reads them: recompute_activations is
        # selective recompute (of core attention), moe_layer_recompute the "moe" module.
        if get("recompute_activations", False) and granularity is None:
            granularity = "selective"
        if get("moe_layer_recompute", False):
            if modules is None:
                modules = ["core_attn"] if granularity == "selective" else []
            modules = list(modules) + ["moe"]
            granularity = granularity or "selective"
        if granularity == "selective" and modules is None:
            modules = ["core_attn"]
        unknown = [m for m in modules or [] if m not in RECOMPUTE_MODULES + RECOMPUTE_NOT_MODELLED]
        if unknown:
            raise ConfigError(f"recompute_modules {unknown}: choose among "
                              f"{', '.join(RECOMPUTE_MODULES + RECOMPUTE_NOT_MODELLED)}")
        uncosted = [f"recompute_modules={m}" for m in modules or [] if m in RECOMPUTE_NOT_MODELLED]
        modules = [m for m in modules or [] if m not in RECOMPUTE_NOT_MODELLED] if modules is not None else None
        if modules and granularity is None:
            granularity = "selective"
        dispatcher = get("moe_token_dispatcher_type", "allgather")
        backend = None
        if dispatcher == "flex":
            backend = flex_backend(v)
            if backend is None:                      # Megatron-Core's default backend
                assumed.append("moe_flex_dispatcher_backend=deepep")
                backend = "deepep"
        # Megatron-Core's unified SM count first, then the deprecated per-backend ones it routes.
        sms = (get("moe_flex_dispatcher_num_sms", None) or get(f"moe_{backend}_num_sms", None)) if backend else None
        if backend == "ncclep":
            assumed.append("moe_flex_dispatcher_backend=ncclep costed as DeepEP's kernels (no published NCCL EP "
                           "figures)")
        # Gradient buffers: FP32 under BF16 training (Megatron-LM turns accumulate_allreduce_grads_in_fp32
        # on for BF16 unless grad_reduce_in_bf16; Bridge's bf16 recipes set grad_reduce_in_fp32), the
        # parameters' BF16 when a configuration sets grad_reduce_in_fp32 false (Bridge's GPT-OSS recipes)
        # or grad_reduce_in_bf16 (Megatron-LM's DDP then keeps and reduces them in BF16).
        grads = 2 if v.get("grad_reduce_in_fp32") is False or get("grad_reduce_in_bf16", False) else 4
        moments = (4, 4)                                 # Adam's, FP32
        if get("use_precision_aware_optimizer", False):
            sizes = {**DTYPE_BYTES, "fp8": 1}
            moments = (sizes.get(get("exp_avg_dtype", "fp32"), 4), sizes.get(get("exp_avg_sq_dtype", "fp32"), 4))
            grads = sizes.get(get("main_grads_dtype", "fp32"), 4)
        state = sum(moments)
        outer = get("outer_dp_sharding_strategy", "no_shard")
        if outer not in OUTER_SHARDING:
            raise ConfigError(f"outer_dp_sharding_strategy={outer!r}: choose {' or '.join(OUTER_SHARDING)} "
                              "(Megatron-FSDP's sharding across optimizer instances)")
        optimizer = str(get("optimizer", "adam"))
        distributed = bool(get("use_distributed_optimizer", True)) or optimizer.startswith("dist_")
        if optimizer in ONE_MOMENT_OPTIMIZERS:
            # Muon keeps one momentum (SGD one velocity) where Adam keeps two moments; dist_muon is
            # Megatron's muon with its states sharded over DP (layer by layer).
            state = moments[0]
            assumed.append(f"optimizer={optimizer}: one moment a parameter" + (", sharded over DP" if distributed else "")
                           + "; its step costed as Adam's (Muon's Newton-Schulz iterations not counted)")
        elif optimizer != "adam":
            uncosted.append(f"optimizer={optimizer} (costed as Adam)")
        # EP overlap as Megatron's 2025 dev branch spelled it (combined 1F1B, recipe ep_a2a), in the
        # ModelZoo's launch lines of that time.
        combined = bool(get("combined_1f1b", False)) and get("combined_1f1b_recipe", "ep_a2a") == "ep_a2a"
        scopes, sync_free = graph_scopes(get("cuda_graph_impl", None),
                                         graph_modules(get("cuda_graph_scope", None), get("cuda_graph_modules", None)),
                                         bool(get("enable_cuda_graph", False) or get("external_cuda_graph", False)))
        fsdp = None
        grad_comm = 2 if get("grad_reduce_in_bf16", False) else None
        if get("use_megatron_fsdp", False) or get("use_custom_fsdp", False):
            if "data_parallel_sharding_strategy" not in v:
                assumed.append("data_parallel_sharding_strategy=optim_grads_params")
            fsdp = v.get("data_parallel_sharding_strategy", "optim_grads_params")
            if fsdp not in FSDP_SHARDS:
                raise ConfigError(f"data_parallel_sharding_strategy={fsdp!r}: choose among {', '.join(FSDP_SHARDS)}")
            grads, grad_comm = fsdp_gradient_bytes(v, assumed)
        offload = ()
        if get("fine_grained_activation_offloading", False):
            offload = name_list(get("offload_modules", None))
            typos = [m for m in offload if m not in LIST_CHOICES["offload_modules"]]
            if typos:                                   # TransformerConfig asserts on these
                raise ConfigError(f"offload_modules {typos}: choose among {', '.join(LIST_CHOICES['offload_modules'])}")
            unknown = [f"offload_modules={m}" for m in offload if m not in OFFLOAD_MODULES]
            offload = [m for m in offload if m in OFFLOAD_MODULES]
        else:
            unknown = []
        optimizer_offload = float(get("optimizer_offload_fraction", 1.0)) if get("optimizer_cpu_offload", False) else 0.0
        cpu_offload_layers = int(get("cpu_offloading_num_layers", 0) or 0) \
            if get("cpu_offloading", False) and get("cpu_offloading_activations", True) else 0
        state_offload = 0.0
        if get("chunked_optimizer_state_offload", False) or get("offload_optimizer_states", False):
            state_offload = float(get("optimizer_state_offload_fraction", 1.0))
        pp, ep = size("pipeline_model_parallel_size"), size("expert_model_parallel_size")
        vpp = size("virtual_pipeline_model_parallel_size") if v.get("virtual_pipeline_model_parallel_size") else \
            size("num_virtual_stages_per_pipeline_rank") if v.get("num_virtual_stages_per_pipeline_rank") else 1
        if v.get("pipeline_model_parallel_layout"):
            # Megatron derives VPP from the layout (its stages over PP), over any VPP given beside it.
            derived = layout_vpp(v["pipeline_model_parallel_layout"], pp)
            if v.get("virtual_pipeline_model_parallel_size") and derived != vpp:
                assumed.append(f"virtual_pipeline_model_parallel_size={derived} (the layout's stages over PP "
                               f"{pp}, which Megatron takes over the {vpp} given)")
            vpp = derived
        per_virtual = size("num_layers_per_virtual_pipeline_stage") if v.get("num_layers_per_virtual_pipeline_stage") \
            else None
        natural = ep > 1 and not get("moe_router_force_load_balancing", False)
        # A benchmark on random tokens (Megatron-LM's --mock-data): the router sees no text to
        # specialise on, so its choices spread as evenly as random ones (`cost.Routing("uniform")`).
        mock = natural and bool(get("mock_data", False) or get("mock", False))
        if mock:
            assumed.append("mock_data: random tokens, so the natural router's loads are costed as uniform random "
                           "choices (--routing uniform); a trained router on real text loads its experts less evenly")
        if ep > 1 and tp > 1 and not v.get("expert_tensor_parallel_size"):
            # Megatron's default, easy to leave out by mistake: it changes the experts' memory and traffic.
            assumed.append(f"expert_tensor_parallel_size={tp} (Megatron's default, the TP size: each expert split "
                           f"{tp} ways; give 1 to keep experts whole)")
        layout = cls(
            gpus=gpus, tp=tp, pp=pp, vpp=vpp, layers_per_virtual_stage=per_virtual,
            cp=size("context_parallel_size"), ep=ep,
            etp=size("expert_tensor_parallel_size", tp) if v.get("expert_tensor_parallel_size") else tp,
            micro_batch=size("micro_batch_size"), global_batch=v.get("global_batch_size"),
            seq=size("seq_length", 4096), precision=precision, fp8_recipe=recipe,
            recompute=granularity, recompute_modules=tuple(modules or ()),
            recompute_method=get("recompute_method", "uniform" if granularity == "full" else None),
            recompute_layers=int(get("recompute_num_layers", 1) or 1),
            dispatcher=dispatcher, flex_backend=backend, dispatcher_sms=sms,
            natural_routing=natural, routing="uniform" if mock else None,
            ep_overlap=bool(get("overlap_moe_expert_parallel_comm", False)) or combined,
            # the prototype ran the experts' weight gradients after the dispatch's backward
            delay_wgrad=bool(get("delay_wgrad_compute", False)) or combined,
            tp_comm_overlap=bool(get("tp_comm_overlap", False)),
            distributed_optimizer=distributed, optimizer_instances=size("num_distributed_optimizer_instances"),
            optimizer_outer_shard=bool(fsdp) and outer == "optim",
            overlap_grad_reduce=bool(get("overlap_grad_reduce", True)),
            precision_aware_optimizer=bool(get("use_precision_aware_optimizer", False)),
            optimizer_state_bytes=state, main_grad_bytes=grads,
            grad_comm_bytes=grad_comm,
            first_stage_layers=stage_override(v, "first"), last_stage_layers=stage_override(v, "last"),
            embedding_in_split=bool(get("account_for_embedding_in_pipeline_split", False)),
            loss_in_split=bool(get("account_for_loss_in_pipeline_split", False)),
            layout_string=v.get("pipeline_model_parallel_layout"), graph_scopes=scopes,
            sync_free=sync_free, fsdp=fsdp,
            offload_modules=tuple(offload), cpu_offload_layers=cpu_offload_layers, optimizer_offload=optimizer_offload,
            optimizer_offload_overlap=bool(get("overlap_cpu_optimizer_d2h_h2d", False)),
            rank_capacity=get("moe_expert_rank_capacity_factor", None) if backend in ("hybridep", "ncclep") else None,
            capacity_factor=get("moe_expert_capacity_factor", None),
            pad_to_capacity=bool(get("moe_pad_expert_input_to_capacity", False))
            and get("moe_expert_capacity_factor", None) is not None,
            shared_expert_overlap=bool(get("moe_shared_expert_overlap", False)),
            fp8_wire=(get("moe_dispatch_fwd_dtype", "bf16") == "mxfp8") if backend == "ncclep" else None,
            optimizer_state_offload=state_offload,
            optimizer_state_chunk_MB=int(get("optimizer_state_offload_chunk_size_mb", 0) or 0), assumed=tuple(assumed),
            not_modelled=tuple(f for f in NOT_MODELLED if _set_away_from_default(f, v.get(f)))
            + tuple(unknown) + tuple(uncosted))
        return layout

    def for_model(self, layers: int, mtp_layers: int = 0, head: float = 1.0) -> "TrainingLayout":
        """This layout once the model's layer counts are known: ``num_layers_per_virtual_pipeline_stage``
        sets VPP (the layers of a pipeline rank over the layers of one of its virtual stages); and
        where the configuration gives no pipeline split and Megatron's even split does not build
        (DeepSeek-V3's 61 layers on PP 16), the plainest split Megatron builds (`megatron_split`
        with the output layer ``head`` layers' worth, what `plan --fit` writes), said on the
        assumed line: Megatron-Bridge's DeepSeek-V3 and
        Kimi-K2 recipes fill in a layout of their own there, Megatron-LM refuses (as `validate`'s
        pipeline-split rule says)."""
        from dataclasses import replace
        layout = self
        if self.layers_per_virtual_stage is not None and self.vpp == 1:
            layout = replace(self, vpp=vpp_of_stage_layers(layers, self.pp, self.layers_per_virtual_stage,
                                                           self.embedding_in_split, self.loss_in_split))
        given = (layout.layout_string or layout.first_stage_layers is not None or layout.last_stage_layers is not None
                 or layout.embedding_in_split or layout.loss_in_split)
        if layout.pp > 1 and not given and pipeline_split_problems(layers, layout.pp, layout.vpp):
            split = megatron_split(layers, mtp_layers, layout.pp, layout.vpp, head)
            if split is not None:
                named = (f"pipeline_model_parallel_layout='{split['layout_string']}'" if "layout_string" in split
                         else "account_for_embedding_in_pipeline_split=true, account_for_loss_in_pipeline_split=true")
                note = (f"{named} ({layers} layers do not split evenly over PP {layout.pp} x VPP {layout.vpp} and the "
                        "configuration gives no split: the plainest Megatron builds, as plan --fit writes it; "
                        "Megatron-LM refuses the configuration as given)")
                layout = replace(layout, **split, assumed=(*layout.assumed, note))
        return layout


def vpp_of_stage_layers(layers: int, pp: int, per_stage: int, embedding: bool = False, loss: bool = False) -> int:
    """VPP as Megatron derives it from ``num_layers_per_virtual_pipeline_stage``: a pipeline rank's
    layers (the embedding and loss counted where the account_for_* flags say) over ``per_stage``;
    refused by name where they do not divide."""
    slots = layers + embedding + loss
    if slots % pp:
        raise ConfigError(f"num_layers_per_virtual_pipeline_stage needs the {slots} layers to split evenly "
                          f"over PP {pp} (as Megatron requires); give virtual_pipeline_model_parallel_size instead")
    if (slots // pp) % per_stage:
        raise ConfigError(f"num_layers_per_virtual_pipeline_stage={per_stage} does not divide the {slots // pp} "
                          f"layers of each of the PP {pp} ranks: choose a divisor")
    return slots // pp // per_stage


def stage_layers(layout: TrainingLayout, layers: int, mtp_layers: int, dense_layers: int = 0) -> list:
    """[(decoder layers, of them dense, embedding?, output + loss?, MTP layers)] per pipeline
    rank, all its virtual stages together: from ``pipeline_model_parallel_layout`` where given
    (``E`` the embedding, ``t`` a layer, ``m`` an MTP layer, ``L`` the loss, ``|`` between
    stages, ``(..)*N`` and ``X*N`` repeats; virtual stage i lives on rank i mod PP), else even
    splits over the PP x VPP virtual stages with ``decoder_first/last_pipeline_num_layers``
    (the first / last pipeline rank's layers, split evenly over its virtual stages) taken out
    first, and the embedding and the loss counted as a layer each where
    ``account_for_embedding/loss_in_pipeline_split`` say so (Megatron's even split of the slots).
    The model's first ``dense_layers`` layers are its dense ones."""
    pp, vpp = layout.pp, layout.vpp
    if layout.layout_string:
        stages = expand_layout(layout.layout_string)
        if len(stages) != pp * vpp:
            raise ConfigError(f"pipeline_model_parallel_layout has {len(stages)} stages; PP {pp} x VPP {vpp} = "
                              f"{pp * vpp} expected")
        counts = [st.count("t") for st in stages]
        if sum(counts) != layers:
            raise ConfigError(f"pipeline_model_parallel_layout holds {sum(counts)} layers; the model has {layers}")
        marks = [("E" in st, "L" in st, st.count("m")) for st in stages]
    else:
        counts = _even_split(layout, layers)
        n = pp * vpp
        marks = [(i == 0, i == n - 1, mtp_layers if i == n - 1 else 0) for i in range(n)]
    ranks = [[0, 0, False, False, 0] for _ in range(pp)]
    start = 0
    for i, (count, (emb, loss, mtp)) in enumerate(zip(counts, marks)):
        r = ranks[i % pp]
        r[0] += count
        r[1] += max(0, min(start + count, dense_layers) - start)
        r[2] |= emb
        r[3] |= loss
        r[4] += mtp
        start += count
    return [tuple(r) for r in ranks]


def _even_split(layout: TrainingLayout, layers: int) -> list:
    """Decoder layers of each of the PP x VPP virtual stages, in order (virtual stage i on rank
    i mod PP), as Megatron splits them: the first / last pipeline rank's given layers evenly
    over its virtual stages, the rest evenly over the others, the embedding and the loss each
    taking a layer's slot where they count; refused by name where Megatron refuses the split
    (`pipeline_split_problems`)."""
    pp, vpp = layout.pp, layout.vpp
    if pp == 1:
        return [layers]
    problems = pipeline_split_problems(layers, pp, vpp, layout.first_stage_layers, layout.last_stage_layers,
                                       layout.embedding_in_split, layout.loss_in_split)
    if problems:
        raise ConfigError("; ".join(problems))
    n = pp * vpp
    fixed = {}                                        # virtual stage -> layers it is given
    for count, rank in ((layout.first_stage_layers, 0), (layout.last_stage_layers, pp - 1)):
        if count is not None:
            for chunk in range(vpp):
                fixed[chunk * pp + rank] = count // vpp
    free = n - len(fixed)
    slots = layers - sum(fixed.values()) + layout.embedding_in_split + layout.loss_in_split
    counts = [fixed.get(i, slots // free if free else 0) for i in range(n)]
    counts[0] -= layout.embedding_in_split            # the embedding took a layer's slot
    counts[-1] -= layout.loss_in_split                # the loss took a layer's slot
    return counts


# Megatron-Core's layer type names in a pipeline_model_parallel_layout given as a list of stages
# (as Megatron-Bridge's recipes write it), by the mark the string form gives each.
LAYOUT_LAYER_NAMES = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}


def layout_text(value) -> str:
    """``pipeline_model_parallel_layout`` in its string form: a string as given, or the list of
    stages Megatron-Core and Bridge also take (each a list of ``embedding`` / ``decoder`` /
    ``mtp`` / ``loss``) written as one."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(st, (list, tuple)) for st in value):
        stages = []
        for stage in value:
            marks = [LAYOUT_LAYER_NAMES.get(str(name).lower(), str(name)) for name in stage]
            wrong = [m for m in marks if m not in PIPELINE_STAGE_MARKS]
            if wrong:
                raise ConfigError(f"pipeline_model_parallel_layout: {wrong[0]!r} is no layer: a stage lists "
                                  f"{', '.join(LAYOUT_LAYER_NAMES)}")
            stages.append("".join(marks))
        return "|".join(stages)
    raise ConfigError(f"pipeline_model_parallel_layout={value!r}: give a string such as 'Et*4|(t*4|)*14tmL' or a "
                      f"list of stages, each a list of {', '.join(LAYOUT_LAYER_NAMES)}")


def layout_vpp(text: str, pp: int) -> int:
    """VPP as Megatron derives it from ``pipeline_model_parallel_layout``: its stages over PP
    (which must divide them)."""
    stages = len(expand_layout(text))
    if stages % pp:
        raise ConfigError(f"pipeline_model_parallel_layout has {stages} stages, which PP {pp} does not divide: "
                          "give every pipeline rank the same number of virtual stages")
    return stages // pp


def expand_layout(text: str) -> list:
    out = text.replace(" ", "").replace(",", "")
    while "(" in out:                                   # innermost group first
        start = out.rfind("(")
        end = out.index(")", start)
        tail = out[end + 1:]
        times = _digits(tail[1:]) if tail.startswith("*") else ""
        body = out[start + 1:end] * (int(times) if times else 1)
        out = out[:start] + body + out[end + 1 + (1 + len(times) if times else 0):]
    stages, current, i = [], "", 0
    while i < len(out):
        ch = out[i]
        if ch == "|":
            stages.append(current)
            current = ""
        elif ch == "*":
            n = _digits(out[i + 1:])
            current += current[-1] * (int(n) - 1)
            i += len(n)
        elif ch in PIPELINE_STAGE_MARKS:
            current += ch
        else:
            raise ConfigError(f"pipeline_model_parallel_layout {text!r}: unexpected {ch!r}; use E, t, m, L, |, (..)*N")
        i += 1
    stages.append(current)
    return stages


def _digits(text: str) -> str:
    n = ""
    for ch in text:
        if not ch.isdigit():
            break
        n += ch
    return n


SPLIT_FIX = ("give decoder_first/last_pipeline_num_layers, account_for_embedding/loss_in_pipeline_split or a "
             "pipeline_model_parallel_layout that splits them (`expertrail plan --fit --emit megatron` writes one)")


def sequence_split_problems(seq: int, cp: int, tp: int, sequence_parallel: bool = True) -> dict:
    """{field: why, with the fix} where Megatron-LM cannot split a sequence of ``seq`` tokens:
    into 2 x CP chunks (context_parallel_size; causal load balance), and, under sequence
    parallelism (the estimate costs TP with it), each CP rank's part over TP
    (sequence_parallel). `TrainingLayout.problems` and `validate`'s rules both ask it."""
    out = {}
    if cp > 1 and seq % (2 * cp):
        out["context_parallel_size"] = (f"seq_length {seq} is not a multiple of 2 x CP {cp} (Megatron-LM asserts): "
                                        f"choose a multiple of {2 * cp}")
    if sequence_parallel and tp > 1 and (seq // cp) % tp:
        out["sequence_parallel"] = (f"seq_length {seq} over CP {cp} does not split over TP {tp} (sequence "
                                    f"parallelism): choose a multiple of {cp * tp}")
    return out


def pipeline_split_problems(layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
                            embedding: bool = False, loss: bool = False, layout: str | None = None,
                            mtp_layers: int | None = None) -> list:
    """Why Megatron-Core refuses to split ``layers`` decoder layers over PP x VPP stages as
    configured (TransformerConfig's pipeline checks and get_num_layers_to_build's asserts), each
    with its fix; empty when it builds them. ``first`` / ``last``: decoder_first/last_pipeline_num_layers;
    ``embedding`` / ``loss``: account_for_embedding/loss_in_pipeline_split; ``layout``:
    pipeline_model_parallel_layout, whose MTP layers are checked against ``mtp_layers`` when given."""
    if pp <= 1:
        vpp = len(expand_layout(layout)) if layout else vpp
        # Megatron-LM asserts PP > 1 for the interleaved schedule (PP > 2 with overlap_p2p_comm off).
        return [] if vpp <= 1 else [f"VPP {vpp} virtual stages need pipeline parallelism (Megatron-LM asserts "
                                    "pipeline_model_parallel_size > 1 for the interleaved schedule): set PP > 1 or "
                                    "drop the virtual-pipeline split"]
    if layout:
        if first is not None or last is not None or embedding or loss:
            return ["pipeline_model_parallel_layout cannot be set with decoder_first/last_pipeline_num_layers or "
                    "account_for_embedding/loss_in_pipeline_split (Megatron-Core raises): keep the layout alone"]
        stages = expand_layout(layout)
        out = []
        decoders, mtp = sum(s.count("t") for s in stages), sum(s.count("m") for s in stages)
        if decoders != layers:
            out.append(f"pipeline_model_parallel_layout places {decoders} decoder layers (t); the model has {layers}: "
                       "place every layer once")
        if mtp_layers is not None and mtp != mtp_layers:
            out.append(f"pipeline_model_parallel_layout places {mtp} MTP layers (m); mtp_num_layers is {mtp_layers}: "
                       "place each MTP layer once (in the last stage, before L)")
        if "E" not in stages[0] or "L" not in stages[-1]:
            out.append("pipeline_model_parallel_layout must start with the embedding (E) and end with the loss (L)")
        return out
    if first is not None or last is not None:
        if embedding or loss:
            return ["decoder_first/last_pipeline_num_layers and account_for_embedding/loss_in_pipeline_split cannot "
                    "be set together (Megatron-Core raises): keep one way of splitting"]
        out, middle, middle_ranks = [], layers, pp
        for name, count in (("first", first), ("last", last)):
            if count is None:
                continue
            if count < 1:
                out.append(f"decoder_{name}_pipeline_num_layers={count} must be at least 1")
            elif count % vpp:
                out.append(f"decoder_{name}_pipeline_num_layers={count} is the layers of a whole pipeline rank, split "
                           f"over its VPP {vpp} virtual stages: give a multiple of {vpp}")
            middle, middle_ranks = middle - count, middle_ranks - 1
        if middle_ranks and (middle < middle_ranks or middle % middle_ranks):
            out.append(f"the {middle} layers left between the first and last pipeline ranks do not split evenly over "
                       f"the other {middle_ranks} ranks: choose decoder_first/last_pipeline_num_layers that leave a "
                       f"multiple of {middle_ranks}")
        elif middle_ranks and (middle // middle_ranks) % vpp:
            out.append(f"each middle pipeline rank's {middle // middle_ranks} layers do not split over its VPP {vpp} "
                       f"virtual stages: leave a multiple of {middle_ranks * vpp} layers between the first and last ranks")
        elif not middle_ranks and middle:
            out.append(f"decoder_first/last_pipeline_num_layers ({first} + {last}) must add up to the model's {layers} "
                       f"layers at PP {pp}")
        return out
    slots = layers + embedding + loss
    counted = " (the embedding and loss counted as layers)" if embedding or loss else ""
    if slots % pp:
        return [f"{slots} layers{counted} do not split evenly over PP {pp} (Megatron-Core asserts): {SPLIT_FIX}"]
    if (slots // pp) % vpp:
        return [f"each pipeline rank's {slots // pp} layers{counted} do not split over VPP {vpp} virtual stages "
                f"(Megatron-Core asserts): choose a VPP dividing {slots // pp}, or {SPLIT_FIX}"]
    return []


def megatron_split(layers: int, mtp_layers: int, pp: int, vpp: int, head: float = 1.0) -> dict | None:
    """A copy of `_megatron_split`'s answer (cached: `plan --fit` asks the same split of many layouts)."""
    split = _megatron_split(layers, mtp_layers, pp, vpp, head)
    return None if split is None else dict(split)


@lru_cache(maxsize=1024)
def _megatron_split(layers: int, mtp_layers: int, pp: int, vpp: int, head: float = 1.0) -> dict | None:
    """The plainest `TrainingLayout` split fields with which Megatron-Core builds ``layers``
    decoder layers on PP x VPP stages: none when they split evenly; the two account_for_* flags
    when the embedding and loss slots make them split; else a pipeline_model_parallel_layout
    balancing the stages' work: the embedding light, the output layer and loss ``head`` decoder
    layers' worth (`Architecture.output_layers_worth`), each MTP layer one more layer and its own
    head, all on the last stage. None when a stage would be left without a layer's worth."""
    if not pipeline_split_problems(layers, pp, vpp):
        return {}
    if not pipeline_split_problems(layers, pp, vpp, embedding=True, loss=True):
        return {"embedding_in_split": True, "loss_in_split": True}
    stages = pp * vpp
    tail = head + mtp_layers * (1 + head)             # what the last stage holds beside its layers
    if stages == 2:
        options = [(first, layers - first) for first in range(1, layers + 1)]
    else:
        top = layers // (stages - 2) + 2
        options = [(first, last) for first in range(1, top) for last in range(0, top)
                   if layers - first - last >= stages - 2]
    if not options:
        return None

    def heaviest(option):                              # the most work a stage holds
        first, last = option
        middle = -(-(layers - first - last) // (stages - 2)) if stages > 2 else 0
        return max(first, middle, last + tail), -first   # ties: the first stage takes more
    first, last = min(options, key=heaviest)
    middle, extra = divmod(layers - first - last, stages - 2) if stages > 2 else (0, 0)
    counts = [first, *(middle + (i < extra) for i in range(stages - 2)), last]
    return {"layout_string": _layout_of_counts(counts, mtp_layers)}


def _layout_of_counts(counts: list, mtp_layers: int) -> str:
    """pipeline_model_parallel_layout of stages holding ``counts`` decoder layers, the embedding
    before the first stage's and the MTP layers and the loss after the last's; runs of equal
    stages written once as (..)*N."""
    def stage(n):
        return "t" if n == 1 else f"t*{n}" if n else ""
    inner, i = [], 1
    while i < len(counts) - 1:
        j = i
        while j < len(counts) - 1 and counts[j] == counts[i]:
            j += 1
        inner.append(f"({stage(counts[i])}|)*{j - i}" if j - i > 1 else f"{stage(counts[i])}|")
        i = j
    return f"E{stage(counts[0])}|{''.join(inner)}{stage(counts[-1])}{'m' * mtp_layers}L"
