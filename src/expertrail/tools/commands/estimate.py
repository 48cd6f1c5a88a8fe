"""`expertrail estimate`: whether a training configuration fits, its step time, TFLOPS per GPU
and the wall it hits (torch-free)."""
from __future__ import annotations

import sys

from ...errors import ExpertrailError
from ..arguments import ConfigArguments, positive_int


def add_parser(sub) -> None:
    from ...plan.architecture import ARCHITECTURES
    p = sub.add_parser(
        "estimate", help="does a training configuration fit; step time, TFLOPS per GPU and the wall it hits",
        usage="%(prog)s [-h] [--hardware NAME] [--gpus N] [--model NAME|DIR] [--json PATH] [CONFIG.yaml] "
              "[key=value | --megatron-flag [VALUE]] ...",
        description="Reads a Megatron-Core / Megatron-Bridge training configuration (the forms `expertrail validate` "
                    "reads) and predicts memory per GPU on the busiest pipeline rank, the step time, per-GPU TFLOPS "
                    "(model FLOPs, Megatron's count) and the wall the run hits (docs/planner.md). Torch-free.",
        allow_abbrev=False)
    p.__class__ = ConfigArguments
    _fit_arguments(p, ARCHITECTURES)
    p.add_argument("--json", metavar="PATH", help="also write the estimate as JSON (fits, peak_memory_GB, "
                                                  "step_time_s, tflops_per_gpu and the breakdowns)")
    p.add_argument("--routing", metavar="SPEC", default=None,
                   help="a natural router's loads, where the configuration does not force balance: zipf:<alpha> (hot "
                        "experts at low ids), uniform, a .npy of recorded topk_idx ([N, K] or [world, N, K], every "
                        "rank's tokens counted), or LoadRecorder's token counts [layers, experts] (.npy, .csv, .json, "
                        "as `expertrail balance --load` reads them): each MoE layer waits for the EP rank with the "
                        "most rows (default: the calibrated natural-router model, docs/cost-model.md)")
    p.set_defaults(config=[])


def _fit_arguments(p, architectures) -> None:
    """--hardware / --gpus / --model of `estimate`."""
    p.add_argument("--hardware", metavar="NAME|FILE", default=None,
                   help="GPU system (as for plan; default: the configuration's hardware, Bridge's -g)")
    p.add_argument("--gpus", type=positive_int(256), default=None,
                   help="GPUs of the run (default: the configuration's world_size, or num_nodes x gpus_per_node, "
                        "a node of the system's size where it gives no gpus_per_node)")
    p.add_argument("--model", metavar="NAME|DIR", default=None,
                   help=f"model shape: one of {', '.join(architectures)}, a Hugging Face config.json or model "
                        "directory, or ORG/NAME in the local Hugging Face cache; fields such as num_layers or hidden_size in "
                        "the configuration override it (default: the model of Bridge's -mr recipe name, else the "
                        "configuration spells the model out)")


def _estimate_inputs(args, config: list) -> tuple:
    """(architecture, hardware, layout fields, validate violations, GPUs) from --model, --gpus and
    config entries."""
    from ...plan.architecture import from_fields, load_architecture, recipe_model
    from ...plan.catalog import load_hardware
    from ...plan.validate import Config, config_values, validate, value_violations, with_model_fields
    values = config_values(config, hardware=args.hardware)
    # A value of the wrong kind (moe_ffn_hidden_size=2k) is refused as validate refuses it,
    # before the estimator would compute with it.
    wrong = value_violations(values)
    if wrong:
        raise ExpertrailError("\n".join(v.format() for v in wrong))
    hardware = _hardware(args.hardware, values.get("hardware"))
    hw = load_hardware(hardware)
    gpus = _gpus(args.gpus, Config(dict(values, hardware=hardware)).world)
    arch = from_fields(load_architecture(args.model or recipe_model(values)), values)
    with_model_fields(values, arch)
    checked = dict(values, hardware=hw.name if not hardware.endswith((".yaml", ".yml", ".json")) else hardware,
                   world_size=gpus)
    return arch, hw, values, validate(checked), gpus


def _hardware(given: str | None, stated: str | None) -> str:
    """The run's system: --hardware, or the configuration's hardware (Bridge's -g); both, only
    where they name one system."""
    from ...plan.catalog import hardware_key
    if given is None and stated is None:
        raise ExpertrailError("--hardware NAME: give the GPU system of the run, e.g. --hardware h100")
    if given is not None and stated is not None and (hardware_key(given) or given) != (hardware_key(stated) or stated):
        raise ExpertrailError(f"--hardware {given}, but the configuration's hardware is {stated}: give one of them, "
                              "or make them agree")
    return given if given is not None else stated


def _gpus(given: int | None, stated: int | None) -> int:
    """The run's GPUs: --gpus, or the configuration's world size; both, only where they agree."""
    if given is None and stated is None:
        raise ExpertrailError("--gpus N: give the GPUs of the run (the configuration states no world_size or "
                              "num_nodes x gpus_per_node), e.g. --gpus 256")
    if given is not None and stated is not None and given != stated:
        raise ExpertrailError(f"--gpus {given}, but the configuration's world size is {stated} (world_size, or "
                              "num_nodes x gpus_per_node): give one of them, or make them agree")
    return given or stated


def run(args) -> int:
    from dataclasses import replace
    from ...plan.architecture import unstated_model_fields
    from ...plan.bridge_recipes import RECIPE_FIELD
    from ...plan.estimate import estimate, format_estimate
    from ...plan.layout import TrainingLayout
    from ...plan.output import dumps
    from ...plan.validate import READ_FIELDS, unknown_fields
    from ...balance.report import recorded_loads
    arch, hw, values, violations, gpus = _estimate_inputs(args, args.config)
    layout = TrainingLayout.from_fields(values, gpus)
    if args.routing:
        layout = replace(layout, routing=args.routing,
                         expert_loads=recorded_loads(args.routing, arch.experts, arch.name))
    if args.model is None and not values.get("model_recipe_name") and not values.get("modelzoo_model"):
        layout = replace(layout, assumed=(*layout.assumed, *unstated_model_fields(values)))
    if values.get("model_recipe_name") and not values.get(RECIPE_FIELD):
        layout = replace(layout, assumed=(*layout.assumed, f"-mr {values['model_recipe_name']} names no Megatron-Bridge "
                                          "performance recipe of this system and precision that expertrail holds "
                                          "(plan/bridge_perf_recipes.json), so its settings (layout, dispatcher, "
                                          "recompute, CUDA graphs, ...) are not read: give them as fields"))
    elif values.get("recipe") and not values.get(RECIPE_FIELD):
        layout = replace(layout, assumed=(*layout.assumed, f"--recipe {values['recipe']} is a Megatron-Bridge recipe "
                                          "outside its performance recipes (plan/bridge_perf_recipes.json): its model "
                                          "is read, its settings (layout, dispatcher, recompute, ...) are not: give "
                                          "them as overrides"))
    if values.get("modelzoo_model"):
        layout = replace(layout, assumed=(*layout.assumed, f"MODEL={values['modelzoo_model']}: its ModelZoo model file "
                                          "(model_configs/benchmarking/<MODEL>.yaml) is not beside the launch script, "
                                          "so --model's (else the catalog's) with what every such file sets (ETP 1, "
                                          "sequence parallel, distributed optimizer, overlapped gradient reduce and "
                                          "parameter gather, grouped GEMM, BF16) and its file's pipeline split and MTP "
                                          "layers; run from the ModelZoo checkout or set TRAINING_PARAMS_PATH to read "
                                          "the file's own"))
    result = estimate(arch, hw, layout)
    result["violations"] = [v.__dict__ for v in violations]
    # A field no Megatron or Bridge configuration has (a typo, another launcher's flag) changes
    # nothing here, and would change nothing in Megatron but an error: said, not passed over.
    unknown = unknown_fields(values)
    result["unknown_fields"] = [w["field"] for w in unknown]
    for field in READ_FIELDS:
        if values.get(field):
            result[field] = values[field]
            print(f"read: {values[field]}")
    print(format_estimate(result))
    for w in unknown:
        close = f" (did you mean {w['closest']!r}?)" if w["closest"] else ""
        print(f"warning: unknown field {w['field']!r}{close}: no Megatron or Bridge configuration has it, and the "
              "estimate leaves it out", file=sys.stderr)
    for v in violations:
        print(f"validate: {v.format()}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(dumps(result, fallback=str))
        print(f"wrote {args.json}")
    return 0
