"""`expertrail validate`: a Megatron-Core / Megatron-Bridge MoE config checked before launch
(torch-free)."""
from __future__ import annotations

import argparse

from ...errors import ExpertrailError
from ..arguments import ConfigArguments, positive_int


def add_parser(sub) -> None:
    from ...names import NAMES_HELP
    p = sub.add_parser(
        "validate", help="check a Megatron-Core / Megatron-Bridge MoE config before launch",
        usage="%(prog)s [-h] [--json] [--strict] [--model NAME|DIR] [--gpus N] [CONFIG.yaml] "
              "[key=value | --megatron-flag [VALUE]] ...",
        description="Checks a YAML/JSON config (Megatron-Core or Megatron-Bridge field names), key=value overrides "
                    "and Megatron command-line arguments against the EP-overlap and MoE rules and the fields' "
                    "types and choices; prints each violation with its fields and fix, and warns about unknown "
                    "fields (with the closest known name).",
        epilog="config entries, in any order (at most one file):\n"
               "  CONFIG.yaml, CONFIG.json     flat, or nested as Megatron-Bridge's model: / comm_overlap: sections\n"
               "  key=value                    model.expert_model_parallel_size=8 (section, dashes, case ignored)\n"
               "  --flag VALUE, --flag=VALUE   Megatron's arguments as written: --expert-model-parallel-size 8,\n"
               "                               --num-experts 256 (= num_moe_experts), --fp8-format e4m3 (= fp8)\n"
               "  --switch                     boolean flags: --moe-grouped-gemm, --no-gradient-accumulation-fusion\n"
               "  expertrail's own fields      hardware=h100, world_size=64 (or num_nodes, gpus_per_node),\n"
               "                               torch_version=2.6.0, NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=8\n"
               "exit status: 0 valid; 1 a rule or a field value violated (with --strict, also an unknown field);\n"
               "             2 unusable arguments (no config, two files, unreadable file)\n"
               "example: expertrail validate $(expertrail plan --hardware h100 --model deepseek-v3 --ep 32 "
               "--emit megatron)\n\n" + NAMES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.__class__ = ConfigArguments
    p.add_argument("--json", action="store_true", help="print the result as JSON (default: text)")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 1) on unknown fields too (default: warn about them)")
    p.add_argument("--model", metavar="NAME|DIR", default=None,
                   help="a catalog model, a Hugging Face config.json or ORG/NAME in its cache (as for estimate): its "
                        "layers, experts, top-k, "
                        "heads and widths where the configuration leaves them out, so the pipeline split, the EP size "
                        "and the TP / expert-TP splits are checked as `estimate` checks them (default: the "
                        "configuration's fields only)")
    p.add_argument("--gpus", type=positive_int(256), default=None,
                   help="GPUs of the run (default: world_size, num_nodes x gpus_per_node, as the configuration gives them)")
    p.set_defaults(config=[])


def run(args) -> int:
    from ...plan.output import dumps
    from ...plan.validate import READ_FIELDS, RULES, config_values, unknown_fields, validate, value_violations
    if not args.config:
        raise ExpertrailError("nothing to validate: give a YAML/JSON file, key=value overrides or Megatron flags, "
                              "e.g. expertrail validate --expert-model-parallel-size 8 --num-experts 64")
    values = config_values(args.config)
    if args.gpus is not None:
        values.setdefault("world_size", args.gpus)
    from ...plan.architecture import recipe_model
    model = args.model or recipe_model(values)          # Megatron-Bridge's -mr, as estimate reads it
    if model is not None and not value_violations(values):
        from ...errors import ConfigError
        from ...plan.architecture import from_fields, load_architecture
        from ...plan.validate import with_model_fields
        base = load_architecture(model)
        try:
            arch = from_fields(base, values)
        except ConfigError:         # fields the model cannot take: the rules below name them
            arch = base
        with_model_fields(values, arch)
    violations = validate(values)
    warnings = unknown_fields(values)
    failed = bool(violations) or (args.strict and bool(warnings))
    if args.json:
        print(dumps({"valid": not failed, "rules_checked": len(RULES), "fields_checked": len(values),
                     "warnings": warnings, "violations": [v.__dict__ for v in violations],
                     **{f: values[f] for f in READ_FIELDS if values.get(f)}},
                    fallback=str))
        return 1 if failed else 0
    for field in READ_FIELDS:
        if values.get(field):
            print(f"read: {values[field]}")
    for w in warnings:
        print(f"warning: {w['message']}")
    if violations:
        print(f"{len(violations)} rule(s) violated:")
        for v in violations:
            print(v.format())
    elif failed:
        print(f"not valid with --strict: {len(warnings)} unknown field(s)")
    else:
        print(f"valid: {len(RULES)} rules and {len(values)} field value(s) checked, none violated"
              + (f"; {len(warnings)} warning(s) above" if warnings else ""))
    return 1 if failed else 0
