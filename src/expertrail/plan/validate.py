"""`expertrail validate`: check a Megatron-Core / Megatron-Bridge MoE config before launch.

A config is a YAML or JSON file (flat, or nested as Bridge's ``model:`` / ``comm_overlap:``
sections) and/or command-line entries: ``key=value`` overrides
(``model.expert_model_parallel_size=8``) and Megatron's own argument forms as written
(``--expert-model-parallel-size 8``, ``--expert-model-parallel-size=8``, switches such as
``--moe-grouped-gemm``, ``--no-<field>`` / ``--disable-<field>``, and flags named unlike their
field: ``--num-experts`` sets ``num_moe_experts``). Dashes, case and section prefixes are
ignored, so the output of ``expertrail plan --emit`` validates as it is.

Three kinds of finding:
- a field no known Megatron / Bridge config has: a warning, with the closest known name;
- a value of the wrong type or outside its choices (``moe_token_dispatcher_type=alltoal``,
  ``expert_model_parallel_size=abc``): a violation of ``field-value``; rules reading that field
  are then left out rather than evaluated on nonsense;
- a rule of `RULES` broken. Each rule names the fields it reads and the fix; a field that is
  absent takes Megatron's default or, where no default decides it, leaves the rule out.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from . import megatron_fields as mf
from .catalog import HARDWARE, hardware_key, load_hardware, read_mapping
from .architecture import GATED_DELTA_NET, dense_layers_of, group_routing_holds, width_split_problems
from .layout import (GRAPH_MODULES_DEFAULTS, OUTER_SHARDING, expand_layout, layout_text, name_list,
                     pipeline_split_problems, sequence_split_problems, stage_override, vpp_of_stage_layers)
from .simulate import domain_for
from .modelzoo import launch_arguments
from .launch_line import script_arguments
from .bridge_recipes import RECIPE_FIELD, recipe_fields
from .launch_script import LAUNCH_FIELD, script_at, script_launch

FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")
# Megatron-LM's arguments of old, which its validate_args refuses, with what replaces each.
REMOVED_ARGUMENTS = {"batch_size": "give micro_batch_size (--micro-batch-size) instead",
                     "warmup": "give lr_warmup_fraction (--lr-warmup-fraction) instead",
                     "model_parallel_size": "give tensor_model_parallel_size (--tensor-model-parallel-size) instead",
                     "checkpoint_activations": "give recompute_activations (--recompute-activations), or "
                                               "recompute_granularity with recompute_method, instead"}
# The precision each kind of quantized weights needs, and the fields that ask for them.
QUANTIZED_WEIGHTS = {"fp8": ("fp8_param", "fp8_param_gather"), "fp4": ("fp4_param", "fp4_param_gather")}
DOMAIN_FIELD = "num_of_hybrid_ep_ranks_per_nvlink_domain"

# Megatron-Core defaults for the fields the rules read.
DEFAULTS = {
    "expert_model_parallel_size": 1, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
    "context_parallel_size": 1, "moe_token_dispatcher_type": "allgather", "moe_router_topk": 2,
    "moe_router_score_function": "softmax", "moe_router_load_balancing_type": "aux_loss",
}


# Megatron-Bridge's mixed-precision recipes (megatron/bridge/training/mixed_precision.py): the
# fields each sets that change memory or time, by the name a config gives as mixed_precision.
_BF16, _FP16 = {"bf16": True, "grad_reduce_in_fp32": True}, {"fp16": True, "grad_reduce_in_fp32": False}
_DELAYED = {"fp8": "hybrid", "fp8_recipe": "delayed", "fp8_param_gather": True}
_MXFP8 = {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp8_param_gather": True, "reuse_grad_buf_for_mxfp8_param_ag": True}
_CURRENT = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "first_last_layers_bf16": True,
            "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 1, "fp8_param_gather": True}
_SUBCHANNEL = {"fp8": "hybrid", "fp8_recipe": "blockwise", "fp8_param_gather": False}
_NVFP4 = {"fp4": "e2m1", "fp4_recipe": "nvfp4", "fp4_param_gather": True}
PRECISION_RECIPES = {
    "bf16_mixed": _BF16, "fp16_mixed": _FP16,
    "bf16_with_fp8_delayed_scaling_mixed": {**_BF16, **_DELAYED}, "fp16_with_fp8_delayed_scaling_mixed": {**_FP16, **_DELAYED},
    "bf16_with_mxfp8_mixed": {**_BF16, **_MXFP8}, "fp16_with_mxfp8_mixed": {**_FP16, **_MXFP8},
    "bf16_with_fp8_current_scaling_mixed": {**_BF16, **_CURRENT},
    "fp16_with_fp8_current_scaling_mixed": {**_FP16, **_CURRENT},
    "bf16_with_fp8_subchannel_scaling_mixed": {**_BF16, **_SUBCHANNEL},
    "fp16_with_fp8_subchannel_scaling_mixed": {**_FP16, **_SUBCHANNEL},
    "bf16_with_nvfp4_mixed": {**_BF16, **_NVFP4},
}

# Megatron-Bridge's performance scripts (scripts/performance/argument_parser.py) spell a layout with
# short flags (-tp 2 -ep 32 -mb 1 -gb 4096 -ng 256) and the precision as a compute dtype
# (-c fp8_mx), which is the mixed-precision recipe their utils/precision.py picks; EP overlap as
# --moe_a2a_overlap (`expand_bridge_names` expands both).
PERF_SCRIPT_FLAGS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                     "cp": "context_parallel_size", "vp": "virtual_pipeline_model_parallel_size",
                     "ep": "expert_model_parallel_size", "et": "expert_tensor_parallel_size",
                     "mb": "micro_batch_size", "gb": "global_batch_size", "sl": "seq_length",
                     "ng": "world_size", "num_gpus": "world_size", "gn": "gpus_per_node", "c": "compute_dtype",
                     "g": "hardware", "gpu": "hardware", "m": "model_family_name", "mr": "model_recipe_name",
                     "cv": "config_variant",
                     # scripts/training/run_recipe.py's spellings beside those
                     "etp": "expert_tensor_parallel_size", "ms": "train_iters"}
COMPUTE_DTYPES = {"bf16": "bf16_mixed", "fp8_cs": "bf16_with_fp8_current_scaling_mixed",
                  "fp8_mx": "bf16_with_mxfp8_mixed", "fp8_sc": "bf16_with_fp8_subchannel_scaling_mixed",
                  "fp8_ds": "bf16_with_fp8_delayed_scaling_mixed",
                  "nvfp4": "bf16_with_nvfp4_mixed"}

# The fields that say what a command line was read as (a launch script's run, a Bridge recipe),
# which validate and estimate print on a read: line.
READ_FIELDS = (LAUNCH_FIELD, RECIPE_FIELD)
# The model `--model` named (`with_model_fields`): its attention is then known, stated or not.
MODEL_FIELD = "expertrail_model"
# Fields the rules read that are expertrail's, not Megatron's.
EXPERTRAIL_FIELDS = {"hardware": "str", "world_size": "int", "num_nodes": "int", "gpus_per_node": "int",
                     "torch_version": "str", DOMAIN_FIELD: "int", "data_parallel_size": "int", MODEL_FIELD: "str",
                     "model_family_name": "str", "model_recipe_name": "str", "modelzoo_model": "str",
                     LAUNCH_FIELD: "str", RECIPE_FIELD: "str", "config_variant": "str",
                     # Megatron-Bridge's scripts/training/run_recipe.py: a recipe function by name, the
                     # training mode, a dataset preset (mock: random tokens, as Megatron-LM's --mock-data)
                     "recipe": "str", "mode": "str", "dataset": "str"}


def _kinds() -> dict:
    kinds = {}
    for kind, names in (("bool", mf.BOOL), ("int", mf.INT), ("float", mf.FLOAT), ("str", mf.STR), ("list", mf.LIST),
                        ("any", mf.ANY)):
        kinds.update((n.lower(), kind) for n in names)
    kinds.update((n.lower(), ("choice", c)) for n, c in mf.CHOICES.items())
    kinds.update((n.lower(), ("list_choice", c)) for n, c in mf.LIST_CHOICES.items())
    kinds.update(EXPERTRAIL_FIELDS)
    kinds["mixed_precision"] = ("choice", [n for r in PRECISION_RECIPES for n in (r, r.replace("_", "-"))])
    kinds["compute_dtype"] = ("choice", list(COMPUTE_DTYPES))
    kinds["moe_a2a_overlap"] = "bool"
    return kinds


KINDS = _kinds()
"""field -> "bool" | "int" | "float" | "str" | "list" | "any" | ("choice" | "list_choice", choices)"""
KNOWN = sorted(KINDS)
FLAG_ALIASES = {k.lower(): (dest.lower(), value) for k, (dest, value) in mf.FLAG_ALIASES.items()}

# The optimizer's dtypes Megatron-Core keeps FP32 unless use_precision_aware_optimizer.
OPTIMIZER_DTYPES = ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
# Whole numbers that must be at least 1 (sizes and counts the rules divide by or compare).
POSITIVE = {
    "expert_model_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "context_parallel_size", "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size",
    "data_parallel_size", "world_size", "num_nodes", "gpus_per_node", "num_moe_experts", "moe_router_topk",
    "moe_router_num_groups", "moe_router_group_topk", DOMAIN_FIELD, "moe_deepep_num_sms", "moe_hybridep_num_sms",
    "moe_flex_dispatcher_num_sms", "num_layers", "hidden_size", "ffn_hidden_size", "moe_ffn_hidden_size",
    "num_attention_heads", "micro_batch_size", "global_batch_size", "seq_length", "recompute_num_layers",
    "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
    "num_distributed_optimizer_instances",
}
NON_NEGATIVE = {"mtp_num_layers", "moe_shared_expert_intermediate_size"}


def parse_value(text: str):
    """A command-line value as Megatron-LM's argparse or a Megatron-Bridge (Hydra-style) override
    reads it: true / false, none, a number, a list written ``[a,b]`` (or ``['a', 'b']``), else text."""
    inner = text.strip()
    if len(inner) > 1 and inner[0] == "[" and inner[-1] == "]":
        return [parse_value(item) for item in inner[1:-1].split(",") if item.strip()]
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null", ""):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip().strip("'\"")


def _key(name: str) -> str:
    return name.strip().lstrip("-").split(".")[-1].replace("-", "_").lower()


def canonical(name: str) -> tuple:
    """(field, value a switch sets or None) for a key or flag as written: section prefixes, dashes
    and case ignored; Megatron's flag aliases and ``--no-`` / ``--disable-`` switches resolved."""
    key = _key(name)
    if key in KINDS:
        return key, None
    if key in FLAG_ALIASES:
        return FLAG_ALIASES[key]
    if key in PERF_SCRIPT_FLAGS:
        return PERF_SCRIPT_FLAGS[key], None
    for prefix in ("no_", "disable_"):
        if key.startswith(prefix) and KINDS.get(key[len(prefix):]) == "bool":
            return key[len(prefix):], False
    return key, None


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token in ("-", "--"):
        return False
    try:
        float(token)                    # a negative number is a value
        return False
    except ValueError:
        return True


def _switched(value, forced):
    """The value a ``--no-x=true`` style entry sets: the switch's value, or its negation for false."""
    if forced is None or not isinstance(value, bool):
        return value
    return forced if value else not forced


def split_arguments(tokens: list) -> tuple:
    """(config files, [(field, value)]) from command-line tokens, in order.

    ``key=value`` and ``--flag=value`` set a field; ``--flag value`` too, unless the flag is a
    switch (a boolean field: ``--moe-grouped-gemm``, ``--no-gradient-accumulation-fusion``), which
    takes no value (``true`` / ``false`` after one is read as its value). A list field
    (``--moe-router-load-balancing-type aux_loss``) takes every value up to the next flag. A
    lone ``\\`` (a line continuation split by the shell) is skipped; any other bare word is a
    config file. A Megatron-MoE-ModelZoo launch (``PR=mxfp8 TP=1 ... bash sbatch_benchmarking.sh
    --flag ...``) is read as the arguments it starts its run with (`modelzoo.launch_arguments`), a
    Python launch (``torchrun --nproc_per_node 8 --nnodes 4 pretrain_gpt.py --flag ...``, ``python
    pretrain_gpt.py --flag ...``) as its script's arguments on the GPUs torchrun starts
    (`launch_line.script_arguments`), and a launch script (``NNODES=4 bash train.sh``) as the
    training command it starts (`launch_script.script_launch`)."""
    at = script_at(tokens)
    script = None if at is None else str(tokens[at]).strip()
    tokens = script_arguments(launch_arguments(script_launch(tokens)))
    try:
        return _files_and_fields(tokens)
    except ConfigError as error:
        if script is None:
            raise
        raise ConfigError(f"{error}, in the training command {script} starts (a variable it leaves empty drops a "
                          f"value: give its arguments after it and its variables before it, NAME=value {script} "
                          "ARG ...)") from None


def _files_and_fields(tokens: list) -> tuple:
    """`split_arguments` of tokens with no launch left in them."""
    files, pairs = [], []
    i = 0
    while i < len(tokens):
        tok = str(tokens[i]).strip()
        i += 1
        if tok in ("", "\\"):
            continue
        if _is_flag(tok):
            name, eq, text = tok.partition("=")
            key, forced = canonical(name)
            kind = KINDS.get(key)
            if eq:
                value = _switched(parse_value(text), forced)
            elif forced is not None:
                value = forced
            elif kind == "bool":
                value = True
                if i < len(tokens) and str(tokens[i]).strip().lower() in ("true", "false"):
                    value = parse_value(tokens[i])
                    i += 1
            elif kind == "list" or (isinstance(kind, tuple) and kind[0] == "list_choice"):
                value = []
                while i < len(tokens) and not _is_flag(str(tokens[i])) and "=" not in str(tokens[i]):
                    value.append(parse_value(str(tokens[i])))
                    i += 1
                if not value:
                    raise ConfigError(f"{name} needs one or more values, e.g. {name} VALUE")
                value = value[0] if len(value) == 1 else value
            elif i < len(tokens) and not _is_flag(str(tokens[i])) and (kind is not None or "=" not in str(tokens[i])):
                value = parse_value(str(tokens[i]))
                i += 1
            elif kind is None:
                value = True                        # an unknown switch; warned about as an unknown field
            else:
                raise ConfigError(f"{name} needs a value, e.g. {name}=VALUE or {name} VALUE")
            pairs.append((key, value))
        elif "=" in tok:
            name, _, text = tok.partition("=")
            if not name.strip():
                raise ConfigError(f"{tok!r}: write key=value, e.g. expert_model_parallel_size=8")
            key, forced = canonical(name)
            pairs.append((key, _switched(parse_value(text), forced)))
        else:
            files.append(tok)
    return files, pairs


# torch's dtype names (Megatron-Core's OptimizerConfig and Bridge's YAML write them) -> Megatron-LM's
# short names, which its dtype fields take (uint8 is how Megatron-LM stores an "fp8" Adam moment).
TORCH_DTYPES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                "uint8": "fp8", "float64": "fp64", "double": "fp64"}


def _short_dtype(key: str, value):
    """``value`` of a dtype field written as torch writes it (``torch.bfloat16``, ``bfloat16``) ->
    the short name the field takes (``bf16``); other values as they are."""
    choices = mf.CHOICES.get(key, ())
    if isinstance(value, str) and ("fp32" in choices or "bf16" in choices):
        short = TORCH_DTYPES.get(value.removeprefix("torch."))
        if short in choices:
            return short
    return value


def _flatten(data: dict, out: dict) -> dict:
    for k, v in data.items():
        if isinstance(v, dict) and str(v.get("_target_", "")).startswith("torch.") and v.get("_call_") is False:
            v = v["_target_"]               # Bridge's YAML writes a dtype as an uncalled target: torch.bfloat16
        if isinstance(v, dict):
            if str(v.get("_target_", "")).endswith(".MockGPTDatasetConfig"):
                out["mock"] = True          # Bridge's random-token dataset, as Megatron-LM's --mock-data
            _flatten(v, out)
        else:
            key, forced = canonical(str(k))
            if isinstance(v, str) and len(v) > 1 and v[0] == v[-1] and v[0] in "'\"":
                v = v[1:-1]                 # quoted for the shell a launch line passes it through
            if isinstance(v, str) and KINDS.get(key) in ("int", "float"):
                v = parse_value(v)          # YAML 1.1 reads 1e-6 as text; Megatron's argparse, as a number
            out[key] = _switched(v, forced)
    return out


def read_file(source: str) -> dict:
    """The fields of a YAML/JSON config file, flattened; every way it can be unusable is a ConfigError."""
    path = Path(source)
    if path.is_dir():
        raise ConfigError(f"config {source!r} is a directory: give a YAML/JSON file")
    if not path.exists():
        raise ConfigError(f"config file {source!r} not found (give a YAML/JSON file, key=value overrides or "
                          "Megatron flags such as --expert-model-parallel-size 8)")
    data = read_mapping(path, "config file")
    # A Megatron-LM recipe file (the ModelZoo's, Megatron-LM's functional tests) sets the launch's
    # environment beside its MODEL_ARGS: variables of the shell, not fields of the run.
    cfg = _flatten({k: v for k, v in data.items() if k != "ENV_VARS"}, {})
    if not cfg:
        raise ConfigError(f"config file {source!r} holds no fields: nothing to validate")
    return cfg


def load_config(source: str | None = None, overrides: list | None = None) -> dict:
    """Flat config from a YAML/JSON file (optional) plus command-line entries (`split_arguments`:
    ``key=value``, ``--flag value``, ``--flag=value``, ``--switch``), Bridge's recipe and
    performance-script names expanded (`expand_bridge_names`), a list-of-stages pipeline layout
    as its string."""
    cfg = read_file(source) if source is not None else {}
    files, pairs = split_arguments(list(overrides or []))
    if files:
        raise ConfigError(f"{files[0]!r} is neither key=value nor a --flag: write key=value, e.g. "
                          "model.expert_model_parallel_size=8, or --expert-model-parallel-size 8")
    cfg.update(pairs)
    if not cfg:
        raise ConfigError("no config fields given: give a YAML/JSON file, key=value overrides or Megatron flags "
                          "such as --expert-model-parallel-size 8")
    return _normalized(cfg)


def config_values(tokens: list, hardware: str | None = None) -> dict:
    """The flat config of a command line's config entries (empty for none): at most one
    YAML/JSON file, then ``key=value`` / Megatron flags over it, a Bridge mixed-precision recipe
    name expanded (as `load_config`). ``hardware`` (a command's --hardware) is the system of a
    Bridge performance recipe the entries name without their own (-g)."""
    files, pairs = split_arguments(list(tokens))
    if len(files) > 1:
        raise ConfigError(f"give at most one config file, got {files} (a bare word is read as a file: write "
                          "key=value or --flag VALUE for the others)")
    values = read_file(files[0]) if files else {}
    values.update(pairs)
    if hardware and values.get("model_recipe_name") and not values.get("hardware"):
        values["hardware"] = hardware
    return _normalized(values)


def _normalized(values: dict) -> dict:
    """``values`` over the Bridge performance recipe its perf-script names pick
    (`bridge_recipes.recipe_fields`), with Bridge's recipe and performance-script names expanded (`expand_bridge_names`),
    torch's dtype names as Megatron-LM's (`_short_dtype`) and a pipeline layout given as a list
    of stages written as its string (`layout.layout_text`)."""
    values = expand_bridge_names(recipe_fields(values))
    values = {k: _short_dtype(k, v) for k, v in values.items()}
    if values.get("dataset") == "mock":         # run_recipe.py --dataset mock: random tokens, as --mock-data
        values.setdefault("mock", True)
    if isinstance(values.get("pipeline_model_parallel_layout"), (list, tuple)):
        values = dict(values, pipeline_model_parallel_layout=layout_text(values["pipeline_model_parallel_layout"]))
    return values


def expand_bridge_names(values: dict) -> dict:
    """``mixed_precision: bf16_with_mxfp8_mixed`` (Megatron-Bridge names a mixed-precision recipe
    this way, in YAML or as an override) -> the fields that recipe sets, beside ``values``'s own
    (which win where both give one); Bridge's performance scripts' ``compute_dtype`` as the recipe
    they pick for it (fp8_cs without its BF16 first and last layers, as they set it), and their
    ``moe_a2a_overlap`` as EP overlap with delayed weight gradients. Other values are returned as
    they are."""
    if values.get("moe_a2a_overlap"):        # as their overrides.py sets it
        values = {"overlap_moe_expert_parallel_comm": True, "delay_wgrad_compute": True,
                  "moe_shared_expert_overlap": False, **values}
    dtype = values.get("compute_dtype")
    if dtype in COMPUTE_DTYPES and not values.get("mixed_precision"):
        values = dict(values, mixed_precision=COMPUTE_DTYPES[dtype])
        if dtype in ("fp8_cs", "fp8_ds"):
            values.setdefault("first_last_layers_bf16", False)
    name = values.get("mixed_precision")
    if not isinstance(name, str):
        return values
    recipe = PRECISION_RECIPES.get(name.replace("-", "_"))
    if recipe is None:
        raise ConfigError(f"mixed_precision={name!r} is not a Megatron-Bridge mixed-precision recipe: choose one of "
                          f"{', '.join(PRECISION_RECIPES)}, or give its fields (bf16, fp8, fp8_recipe, ...)")
    return {**recipe, **values}


def unknown_fields(values: dict) -> list:
    """Warnings for fields no known Megatron / Bridge / expertrail config has, each with the
    closest known name when one is close (keys starting with ``_``, such as a Bridge dump's
    ``_target_``, are its loader's, not fields)."""
    out = []
    for key in values:
        if key in KINDS or key.startswith("_"):         # Hydra's _target_, Bridge's private fields
            continue
        close = difflib.get_close_matches(key, KNOWN, n=1, cutoff=0.8)
        out.append({"field": key, "closest": close[0] if close else None,
                     "message": f"unknown field {key!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                     + "; no rule reads it"})
    return out


def _value_problem(key: str, value) -> tuple | None:
    """(what is wrong, fix) for a value that does not fit its field, else None."""
    kind = KINDS.get(key)
    if value is None or kind is None:
        return None
    if kind in ("bool", "int", "float") and isinstance(value, str) and "$" in value:     # ${TP}: a launcher's variable
        return (f"is {value}, a shell variable its launch script fills",
                "give the launch line that fills it (a ModelZoo model file: MODEL=<its name> TP=... bash "
                f"sbatch_benchmarking.sh, docs/planner.md), or {key}=<a value>")
    if key == "pipeline_model_parallel_layout" and not isinstance(value, str):    # a list was written as one
        return "must be a layout", f"write {key}='Et*4|(t*4|)*14tmL' (E, t, m, L stages between |) or a list of stages"
    if kind == "bool":
        if not isinstance(value, bool):
            return "must be true or false", f"write {key}=true or {key}=false"
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return "must be a whole number", f"write a whole number, e.g. {key}=8"
        if key in POSITIVE and value < 1:
            return "must be at least 1", f"write a whole number >= 1, e.g. {key}=8"
        if key in NON_NEGATIVE and value < 0:
            return "must not be negative", f"write a whole number >= 0, or leave {key} unset"
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number", f"write a number, e.g. {key}=1.0"
        if key == "moe_expert_capacity_factor" and value <= 0:
            return "must be positive", f"write a positive number, e.g. {key}=1.25, or leave it unset (dropless)"
    elif isinstance(kind, tuple):
        choices = kind[1]
        given = name_list(value) if kind[0] == "list_choice" and isinstance(value, (list, str)) else [value]
        bad = [v for v in given if v not in choices]
        if bad:
            close = difflib.get_close_matches(str(bad[0]), [str(c) for c in choices], n=1, cutoff=0.6)
            return (f"{bad[0]!r} is not one of {', '.join(map(str, choices))}"
                    + (f" (did you mean {close[0]!r}?)" if close else ""),
                    f"set {key} to one of {', '.join(map(str, choices))}")
    return None


def value_violations(values: dict) -> list:
    """``field-value`` violations: values of the wrong type or outside their field's choices."""
    out = []
    for key, value in values.items():
        problem = _value_problem(key, value)
        if problem:
            out.append(Violation("field-value", f"{key} {problem[0]}", {key: value}, problem[1]))
    return out


class Config:
    """Read access with Megatron's defaults."""

    def __init__(self, values: dict):
        self.values = values

    def __getitem__(self, name):
        if name == "moe_flex_dispatcher_backend":
            return mf.flex_backend(self.values)
        return self.values.get(name, DEFAULTS.get(name))

    def given(self, name) -> bool:
        return self.values.get(name) is not None

    @property
    def ep(self) -> int:
        return int(self["expert_model_parallel_size"])

    @property
    def world(self) -> int | None:
        if self.given("world_size"):
            return int(self["world_size"])
        if self.given("num_nodes") and self.given("gpus_per_node"):
            return int(self["num_nodes"]) * int(self["gpus_per_node"])
        if self.given("num_nodes") and self.given("hardware"):     # nodes of the system's own size
            return int(self["num_nodes"]) * self.hardware.node_gpus
        return None

    @property
    def hardware(self):
        return load_hardware(str(self["hardware"])) if self.given("hardware") else None

    @property
    def domain(self) -> int | None:
        return int(self[DOMAIN_FIELD]) if self.given(DOMAIN_FIELD) else None


@dataclass(frozen=True)
class Rule:
    """A rule: when ``applies``, ``holds`` must be true; else the fix is printed (a callable fix
    writes it from the config). A violation shows the rule's fields; with ``given_only``, only
    those the config sets (a rule over many optional fields)."""

    id: str
    title: str
    fields: tuple
    fix: str | Callable
    applies: Callable
    holds: Callable
    given_only: bool = False


@dataclass
class Violation:
    rule: str
    title: str
    fields: dict
    fix: str

    def format(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"[{self.rule}] {self.title}\n    fields: {shown}\n    fix: {self.fix}"


def _overlap(c):
    return bool(c["overlap_moe_expert_parallel_comm"])


def _model_ranks(c) -> int:
    """The ranks of one model replica: TP x PP x CP (the world over them is DP)."""
    return int(c["tensor_model_parallel_size"]) * int(c["pipeline_model_parallel_size"]) * \
        int(c["context_parallel_size"])


def _micro_batches(c) -> float | None:
    """Micro-batches per step and data-parallel rank (global / (micro x DP)), when the config
    gives the global batch and the world size (a micro-batch of 1 where it gives none, as the
    estimate reads it); else None."""
    if not (c.given("global_batch_size") and c.world):
        return None
    dp = max(1, c.world // _model_ranks(c))
    return int(c["global_batch_size"]) / (int(c["micro_batch_size"] or 1) * dp)


def _removed(c) -> list:
    """The `REMOVED_ARGUMENTS` a configuration gives (a switch only when on)."""
    return [old for old in REMOVED_ARGUMENTS if c.given(old) and c[old] is not False]


def _shard_ranks(c) -> tuple:
    """(DP x CP, expert-DP): the ranks the distributed optimizer shards dense and expert state over."""
    world, pp = c.world, int(c["pipeline_model_parallel_size"])
    etp = int(c["expert_tensor_parallel_size"] or c["tensor_model_parallel_size"])
    return world // _model_ranks(c) * int(c["context_parallel_size"]), world // (pp * c.ep * etp)


def _layer_pattern_problem(c) -> str:
    """Why moe_layer_freq does not fit the model's layers (`architecture.dense_layers_of`), or ''."""
    try:
        dense_layers_of(c["moe_layer_freq"], int(c["num_layers"]))
    except ConfigError as err:
        return str(err)
    return ""


def _interleaved(c) -> bool:
    """Whether the configuration asks for virtual pipeline stages (any of Megatron's ways)."""
    return any(c.given(f) for f in (*VPP_SOURCES, "virtual_pipeline_model_parallel_size"))


def _delayed(c):
    return bool(c["delay_wgrad_compute"])


def _version(text) -> tuple:
    return tuple(int(p) for p in str(text).split("+")[0].split(".")[:3] if p.isdigit())


def _graph_impl(c) -> str:
    """cuda_graph_impl, the deprecated enable_cuda_graph / external_cuda_graph read as Megatron reads them."""
    impl = c["cuda_graph_impl"] or "none"
    if impl == "none" and c["enable_cuda_graph"]:
        return "local"
    return "transformer_engine" if impl == "none" and c["external_cuda_graph"] else impl


def _graph_names(c) -> set:
    """The parts of a layer cuda_graph_modules (or cuda_graph_scope) names; empty: whole layers."""
    scope = c.values.get("cuda_graph_scope")
    return set(name_list(c.values.get("cuda_graph_modules") if scope is None else scope)) - {"full"}


def _recompute_modules(c) -> list:
    """recompute_modules under selective recompute (a list, or names split by spaces or commas)."""
    if c["recompute_granularity"] != "selective":
        return []
    return name_list(c["recompute_modules"])


def _megatron_lm(c) -> bool:
    """Whether a configuration is Megatron-LM's, whose argument checks it meets: not a
    Megatron-Bridge recipe (its performance scripts' names, a mixed-precision recipe's name, a
    Hydra dump's _target_ keys)."""
    bridge = ("model_recipe_name", "compute_dtype", "mixed_precision", RECIPE_FIELD)
    return not any(c.given(k) for k in bridge) and not any(k.startswith("_") for k in c.values)


def _offload_modules(c) -> set:
    """offload_modules under fine-grained activation offloading (a list, or names split by spaces or commas)."""
    return set(name_list(c["offload_modules"])) if c["fine_grained_activation_offloading"] else set()


def _graph_modules(c) -> set:
    """`_graph_names` under the per-layer implementations (local, Transformer Engine)."""
    return _graph_names(c) if _graph_impl(c) in ("local", "transformer_engine") else set()


def _graph_scope(c) -> str:
    """The named parts under any CUDA graph implementation, as text (empty: none, or whole layers)."""
    return "" if c["cuda_graph_impl"] in (None, "none") else " ".join(sorted(_graph_names(c)))


def _attention_known(c, field: str) -> bool:
    """Whether the model's attention is known: ``field`` (the variant or multi_latent_attention)
    given, or the model `--model` named (`with_model_fields`)."""
    return c.given(field) or c.given(MODEL_FIELD)


def _width_splits(c, name: str) -> bool:
    """Whether Megatron-Core splits the model size ``name`` over the configured TP / expert-TP
    (`architecture.width_split_problems`, which `estimate` asks too)."""
    tp = int(c["tensor_model_parallel_size"])
    etp = int(c["expert_tensor_parallel_size"] or tp)
    return name not in width_split_problems(tp, etp, **{name: int(c[name])})


def _sequence_splits(c) -> dict:
    """`layout.sequence_split_problems` of the configured sequence, CP, TP and sequence parallelism."""
    return sequence_split_problems(int(c["seq_length"]), int(c["context_parallel_size"]),
                                   int(c["tensor_model_parallel_size"]), bool(c["sequence_parallel"]))


def _fsdp(c) -> bool:
    """Megatron-FSDP (use_megatron_fsdp, or its older name use_custom_fsdp) or PyTorch's FSDP2."""
    return bool(c["use_megatron_fsdp"]) or bool(c["use_custom_fsdp"]) or bool(c["use_torch_fsdp2"])


def _quantization_padding(c) -> bool:
    """moe_router_padding_for_quantization, or its older name moe_router_padding_for_fp8."""
    return bool(c["moe_router_padding_for_quantization"]) or bool(c["moe_router_padding_for_fp8"])


def _padded(c) -> bool:
    return c["moe_expert_capacity_factor"] is not None and bool(c["moe_pad_expert_input_to_capacity"])


VPP_SOURCES = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
               "pipeline_model_parallel_layout")


def _layout_stages(c) -> int | None:
    """The stages of ``pipeline_model_parallel_layout`` (None: not given, or not a layout)."""
    if not c.given("pipeline_model_parallel_layout"):
        return None
    try:
        return len(expand_layout(str(c["pipeline_model_parallel_layout"])))
    except ConfigError:
        return None


def _split_problems(c) -> list:
    """`layout.pipeline_split_problems` of the configured pipeline split (a layout that does not
    parse is the pipeline-layout rule's)."""
    pp, layers = int(c["pipeline_model_parallel_size"]), int(c["num_layers"])
    embedding, loss = bool(c["account_for_embedding_in_pipeline_split"]), bool(c["account_for_loss_in_pipeline_split"])
    layout = c["pipeline_model_parallel_layout"] if _layout_stages(c) else None
    vpp = int(c["virtual_pipeline_model_parallel_size"] or c["num_virtual_stages_per_pipeline_rank"] or 1)
    try:
        if c.given("num_layers_per_virtual_pipeline_stage") and not layout:
            vpp = vpp_of_stage_layers(layers, pp, int(c["num_layers_per_virtual_pipeline_stage"]), embedding, loss)
        first, last = stage_override(c.values, "first"), stage_override(c.values, "last")
    except ConfigError as err:
        return [str(err)]
    return pipeline_split_problems(layers, pp, vpp, first, last, embedding, loss, str(layout) if layout else None,
                                   int(c["mtp_num_layers"]) if c.given("mtp_num_layers") else None)


def _expected_domain(c) -> int:
    return domain_for(c.hardware, c.ep)


RULES = [
    # EP communication overlap (overlap_moe_expert_parallel_comm)
    Rule("ep-overlap-ep", "EP overlap needs expert parallelism (EP > 1)", ("overlap_moe_expert_parallel_comm",
         "expert_model_parallel_size"), "set expert_model_parallel_size > 1, or turn the overlap off",
         _overlap, lambda c: c.ep > 1),
    Rule("ep-overlap-experts", "EP overlap needs more than one expert", ("num_moe_experts",),
         "set num_moe_experts > 1", lambda c: _overlap(c) and c.given("num_moe_experts"),
         lambda c: c["num_moe_experts"] > 1),
    Rule("ep-overlap-dispatcher", "EP overlap needs the alltoall or flex dispatcher", ("moe_token_dispatcher_type",),
         "set moe_token_dispatcher_type to 'alltoall' (or 'flex' with a DeepEP/HybridEP backend)",
         _overlap, lambda c: c["moe_token_dispatcher_type"] in ("alltoall", "flex")),
    Rule("ep-overlap-precision", "EP overlap needs BF16 or FP16", ("bf16", "fp16"), "set bf16=true",
         _overlap, lambda c: bool(c["bf16"]) or bool(c["fp16"])),
    Rule("ep-overlap-torch", "EP overlap needs PyTorch >= 2.6 (older versions hang)", ("torch_version",),
         "upgrade PyTorch to 2.6.0 or newer", lambda c: _overlap(c) and c.given("torch_version"),
         lambda c: _version(c["torch_version"]) >= (2, 6)),
    Rule("ep-overlap-vpp", "EP overlap with pipeline parallelism needs virtual pipeline stages",
         ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"),
         "set virtual_pipeline_model_parallel_size (or num_virtual_stages_per_pipeline_rank, or "
         "num_layers_per_virtual_pipeline_stage) when pipeline_model_parallel_size > 1",
         lambda c: _overlap(c) and int(c["pipeline_model_parallel_size"]) > 1,
         lambda c: any(c.given(f) for f in ("virtual_pipeline_model_parallel_size",
                                            "num_virtual_stages_per_pipeline_rank",
                                            "num_layers_per_virtual_pipeline_stage"))
         or (_layout_stages(c) or 0) > int(c["pipeline_model_parallel_size"])),
    Rule("ep-overlap-recompute", "EP overlap does not work with full recompute",
         ("recompute_granularity", "recompute_method", "recompute_num_layers"),
         "use selective recompute (recompute_granularity='selective') and unset recompute_method / "
         "recompute_num_layers", _overlap,
         lambda c: c["recompute_granularity"] != "full" and c["recompute_method"] is None
         and c["recompute_num_layers"] is None),
    # Megatron-Core's TransformerConfig raises on these (and Megatron-LM's arguments on a selective method).
    Rule("recompute-full-method", "full recompute needs recompute_method (uniform or block) and recompute_num_layers "
         "(Megatron-Core raises)", ("recompute_granularity", "recompute_method", "recompute_num_layers"),
         "set recompute_method=uniform and recompute_num_layers=1 (every layer recomputed alone), or "
         "recompute_method=block with recompute_num_layers the layers of each pipeline stage to recompute",
         lambda c: c["recompute_granularity"] == "full",
         lambda c: c["recompute_method"] in ("uniform", "block") and c.given("recompute_num_layers")),
    Rule("distributed-saved-activations", "distribute_saved_activations splits full recompute's saved inputs over "
         "TP: it needs TP > 1 without sequence parallelism, recompute_granularity=full and a recompute_method "
         "(Megatron-LM and Megatron-Core raise)", ("distribute_saved_activations", "tensor_model_parallel_size",
         "sequence_parallel", "recompute_granularity", "recompute_method"),
         "drop distribute_saved_activations (an MoE model with TP > 1 needs sequence parallelism, which it "
         "excludes), or use it with TP > 1, no sequence parallelism and full recompute with a recompute_method",
         lambda c: bool(c["distribute_saved_activations"]),
         lambda c: int(c["tensor_model_parallel_size"]) > 1 and not c["sequence_parallel"]
         and c["recompute_granularity"] == "full" and c.given("recompute_method")),
    Rule("moe-layer-recompute-full", "moe_layer_recompute (the MoE layer recomputed, selectively) does not go with "
         "full recompute (Megatron-Core raises)", ("moe_layer_recompute", "recompute_granularity"),
         "drop moe_layer_recompute (full recompute recomputes the MoE layer too), or use "
         "recompute_granularity=selective with recompute_modules moe",
         lambda c: bool(c["moe_layer_recompute"]), lambda c: c["recompute_granularity"] != "full"),
    Rule("recompute-selective-fields", "selective recompute takes recompute_modules, not recompute_method or "
         "recompute_num_layers (Megatron-Core raises)", ("recompute_granularity", "recompute_method",
                                                          "recompute_num_layers"),
         "unset recompute_method and recompute_num_layers (recompute_modules picks what is recomputed), or use "
         "recompute_granularity=full", lambda c: c["recompute_granularity"] == "selective",
         lambda c: not c.given("recompute_method") and not c.given("recompute_num_layers")),
    Rule("layout-vpp", "virtual_pipeline_model_parallel_size must match the virtual stages "
         "pipeline_model_parallel_layout gives (its stages over PP; Megatron-Core asserts)",
         ("pipeline_model_parallel_layout", "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"),
         lambda c: f"unset virtual_pipeline_model_parallel_size (the layout sets it), or set it to "
                   f"{_layout_stages(c) // int(c['pipeline_model_parallel_size'])}",
         lambda c: c.given("virtual_pipeline_model_parallel_size") and _layout_stages(c) is not None
         and _layout_stages(c) % int(c["pipeline_model_parallel_size"]) == 0,
         lambda c: _layout_stages(c) == int(c["pipeline_model_parallel_size"])
         * int(c["virtual_pipeline_model_parallel_size"])),
    Rule("shared-experts-recompute-overlap", "recomputing shared_experts does not work with the shared-expert "
         "overlap (Megatron-Core raises)", ("recompute_modules", "moe_shared_expert_overlap"),
         "drop shared_experts from recompute_modules, or set moe_shared_expert_overlap=false",
         lambda c: "shared_experts" in _recompute_modules(c) and c.given("moe_shared_expert_intermediate_size"),
         lambda c: not c["moe_shared_expert_overlap"]),
    Rule("moe-act-needs-grouped-gemm", "recompute_modules moe_act needs the grouped GEMM experts (Megatron-Core "
         "raises)", ("recompute_modules", "moe_grouped_gemm"), "set moe_grouped_gemm=true, or drop moe_act",
         lambda c: "moe_act" in _recompute_modules(c) and c.given("moe_grouped_gemm"),
         lambda c: bool(c["moe_grouped_gemm"])),
    Rule("delayed-fp8-recompute", "FP8 delayed scaling (Megatron-LM's default fp8_recipe) does not support "
         "moe_act or layernorm recompute (Megatron-Core raises)", ("fp8", "fp8_recipe", "recompute_modules"),
         "set fp8_recipe to tensorwise, blockwise or mxfp8, or drop moe_act and layernorm from recompute_modules",
         lambda c: bool(c["fp8"]) and bool({"moe_act", "layernorm"} & set(_recompute_modules(c))),
         lambda c: c.given("fp8_recipe") and c["fp8_recipe"] != "delayed"),
    Rule("ep-overlap-shared", "EP overlap needs the shared-expert overlap off", ("moe_shared_expert_overlap",),
         "set moe_shared_expert_overlap=false", _overlap, lambda c: not c["moe_shared_expert_overlap"]),
    Rule("ep-overlap-mtp", "EP overlap supports at most one MTP layer", ("mtp_num_layers",),
         "set mtp_num_layers to 1 or unset it", _overlap, lambda c: c["mtp_num_layers"] in (None, 0, 1)),
    Rule("ep-overlap-microbatches", "EP overlap needs at least 2 micro-batches per step (it runs one micro-batch's "
         "dispatch / combine beside another's compute)", ("global_batch_size", "micro_batch_size", "world_size",
         "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
         "raise global_batch_size to at least 2 x micro_batch_size x data-parallel size, or lower micro_batch_size",
         lambda c: _overlap(c) and _micro_batches(c) is not None, lambda c: _micro_batches(c) >= 2),
    # Delayed weight-gradient computation
    Rule("wgrad-needs-overlap", "delay_wgrad_compute needs EP overlap", ("delay_wgrad_compute",
         "overlap_moe_expert_parallel_comm"), "enable overlap_moe_expert_parallel_comm first (or turn "
         "delay_wgrad_compute off)", _delayed, _overlap),
    Rule("wgrad-graph-fusion", "CUDA graphs over attention with delayed wgrad need gradient accumulation fusion",
         ("cuda_graph_impl", "cuda_graph_scope", "gradient_accumulation_fusion"),
         "set gradient_accumulation_fusion=true (or keep attention out of the CUDA graph scope)",
         lambda c: _delayed(c) and "attn" in _graph_scope(c),
         lambda c: c["gradient_accumulation_fusion"] is not False),
    Rule("wgrad-graph-bias", "CUDA graphs over attention with delayed wgrad do not support attention bias",
         ("cuda_graph_scope", "add_bias_linear", "add_qkv_bias"), "set add_bias_linear=false and add_qkv_bias=false",
         lambda c: _delayed(c) and "attn" in _graph_scope(c),
         lambda c: not c["add_bias_linear"] and not c["add_qkv_bias"]),
    # Dispatchers
    Rule("flex-backend", "the flex dispatcher needs a DeepEP, HybridEP or NCCL-EP backend (else it brings no gain)",
         ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend"),
         "call apply_flex_dispatcher_backend(cfg.model, 'deepep' | 'hybridep'), i.e. set "
         "moe_flex_dispatcher_backend", lambda c: c["moe_token_dispatcher_type"] == "flex",
         lambda c: c["moe_flex_dispatcher_backend"] in FLEX_BACKENDS),
    Rule("ncclep-needs-flex", "the ncclep backend needs the flex dispatcher (Megatron-Core raises otherwise)",
         ("moe_flex_dispatcher_backend", "moe_token_dispatcher_type"), "set moe_token_dispatcher_type='flex'",
         lambda c: c.values.get("moe_flex_dispatcher_backend") == "ncclep",
         lambda c: c["moe_token_dispatcher_type"] == "flex"),
    Rule("rank-capacity-backend", "moe_expert_rank_capacity_factor needs the flex dispatcher's hybridep or ncclep "
         "backend (Megatron-Core raises otherwise)",
         ("moe_expert_rank_capacity_factor", "moe_token_dispatcher_type", "moe_flex_dispatcher_backend"),
         "set moe_token_dispatcher_type='flex' and moe_flex_dispatcher_backend to hybridep or ncclep, or unset "
         "moe_expert_rank_capacity_factor", lambda c: c.given("moe_expert_rank_capacity_factor"),
         lambda c: c["moe_token_dispatcher_type"] == "flex" and c["moe_flex_dispatcher_backend"] in ("hybridep",
                                                                                                   "ncclep")),
    Rule("ncclep-wire", "an MXFP8 wire (moe_dispatch_fwd_dtype / moe_combine_bwd_dtype) needs the ncclep backend, "
         "the TE op fuser and grouped GEMM (Megatron-Core raises otherwise)",
         ("moe_dispatch_fwd_dtype", "moe_combine_bwd_dtype", "moe_flex_dispatcher_backend",
          "use_transformer_engine_op_fuser", "moe_grouped_gemm"),
         "keep both dtypes bf16, or set moe_token_dispatcher_type='flex', moe_flex_dispatcher_backend='ncclep', "
         "use_transformer_engine_op_fuser=true and moe_grouped_gemm=true",
         lambda c: (c["moe_dispatch_fwd_dtype"] or "bf16") != "bf16" or (c["moe_combine_bwd_dtype"] or "bf16") != "bf16",
         lambda c: c["moe_token_dispatcher_type"] == "flex" and c["moe_flex_dispatcher_backend"] == "ncclep"
         and bool(c["use_transformer_engine_op_fuser"]) and bool(c["moe_grouped_gemm"])),
    Rule("deepep-needs-flex", "moe_enable_deepep needs the flex dispatcher (Megatron-Core raises otherwise)",
         ("moe_enable_deepep", "moe_token_dispatcher_type"),
         "set moe_token_dispatcher_type='flex', or drop moe_enable_deepep",
         lambda c: bool(c["moe_enable_deepep"]), lambda c: c["moe_token_dispatcher_type"] == "flex"),
    Rule("deepep-one-backend", "moe_enable_deepep selects DeepEP, but moe_flex_dispatcher_backend names another "
         "backend (Megatron-Core raises)", ("moe_enable_deepep", "moe_flex_dispatcher_backend"),
         "drop moe_enable_deepep (deprecated) and keep moe_flex_dispatcher_backend",
         lambda c: bool(c["moe_enable_deepep"]), lambda c: c["moe_flex_dispatcher_backend"] == "deepep"),
    Rule("flex-no-pad", "the flex dispatcher's DeepEP backend does not pad experts to capacity (Megatron-Core "
         "raises; HybridEP and the alltoall dispatcher do)",
         ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_pad_expert_input_to_capacity"),
         "set moe_pad_expert_input_to_capacity=false, or use the hybridep backend or the alltoall dispatcher",
         lambda c: c["moe_token_dispatcher_type"] == "flex" and c["moe_flex_dispatcher_backend"] == "deepep",
         lambda c: not c["moe_pad_expert_input_to_capacity"]),
    Rule("ncclep-no-drop", "the ncclep backend neither drops tokens nor pads to capacity (Megatron-Core raises)",
         ("moe_flex_dispatcher_backend", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"),
         "unset moe_expert_capacity_factor and moe_pad_expert_input_to_capacity, or use the hybridep backend",
         lambda c: c["moe_token_dispatcher_type"] == "flex" and c["moe_flex_dispatcher_backend"] == "ncclep",
         lambda c: c["moe_expert_capacity_factor"] is None and not c["moe_pad_expert_input_to_capacity"]),
    Rule("flex-gpu", "DeepEP / HybridEP run only on Ampere, Hopper or Blackwell GPUs (else silently skipped)",
         ("moe_flex_dispatcher_backend", "hardware"), "run on Ampere/Hopper/Blackwell or use the alltoall dispatcher",
         lambda c: c["moe_flex_dispatcher_backend"] in FLEX_BACKENDS and c.given("hardware"),
         lambda c: c.hardware.arch in ("ampere", "hopper", "blackwell")),
    Rule("shared-overlap-dispatcher", "moe_shared_expert_overlap needs the alltoall or flex dispatcher",
         ("moe_shared_expert_overlap", "moe_token_dispatcher_type"),
         "set moe_token_dispatcher_type='alltoall' or turn moe_shared_expert_overlap off",
         lambda c: bool(c["moe_shared_expert_overlap"]), lambda c: c["moe_token_dispatcher_type"] in ("alltoall", "flex")),
    # Router and capacity
    Rule("probs-on-input-topk", "moe_apply_probs_on_input works with moe_router_topk=1 only (Megatron-Core's "
         "experts assert)", ("moe_apply_probs_on_input", "moe_router_topk"),
         "set moe_router_topk=1, or leave moe_apply_probs_on_input unset",
         lambda c: bool(c["moe_apply_probs_on_input"]), lambda c: int(c["moe_router_topk"]) == 1),
    Rule("topk-within-experts", "a token cannot pick more experts than exist: moe_router_topk <= num_moe_experts",
         ("moe_router_topk", "num_moe_experts"), "set moe_router_topk to at most num_moe_experts",
         lambda c: c.given("num_moe_experts"), lambda c: int(c["moe_router_topk"]) <= int(c["num_moe_experts"])),
    Rule("capacity-balancing", "a capacity factor works only with aux_loss, seq_aux_loss, global_aux_loss or none "
         "load balancing", ("moe_expert_capacity_factor", "moe_router_load_balancing_type"),
         "set moe_router_load_balancing_type to aux_loss (or seq_aux_loss / global_aux_loss / none)",
         lambda c: c.given("moe_expert_capacity_factor"),
         lambda c: c["moe_router_load_balancing_type"] in ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")),
    Rule("pad-needs-capacity", "padding experts to capacity needs a capacity factor",
         ("moe_pad_expert_input_to_capacity", "moe_expert_capacity_factor"), "set moe_expert_capacity_factor",
         lambda c: bool(c["moe_pad_expert_input_to_capacity"]), lambda c: c.given("moe_expert_capacity_factor")),
    Rule("group-divides-experts", "group-limited routing: the groups must split the experts evenly",
         ("num_moe_experts", "moe_router_num_groups"), "choose moe_router_num_groups dividing num_moe_experts",
         lambda c: c.given("moe_router_num_groups") and c.given("num_moe_experts"),
         lambda c: c["num_moe_experts"] % c["moe_router_num_groups"] == 0),
    Rule("group-topk-needs-groups", "group-limited routing (moe_router_group_topk) needs moe_router_num_groups "
         "(Megatron-Core raises)", ("moe_router_group_topk", "moe_router_num_groups"),
         "set moe_router_num_groups (DeepSeek-V3: 8), or drop moe_router_group_topk",
         lambda c: bool(c["moe_router_group_topk"]), lambda c: bool(c["moe_router_num_groups"])),
    Rule("group-topk", "group-limited routing: group_topk groups must exist and hold the top-k experts",
         ("moe_router_group_topk", "moe_router_num_groups", "moe_router_topk", "num_moe_experts"),
         "set 1 <= moe_router_group_topk <= moe_router_num_groups with group_topk x experts per group >= topk",
         lambda c: c.given("moe_router_num_groups") and c.given("num_moe_experts"),
         lambda c: c.given("moe_router_group_topk") and group_routing_holds(
             c["moe_router_group_topk"], c["moe_router_num_groups"], c["num_moe_experts"], c["moe_router_topk"])),
    Rule("graph-scope-or-modules", "cuda_graph_scope (deprecated) and cuda_graph_modules name the same parts "
         "(Megatron-LM raises with both)", ("cuda_graph_scope", "cuda_graph_modules"),
         "keep cuda_graph_modules, cuda_graph_scope's newer name", lambda c: c.given("cuda_graph_scope"),
         lambda c: c.values.get("cuda_graph_modules") in GRAPH_MODULES_DEFAULTS),
    # Per-layer CUDA graphs: Megatron-Core's TransformerConfig refuses these.
    Rule("graph-moe-or-router", "CUDA graphs capture a MoE layer's MLP side whole (moe) or up to its router "
         "(moe_router), not both (Megatron-Core asserts)", ("cuda_graph_modules", "cuda_graph_scope"),
         "keep moe (drop-and-pad only) or moe_router", lambda c: "moe" in _graph_modules(c),
         lambda c: "moe_router" not in _graph_modules(c), given_only=True),
    Rule("graph-preprocess-needs-router", "the moe_preprocess CUDA graph needs the moe_router one "
         "(Megatron-Core asserts)", ("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_scope"),
         "add moe_router to cuda_graph_modules", lambda c: "moe_preprocess" in _graph_modules(c),
         lambda c: "moe_router" in _graph_modules(c) or _graph_impl(c) == "local", given_only=True),
    Rule("graph-moe-needs-padding", "a CUDA graph over the whole MoE MLP (moe) needs drop-and-pad: "
         "moe_expert_capacity_factor with moe_pad_expert_input_to_capacity (Megatron-Core asserts)",
         ("cuda_graph_modules", "cuda_graph_scope", "moe_expert_capacity_factor",
          "moe_pad_expert_input_to_capacity"), "capture moe_router and moe_preprocess instead (dropless), or pad "
         "to a capacity factor", lambda c: "moe" in _graph_modules(c), _padded, given_only=True),
    Rule("graph-preprocess-sync", "the moe_preprocess CUDA graph cannot hold the alltoall dispatcher's "
         "device-to-host copy, made when a capacity factor drops tokens unpadded or the router pads for FP8 "
         "(Megatron-Core asserts)", ("cuda_graph_modules", "cuda_graph_scope", "moe_token_dispatcher_type",
                                     "moe_expert_capacity_factor", "moe_router_padding_for_fp8"),
         "leave moe_preprocess out of cuda_graph_modules (keep moe_router)",
         lambda c: "moe_preprocess" in _graph_modules(c) and not _padded(c)
         and c["moe_token_dispatcher_type"] == "alltoall",
         lambda c: c["moe_expert_capacity_factor"] is None and not c["moe_router_padding_for_fp8"], given_only=True),
    Rule("graph-full-recompute", "full recompute works with full-iteration CUDA graphs only, not per-layer ones "
         "(Megatron-Core asserts)", ("recompute_granularity", "cuda_graph_impl", "enable_cuda_graph"),
         "use selective recompute, or cuda_graph_impl=full_iteration",
         lambda c: _graph_impl(c) in ("local", "transformer_engine") and c["recompute_granularity"] not in (None, "none"),
         lambda c: c["recompute_granularity"] == "selective"),
    Rule("graph-moe-recompute", "recomputing the moe module cannot cover Transformer Engine's moe_router CUDA graph "
         "(Megatron-Core asserts)", ("recompute_modules", "cuda_graph_impl", "cuda_graph_modules", "cuda_graph_scope"),
         "drop moe from recompute_modules, or moe_router from cuda_graph_modules",
         lambda c: _graph_impl(c) == "transformer_engine" and "moe" in _recompute_modules(c),
         lambda c: "moe_router" not in _graph_modules(c),
         given_only=True),
    Rule("graph-full-iteration-modules", "cuda_graph_impl=full_iteration captures everything: cuda_graph_modules "
         "must be empty (Megatron-Core asserts)", ("cuda_graph_impl", "cuda_graph_modules", "cuda_graph_scope"),
         "leave cuda_graph_modules out", lambda c: c["cuda_graph_impl"] == "full_iteration",
         lambda c: not _graph_names(c) - {"full_iteration"}, given_only=True),
    Rule("limited-devices-or-groups", "moe_router_topk_limited_devices (deprecated) and moe_router_group_topk "
         "name the same limit (Megatron-Core raises with both)", ("moe_router_topk_limited_devices",
                                                                  "moe_router_group_topk"),
         "keep moe_router_group_topk with moe_router_num_groups (num_groups = EP size reads as the device limit)",
         lambda c: c.given("moe_router_topk_limited_devices"), lambda c: not c.given("moe_router_group_topk")),
    Rule("limited-devices-range", "moe_router_topk_limited_devices: each token's experts on at most that many EP "
         "ranks (Megatron-Core's groups of one EP rank's experts), who must hold its top-k",
         ("moe_router_topk_limited_devices", "expert_model_parallel_size", "moe_router_topk", "num_moe_experts"),
         "set 1 <= moe_router_topk_limited_devices <= expert_model_parallel_size, enough ranks for top-k experts",
         lambda c: c.given("moe_router_topk_limited_devices") and c.given("num_moe_experts"),
         lambda c: group_routing_holds(c["moe_router_topk_limited_devices"], c.ep, c["num_moe_experts"],
                                       c["moe_router_topk"])),
    Rule("top1-pre-softmax", "top-1 softmax routing needs the softmax before top-k",
         ("moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax"), "set moe_router_pre_softmax=true",
         lambda c: int(c["moe_router_topk"]) == 1 and c["moe_router_score_function"] == "softmax"
         and c["moe_router_load_balancing_type"] != "sinkhorn", lambda c: bool(c["moe_router_pre_softmax"])),
    Rule("bias-needs-sigmoid", "the expert bias (aux-loss-free balancing) needs sigmoid or sqrtsoftplus scores "
         "(Megatron-Core raises)", ("moe_router_enable_expert_bias", "moe_router_score_function"),
         "set moe_router_score_function='sigmoid' (or 'sqrtsoftplus')",
         lambda c: bool(c["moe_router_enable_expert_bias"]),
         lambda c: c["moe_router_score_function"] in ("sigmoid", "sqrtsoftplus")),
    # Precision
    Rule("quantized-params-need-recipe", "FP8 (FP4) weights need FP8 (FP4) training: fp8_param / fp8_param_gather "
         "without fp8, fp4_param / fp4_param_gather without fp4 (Megatron-Core raises)",
         ("fp8_param", "fp8_param_gather", "fp8", "fp4_param", "fp4_param_gather", "fp4"),
         "set the precision's format and recipe, or drop the quantized weights",
         lambda c: any(c[f] for fields in QUANTIZED_WEIGHTS.values() for f in fields),
         lambda c: all(c[precision] or not any(c[f] for f in fields) for precision, fields in QUANTIZED_WEIGHTS.items()),
         given_only=True),
    Rule("one-half-precision", "bf16 and fp16 cannot both be on", ("bf16", "fp16"), "set only one of bf16 / fp16",
         lambda c: bool(c["bf16"]), lambda c: not c["fp16"]),
    Rule("mxfp8-needs-blackwell", "the MXFP8 recipe needs Blackwell GPUs", ("fp8", "fp8_recipe", "hardware"),
         "use fp8_recipe=blockwise (Hopper) or run on Blackwell",
         lambda c: c.given("fp8") and c["fp8_recipe"] == "mxfp8" and c.given("hardware"),
         lambda c: c.hardware.arch == "blackwell"),
    Rule("fp8-needs-gpu", "FP8 training needs FP8 tensor cores (Hopper or later: Transformer Engine raises below "
         "compute capability 8.9)", ("fp8", "hardware"), "train in bf16, or run on Hopper or Blackwell",
         lambda c: c.given("fp8") and c["fp8"] not in (False, "none") and c.given("hardware"),
         lambda c: c.hardware.fp8_TFLOPS > 0),
    Rule("fp4-or-fp8", "FP4 and FP8 training cannot both be on (Megatron-LM raises)", ("fp4", "fp8"),
         "keep one of fp4 (--fp4-format) / fp8 (--fp8-format)",
         lambda c: c.given("fp4") and c["fp4"] not in (False, "none"), lambda c: c["fp8"] in (None, False, "none")),
    Rule("nvfp4-needs-blackwell", "NVFP4 (fp4) GEMMs need Blackwell GPUs", ("fp4", "hardware"),
         "drop fp4 (use fp8_recipe=blockwise on Hopper) or run on Blackwell",
         lambda c: c.given("fp4") and c["fp4"] not in (False, "none") and c.given("hardware"),
         lambda c: c.hardware.arch == "blackwell"),
    # Parallel layout
    Rule("experts-divide-ep", "the experts must split evenly over the EP ranks", ("num_moe_experts",
         "expert_model_parallel_size"), "choose expert_model_parallel_size dividing num_moe_experts",
         lambda c: c.given("num_moe_experts"), lambda c: c["num_moe_experts"] % c.ep == 0),
    Rule("moe-tp-needs-sp", "an MoE model trained with TP > 1 needs sequence parallelism (Megatron-Core's MoE "
         "layer raises in training without it)",
         ("tensor_model_parallel_size", "expert_model_parallel_size", "sequence_parallel"),
         "set sequence_parallel=true (--sequence-parallel)",
         lambda c: int(c["tensor_model_parallel_size"]) > 1 and (c.given("num_moe_experts") or c.ep > 1),
         lambda c: bool(c["sequence_parallel"])),
    Rule("state-offload-one-way", "optimizer states go to the host one way: chunked_optimizer_state_offload "
         "(offload_optimizer_states) and optimizer_cpu_offload exclude each other (Megatron-Core asserts)",
         ("chunked_optimizer_state_offload", "offload_optimizer_states", "optimizer_cpu_offload"),
         "keep one: chunked_optimizer_state_offload keeps the states on the host between updates and steps on "
         "the GPU, optimizer_cpu_offload steps on the host",
         lambda c: bool(c["chunked_optimizer_state_offload"]) or bool(c["offload_optimizer_states"]),
         lambda c: not c["optimizer_cpu_offload"] or float(c["optimizer_state_offload_fraction"] or 1.0) == 0.0),
    # Megatron-LM's argument checks (megatron/training/arguments.py, validate_args), which a
    # Megatron-Bridge run does not pass through (`_megatron_lm`).
    Rule("removed-arguments", "arguments Megatron-LM no longer takes (it asserts, or exits, on them)",
         tuple(REMOVED_ARGUMENTS), lambda c: "; ".join(f"{old}: {REMOVED_ARGUMENTS[old]}" for old in _removed(c)),
         _megatron_lm, lambda c: not _removed(c), given_only=True),
    Rule("emerging-optimizer-fsdp", "an optimizer other than adam and sgd (muon, ...) runs with neither "
         "Megatron-FSDP nor PyTorch's FSDP2 (Megatron-LM asserts)", ("optimizer", "use_megatron_fsdp",
         "use_torch_fsdp2"), "use the distributed optimizer (layer-wise for these optimizers) without FSDP, or "
         "optimizer=adam", lambda c: _megatron_lm(c) and c.given("optimizer") and c["optimizer"] not in ("adam", "sgd"),
         lambda c: not _fsdp(c)),
    Rule("fp8-param-gather-needs", "fp8_param_gather all-gathers FP8 weights: it needs the distributed optimizer, "
         "Megatron-FSDP or PyTorch's FSDP2 (Megatron-LM asserts)", ("fp8_param_gather", "use_distributed_optimizer",
         "use_megatron_fsdp", "use_torch_fsdp2"), "set use_distributed_optimizer=true, or drop fp8_param_gather",
         lambda c: _megatron_lm(c) and bool(c["fp8_param_gather"]),
         lambda c: c["use_distributed_optimizer"] is not False or _fsdp(c)),
    Rule("param-gather-needs", "overlap_param_gather needs the distributed optimizer (or Megatron-FSDP) and "
         "overlap_grad_reduce (Megatron-LM asserts)",
         ("overlap_param_gather", "use_distributed_optimizer", "use_megatron_fsdp", "overlap_grad_reduce"),
         "set use_distributed_optimizer=true and overlap_grad_reduce=true, or drop overlap_param_gather",
         lambda c: _megatron_lm(c) and bool(c["overlap_param_gather"]),
         lambda c: (bool(c["use_distributed_optimizer"]) or bool(c["use_megatron_fsdp"]))
         and bool(c["overlap_grad_reduce"])),
    Rule("param-gather-with-step-needs", "overlap_param_gather_with_optimizer_step needs the distributed optimizer, "
         "overlap_param_gather and virtual pipeline stages (Megatron-LM asserts)",
         ("overlap_param_gather_with_optimizer_step", "use_distributed_optimizer", "overlap_param_gather",
          "virtual_pipeline_model_parallel_size"),
         "set use_distributed_optimizer=true, overlap_param_gather=true and virtual_pipeline_model_parallel_size, "
         "or drop overlap_param_gather_with_optimizer_step",
         lambda c: _megatron_lm(c) and bool(c["overlap_param_gather_with_optimizer_step"]),
         lambda c: bool(c["use_distributed_optimizer"]) and bool(c["overlap_param_gather"]) and _interleaved(c)),
    Rule("cpu-optimizer-needs", "optimizer_cpu_offload needs the precision-aware optimizer, and with "
         "fp8_param_gather FP8 delayed scaling (Megatron-LM asserts)",
         ("optimizer_cpu_offload", "use_precision_aware_optimizer", "fp8_param_gather", "fp8_recipe"),
         "set use_precision_aware_optimizer=true (and drop fp8_param_gather unless fp8_recipe=delayed)",
         lambda c: _megatron_lm(c) and bool(c["optimizer_cpu_offload"]),
         lambda c: bool(c["use_precision_aware_optimizer"])
         and (not c["fp8_param_gather"] or c["fp8_recipe"] in (None, "delayed"))),
    Rule("optimizer-dtypes-need-aware", "the optimizer's main gradients, main weights and Adam moments stay FP32 "
         "without the precision-aware optimizer (Megatron-Core asserts)",
         OPTIMIZER_DTYPES + ("use_precision_aware_optimizer",),
         "set use_precision_aware_optimizer=true, or leave those dtypes at fp32",
         lambda c: any(c.given(name) and str(c[name]).lower() not in ("fp32", "float32", "torch.float32")
                       for name in OPTIMIZER_DTYPES),
         lambda c: bool(c["use_precision_aware_optimizer"]), given_only=True),
    Rule("torch-fsdp2-layout", "use_torch_fsdp2 (PyTorch's FSDP2) supports neither pipeline nor expert "
         "parallelism nor the distributed optimizer (Megatron-LM asserts)",
         ("use_torch_fsdp2", "pipeline_model_parallel_size", "expert_model_parallel_size", "use_distributed_optimizer"),
         "use Megatron-FSDP instead (use_megatron_fsdp=true, which shards experts over expert-DP), or drop "
         "use_torch_fsdp2", lambda c: _megatron_lm(c) and bool(c["use_torch_fsdp2"]),
         lambda c: int(c["pipeline_model_parallel_size"]) == 1 and c.ep == 1 and not c["use_distributed_optimizer"]),
    # Layer-level activation offloading (cpu_offloading): Megatron-Core's TransformerConfig refuses these.
    Rule("cpu-offload-pp", "layer-level CPU offloading (cpu_offloading) does not support pipeline parallelism "
         "(Megatron-Core raises)", ("cpu_offloading", "pipeline_model_parallel_size"),
         "set pipeline_model_parallel_size=1, or offload with fine_grained_activation_offloading (works with PP) or "
         "optimizer_cpu_offload", lambda c: bool(c["cpu_offloading"]),
         lambda c: int(c["pipeline_model_parallel_size"]) == 1),
    Rule("offload-inside-moe-recompute", "offloading expert_fc1, moe_act or fused_group_mlp does not work while "
         "recompute_modules recomputes the whole moe module (Megatron-Core raises)",
         ("offload_modules", "recompute_modules"),
         "drop moe from recompute_modules (moe_act recomputes the activation alone), or drop those offload_modules",
         lambda c: "moe" in _recompute_modules(c),
         lambda c: not _offload_modules(c) & {"expert_fc1", "moe_act", "fused_group_mlp"}),
    Rule("offload-attn-proj-alone", "offloading attn_proj needs core_attn offloaded too: attn_proj's input is "
         "core_attn's output, which core_attn's backward needs (Megatron-Core raises)", ("offload_modules",),
         "add core_attn to offload_modules, or drop attn_proj", lambda c: "attn_proj" in _offload_modules(c),
         lambda c: "core_attn" in _offload_modules(c)),
    Rule("paged-stash-needs-rank-capacity", "moe_paged_stash needs moe_expert_rank_capacity_factor (Megatron-Core "
         "raises)", ("moe_paged_stash", "moe_expert_rank_capacity_factor"),
         "set moe_expert_rank_capacity_factor (e.g. 1.5, with the hybridep backend), or drop moe_paged_stash",
         lambda c: bool(c["moe_paged_stash"]), lambda c: c.given("moe_expert_rank_capacity_factor")),
    Rule("paged-stash-offload", "moe_paged_stash keeps the experts' activations itself: offload_modules must not "
         "take expert_fc1, moe_act or fused_group_mlp beside it (Megatron-Core raises)",
         ("moe_paged_stash", "offload_modules"), "drop expert_fc1, moe_act and fused_group_mlp from offload_modules, "
         "or drop moe_paged_stash", lambda c: bool(c["moe_paged_stash"]),
         lambda c: not _offload_modules(c) & {"expert_fc1", "moe_act", "fused_group_mlp"}),
    Rule("padding-for-quantization-dispatcher", "moe_router_padding_for_quantization does not work with the "
         "allgather dispatcher (Megatron-Core raises)",
         ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8", "moe_token_dispatcher_type"),
         "set moe_token_dispatcher_type to alltoall or flex, or drop moe_router_padding_for_quantization",
         _quantization_padding, lambda c: c["moe_token_dispatcher_type"] not in ("allgather", "alltoall_seq"),
         given_only=True),
    Rule("padding-for-quantization-precision", "moe_router_padding_for_quantization pads the experts' rows for "
         "FP8 / FP4 GEMMs: it needs fp8 or fp4 (Megatron-Core raises)",
         ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8", "fp8", "fp4"),
         "set an fp8 (or fp4) format and recipe, or drop moe_router_padding_for_quantization",
         _quantization_padding, lambda c: bool(c["fp8"]) or bool(c["fp4"]), given_only=True),
    Rule("gdn-norm-out-needs-gdn", "recompute_modules gdn_norm_out recomputes Gated DeltaNet's output norm: the "
         "attention variant must be Gated DeltaNet (Megatron-Core raises)",
         ("recompute_modules", "experimental_attention_variant"),
         "set experimental_attention_variant=gated_delta_net (or gdn2), or drop gdn_norm_out from recompute_modules",
         lambda c: "gdn_norm_out" in _recompute_modules(c) and _attention_known(c, "experimental_attention_variant"),
         lambda c: c["experimental_attention_variant"] in GATED_DELTA_NET),
    Rule("mla-up-proj-needs-mla", "recompute_modules mla_up_proj recomputes multi-latent attention's up projections: "
         "the model must use multi-latent attention (Megatron-Core raises)",
         ("recompute_modules", "multi_latent_attention"),
         "set multi_latent_attention=true (a DeepSeek-style model), or drop mla_up_proj from recompute_modules",
         lambda c: "mla_up_proj" in _recompute_modules(c) and _attention_known(c, "multi_latent_attention"),
         lambda c: bool(c["multi_latent_attention"])),
    Rule("mhc-recompute", "recompute_modules mhc recomputes hyper-connections: it needs enable_mhc_connections, "
         "and works neither with mlp recompute nor with fine-grained activation offloading (Megatron-Core raises)",
         ("recompute_modules", "enable_mhc_connections", "fine_grained_activation_offloading"),
         "set enable_mhc_connections=true and drop mlp from recompute_modules and fine_grained_activation_offloading, "
         "or drop mhc from recompute_modules",
         lambda c: "mhc" in _recompute_modules(c),
         lambda c: bool(c["enable_mhc_connections"]) and "mlp" not in _recompute_modules(c)
         and not c["fine_grained_activation_offloading"]),
    Rule("cpu-offload-recompute", "layer-level CPU offloading (cpu_offloading) does not work with activation "
         "recomputation (Megatron-Core raises)", ("cpu_offloading", "recompute_granularity", "recompute_activations"),
         "leave recompute_granularity unset, or drop cpu_offloading", lambda c: bool(c["cpu_offloading"]),
         lambda c: c["recompute_granularity"] in (None, "none") and not c["recompute_activations"]),
    Rule("cpu-offload-graphs", "layer-level CPU offloading (cpu_offloading) does not work with CUDA graphs "
         "(Megatron-Core raises)", ("cpu_offloading", "cuda_graph_impl", "enable_cuda_graph"),
         "set cuda_graph_impl=none (or full_iteration), or drop cpu_offloading", lambda c: bool(c["cpu_offloading"]),
         lambda c: _graph_impl(c) in ("none", "full_iteration")),
    Rule("cpu-offload-one-way", "fine_grained_activation_offloading and cpu_offloading exclude each other "
         "(Megatron-Core asserts)", ("fine_grained_activation_offloading", "cpu_offloading"),
         "keep one: fine_grained_activation_offloading (by module, any PP) or cpu_offloading (whole layers, PP 1)",
         lambda c: bool(c["cpu_offloading"]), lambda c: not c["fine_grained_activation_offloading"]),
    Rule("cpu-offload-layers", "cpu_offloading_num_layers must be at least 0 and below num_layers "
         "(Megatron-Core raises)", ("cpu_offloading_num_layers", "num_layers"),
         "offload from 0 to num_layers - 1 layers", lambda c: bool(c["cpu_offloading"]) and c.given("num_layers"),
         lambda c: 0 <= int(c["cpu_offloading_num_layers"] or 0) < int(c["num_layers"])),
    Rule("one-vpp-source", "at most one of the virtual-pipeline splits may be given (Megatron asserts)",
         VPP_SOURCES, "keep one of num_layers_per_virtual_pipeline_stage, num_virtual_stages_per_pipeline_rank, "
         "pipeline_model_parallel_layout", lambda c: True, lambda c: sum(c.given(f) for f in VPP_SOURCES) <= 1),
    Rule("pipeline-layout", "pipeline_model_parallel_layout must parse and its stages split evenly over PP",
         ("pipeline_model_parallel_layout", "pipeline_model_parallel_size"),
         "write stages of E, t, m, L between |, with (..)*N or X*N repeats, a multiple of "
         "pipeline_model_parallel_size of them (Megatron takes VPP = stages / PP)",
         lambda c: c.given("pipeline_model_parallel_layout"),
         lambda c: (stages := _layout_stages(c)) is not None and stages % int(c["pipeline_model_parallel_size"]) == 0),
    Rule("pipeline-split", "the decoder layers must split over the pipeline stages as Megatron-Core builds them",
         ("num_layers", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "num_virtual_stages_per_pipeline_rank", "num_layers_per_virtual_pipeline_stage",
          "decoder_first_pipeline_num_layers",
          "decoder_last_pipeline_num_layers", "account_for_embedding_in_pipeline_split",
          "account_for_loss_in_pipeline_split", "pipeline_model_parallel_layout"),
         lambda c: "; ".join(_split_problems(c)),
         lambda c: c.given("num_layers") and (int(c["pipeline_model_parallel_size"]) > 1 or _interleaved(c)),
         lambda c: not _split_problems(c), given_only=True),
    Rule("moe-layer-pattern", "moe_layer_freq must give every layer one entry, 0 (dense) or 1 (MoE) "
         "(Megatron-Core asserts)", ("moe_layer_freq", "num_layers"), lambda c: _layer_pattern_problem(c),
         lambda c: c.given("moe_layer_freq") and c.given("num_layers"), lambda c: not _layer_pattern_problem(c)),
    Rule("parallel-sizes", "TP x PP x CP x DP must equal the world size",
         ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
          "data_parallel_size"), "choose sizes whose product is the number of GPUs (DP = world / (TP x PP x CP))",
         lambda c: c.world is not None,
         lambda c: c.world % _model_ranks(c) == 0
         and (not c.given("data_parallel_size") or _model_ranks(c) * c["data_parallel_size"] == c.world)),
    Rule("batch-splits", "the global batch must split into whole micro-batches on every data-parallel rank "
         "(Megatron's micro-batch calculator asserts)", ("global_batch_size", "micro_batch_size", "world_size",
         "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"),
         lambda c: f"choose a global_batch_size that is a multiple of micro_batch_size x DP = "
                   f"{int(c['micro_batch_size'] or 1)} x {c.world // _model_ranks(c)}",
         lambda c: _micro_batches(c) is not None and c.world % _model_ranks(c) == 0,
         lambda c: _micro_batches(c).is_integer()),
    Rule("expert-parallel-sizes", "EP x expert-TP must divide the ranks of one pipeline stage",
         ("world_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "pipeline_model_parallel_size"),
         "choose expert_model_parallel_size x expert_tensor_parallel_size dividing world_size / "
         "pipeline_model_parallel_size", lambda c: c.world is not None,
         lambda c: (c.world // c["pipeline_model_parallel_size"])
         % (c.ep * (c["expert_tensor_parallel_size"] or c["tensor_model_parallel_size"])) == 0),
    Rule("optimizer-instances-divide", "num_distributed_optimizer_instances must divide DP x CP and the "
         "expert-DP size (Megatron-Core asserts)", ("num_distributed_optimizer_instances", "world_size",
         "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
         "expert_tensor_parallel_size"),
         lambda c: "choose num_distributed_optimizer_instances dividing both DP x CP ({}) and expert-DP ({})".format(
             *_shard_ranks(c)),
         lambda c: c.world is not None and int(c["num_distributed_optimizer_instances"] or 1) > 1
         and c.world % _model_ranks(c) == 0,
         lambda c: all(ranks % int(c["num_distributed_optimizer_instances"]) == 0 for ranks in _shard_ranks(c))),
    Rule("hsdp-outer-sharding", "outer_dp_sharding_strategy is no_shard or optim, and optim (the optimizer "
         "sharded across HSDP's replicas too) needs data_parallel_sharding_strategy=optim_grads_params "
         "(Megatron-FSDP raises)", ("outer_dp_sharding_strategy", "data_parallel_sharding_strategy"),
         "set outer_dp_sharding_strategy to no_shard, or to optim with data_parallel_sharding_strategy="
         "optim_grads_params", lambda c: c.given("outer_dp_sharding_strategy"),
         lambda c: c["outer_dp_sharding_strategy"] in OUTER_SHARDING
         and (c["outer_dp_sharding_strategy"] == "no_shard"
              or c["data_parallel_sharding_strategy"] in (None, "optim_grads_params"))),
    Rule("cp-splits-sequence", "with CP > 1 the sequence must split into 2 x CP chunks (Megatron-LM asserts)",
         ("seq_length", "context_parallel_size"), "choose a seq_length that is a multiple of 2 x context_parallel_size",
         lambda c: c.given("seq_length") and int(c["context_parallel_size"]) > 1,
         lambda c: "context_parallel_size" not in _sequence_splits(c)),
    Rule("sp-splits-sequence", "sequence parallelism splits each CP rank's part of the sequence over TP",
         ("seq_length", "context_parallel_size", "tensor_model_parallel_size", "sequence_parallel"),
         "choose a seq_length that is a multiple of context_parallel_size x tensor_model_parallel_size",
         lambda c: c.given("seq_length") and bool(c["sequence_parallel"]) and int(c["tensor_model_parallel_size"]) > 1,
         lambda c: "sequence_parallel" not in _sequence_splits(c)),
    Rule("tp-splits-heads", "the attention heads must split evenly over TP (Megatron-Core raises)",
         ("num_attention_heads", "tensor_model_parallel_size"), "choose a tensor_model_parallel_size dividing "
         "num_attention_heads", lambda c: c.given("num_attention_heads"),
         lambda c: _width_splits(c, "num_attention_heads")),
    Rule("tp-query-groups", "the query groups must be a multiple or a divisor of TP (Megatron-Core raises)",
         ("num_query_groups", "tensor_model_parallel_size"), "choose a tensor_model_parallel_size dividing "
         "num_query_groups or divided by it", lambda c: c.given("num_query_groups"),
         lambda c: _width_splits(c, "num_query_groups")),
    Rule("etp-splits-expert", "a routed expert's width must split evenly over expert-TP (its linear layers "
         "assert)", ("moe_ffn_hidden_size", "expert_tensor_parallel_size", "tensor_model_parallel_size"),
         "choose an expert_tensor_parallel_size (by default the TP size) dividing moe_ffn_hidden_size",
         lambda c: c.given("moe_ffn_hidden_size"), lambda c: _width_splits(c, "moe_ffn_hidden_size")),
    Rule("tp-splits-shared-expert", "the shared experts' width must split evenly over TP (their linear layers "
         "assert)", ("moe_shared_expert_intermediate_size", "tensor_model_parallel_size"),
         "choose a tensor_model_parallel_size dividing moe_shared_expert_intermediate_size",
         lambda c: bool(c["moe_shared_expert_intermediate_size"]),
         lambda c: _width_splits(c, "moe_shared_expert_intermediate_size")),
    Rule("domain-divides-ep", "the NVLink domain size must divide EP", (DOMAIN_FIELD, "expert_model_parallel_size"),
         "set NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN to a divisor of EP (the GPUs one NVLink domain joins)",
         lambda c: c.domain is not None, lambda c: c.ep % c.domain == 0),
    Rule("domain-matches-hardware", "the NVLink domain size must match the hardware",
         (DOMAIN_FIELD, "hardware", "expert_model_parallel_size"),
         "set NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN to the largest divisor of EP that fits one NVLink domain "
         "of the hardware", lambda c: c.domain is not None and c.given("hardware"),
         lambda c: c.domain == _expected_domain(c)),
]


def with_model_fields(values: dict, arch) -> dict:
    """``values`` with the model's experts, top-k, layers, heads, widths and attention (an
    `Architecture`) where the configuration leaves them out: the rules read them (the pipeline
    split, the EP size against the experts, TP and expert-TP against the heads and widths, the
    recompute modules of an attention it has), so `estimate` and `validate --model` check one
    configuration alike."""
    values.setdefault("num_moe_experts", arch.experts)
    values.setdefault("moe_router_topk", arch.topk)
    values.setdefault("num_layers", arch.layers)
    values.setdefault("num_attention_heads", arch.heads)
    values.setdefault("num_query_groups", arch.query_groups)
    values.setdefault("moe_ffn_hidden_size", arch.moe_ffn)
    if arch.shared_ffn:
        values.setdefault("moe_shared_expert_intermediate_size", arch.shared_ffn)
    values.setdefault("multi_latent_attention", arch.mla)
    if arch.linear_layers:
        values.setdefault("experimental_attention_variant", "gdn2" if arch.linear_gdn2 else "gated_delta_net")
    values.setdefault(MODEL_FIELD, arch.name)
    return values


def validate(values: dict) -> list:
    """Violations by a flat config dict (see `load_config`): ``field-value`` for values that do not
    fit their field, then every rule of `RULES` that reads no such field."""
    out = value_violations(values)
    bad = {f for v in out for f in v.fields}
    c = Config({k: v for k, v in values.items() if k not in bad})
    if c.given("hardware") and not hardware_key(c["hardware"]) and not Path(str(c["hardware"])).is_file():
        raise ConfigError(f"hardware={c['hardware']!r}: choose one of {', '.join(HARDWARE)} or give a YAML/JSON file")
    for rule in RULES:
        if bad & set(rule.fields):
            continue                        # already reported as a bad value
        try:
            broken = rule.applies(c) and not rule.holds(c)
        except (TypeError, ValueError, ZeroDivisionError) as err:
            broken = True
            rule = replace(rule, title=f"{rule.title} (could not evaluate: {err})",
                           fix=rule.fix if isinstance(rule.fix, str) else "give each of the fields a value of its kind")
        if broken:
            shown = {f: c[f] for f in rule.fields if not rule.given_only or c.given(f)}
            if rule.id == "domain-matches-hardware":
                shown["expected"] = _expected_domain(c)
            out.append(Violation(rule.id, rule.title, shown, rule.fix(c) if callable(rule.fix) else rule.fix))
    return out
