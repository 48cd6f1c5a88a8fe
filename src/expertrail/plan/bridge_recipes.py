"""Megatron-Bridge's performance recipes, as its performance scripts pick them.

``python scripts/performance/setup_experiment.py -m qwen3 -mr qwen3_235b_a22b -g gb200 -ng 256
-c fp8_mx`` runs the flat recipe ``qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config``: the
layout, dispatcher, recompute, CUDA graphs and overlap Bridge tuned for that model, system, GPU
count and precision; the line's own flags (-tp, -ep, -mb, -gb, ...) override it. `recipe_fields`
picks it the same way from bridge_perf_recipes.json (the recipes' fields as
tools/bridge_recipes.py reads them from a Bridge checkout): the recipe of the line's GPU count,
else (no -ng) the largest, as Bridge's ``_select_default_recipe_name`` does, Qwen3-30B's smaller
defaults included.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from ..errors import ConfigError

RECIPES_FILE = Path(__file__).with_name("bridge_perf_recipes.json")
RECIPE_FIELD = "bridge_recipe"                  # the recipe read, for the commands to say: expertrail's field
# Bridge's compute dtypes as its recipe names spell them (scripts/performance/utils/utils.py).
PRECISION_NAMES = {"bf16": "bf16", "fp8_cs": "fp8cs", "fp8_ds": "fp8ds", "fp8_mx": "fp8mx", "fp8_sc": "fp8sc",
                   "nvfp4": "nvfp4"}
# Workloads whose default recipe is not the largest (its _DEFAULT_GPU_COUNT_OVERRIDES, the catalog's).
DEFAULT_GPUS = {("qwen3_30b_a3b", gpu, precision): 8 for gpu in ("b200", "gb200", "gb300")
                for precision in ("bf16", "fp8cs")} | {("qwen3_30b_a3b", "h100", p): 16 for p in ("bf16", "fp8cs")}


# A performance recipe's function name: model stem, GPU count, system, precision, variant.
_PERF_RECIPE = re.compile(r"(?P<stem>\w+?)_pretrain_(?P<gpus>\d+)gpu_(?P<gpu>[a-z0-9]+)_"
                          rf"(?P<precision>{'|'.join(PRECISION_NAMES.values())})(?:_(?P<variant>\w+?))?_config")
# A library recipe's (megatron.bridge.recipes): the model stem and the task.
_LIBRARY_RECIPE = re.compile(r"(?P<stem>\w+?)_(?:pretrain|sft|peft|finetune)\w*_config")


@lru_cache(maxsize=1)
def recipes() -> dict:
    """{recipe function name: {field: value}}."""
    return json.loads(RECIPES_FILE.read_text())["recipes"]


def matching(model_recipe_name: str, gpu: str, compute_dtype: str, variant: str | None = None) -> dict:
    """{GPU count: recipe name} of the recipes for a model (Bridge's -mr), system (-g), precision
    (-c) and config variant (-cv; none: the canonical recipes)."""
    prefix = f"{model_recipe_name}_pretrain_"
    suffix = f"gpu_{gpu}_{PRECISION_NAMES.get(compute_dtype, compute_dtype)}{f'_{variant}' if variant else ''}_config"
    return {int(name[len(prefix):-len(suffix)]): name for name in recipes()
            if name.startswith(prefix) and name.endswith(suffix) and name[len(prefix):-len(suffix)].isdigit()}


def recipe_stem(name: str) -> str | None:
    """The model stem (``gpt_oss_20b``) of a recipe function name Megatron-Bridge's
    scripts/training/run_recipe.py takes as ``--recipe``: a performance recipe's
    (``qwen3_30b_a3b_pretrain_16gpu_h100_bf16_config``) or a library recipe's
    (``gpt_oss_20b_pretrain_config``); None for another name."""
    found = _PERF_RECIPE.fullmatch(name) or _LIBRARY_RECIPE.fullmatch(name)
    return found["stem"] if found else None


def named_recipe_fields(values: dict) -> dict:
    """``values`` over the performance recipe run_recipe.py's ``--recipe`` names by its function
    name (``recipe``), with `RECIPE_FIELD` naming it; its system where ``values`` gives none, and
    its GPU count where they give no world size (as Bridge's launcher starts it). ``values`` as
    they are for a library recipe or another name: the model comes from its stem
    (`architecture.recipe_model`), its settings are not read."""
    name = values.get("recipe")
    found = _PERF_RECIPE.fullmatch(name) if isinstance(name, str) and name in recipes() else None
    if not found:
        return values
    sized = any(values.get(k) for k in ("world_size", "num_nodes", "gpus_per_node"))
    return {**recipes()[name], "hardware": found["gpu"], **({} if sized else {"world_size": int(found["gpus"])}),
            **values, RECIPE_FIELD: name}


def recipe_fields(values: dict) -> dict:
    """``values`` over the fields of the recipe its perf-script names pick (``model_recipe_name``,
    ``hardware``, ``compute_dtype``, default bf16 as Bridge's, ``world_size`` and
    ``config_variant``), or run_recipe.py's ``--recipe`` names (`named_recipe_fields`), with
    `RECIPE_FIELD` naming it; ``values`` as they are where they name no recipe or none matches (the
    estimate then says the recipe was not read)."""
    if values.get("recipe") and not values.get("model_recipe_name"):
        return named_recipe_fields(values)
    name, gpu = values.get("model_recipe_name"), values.get("hardware")
    if not name or not isinstance(gpu, str):
        return values
    gpu = gpu.lower().removesuffix("-nvl72")          # the catalog's name of a rack, Bridge's of its GPU
    dtype = values.get("compute_dtype") or "bf16"
    precision, variant = PRECISION_NAMES.get(dtype, dtype), values.get("config_variant")
    found = matching(str(name), gpu, dtype, variant)
    if not found and variant:                          # Bridge's scripts refuse it too
        stem = f"{name}_pretrain_"
        tail = f"gpu_{gpu}_{precision}_"
        variants = sorted({n.split(tail, 1)[1].removesuffix("_config") for n in recipes()
                           if n.startswith(stem) and tail in n and not n.endswith(f"{tail}config")})
        raise ConfigError(f"-cv {variant}: no {name} recipe on {gpu} in {dtype} has that variant: "
                          + (f"choose among {', '.join(variants)}, or " if variants else "")
                          + "leave -cv out for the canonical recipe")
    if not found:
        return values
    gpus = values.get("world_size")
    if isinstance(gpus, int) and gpus in found:
        count = gpus
    else:
        default = DEFAULT_GPUS.get((str(name), gpu, precision))
        count = default if default in found else max(found)
    fields = dict(recipes()[found[count]])
    sizes = ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
    if any(k in values and values[k] != fields.get(k) for k in sizes):
        # Bridge's scripts rebuild the recipe's pipeline layout for the line's PP and VP sizes
        # (overrides.py): the recipe's own layout no longer applies.
        fields.pop("pipeline_model_parallel_layout", None)
    read = found[count] + (f" (no {gpus}-GPU recipe: its settings on {gpus} GPUs)"
                           if isinstance(gpus, int) and gpus != count else "")
    return {**fields, "world_size": count, **values, RECIPE_FIELD: read}
