"""A torchrun launch line read as the Megatron-LM arguments it passes and the world it starts.

Megatron-LM's example scripts launch a run as

    torchrun --nproc_per_node 8 --nnodes 4 --node_rank 0 --master_addr host --master_port 6000 \\
        pretrain_gpt.py --num-layers 32 ... --expert-model-parallel-size 8

(``python -m torch.distributed.run`` and the older ``torch.distributed.launch`` alike). Pasted after
`validate` or `estimate`, the launcher's own options are not Megatron fields and the script's name
is not a config file: `torchrun_arguments` keeps the script's arguments and turns
``--nproc_per_node`` x ``--nnodes`` into the run's GPUs (``gpus_per_node`` and ``num_nodes``).
"""
from __future__ import annotations

import re

from ..errors import ConfigError

# torchrun's options that take no value (torch.distributed.run's parser, and launch's --use_env).
SWITCHES = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
            "--use-env", "--use_env"}
_PYTHON = re.compile(r"(.*/)?python[0-9.]*$")
_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_SHELL_VARIABLE = re.compile(r"[A-Z_][A-Z0-9_]*=")


def launcher_at(tokens: list) -> tuple | None:
    """(where the launch starts, where torchrun's options start) in ``tokens``, or None where
    they hold no torchrun launch: ``torchrun``, or a Python running torch.distributed.run /
    .launch as a module; shell variables set just before it belong to it."""
    words = [str(t).strip() for t in tokens]
    for i, word in enumerate(words):
        if word.rsplit("/", 1)[-1] == "torchrun":
            start, options = i, i + 1
        elif word in _MODULES and i >= 2 and words[i - 1] == "-m" and _PYTHON.match(words[i - 2]):
            start, options = i - 2, i + 1
        else:
            continue
        while start > 0 and _SHELL_VARIABLE.match(words[start - 1]):
            start -= 1
        return start, options
    return None


def torchrun_arguments(tokens: list) -> list:
    """``tokens`` with a torchrun launch replaced by its script's arguments, and the GPUs it
    starts as ``gpus_per_node`` (its ``--nproc_per_node``, where a number) and ``num_nodes``
    (``--nnodes``, the upper bound of an elastic range; 1 where not given); ``tokens`` as they are
    where they hold no launch."""
    found = launcher_at(tokens)
    if found is None:
        return list(tokens)
    start, i = found
    words = [str(t).strip() for t in tokens]
    options = {}
    while i < len(words) and words[i].startswith("-"):
        name, eq, value = words[i].partition("=")
        i += 1
        if name in SWITCHES:
            continue
        if not eq:
            if i >= len(words):
                break
            value = words[i]
            i += 1
        options[name.lstrip("-").replace("-", "_")] = value
    if i >= len(words):
        raise ConfigError("a torchrun launch names no training script: write torchrun [its options] pretrain_gpt.py "
                          "--megatron-flag ...")
    out = [*words[:start], *words[i + 1:]]
    nproc = options.get("nproc_per_node")
    if nproc is not None and nproc.isdigit():
        out.append(f"gpus_per_node={nproc}")
        nodes = options.get("nnodes", "1").split(":")[-1]
        if not nodes.isdigit() or int(nodes) < 1:
            raise ConfigError(f"torchrun --nnodes {options['nnodes']}: a whole number of nodes (or MIN:MAX), e.g. "
                              "--nnodes 4")
        out.append(f"num_nodes={nodes}")
    return out
