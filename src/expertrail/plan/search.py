"""`expertrail plan --fit --gpus N`: the layouts that fit, ranked by predicted step time.

Parallel folding: attention layers take TP x CP x DP x PP and MoE layers ETP x EP x EDP x PP of
the same GPUs, so TP / CP and EP / ETP are searched independently (within one pipeline
stage's GPUs), and so are the micro-batch sizes of `MICRO_BATCHES` (a larger micro-batch
fills the GEMMs and spreads each layer's launches over more tokens, at the cost of memory and
of the pipeline's fill). For each layout the search also tries the recompute choices of `RECOMPUTE`
(lightest first) and VPP, each with the plainest pipeline split Megatron builds
(`layout.megatron_split`: even, the embedding and loss counted as layers, or a
pipeline_model_parallel_layout), and with EP it tries Megatron's EP overlap (with delayed weight
gradients) as well as without; a layout that does not fit at any of them, or that breaks a
`validate` rule (EP overlap needs VPP with PP, no full recompute, two micro-batches), is
dropped. The estimate of each survivor (`estimate.estimate`) ranks them.

`fitting_pp` is the memory check `expertrail plan` makes for an EP size: the fewest pipeline
stages with which a reference run of the model fits at that EP.
"""
from __future__ import annotations

import shlex
from dataclasses import replace

from ..errors import ConfigError
from ..names import default_flex_backend
from .architecture import ARCHITECTURES, Architecture
from .catalog import Hardware, MoEModel
from .estimate import estimate, speed_assumption
from .layout import FUSED_BY_RECIPES, TrainingLayout, megatron_split
from .validate import validate

# Lightest first: selective recompute of cheap modules before whole layers (MLA's up projection and
# Gated DeltaNet's output norm only for models that have them).
RECOMPUTE = [(None, ()), ("selective", ("mla_up_proj", "gdn_norm_out", "moe_act", "layernorm")),
             ("selective", ("mla_up_proj", "gdn_norm_out", "moe_act", "layernorm", "mlp", "shared_experts")),
             ("selective", ("moe",)), ("full", ())]
# Pipeline sizes searched: every divisor of the GPUs up to this many stages (the published runs
# reach PP 32), so 72 GPUs of an NVL72 rack try PP 3, 6, 9, ... too; uneven splits as Megatron builds them.
MAX_PP = 32
# Micro-batch sizes searched, up to MAX_MICRO_BATCH_TOKENS tokens a micro-batch (the published
# recipes run 1 to 8 sequences of 4096).
MICRO_BATCHES = (1, 2, 4, 8)
MAX_MICRO_BATCH_TOKENS = 32768


def _divisors(n: int, limit: int) -> list:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def pp_sizes(gpus: int, layers: int) -> list:
    """The pipeline sizes searched on ``gpus`` GPUs: its divisors up to `MAX_PP` and the layers."""
    return _divisors(gpus, min(MAX_PP, layers))


def _recompute_choices(arch: Architecture) -> list:
    out = []
    for granularity, modules in RECOMPUTE:
        mods = tuple(m for m in modules if not arch.recompute_problems((m,)))     # only the model's own attention's
        if (granularity, mods) not in out:
            out.append((granularity, mods))
    return out


def architecture_of(model: MoEModel) -> Architecture | None:
    """The whole-model shape behind a catalog MoE model, if the catalog has it."""
    return ARCHITECTURES.get(model.name)


def fitting_pp(arch: Architecture, hw: Hardware, ep: int, precision: str, gpus: int = 256,
               seq: int = 4096) -> tuple:
    """(fewest PP that fits or None, its estimate or the last one tried) for a reference run:
    ``gpus`` GPUs, TP 1, micro-batch 1 of ``seq`` tokens, 8 micro-batches per stage, the
    flex dispatcher, light selective recompute or else full recompute, the plainest pipeline
    split Megatron builds."""
    last = None
    light = ("selective", ("mla_up_proj", "moe_act") if arch.mla else ("moe_act",))
    for pp in pp_sizes(gpus, arch.layers):
        split = megatron_split(arch.layers, arch.mtp_layers, pp, 1, arch.output_layers_worth(seq))
        if gpus % (pp * ep) or split is None:
            continue
        for granularity, modules in (light, ("full", ())):
            layout = TrainingLayout(gpus=gpus, pp=pp, ep=ep, seq=seq, precision=precision, dispatcher="flex",
                                    flex_backend=default_flex_backend(hw.domain_size),
                                    global_batch=8 * gpus, recompute=granularity, recompute_modules=modules,
                                    recompute_method="uniform" if granularity == "full" else None, **split)
            last = estimate(arch, hw, layout)
            if last["fits"]:
                return pp, last
    return None, last


def _shapes(arch: Architecture, hw: Hardware, gpus: int):
    """Each (PP, TP, CP, DP, EP, ETP) of ``gpus`` GPUs: TP within the NVLink domain (at most 8),
    CP 1 or 2, EP > 1 dividing the experts, EP x ETP and TP x CP each dividing a stage's GPUs,
    and TP and ETP splitting the model's heads and widths (`Architecture.split_problems`)."""
    for pp in pp_sizes(gpus, arch.layers):
        stage = gpus // pp
        for tp in _divisors(stage, min(8, hw.domain_size)):
            for cp in (1, 2):
                if stage % (tp * cp):
                    continue
                for ep in [e for e in _divisors(arch.experts, stage) if e > 1]:
                    for etp in (1, tp) if tp > 1 else (1,):
                        if stage % (ep * etp) == 0 and not arch.split_problems(tp, etp):
                            yield pp, tp, cp, stage // (tp * cp), ep, etp


def micro_batches(seq: int) -> list:
    """The micro-batch sizes `search` tries at sequence length ``seq``."""
    return [m for m in MICRO_BATCHES if m == 1 or m * seq <= MAX_MICRO_BATCH_TOKENS]


def default_global_batch(sequences: int, seq: int) -> int:
    """The global batch a layout is searched at when none is given: the first multiple of the
    ``sequences`` one step of micro-batches takes (DP x micro-batch) from 1024 sequences (256
    beyond 8k tokens), so a layout whose DP is not a power of two (72 GPUs of an NVL72 rack) is
    searched too."""
    least = 1024 if seq <= 8192 else 256
    return -(-least // sequences) * sequences


def search(arch: Architecture, hw: Hardware, gpus: int, seq: int = 4096, global_batch: int | None = None,
           micro_batch: int | None = None, precision: str = "bf16", top: int = 5,
           natural_routing: bool = False, routing: str | None = None, expert_loads: tuple | None = None) -> list:
    """Fitting layouts, fastest first: [(estimate, layout)]; ``micro_batch`` fixes the
    micro-batch size (default: each of `micro_batches`, smallest first: a micro-batch that does not
    fit at any recompute ends the layout's larger ones, and each starts from the recompute its
    smaller one needed, as activations only grow with the micro-batch). Each layout is costed with
    the routers forced to balance, as benchmarks run, or with ``natural_routing`` the model's
    trained router, whose busiest EP rank waits longer at larger EP (`estimate.routing_imbalance`):
    the calibrated one, or ``routing`` (a `cost.Routing` spec) / ``expert_loads`` (recorded token
    counts [layers][experts]) as `estimate --routing` takes them."""
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus}: give the number of GPUs, e.g. --gpus 256")
    backend = default_flex_backend(hw.domain_size)
    sizes = [micro_batch] if micro_batch else micro_batches(seq)
    found, steps = [], set()                 # steps: the sequences one round of micro-batches takes, DP x MBS
    for (pp, tp, cp, dp, ep, etp), overlap in ((shape, o) for shape in _shapes(arch, hw, gpus) for o in (False, True)):
        lightest = 0
        for mbs in sizes:
            batch = global_batch or default_global_batch(dp * mbs, seq)
            steps.add(dp * mbs)
            if batch % (dp * mbs):
                continue
            base = TrainingLayout(gpus=gpus, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, seq=seq, micro_batch=mbs,
                                  global_batch=batch, precision=precision, dispatcher="flex", flex_backend=backend,
                                  ep_overlap=overlap, delay_wgrad=overlap, natural_routing=natural_routing,
                                  routing=routing if natural_routing else None,
                                  expert_loads=expert_loads if natural_routing else None)
            best = _best_fit(arch, hw, base, lightest)
            if best is None:
                break
            found.append(best[:2])
            lightest = best[2]
    if global_batch and steps and not any(global_batch % step == 0 for step in steps):
        raise ConfigError(f"--global-batch {global_batch} is not a multiple of DP x micro-batch of any layout of "
                          f"{gpus} GPUs (the smallest: {', '.join(map(str, sorted(steps)[:4]))}): choose a multiple "
                          "of one, or leave it out")
    found.sort(key=lambda pair: pair[0]["step_time_s"] / pair[0]["layout"]["global_batch"])
    return found[:top]


def _best_fit(arch: Architecture, hw: Hardware, base: TrainingLayout, lightest: int = 0):
    """(estimate, layout, its recompute's index) of the lightest recompute from
    ``_recompute_choices(arch)[lightest]`` on and the fastest VPP that fit and validate, or None."""
    vpps = [v for v in (1, 2, 4) if base.pp > 1 or v == 1]
    best = None
    for index, (granularity, modules) in enumerate(_recompute_choices(arch)[lightest:], lightest):
        for vpp in vpps:
            split = megatron_split(arch.layers, arch.mtp_layers, base.pp, vpp, arch.output_layers_worth(base.seq))
            if split is None:
                continue
            layout = replace(base, vpp=vpp, recompute=granularity, recompute_modules=modules,
                             recompute_method="uniform" if granularity == "full" else None, **split)
            if layout.problems(arch.experts, arch.layers) or _violations(arch, hw, layout):
                continue
            r = estimate(arch, hw, layout)
            if r["fits"] and (best is None or r["step_time_s"] < best[0]["step_time_s"]):
                best = (r, layout, index)
        if best:
            return best                 # lighter recompute fits: heavier ones only cost time
    return None


def layout_fields(arch: Architecture, layout: TrainingLayout, hw: Hardware) -> dict:
    """Megatron-Core fields of a layout (what `--emit` prints and `validate` reads)."""
    fields = {"tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
              "context_parallel_size": layout.cp, "expert_model_parallel_size": layout.ep,
              "expert_tensor_parallel_size": layout.etp, "num_moe_experts": arch.experts,
              "moe_router_topk": arch.topk, "micro_batch_size": layout.micro_batch,
              "global_batch_size": layout.global_batch, "seq_length": layout.seq,
              "moe_token_dispatcher_type": layout.dispatcher, "moe_grouped_gemm": True,
              "use_distributed_optimizer": True, "overlap_grad_reduce": layout.overlap_grad_reduce,
              "overlap_param_gather": layout.overlap_grad_reduce, "bf16": True,
              **dict.fromkeys(FUSED_BY_RECIPES, True)}
    fields.update(arch.moe_model().router_fields())
    if layout.tp > 1:
        fields["sequence_parallel"] = True
    if layout.pp > 1:                       # the split Megatron builds depends on the layers
        fields["num_layers"] = arch.layers
    if arch.mtp_layers:
        fields["mtp_num_layers"] = arch.mtp_layers
    if layout.layout_string:                # it sets VPP itself
        fields["pipeline_model_parallel_layout"] = layout.layout_string
    elif layout.vpp > 1:
        fields["virtual_pipeline_model_parallel_size"] = layout.vpp
    if layout.embedding_in_split:
        fields.update(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    if layout.flex_backend:
        fields["moe_flex_dispatcher_backend"] = layout.flex_backend
    if layout.recompute:
        fields["recompute_granularity"] = layout.recompute
        if layout.recompute == "selective":
            fields["recompute_modules"] = list(layout.recompute_modules)
        else:
            fields.update(recompute_method="uniform", recompute_num_layers=1)
    if layout.precision == "fp8":
        fields.update(fp8="e4m3", fp8_recipe="mxfp8" if hw.arch == "blackwell" else "blockwise",
                      moe_router_dtype="fp32")
    if layout.ep_overlap:
        fields.update(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=layout.delay_wgrad)
    return fields


def _violations(arch: Architecture, hw: Hardware, layout: TrainingLayout) -> list:
    fields = layout_fields(arch, layout, hw)
    return validate(dict(fields, hardware=hw.name, world_size=layout.gpus))


# Megatron-Bridge's ConfigContainer section of each field a layout sets that is not the model's,
# and its mixed-precision recipe for the fp8_recipe `layout_fields` writes (None: BF16).
BRIDGE_SECTIONS = {"micro_batch_size": "train", "global_batch_size": "train", "use_distributed_optimizer": "ddp",
                   "overlap_grad_reduce": "ddp", "overlap_param_gather": "ddp",
                   "overlap_moe_expert_parallel_comm": "comm_overlap", "delay_wgrad_compute": "comm_overlap"}
BRIDGE_PRECISION = {None: "bf16_mixed", "mxfp8": "bf16_with_mxfp8_mixed",
                    "blockwise": "bf16_with_fp8_subchannel_scaling_mixed"}


def emit_layout(arch: Architecture, hw: Hardware, layout: TrainingLayout, style: str) -> str:
    """Megatron-Core flags or Megatron-Bridge overrides of a layout."""
    fields = layout_fields(arch, layout, hw)
    if style == "megatron":
        out = []
        for k, v in fields.items():
            flag = {"num_moe_experts": "--num-experts", "fp8": "--fp8-format"}.get(k, "--" + k.replace("_", "-"))
            value = " ".join(v) if isinstance(v, list) else shlex.quote(str(v))    # a layout's | ( * for the shell
            out.append(flag if v is True else f"{flag} {value}")
        return " \\\n  ".join(out)
    if style == "bridge":
        def text(v):
            return str(v).lower() if isinstance(v, bool) else f"[{','.join(v)}]" if isinstance(v, list) else str(v)
        lines = [f"mixed_precision={BRIDGE_PRECISION[fields.get('fp8_recipe')]}"]
        lines += [f"{BRIDGE_SECTIONS.get(k, 'model')}.{k}={text(v)}" for k, v in fields.items()
                  if k not in ("bf16", "fp8", "fp8_recipe")]
        lines.append(f"dataset.seq_length={fields['seq_length']}")       # Bridge asserts it equals the model's
        return "\n".join(map(shlex.quote, lines))
    raise ConfigError(f"--emit {style!r}; choose megatron or bridge")


def leanest(arch: Architecture, hw: Hardware, gpus: int, seq: int = 4096, precision: str = "bf16"):
    """(estimate, layout) of the layout `search` tries that needs the least memory on its busiest
    rank (each shape at micro-batch 1 with full recompute, the plainest split), or None when
    ``gpus`` GPUs have no shape at all: what `format_search` shows when nothing fits."""
    best = None
    for pp, tp, cp, dp, ep, etp in _shapes(arch, hw, gpus):
        split = megatron_split(arch.layers, arch.mtp_layers, pp, 1, arch.output_layers_worth(seq))
        if split is None:
            continue
        layout = TrainingLayout(gpus=gpus, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, seq=seq, precision=precision,
                                global_batch=default_global_batch(dp, seq), dispatcher="flex",
                                flex_backend=default_flex_backend(hw.domain_size), recompute="full",
                                recompute_method="uniform", **split)
        if layout.problems(arch.experts, arch.layers):
            continue
        r = estimate(arch, hw, layout)
        if best is None or r["peak_memory_GB"] < best[0]["peak_memory_GB"]:
            best = (r, layout)
    return best


def format_search(found: list, arch: Architecture, hw: Hardware, gpus: int, closest=None) -> str:
    """`plan --fit`'s table of ``found`` layouts; when none fits, the message names ``closest``
    (`leanest`'s answer) and what it needs."""
    if not found:
        why = "no shape: EP must divide the experts and a pipeline stage's GPUs"
        if closest:
            r, lay = closest
            why = (f"the leanest, TP {lay.tp} CP {lay.cp} PP {lay.pp} EP {lay.ep} ETP {lay.etp} at micro-batch 1 with "
                   f"full recompute, needs {r['peak_memory_GB']:.0f} GB of {r['usable_memory_GB']:.0f} usable")
            broken = _violations(arch, hw, lay) if r["fits"] else []
            if broken:                      # it fits: a rule Megatron enforces refused the layouts, not memory
                return (f"plan --fit: no layout of {arch.name} on {gpus} x {hw.name} passes validate (the leanest, "
                        f"TP {lay.tp} CP {lay.cp} PP {lay.pp} EP {lay.ep} ETP {lay.etp}, fits in "
                        f"{r['peak_memory_GB']:.0f} GB but breaks " + "; ".join(v.format() for v in broken) + ")")
        return (f"plan --fit: no layout of {arch.name} fits {gpus} x {hw.name} (every PP, TP, CP, EP, ETP, VPP, "
                f"micro-batch and recompute choice tried; {why}): more GPUs, or GPUs with more memory")
    chosen = found[0][1]
    router = ("routers forced to balance; --router natural for the model's trained router"
              if not chosen.natural_routing else
              f"the router's loads of --router {chosen.routing}, its busiest EP rank waited for" if chosen.routing
              else "the model's natural router, its busiest EP rank waited for")
    lines = [f"plan --fit: {arch.name} on {gpus} x {hw.name}, fastest first (predicted, {router}; "
             "docs/planner.md)", "",
             f"  {'#':>2} {'TP':>3} {'CP':>3} {'PP':>3} {'VPP':>3} {'DP':>4} | {'EP':>4} {'ETP':>3} {'EDP':>4} "
             f"{'MBS':>3} {'overlap':>7}  {'recompute':<28} {'step s':>7} {'TFLOPS':>7} {'peak GB':>8}  wall"]
    for i, (r, layout) in enumerate(found, 1):
        lay = r["layout"]
        rec = layout.recompute or "none"
        if layout.recompute == "selective":
            rec = ",".join(layout.recompute_modules)
        lines.append(f"  {i:>2} {lay['tp']:>3} {lay['cp']:>3} {lay['pp']:>3} {lay['vpp']:>3} {lay['dp']:>4} | "
                     f"{lay['ep']:>4} {lay['etp']:>3} {lay['edp']:>4} {layout.micro_batch:>3} "
                     f"{'EP' if lay['ep_overlap'] else '-':>7}  "
                     f"{rec:<28} {r['step_time_s']:>7.2f} "
                     f"{r['tflops_per_gpu']:>7.0f} {r['peak_memory_GB']:>8.1f}  {r['wall']}")
    r = found[0][0]
    mem = r["memory"]
    lines += ["", "memory of #1 (busiest rank, GB): " + ", ".join(
        f"{k} {mem[k + '_GB']:.1f}" for k in ("weights", "gradients", "optimizer", "activations", "dispatcher"))
        + f" = {r['peak_memory_GB']:.1f} of {r['usable_memory_GB']:.1f} usable"]
    said = list(arch.assumed) + speed_assumption(hw)          # what holds for every layout: the model's, the system's
    if said:
        lines.append("assumed (every layout): " + "; ".join(said))
    return "\n".join(lines)
