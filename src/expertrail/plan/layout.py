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

from ..errors import ConfigError

RECIPE_DEFAULTS = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "overlap_param_gather": True}
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
PIPELINE_STAGE_MARKS = {"E": "embedding", "t": "layer", "m": "mtp", "L": "loss"}


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
    precision: str = "bf16"                 # bf16 | fp8
    fp8_recipe: str | None = None
    recompute: str | None = None            # None | "selective" | "full"
    recompute_modules: tuple = ()
    recompute_method: str | None = None     # full: "uniform" | "block"
    recompute_layers: int = 1
    dispatcher: str = "alltoall"            # Megatron moe_token_dispatcher_type
    flex_backend: str | None = None
    dispatcher_sms: int | None = None
    ep_overlap: bool = False
    tp_comm_overlap: bool = False
    distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    precision_aware_optimizer: bool = False
    optimizer_state_bytes: int = 8          # Adam's two moments, per parameter
    main_grad_bytes: int = 4
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    layout_string: str | None = None
    cuda_graphs: bool = False
    assumed: tuple = field(default=(), compare=False)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        return self.gpus // (self.pp * self.ep * self.etp)

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
        model = self.tp * self.pp * self.cp
        if self.gpus % model:
            out.append(f"TP {self.tp} x PP {self.pp} x CP {self.cp} = {model} does not divide {self.gpus} GPUs: "
                       "choose sizes whose product divides --gpus")
        if self.gpus % (self.pp * self.ep * self.etp):
            out.append(f"PP {self.pp} x EP {self.ep} x ETP {self.etp} does not divide {self.gpus} GPUs: choose "
                       "expert_model_parallel_size x expert_tensor_parallel_size dividing GPUs / PP")
        if experts % self.ep:
            out.append(f"EP {self.ep} does not divide the {experts} experts: choose a divisor")
        if self.pp * self.vpp > layers:
            out.append(f"PP {self.pp} x VPP {self.vpp} exceeds the {layers} layers: fewer stages")
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
        fp8 = v.get("fp8")
        precision = "fp8" if fp8 not in (None, False, "none") else "bf16"
        granularity = get("recompute_granularity", None)
        modules = get("recompute_modules", None)
        if isinstance(modules, str):
            modules = modules.replace(",", " ").split()
        if granularity == "selective" and modules is None:
            modules = ["core_attn"]
        unknown = [m for m in modules or [] if m not in RECOMPUTE_MODULES]
        if unknown:
            raise ConfigError(f"recompute_modules {unknown}: choose among {', '.join(RECOMPUTE_MODULES)}")
        if modules and granularity is None:
            granularity = "selective"
        dispatcher = get("moe_token_dispatcher_type", "allgather")
        backend = get("moe_flex_dispatcher_backend", None) if dispatcher == "flex" else None
        if dispatcher == "flex" and backend is None:
            backend = "deepep"
        sms = get(f"moe_{backend}_num_sms", None) if backend else None
        state = 8
        grads = 4
        if get("use_precision_aware_optimizer", False):
            sizes = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
            state = sizes.get(get("exp_avg_dtype", "fp32"), 4) + sizes.get(get("exp_avg_sq_dtype", "fp32"), 4)
            grads = sizes.get(get("main_grads_dtype", "fp32"), 4)
        graphs = get("cuda_graph_impl", None) not in (None, "none") or bool(get("enable_cuda_graph", False))
        layout = cls(
            gpus=gpus, tp=tp, pp=size("pipeline_model_parallel_size"),
            vpp=size("virtual_pipeline_model_parallel_size") if v.get("virtual_pipeline_model_parallel_size") else 1,
            cp=size("context_parallel_size"), ep=size("expert_model_parallel_size"),
            etp=size("expert_tensor_parallel_size", tp) if v.get("expert_tensor_parallel_size") else tp,
            micro_batch=size("micro_batch_size"), global_batch=v.get("global_batch_size"),
            seq=size("seq_length", 4096), precision=precision, fp8_recipe=get("fp8_recipe", None) if fp8 else None,
            recompute=granularity, recompute_modules=tuple(modules or ()),
            recompute_method=get("recompute_method", "uniform" if granularity == "full" else None),
            recompute_layers=int(get("recompute_num_layers", 1) or 1),
            dispatcher=dispatcher, flex_backend=backend, dispatcher_sms=sms,
            ep_overlap=bool(get("overlap_moe_expert_parallel_comm", False)),
            tp_comm_overlap=bool(get("tp_comm_overlap", False)),
            distributed_optimizer=bool(get("use_distributed_optimizer", True)),
            overlap_grad_reduce=bool(get("overlap_grad_reduce", True)),
            precision_aware_optimizer=bool(get("use_precision_aware_optimizer", False)),
            optimizer_state_bytes=state, main_grad_bytes=grads,
            first_stage_layers=v.get("decoder_first_pipeline_num_layers"),
            last_stage_layers=v.get("decoder_last_pipeline_num_layers"),
            layout_string=v.get("pipeline_model_parallel_layout"), cuda_graphs=graphs, assumed=tuple(assumed))
        return layout


def stage_layers(layout: TrainingLayout, layers: int, mtp_layers: int, dense_layers: int = 0) -> list:
    """[(decoder layers, of them dense, embedding?, output + loss?, MTP layers)] per pipeline
    rank, all its virtual stages together: from ``pipeline_model_parallel_layout`` where given
    (``E`` the embedding, ``t`` a layer, ``m`` an MTP layer, ``L`` the loss, ``|`` between
    stages, ``(..)*N`` and ``X*N`` repeats; virtual stage i lives on rank i mod PP), else even
    splits over the PP x VPP virtual stages with ``decoder_first/last_pipeline_num_layers``
    taken out first. The model's first ``dense_layers`` layers are its dense ones."""
    pp, vpp = layout.pp, layout.vpp
    if layout.layout_string:
        stages = _expand_layout(layout.layout_string)
        if len(stages) != pp * vpp:
            raise ConfigError(f"pipeline_model_parallel_layout has {len(stages)} stages; PP {pp} x VPP {vpp} = "
                              f"{pp * vpp} expected")
        counts = [st.count("t") for st in stages]
        if sum(counts) != layers:
            raise ConfigError(f"pipeline_model_parallel_layout holds {sum(counts)} layers; the model has {layers}")
        marks = [("E" in st, "L" in st, st.count("m")) for st in stages]
    else:
        first, last = layout.first_stage_layers, layout.last_stage_layers
        n = pp * vpp
        inner = n - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if rest < 0 or (inner == 0 and rest) or (inner and rest < inner):
            raise ConfigError(f"decoder_first/last_pipeline_num_layers ({first}, {last}) do not leave the other stages "
                              f"layers to split ({layers} layers, PP {pp} x VPP {vpp})")
        counts = [rest // inner + (i < rest % inner) for i in range(inner)] if inner else []
        if first is not None:
            counts.insert(0, first)
        if last is not None:
            counts.append(last)
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


def _expand_layout(text: str) -> list:
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
