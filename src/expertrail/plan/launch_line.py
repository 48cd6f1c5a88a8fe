"""A Python launch line read as the Megatron arguments it passes and the world it starts.

Megatron-LM's example scripts launch a run as

    torchrun --nproc_per_node 8 --nnodes 4 --node_rank 0 --master_addr host --master_port 6000 \\
        pretrain_gpt.py --num-layers 32 ... --expert-model-parallel-size 8

(``python -m torch.distributed.run`` and the older ``torch.distributed.launch`` alike), a single
process as ``python pretrain_gpt.py --flags``, and Megatron-Bridge's performance scripts as
``python scripts/performance/setup_experiment.py -m qwen3 -mr qwen3_30b_a3b -ng 8 ...``. Pasted
after `validate` or `estimate`, the interpreter, the launcher's options and the script's name are
not Megatron fields or a config file: `script_arguments` keeps the script's arguments and turns
torchrun's ``--nproc_per_node`` x ``--nnodes`` into the run's GPUs (``gpus_per_node`` and
``num_nodes``); for a Python started by Slurm (``srun --nodes 4 --ntasks-per-node 8 python
pretrain_gpt.py ...``), one process a task, srun's ``--nodes`` x ``--ntasks-per-node``.
"""
from __future__ import annotations

import re

from ..errors import ConfigError
from .modelzoo import SHELL_VARIABLE, run_environment

# torchrun's options that take no value (torch.distributed.run's parser, and launch's --use_env).
SWITCHES = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "-m", "--module",
            "--use-env", "--use_env"}
_PYTHON = re.compile(r"(.*/)?python[0-9.]*$")
_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_PYTHON_VALUED = ("-W", "-X", "-Q")             # the interpreter's options that take a value
# Slurm's options for a job's size, as sbatch and srun spell them -> what they set.
_SLURM_OPTIONS = {"-N": "nodes", "--nodes": "nodes", "--ntasks-per-node": "tasks_per_node",
                  "--gpus-per-node": "gpus_per_node", "--gres": "gres"}


def launcher_at(tokens: list) -> tuple | None:
    """(where the launch starts, where the launcher's options start (a Python script's name, for
    a plain Python), whether it is torchrun) in ``tokens``, or None where they hold no Python
    launch: ``torchrun``, a Python running torch.distributed.run / .launch as a module, or a
    Python running a script (``*.py``), the interpreter's own options (``-u``, ``-X dev``)
    before either; shell variables set just before it belong to it."""
    words = [str(t).strip() for t in tokens]
    for i, word in enumerate(words):
        if word.rsplit("/", 1)[-1] == "torchrun":
            start, options, torchrun = i, i + 1, True
        elif _PYTHON.match(word):
            j = i + 1
            while j < len(words) and words[j].startswith("-") and words[j] not in ("-m", "-c"):
                j += 2 if words[j] in _PYTHON_VALUED else 1
            if j < len(words) and words[j].endswith(".py"):
                start, options, torchrun = i, j, False
            elif j + 1 < len(words) and words[j] == "-m" and words[j + 1] in _MODULES:
                start, options, torchrun = i, j + 2, True
            else:
                continue
        else:
            continue
        while start > 0 and SHELL_VARIABLE.match(words[start - 1]):
            start -= 1
        return start, options, torchrun
    return None


def script_arguments(tokens: list, job: dict | None = None) -> list:
    """``tokens`` with a Python launch replaced by its script's arguments, and the GPUs it starts
    (``gpus_per_node``, ``num_nodes``): for torchrun, its ``--nproc_per_node`` (where a number) x
    ``--nnodes`` (the upper bound of an elastic range; 1 where not given); else, for a launch an
    srun starts (on its line, or, as ``job``, the `slurm_sizes` of the srun and allocation that
    start it), srun's nodes x tasks a node, over ``job``'s; ``tokens`` as they are where they
    hold no launch."""
    found = launcher_at(tokens)
    if found is None:
        return list(tokens)
    start, i, torchrun = found
    words = [str(t).strip() for t in tokens]
    options = {}
    while torchrun and i < len(words) and words[i].startswith("-"):
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
    before, srun = words[:start], srun_options(words[:start])
    if srun is not None:
        before = before[:len(before) - len(srun) - 1]
        job = {**(job or {}), **slurm_sizes(srun)}
    out = [*before, *run_environment(words[start:found[1]]), *words[i + 1:]]
    nproc = options.get("nproc_per_node")
    if nproc is not None and nproc.isdigit():
        out.append(f"gpus_per_node={nproc}")
        nodes = options.get("nnodes", "1").split(":")[-1]
        if not nodes.isdigit() or int(nodes) < 1:
            raise ConfigError(f"torchrun --nnodes {options['nnodes']}: a whole number of nodes (or MIN:MAX), e.g. "
                              "--nnodes 4")
        out.append(f"num_nodes={nodes}")
    elif not torchrun and job and job.get("nodes") and job.get("tasks_per_node"):
        out += [f"gpus_per_node={job['tasks_per_node']}", f"num_nodes={job['nodes']}"]
    return out


def srun_options(words: list) -> list | None:
    """The options of the srun among ``words`` (the words after it), or None where there is none."""
    names = [w.rsplit("/", 1)[-1] for w in words]
    return words[names.index("srun") + 1:] if "srun" in names else None


def slurm_sizes(options: list) -> dict:
    """{nodes, tasks_per_node, gpus_per_node} that sbatch or srun ``options`` give, where whole
    numbers (``-N 4``, ``-N4``, ``--nodes=4``, ``--ntasks-per-node 8``, ``--gpus-per-node 8``,
    ``--gres=gpu:8``; a node range's upper end)."""
    sizes, i = {}, 0
    while i < len(options):
        name, eq, value = options[i].partition("=")
        if name.startswith("-N") and len(name) > 2 and not eq:
            name, value, eq = "-N", name[2:], "="
        i += 1
        if name in _SLURM_OPTIONS:
            if not eq and i < len(options):
                value, i = options[i], i + 1
            value = value.split(":")[-1].split("-")[-1]
            if value.isdigit():
                sizes[_SLURM_OPTIONS[name]] = int(value)
    if "gres" in sizes:
        sizes.setdefault("gpus_per_node", sizes.pop("gres"))
    return sizes
