"""Megatron's configuration field names, with the kind of value each takes (generated data,
kept as data in megatron_fields.json beside this file).

`expertrail validate` reads it to warn about unknown keys (with the closest known name), to
check value types and choices, and to read Megatron's command-line forms: a ``bool`` field is a
``store_true`` switch (``--moe-grouped-gemm``); one that defaults to true is turned off with
``--no-<name>`` or ``--disable-<name>``; `FLAG_ALIASES` maps flags whose name differs from the
field they set (``--num-experts`` sets ``num_moe_experts``, ``--fp8-format`` sets ``fp8``).

Taken from Megatron-LM (main, commit d98e8a64dd): the dataclass fields of TransformerConfig,
ModelParallelConfig, OptimizerConfig, DistributedDataParallelConfig, the training configs
(TrainingConfig, ValidationConfig, SchedulerConfig, LoggerConfig, CheckpointConfig,
TokenizerConfig, RNGConfig, ProfilingConfig, DistributedInitConfig, RerunStateMachineConfig,
StragglerDetectionConfig), BlendedMegatronDatasetConfig / GPTDatasetConfig, and the arguments
declared in megatron/training/arguments.py; from its dev branch (commit d48bd6be0a), the
optimizer-state offload fields recipes already use (``chunked_optimizer_state_offload``, its
alias ``offload_optimizer_states``, ``optimizer_state_offload_chunk_size_mb``,
``optimizer_state_offload_fraction``), the EP overlap of its 2025 prototype, ``combined_1f1b``
with ``combined_1f1b_recipe``, and its 2025 name of the linear attention variant,
``linear_attention_type`` (Megatron-MoE-ModelZoo's launch lines and model files of 2025); and
Megatron-Bridge's GPTModelProvider and MLAModelProvider fields beyond those (commit 067f987d:
``share_embeddings_and_output_weights``, the YaRN and rope-scaling fields, ``hf_model_id``, ...). Names only, no code. ``ANY`` holds fields whose type the validator does
not check (unions, enums, callables).

BOOL, INT, FLOAT, STR, LIST, ANY, TRUE_BY_DEFAULT: frozensets of field names; CHOICES /
LIST_CHOICES: field -> allowed values (tuple; for ``recompute_modules`` and ``offload_modules``
the sets TransformerConfig asserts on); FLAG_ALIASES: flag -> (field, value it sets, or
None for the value given).
"""
import json
from pathlib import Path

_DATA = json.loads((Path(__file__).with_name("megatron_fields.json")).read_text())

BOOL, INT, FLOAT, STR, LIST, ANY, TRUE_BY_DEFAULT = (
    frozenset(_DATA[kind]) for kind in ("BOOL", "INT", "FLOAT", "STR", "LIST", "ANY", "TRUE_BY_DEFAULT"))
CHOICES = {field: tuple(values) for field, values in _DATA["CHOICES"].items()}
LIST_CHOICES = {field: tuple(values) for field, values in _DATA["LIST_CHOICES"].items()}
FLAG_ALIASES = {flag: tuple(target) for flag, target in _DATA["FLAG_ALIASES"].items()}


def flex_backend(values: dict) -> str | None:
    """The flex dispatcher's backend a flat config sets: ``moe_flex_dispatcher_backend``, or
    DeepEP where it sets only the deprecated ``moe_enable_deepep`` (Megatron-Core maps the one
    onto the other); None where it sets neither."""
    return values.get("moe_flex_dispatcher_backend") or ("deepep" if values.get("moe_enable_deepep") else None)
