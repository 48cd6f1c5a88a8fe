"""A launch script read as the training command it starts.

Megatron-LM's example scripts (examples/mixtral/train_mixtral_8x7b_distributed.sh,
examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh), like most users' own, build a run's
arguments in bash: variables with defaults (``NNODES=${SLURM_NNODES:-1}``), arithmetic, arrays
appended to under conditions; and start it with ``torchrun``, ``python pretrain_gpt.py`` or
``srun``, directly, through ``bash -c "..."`` or from an sbatch here-document. Rather than imitate
bash, `recorded_commands` lets bash run the script, in its restricted mode (``bash -r``) with no
program on its PATH: assignments, conditions, loops and functions run as they would on the node,
and every command the script would start reaches bash's ``command_not_found_handle``
(launch_script.bash), which records it in place of running it. Restricted bash refuses output
redirections to files and commands named by a path, so reading a script starts nothing and writes
nothing; a script that runs on past `TIMEOUT_S` is stopped. What scripts use to find their own
files (cd, source, dirname, ...) is done there on the paths' text.

`script_launch` replaces ``[NAME=value ...] [bash | sh | sbatch [options]] train.sh [arguments]``
among a command line's tokens with the arguments of the training command the script starts, and
the GPUs it starts them on: torchrun's (`launch_line.script_arguments`), else srun's ``--nodes`` x
``--ntasks-per-node``, else the job's allocation (the script's ``#SBATCH`` lines and sbatch's
options, as Slurm's variables the script can read too). A Megatron-MoE-ModelZoo run script's
``bash sbatch_benchmarking.sh`` is not followed but handed on (`HANDED_ON`) with the variables
it reads, as the pasted line the ModelZoo reader (modelzoo.py) reads. ``launch=N`` after the
script picks one of several training commands (`CHOICE_FIELD`).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

from ..errors import ConfigError
from .launch_line import launcher_at, script_arguments, slurm_sizes, srun_options
from .modelzoo import (LAUNCH_SCRIPTS, LAUNCH_VARIABLES, SHELL_VARIABLE, SHELLS, launch_at, launch_start,
                       run_environment, shell_variables)

SUFFIXES = (".sh", ".bash", ".sbatch", ".slurm")
LAUNCH_FIELD = "launch_script"                   # what was read, for the commands to say: expertrail's field
TIMEOUT_S = 10.0
CHOICE_FIELD = "launch"                          # launch=2: the second of the training commands a script starts
HANDED_ON = "#HANDED_ON"                         # a ModelZoo launch recorded whole (launch_script.bash)
_PRELUDE = Path(__file__).with_name("launch_script.bash")
_FIELD = re.compile(r"[a-z][a-z0-9_.]*=")        # hardware=h100: expertrail's field, not the script's argument
_SHEBANG = re.compile(rb"#!\s*\S*(bash|/sh|env\s+(ba)?sh)\b")


def script_at(tokens: list) -> int | None:
    """The index of the launch script among command-line ``tokens``, or None: a path ending in
    .sh (.bash, .sbatch, .slurm), or, first on the line or after a shell, sbatch or a
    ``NAME=value``, an existing file whose first line is a ``#!`` naming bash or sh. The
    ModelZoo's benchmarking scripts are read by `modelzoo.launch_arguments` instead."""
    words = [str(t).strip() for t in tokens]
    for i, word in enumerate(words):
        path = Path(word)
        if path.name in LAUNCH_SCRIPTS or word.startswith("-") or "=" in word:
            continue
        if path.suffix in SUFFIXES:
            return i
        if i == 0 or words[i - 1] in SHELLS | {"sbatch"} or SHELL_VARIABLE.match(words[i - 1]):
            try:
                with path.open("rb") as f:
                    if _SHEBANG.match(f.readline()):
                        return i
            except OSError:
                continue
    return None


def script_launch(tokens: list) -> list:
    """``tokens`` with a launch script (``[NAME=value ...] [bash | sh | sbatch [options]] FILE
    [arguments]``: its arguments are every word after it but a lower-case ``key=value``, which
    stays a field, ``hardware=h100``) replaced by the arguments of the training command it starts
    and the GPUs it starts it on (``gpus_per_node``, ``num_nodes``), and `LAUNCH_FIELD` saying what
    was read; ``tokens`` as they are where they name none."""
    at = script_at(tokens)
    if at is None:
        return list(tokens)
    words = [str(t).strip() for t in tokens]
    path = Path(words[at])
    if not path.is_file():
        raise ConfigError(f"launch script {words[at]!r} not found: give the path of the script that starts the run "
                          "(expertrail reads it with bash, running none of its commands)")
    arguments = [w for w in words[at + 1:] if not _FIELD.match(w)]
    launched, sbatch_options = at, []
    if "sbatch" in words[:at]:
        launched = max(i for i in range(at) if words[i] == "sbatch")
        sbatch_options = words[launched + 1:at]
    start = launch_start(words, launched)
    variables = [w for w in words[start:at] if SHELL_VARIABLE.match(w)]
    given = shell_variables(variables)
    job = {**slurm_sizes(_directives(path.read_text(errors="replace"))), **slurm_sizes(sbatch_options)}
    environment = {**_slurm_environment(job), **given}
    fields = [w for w in words[at + 1:] if _FIELD.match(w) and not w.startswith(f"{CHOICE_FIELD}=")]
    choice = next((w.partition("=")[2] for w in words[at + 1:] if w.startswith(f"{CHOICE_FIELD}=")), None)
    commands, printed = recorded_commands(path, arguments, environment)
    command = training_command(path, commands, printed, choice)
    if command[0] == HANDED_ON:                 # a ModelZoo launch: its reader builds the arguments
        zoo = launch_at(command)
        read = (f"{LAUNCH_FIELD}={path} starts {Path(command[zoo]).name} (the ModelZoo's) with "
                f"{len(command) - zoo - 1} arguments")
        return [*words[:start], *command[1:], read, *fields]
    begin, options, _ = launcher_at(command)
    script = next((k for k in range(options, len(command)) if command[k].endswith(".py")), options - 1)
    read = (f"{LAUNCH_FIELD}={path} starts {' '.join(command[begin:script + 1])} with {len(command) - script - 1} "
            "arguments")
    return [*words[:start], *run_environment(variables), *_launch_arguments(command, commands, job), read, *fields]


def recorded_commands(path: Path, arguments: list, environment: dict, timeout: float | None = None) -> tuple:
    """(every command the shell script at ``path`` would start given ``arguments`` and only
    ``environment`` as its environment, in order, each as its words; what it printed, output
    and errors together): bash runs it restricted, with no program it could start (module docstring),
    for at most ``timeout`` seconds (`TIMEOUT_S`)."""
    timeout = TIMEOUT_S if timeout is None else timeout
    bash = _bash(path)
    with tempfile.TemporaryDirectory() as nowhere, tempfile.TemporaryFile() as record:
        env = {"PATH": nowhere, "HOME": nowhere, "BASH_ENV": str(_PRELUDE),
               "EXPERTRAIL_RECORD_FD": str(record.fileno()), "EXPERTRAIL_HANDED_ON": " ".join(LAUNCH_SCRIPTS),
               "EXPERTRAIL_HANDED_ON_VARIABLES": " ".join(LAUNCH_VARIABLES), **environment}
        shell = subprocess.Popen([bash, "-r", str(path), *arguments], env=env,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 pass_fds=(record.fileno(),), start_new_session=True)
        try:
            printed, _ = shell.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(shell.pid, signal.SIGKILL)        # the script's subshells too
            shell.communicate()
            raise ConfigError(f"launch script {path} still ran after {timeout:g} s with none of its commands started "
                              "(a loop that waits on a job?): give the training command it runs instead") from None
        record.seek(0)
        parts = record.read().split(b"\0")
    commands, current = [], {}                  # pieces by process (launch_script.bash)
    for pid, tag, text in zip(parts[0::3], parts[1::3], parts[2::3]):
        if tag == b"c":
            current[pid] = []
            commands.append(current[pid])
        elif tag == b"w":
            current[pid].append(text)
        else:
            current[pid][-1] += text            # a piece may end inside a character: decoded whole below
    commands = [[word.decode(errors="replace") for word in command] for command in commands]
    return commands, printed.decode(errors="replace").strip()


@lru_cache(maxsize=1)
def _bash_version(bash: str) -> int:
    """The major version of the bash at ``bash``."""
    out = subprocess.run([bash, "-c", "echo ${BASH_VERSINFO[0]}"], capture_output=True, text=True, timeout=10)
    return int(out.stdout.strip() or 0)


def _bash(path: Path) -> str:
    """The bash that reads launch scripts: one on PATH, version 4 or newer (its
    command_not_found_handle and BASHPID), else a ConfigError saying so."""
    bash = shutil.which("bash")
    instead = "give the training command it runs instead (torchrun ... pretrain_gpt.py --megatron-flag ...)"
    if bash is None:
        raise ConfigError(f"reading launch script {path} needs bash, which is not on PATH: {instead}")
    if _bash_version(bash) < 4:
        raise ConfigError(f"reading launch script {path} needs bash 4 or newer, and {bash} is "
                          f"{_bash_version(bash)}.x (macOS's own): put a newer bash first on PATH, or {instead}")
    return bash


def training_command(path: Path, commands: list, printed: str = "", choice: str | None = None) -> list:
    """The training run among a script's ``commands``: the Python launch among them
    (`launch_line.launcher_at`), or where there are several, the one of a ``pretrain*.py``
    script; else a ModelZoo launch the script hands on (`HANDED_ON`). Where several remain,
    ``choice`` (`CHOICE_FIELD`'s value, from 1) picks one; a ConfigError naming what the script
    runs (and the last line it ``printed``: why it stopped, where it did) where none remain, or
    several and no choice."""
    launches = [c for c in commands if launcher_at(c) is not None]
    pretrain = [c for c in launches if any(re.match(r"pretrain\w*\.py$", Path(w).name) for w in c)]
    handed_on = [c for c in commands if c and c[0] == HANDED_ON]
    distinct = list(dict.fromkeys(map(tuple, pretrain or launches or handed_on)))
    if choice is not None and distinct:
        if not choice.isdigit() or not 1 <= int(choice) <= len(distinct):
            raise ConfigError(f"{CHOICE_FIELD}={choice}: launch script {path} starts {len(distinct)} training "
                              f"command(s): give {CHOICE_FIELD}=N with N from 1 to {len(distinct)}")
        return list(distinct[int(choice) - 1])
    if len(distinct) == 1:
        return list(distinct[0])
    if distinct:
        first = next((i for i, words in enumerate(zip(*distinct)) if len(set(words)) > 1), min(map(len, distinct)) - 1)
        shown = "; ".join(f"{n}: ... " + " ".join(c[max(first - 1, 0):first + 1]) + " ..."
                          for n, c in enumerate(distinct, 1))
        raise ConfigError(f"launch script {path} starts {len(distinct)} training commands ({shown}): give "
                          f"{CHOICE_FIELD}=N after the script to read the N-th, or the one to read as its own line")
    ran = ", ".join(dict.fromkeys(c[0] for c in commands if c)) or "no command"
    if re.search(r"\bPATH: readonly variable", printed or ""):
        raise ConfigError(f"launch script {path} sets PATH, which stays fixed while expertrail reads a script (so that "
                          "no program it names can run): read a copy without that line, or give the training "
                          "command it runs instead (torchrun ... pretrain_gpt.py --megatron-flag ...)")
    unbound = re.search(r"(\w+): unbound variable", printed or "")
    if unbound:                     # set -u and a variable the node's environment gives (a data path)
        raise ConfigError(f"launch script {path} stopped at {unbound.group(1)}, a variable it reads unset (set -u): "
                          f"set it before the script, as the node's environment would ({unbound.group(1)}=... bash "
                          f"{path}; a data or checkpoint path's value does not change the estimate)")
    raise ConfigError(f"launch script {path} starts no Python training command (torchrun, python ... .py): it runs "
                      f"{ran}" + (f"; it printed last: {printed.splitlines()[-1]}" if printed else "")
                      + ". Give the training command it runs instead (torchrun ... pretrain_gpt.py --megatron-flag ...)")


def _launch_arguments(command: list, commands: list, job: dict) -> list:
    """A recorded training ``command``'s script arguments on its GPUs (`launch_line.
    script_arguments`): an srun starts it on its line, or it runs in the ``bash -c`` string of the
    last srun recorded before it; its job is ``job`` (the script's own allocation) or that of an
    sbatch recorded before it. A Python no srun starts is one process: no GPUs stated."""
    start = launcher_at(command)[0]
    before = commands[:max(i for i, c in enumerate(commands) if c == command)]
    own = srun_options(command[:start])
    sizes, srun = dict(job), own
    for k, words in enumerate(before):
        if words and Path(words[0]).name == "sbatch":
            script = before[k + 1][1] if k + 1 < len(before) and before[k + 1][0] == "#SBATCH" else ""
            sizes = {**job, **slurm_sizes(_directives(script)), **slurm_sizes(words[1:])}
        elif own is None and srun_options(words) is not None:
            srun = srun_options(words)
    if srun is None:
        return script_arguments(command[start:])
    return script_arguments(command[start:], job={**sizes, **slurm_sizes(srun)})


def _directives(script: str) -> list:
    """The options of a batch script's ``#SBATCH`` lines, which sbatch reads up to its first
    command."""
    options = []
    for line in script.splitlines()[1:]:
        line = line.strip()
        if line and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            options += line.split("#", 2)[1].split()[1:]
    return options


def _slurm_environment(sizes: dict) -> dict:
    """The variables Slurm sets in a job of ``sizes``, which launch scripts read
    (``NNODES=${SLURM_NNODES:-1}``)."""
    env = {}
    if "nodes" in sizes:
        env.update(SLURM_NNODES=str(sizes["nodes"]), SLURM_JOB_NUM_NODES=str(sizes["nodes"]))
    if "tasks_per_node" in sizes:
        env["SLURM_NTASKS_PER_NODE"] = str(sizes["tasks_per_node"])
    if "gpus_per_node" in sizes:
        env.update(SLURM_GPUS_ON_NODE=str(sizes["gpus_per_node"]), SLURM_GPUS_PER_NODE=str(sizes["gpus_per_node"]))
    return env
