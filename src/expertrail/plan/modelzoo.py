"""A Megatron-MoE-ModelZoo launch line read as the Megatron-LM arguments it starts its run with.

The ModelZoo (github.com/yanring/Megatron-MoE-ModelZoo) launches a benchmark as

    PR=mxfp8 TP=1 PP=8 EP=32 NNODES=32 GBS=8192 bash sbatch_benchmarking.sh --recompute-modules mlp ...

Shell variables pick the model (``MODEL``), the layout, the batch and the precision; the script
fills the ones a line leaves out from its model's row of runtime_configs/benchmarking/runtime.conf
(`RUNTIME_DEFAULTS`), substitutes them into the model's file (model_configs/benchmarking/<MODEL>.yaml,
its ``MODEL_ARGS``, a flag a line, ``false`` ones left out), appends the line's own flags, then the
flags its variables stand for (``PR``, ``DISPATCHER``, ``A2A_OVERLAP``, ``VPP``,
``OPTIMIZER_OFFLOAD``), and starts ``NNODES`` nodes of 8 ranks (4 with ``GB200_CLUSTER=1``).
`launch_arguments` builds the same argument list, so `validate`, `estimate` and `plan --fit` read
the run the line starts: without it, ``PR``, ``VPP``, ``GBS`` or ``NNODES`` are names no Megatron
configuration has, and a line read flag by flag is a different run (BF16, micro-batch 1 of one).

Where the model's file is not beside the script (the line pasted outside a ModelZoo checkout, and
no ``TRAINING_PARAMS_PATH``), the run is the catalog model ``MODEL`` names with what every
ModelZoo model file sets around it (`SHARED_MODEL_ARGS`), and the estimate says so.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import ConfigError

LAUNCH_SCRIPTS = ("sbatch_benchmarking.sh", "interactive_benchmarking.sh")
SHELLS = {"bash", "sh", "env", "\\"}              # words between a launch's variables and its script

# runtime_configs/benchmarking/runtime.conf at the ModelZoo's commit e8650517 (2026-05): per model,
# what a launch line leaves unset. NUM_LAYERS is the script's count for the pipeline split (Qwen3-235B's
# 96 counts the embedding and the loss, as its model file's split does); PP_FIRST / PP_LAST the uneven
# split's first and last stages where NUM_LAYERS does not divide by PP.
_RUNTIME_FIELDS = ("TP", "PP", "EP", "CP", "VPP", "MBS", "GBS", "NUM_LAYERS", "MOE_TOKEN_DISPATCHER",
                   "MOE_GROUPED_GEMM", "NNODES", "PRETRAIN", "SEQ_LEN", "PP_FIRST", "PP_LAST")
RUNTIME_DEFAULTS = {model: dict(zip(_RUNTIME_FIELDS, row.split())) for model, row in {
    "Mixtral-8x2B": "1 1 8 1 1 2 256 24 alltoall false 8 1 4096",
    "Mixtral-8x7B": "1 4 8 1 8 1 256 32 alltoall true 8 0 4096",
    "Mixtral-8x22B": "2 8 8 1 7 1 256 56 alltoall true 16 0 4096",
    "DeepSeek-V2": "1 16 8 1 2 1 1024 60 alltoall true 32 0 4096 2 2",
    "DeepSeek-V2-Lite": "1 1 8 1 1 1 512 27 alltoall true 1 0 4096",
    "DeepSeek-V3": "1 16 64 1 1 1 8192 61 flex true 128 0 4096 4 1",
    "DeepSeek-V3-Proxy": "1 4 16 1 1 1 512 14 flex true 8 0 4096 2 2",
    "Qwen3-235B-A22B": "2 8 32 1 4 1 256 96 flex true 32 0 4096",
    "Qwen3-30B-A3B": "1 1 8 1 1 1 256 48 alltoall true 4 0 4096",
    "Qwen3-Next-80B-A3B": "1 4 8 1 3 1 256 48 flex true 8 0 4096",
    "Kimi-K2": "1 4 64 1 4 1 128 61 deepep true 16 0 4096 4 1",
}.items()}

# A line whose model file is not at hand: the MODEL_ARGS every ModelZoo model file sets beside the
# model itself, and the pipeline and MTP fields of the catalog models' files (at commit e8650517).
SHARED_MODEL_ARGS = {
    "--tensor-model-parallel-size": "${TP}", "--pipeline-model-parallel-size": "${PP}",
    "--expert-model-parallel-size": "${EP}", "--context-parallel-size": "${CP}", "--expert-tensor-parallel-size": 1,
    "--use-distributed-optimizer": True, "--overlap-grad-reduce": True, "--overlap-param-gather": True,
    "--sequence-parallel": True, "--micro-batch-size": "${MBS}", "--global-batch-size": "${GBS}",
    "--seq-length": "${SEQ_LEN}", "--moe-grouped-gemm": "${MOE_GROUPED_GEMM}", "--bf16": True,
}
_PER_STAGE = {"--num-layers-per-virtual-pipeline-stage": "${LAYERS_PER_VP}"}
CATALOG_MODEL_ARGS = {
    "Mixtral-8x7B": _PER_STAGE, "Mixtral-8x22B": {}, "Qwen3-30B-A3B": _PER_STAGE,
    "Qwen3-235B-A22B": {**_PER_STAGE, "--account-for-embedding-in-pipeline-split": True,
                        "--account-for-loss-in-pipeline-split": True},
    "Qwen3-Next-80B-A3B": {**_PER_STAGE, "--mtp-num-layers": 1},
    "DeepSeek-V3": {"--mtp-num-layers": 0}, "Kimi-K2": {"--mtp-num-layers": 0},   # their files leave MTP off
}

# The flags sbatch_benchmarking.sh appends for its variables, in its order.
_DISPATCHERS = {"alltoall": "--moe-token-dispatcher-type alltoall",
                "deepep": "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep",
                "hybridep": "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
                            "--moe-hybridep-num-sms 32"}
_OPTIMIZER = ("--use-precision-aware-optimizer --main-grads-dtype fp32 --main-params-dtype fp32 "
              "--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16")
PRECISIONS = ("bf16", "fp8", "mxfp8")

SHELL_VARIABLE = re.compile(r"[A-Z_][A-Z0-9_]*=")       # PR=mxfp8: a launch's environment
# Environment variables that shape the run and that validate reads as fields (HybridEP's NVLink
# domain): a launch line's assignment of one is passed on, the rest are the shell's.
RUN_ENVIRONMENT = ("NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN",)
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


# The shell variables a launch's scripts read (`_launch_variables`, `_script_flags`): what a
# launch script that starts one hands on with it (launch_script.py).
LAUNCH_VARIABLES = ("MODEL", "PR", "DISPATCHER", "A2A_OVERLAP", "OPTIMIZER_OFFLOAD", *_RUNTIME_FIELDS, "LAYERS_PER_VP",
                    "TRAINING_PARAMS_PATH", "TRAINING_PARAMS", "GB200_CLUSTER", *RUN_ENVIRONMENT)


def launch_at(tokens: list) -> int | None:
    """The index of the ModelZoo launch script among ``tokens``, or None where there is none."""
    for i, tok in enumerate(tokens):
        if Path(str(tok).strip()).name in LAUNCH_SCRIPTS:
            return i
    return None


def launch_arguments(tokens: list) -> list:
    """``tokens`` with a ModelZoo launch (``VAR=value ... bash sbatch_benchmarking.sh --flags``)
    replaced by the Megatron-LM arguments it starts the run with, and ``num_nodes`` (with
    ``gpus_per_node`` where ``GB200_CLUSTER`` sets it) and, where the model's file is not at hand,
    ``modelzoo_model``; ``tokens`` as they are where they hold no launch."""
    at = launch_at(tokens)
    if at is None:
        return list(tokens)
    script = Path(str(tokens[at]).strip())
    start = launch_start([str(t).strip() for t in tokens], at)
    env = _launch_variables(tokens[start:at], script.name)
    flags = [str(t) for t in tokens[at + 1:]]
    model_file = Path(env["TRAINING_PARAMS_PATH"]) if env.get("TRAINING_PARAMS_PATH") else \
        script.parent / "model_configs" / "benchmarking" / f"{env['MODEL']}.yaml"
    if model_file.is_file():
        params = model_file_arguments(model_file, env)
        found = []
    elif env.get("TRAINING_PARAMS_PATH"):
        raise ConfigError(f"TRAINING_PARAMS_PATH={env['TRAINING_PARAMS_PATH']}: no such model file; give the path of "
                          f"the ModelZoo's model_configs/benchmarking/{env['MODEL']}.yaml")
    else:
        shared = {**SHARED_MODEL_ARGS, **CATALOG_MODEL_ARGS.get(env["MODEL"], {})}
        params = _arguments({k: substitute(str(v), env) if isinstance(v, str) else v for k, v in shared.items()})
        found = [f"modelzoo_model={env['MODEL']}"]
    params = env.get("TRAINING_PARAMS", "").split() + params + flags       # the script starts from TRAINING_PARAMS
    params += _script_flags(env, " ".join(params), interactive=script.name == "interactive_benchmarking.sh")
    nodes = [f"num_nodes={env['NNODES']}"]
    if "GB200_CLUSTER" in env:
        nodes.append(f"gpus_per_node={4 if env['GB200_CLUSTER'] == '1' else 8}")
    return [str(t) for t in tokens[:start]] + run_environment(tokens[start:at]) + params + nodes + found


def launch_start(words: list, at: int) -> int:
    """Where the launch of the script ``words[at]`` starts: the shell variables it sets and the
    shell it names just before it (``PR=mxfp8 TP=1 bash``)."""
    start = at
    while start > 0 and (words[start - 1] in SHELLS or SHELL_VARIABLE.match(words[start - 1])):
        start -= 1
    return start


def shell_variables(words: list) -> dict:
    """{NAME: value} of the ``NAME=value`` assignments among a launch's ``words``, the shell's
    quotes taken off."""
    return {name: value.strip().strip("'\"")
            for name, _, value in (str(w).strip().partition("=") for w in words if SHELL_VARIABLE.match(str(w).strip()))}


def run_environment(assignments: list) -> list:
    """The ``NAME=value`` assignments among a launch's shell variables that the run reads as
    fields (`RUN_ENVIRONMENT`)."""
    return [str(t).strip() for t in assignments if str(t).strip().partition("=")[0] in RUN_ENVIRONMENT]


def _launch_variables(before: list, script: str) -> dict:
    """The shell variables a launch line sets before its script (``NAME=value``), over its
    model's runtime.conf row and the scripts' own defaults (as common.conf and runtime.conf fill
    them)."""
    given = shell_variables(before)
    model = given.get("MODEL")
    if model not in RUNTIME_DEFAULTS:
        what = f"MODEL={model} is not one of the ModelZoo's models" if model else "the line sets no MODEL"
        raise ConfigError(f"{what}: write MODEL=<one of {', '.join(RUNTIME_DEFAULTS)}> before {script}")
    env = {"PR": "bf16", "DISPATCHER": "deepep", "A2A_OVERLAP": "0", "OPTIMIZER_OFFLOAD": "0",
           **RUNTIME_DEFAULTS[model], **given}
    if env["PR"] not in PRECISIONS:
        raise ConfigError(f"PR={env['PR']}: the ModelZoo's precisions are {', '.join(PRECISIONS)} (common.conf)")
    if env["DISPATCHER"] not in _DISPATCHERS:
        raise ConfigError(f"DISPATCHER={env['DISPATCHER']}: the ModelZoo's dispatchers are {', '.join(_DISPATCHERS)}")
    for name in ("TP", "PP", "EP", "CP", "VPP", "MBS", "GBS", "NUM_LAYERS", "NNODES", "SEQ_LEN"):
        if not env[name].isdigit() or int(env[name]) < 1:
            raise ConfigError(f"{name}={env[name]}: a whole number >= 1, e.g. {name}={RUNTIME_DEFAULTS[model][name]}")
    layers, pp, vpp = int(env["NUM_LAYERS"]), int(env["PP"]), int(env["VPP"])
    env.setdefault("LAYERS_PER_VP", str(layers // pp // vpp) if vpp > 1 else "false")
    if layers % pp:
        if "PP_FIRST" not in env:
            raise ConfigError(f"NUM_LAYERS={layers} does not divide by PP={pp} and {model} has no uneven split in "
                              "runtime.conf: set PP_FIRST and PP_LAST (its first and last stages' layers)")
    else:
        env["PP_FIRST"] = env["PP_LAST"] = "false"
    if env.get("PRETRAIN", "0") == "0":            # the cluster file's checkpoint, loaded (its path is the user's)
        env.setdefault("LOAD_PATH", "checkpoint")
    return env


def substitute(text: str, env: dict) -> str:
    """``text`` with ``${VAR}`` and ``$VAR`` replaced from ``env``, an unset one by nothing (as
    envsubst, which the scripts run over the model file)."""
    return _VARIABLE.sub(lambda m: env.get(m.group(1) or m.group(2), ""), text)


def model_file_arguments(path: Path, env: dict) -> list:
    """The ModelZoo model file's MODEL_ARGS as the argument tokens the scripts pass: variables
    substituted, a ``false`` flag left out, a ``true`` one a bare switch, the rest ``--flag value``
    split as the shell splits them."""
    import yaml
    try:
        data = yaml.safe_load(substitute(path.read_text(), env))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"ModelZoo model file {str(path)!r}: cannot read it ({err.__class__.__name__}: {err})") \
            from None
    args = data.get("MODEL_ARGS") if isinstance(data, dict) else None
    if not isinstance(args, dict):
        raise ConfigError(f"ModelZoo model file {str(path)!r} has no MODEL_ARGS mapping (model_configs/benchmarking/"
                          "<MODEL>.yaml holds one)")
    return _arguments(args)


def _arguments(args: dict) -> list:
    """MODEL_ARGS as the scripts' yq passes them: ``false`` (or empty) left out, ``true`` a bare
    switch, the rest ``--flag value`` split as the shell splits it."""
    out = []
    for key, value in args.items():
        if value is False or value is None or str(value) in ("false", ""):
            continue
        out.append(str(key))
        if value is not True and str(value) != "true":
            out.extend(str(value).split())
    return out


def _script_flags(env: dict, params: str, interactive: bool) -> list:
    """The flags sbatch_benchmarking.sh (interactive_benchmarking.sh alike) appends after the model
    file's and the line's, in its order; ``params`` is what they already hold."""
    out = []
    pp_layout = "--pipeline-model-parallel-layout" in params
    if int(env["VPP"]) > 1 and not pp_layout and "--num-virtual-stages-per-pipeline-rank" not in params \
            and "--num-layers-per-virtual-pipeline-stage" not in params:
        out += (["--num-layers-per-virtual-pipeline-stage", env["LAYERS_PER_VP"]] if interactive
                else ["--num-virtual-stages-per-pipeline-rank", env["VPP"]])
    if env["PP_FIRST"] != "false" and not pp_layout:
        out += ["--decoder-first-pipeline-num-layers", env["PP_FIRST"],
                "--decoder-last-pipeline-num-layers", env["PP_LAST"]]
    offload = env["OPTIMIZER_OFFLOAD"] == "1"
    if offload:
        out += ["--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d"]
    out += _DISPATCHERS[env["DISPATCHER"]].split()
    if env["PR"] == "fp8":
        out += ["--fp8-recipe", "blockwise", "--fp8-format", "e4m3"] + ([] if offload else ["--fp8-param-gather"])
        out += _OPTIMIZER.split() + ["--moe-router-padding-for-fp8"]
    elif env["PR"] == "bf16":
        out += ["--tp-comm-overlap"]
    else:
        out += ["--fp8-recipe", "mxfp8", "--fp8-format", "e4m3"]
        if not offload:
            out += ["--fp8-param-gather", "--reuse-grad-buf-for-mxfp8-param-ag", "--overlap-grad-reduce",
                    "--overlap-param-gather"]
        out += _OPTIMIZER.split() + ["--moe-router-padding-for-quantization"]
    if env["A2A_OVERLAP"] == "1":
        out += ["--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm"]
    words = params.split()
    if "--max-position-embeddings" in words:         # long context: positions as long as the sequence
        at = words.index("--max-position-embeddings") + 1
        if at < len(words) and words[at].isdigit() and int(env["SEQ_LEN"]) > int(words[at]):
            out += ["--max-position-embeddings", env["SEQ_LEN"]]
    return out
