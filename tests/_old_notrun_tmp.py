"""Every command shown in README.md and docs/ runs, at small sizes, and ends as the text says.

A command is a line of a fenced code block (a leading ``$ `` dropped, backslash-continued lines
joined) or an inline code span that `COMMAND` matches: `./run.sh <verb>`, a program under
`.venv/bin/`, `torchrun ...`, `python ...`, or `expertrail <command>` with arguments (a bare
`expertrail plan` in a sentence names the command, and a synopsis with placeholders such as
`cluster down NAME | --all` describes one: neither is one to copy). A trailing
``# exit N`` says the status it must end with (0 otherwise).

Each runs from the repository root as written, with `.venv/bin/` pointed at this test's Python
environment, output files (`--json`, `--plot`, `--emit-hardware`, `--timeline`) sent to a temporary folder, and the size options
of `SMALL` appended (argparse keeps the last value of an option); commands that then run alike
(`same_run`) run once, as do commands that differ only in the output files they ask for
(`distinct_runs`), so the whole list takes a few minutes on 2 cores. The planner's commands (torch-free, milliseconds each) run in this process.
A command that cannot run here says why in `NOT_RUN`.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from expertrail.tools.cli import main

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^([A-Z_]+=\S* )*(\./run\.sh [a-z]|\.venv/bin/[a-z]|torchrun |python3? |expertrail [a-z-]+ )")
# A synopsis, not a command: placeholders (NAME, <node 0>, ...), alternatives (a|b), optional parts.
SYNOPSIS = re.compile(r"<[^>]+>|\||\[|(^|\s)[A-Z][A-Z_]*(\.\w+)?(\s|$)|(^|\s)\.\.\.(\s|$)")
IN_PROCESS = ("plan", "simulate", "validate", "balance", "estimate")

# Appended to a command that matches the pattern (first match wins): the sizes that keep it quick.
SMALL = [
    (r"expertrail bench|run\.sh bench", "--tokens 32 --hidden 16 --experts 8 --topk 2 --iters 1 --warmup 1 "
                                        "--no-progress"),
    (r"expertrail train.*--overlap", "--steps 8 --world 2 --backends dedup --hidden 16 --ffn 16 --seq 8 --batch 2 "
                                      "--micro-batches 2"),
    (r"expertrail train", "--steps 20 --world 2 --backends dedup"),
    (r"expertrail serve-sim", "--world 2 --steps 8 --rebalance-every 3 --window 3 --drift-every 4 --experts 8 "
                              "--redundant 2 --topk 2 --hidden 16 --ffn 16 --tokens 8"),
    (r"benchmarks/(phases|cpu_time|combine_flags)\.py", "--tokens 64 --hidden 8 --iters 2 --warmup 1"),
    (r"benchmarks/layouts\.py", "--shrink 256 --iters 2 --warmup 1"),
    (r"benchmarks/overlap_phases\.py", "--hidden 16 --ffn 16 --seq 8 --batch 2 --steps 2"),
    (r"benchmarks/messages\.py", "--rows-per-peer 16 --hidden 8 --iters 2 --warmup 1"),
    (r"benchmarks/soak\.py", "--iters 30 --warmup 10"),
    (r"benchmarks/user_process\.py.*--soak", "--tokens 256 --hidden 64 --soak 20"),
    (r"benchmarks/user_process\.py", "--tokens 256 --hidden 64 --iters 2"),
    (r"benchmarks/balance_quality\.py", "--layers 2"),
    (r"benchmarks/gpu_lowlatency\.py", "--tokens 1,8 --hidden 64 --iters 2"),
]
# Options naming an output file: sent to the test's temporary folder.
OUTPUTS = ("--json", "--plot", "--emit-hardware", "--timeline")
# Commands that build an emulated cluster (network namespaces): they need root, as in CI.
NEEDS_NAMESPACES = re.compile(r"expertrail (cluster |(bench|train) .*--nodes)")
# Commands shown in the docs that this test does not run, and why.
NOT_RUN = {
    "./run.sh test": "the suite itself",
    ".venv/bin/python benchmarks/gpu_kernels.py": "needs a CUDA device",
    ".venv/bin/python -m pytest tests/multirank/test_hf_world4.py tests/test_hf.py -q": "part of the suite itself",
    ".venv/bin/python examples/quickstart.py": "run by tests/test_examples.py, which also checks its output",
    ".venv/bin/expertrail bench --nodes 4 --ranks-per-node 2 --tokens 64 --hidden 64 --iters 2":
        "run (smaller) by tests/test_cluster.py::test_bench_on_four_nodes_of_two_is_correct, which also checks "
        "that every backend passed",
    ".venv/bin/python examples/hf_expert_parallel.py": "run by tests/test_examples.py, which also checks its output",
    ".venv/bin/python benchmarks/cpu_time.py": "run as documented by tests/test_profile_scripts.py, which also checks "
                                                "its table",
    ".venv/bin/python benchmarks/layouts.py": "run with the same sizes by tests/test_profile_scripts.py, which also "
                                              "checks its table",
    ".venv/bin/python benchmarks/messages.py": "run with the same sizes by tests/test_profile_scripts.py, which also "
                                               "checks its table",
    ".venv/bin/expertrail train": "run as documented (every backend, 4 ranks, 20 steps) by tests/test_train_cli.py::"
                                  "test_train_matches_single_process_for_every_backend, which also checks the losses",
    "expertrail train --overlap --steps 3 --hidden 256 --ffn 8 --topk 8 --experts 16 --seq 64 --batch 8":
        "shrunk for the test it is the `expertrail train --overlap --json` run (which runs) with top-8 of 16 experts, "
        "which the emulated-cluster train command (which runs) passes too",
    "expertrail bench --iters 30 --backends alltoall,dedup":
        "shrunk for the test it is `./run.sh bench` (which runs every backend) with two of the backends",
    "expertrail bench --decode":
        "run (smaller, the same default dtype) by tests/test_bench_cli.py::test_bench_decode_writes_p50_and_p99_per_"
        "mode_and_size, which also checks its JSON; the documented bf16 decode commands run",
    "expertrail train --overlap --steps 4 --hidden 256 --ffn 8 --topk 8 --experts 16 --seq 64 --batch 8 --nodes 2 "
    "--ranks-per-node 2 --inter-link 1gbit,queue=5ms":
        "the `--inter-link 1gbit` train run (which runs) with a shallower shaper queue; that a queue setting "
        "reaches tc is checked by tests/test_cluster.py::test_two_nodes_launch_like_a_multinode_job_and_shape_"
        "the_inter_node_link, and parsing it by test_cluster.py's LinkSpec cases",
}


def documented_commands(path: Path) -> list[tuple[str, int]]:
    """(command, expected exit status) for every command a reader of ``path`` would copy, in
    order of appearance, each once."""
    lines, found, fenced, i = path.read_text().splitlines(), [], False, 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            line = line[2:] if line.startswith("$ ") else line
            while line.endswith("\\") and i < len(lines):
                line = line[:-1].rstrip() + " " + lines[i].strip()
                i += 1
            found.append(line)
        else:
            found += re.findall(r"(?<!`)`([^`]+)`(?!`)", line)
    commands = []
    for line in found:
        status = re.search(r"#\s*exit\s+(\d+)\s*$", line)
        command = re.sub(r"\s+#.*$", "", line).strip()
        entry = (command, int(status.group(1)) if status else 0)
        synopsis = SYNOPSIS.search(re.sub(r"^([A-Z_]+=\S* )*", "", command))
        if COMMAND.match(command) and not synopsis and entry not in commands:
            commands.append(entry)
    return commands


def runnable(command: str, tmp: Path) -> list[str]:
    """``command`` as argv, run from the repository root with this test's environment."""
    bin_dir = str(Path(sys.executable).parent) + "/"
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = bin_dir + argv[0][len(".venv/bin/"):]
    elif argv[0] in ("expertrail", "torchrun", "python", "python3"):
        argv[0] = bin_dir + argv[0]
    for i, arg in enumerate(argv[:-1]):
        if arg in OUTPUTS:
            argv[i + 1] = str(tmp / Path(argv[i + 1]).name)
    for pattern, extra in SMALL:
        if re.search(pattern, command):
            argv += extra.split()
            break
    return argv


ALL = sorted({entry for doc in DOCUMENTS for entry in documented_commands(doc)})


def same_run(command: str) -> tuple:
    """What running ``command`` here does: its words less the options `SMALL` overrides and the
    output paths (sent to a temporary folder anyway; which outputs are asked for stays in).
    Commands with the same key run alike, so the test runs the first of them only; a command
    whose key differs from another's only by asking for fewer outputs runs within that one
    (`distinct_runs`)."""
    extra = next((e.split() for pattern, e in SMALL if re.search(pattern, command)), [])
    overridden = {a for a in extra if a.startswith("--")}
    words, key, skip = shlex.split(command), [], False
    words[0] = words[0].removeprefix(".venv/bin/")          # the same program either way (`runnable`)
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        if word in overridden or word in OUTPUTS:
            skip = i + 1 < len(words) and not words[i + 1].startswith("--")
            if word in OUTPUTS:
                key.append(word)
            continue
        key.append(word)
    return tuple(key)


def distinct_runs(entries: list) -> list:
    """One command per way of running: commands with the same `same_run` key run once (the
    first of them), and commands that differ only in which outputs they ask for run as one
    command asking for all of those outputs (the first such command, with the output options
    the others add appended)."""
    def split(command):
        key = same_run(command)
        return tuple(w for w in key if w not in OUTPUTS), {w for w in key if w in OUTPUTS}

    runs = {}                  # (words, status) -> [command to run, the outputs it asks for]
    for command, status in entries:
        words, outputs = split(command)
        if (words, status) not in runs:
            runs[(words, status)] = [command, outputs]
            continue
        run = runs[(words, status)]
        argv = shlex.split(command)
        for option in sorted(outputs - run[1]):
            run[0] += f" {option} {argv[argv.index(option) + 1]}"
            run[1].add(option)
    return sorted((command, status) for (_, status), (command, _) in runs.items())


def test_the_docs_show_commands_and_every_exclusion_is_still_shown():
    commands = {c for c, _ in ALL}
    assert len(commands) > 25 and any(status for _, status in ALL), ALL
    assert set(NOT_RUN) <= commands, set(NOT_RUN) - commands
    assert {"./run.sh bench", ".venv/bin/python examples/quickstart.py"} <= commands


def test_extraction_joins_continuations_and_reads_the_expected_status(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Run `expertrail plan --ep 8` or `expertrail plan` (a name).\n\n```\n"
                   "$ expertrail validate a=1 \\\n    b=2   # exit 1\noutput line\n```\n")
    assert documented_commands(doc) == [("expertrail plan --ep 8", 0), ("expertrail validate a=1 b=2", 1)]
    doc.write_text("`expertrail cluster down NAME | --all`, `expertrail bench --nodes N`, `torchrun --rdzv <node 0>`, "
                   "`expertrail bench --emit-hardware PATH.yaml`, `expertrail bench --tokens 8`\n")
    assert documented_commands(doc) == [("expertrail bench --tokens 8", 0)]


def test_commands_differing_only_in_their_outputs_run_as_one():
    runs = distinct_runs([(".venv/bin/expertrail bench --dtype bf16", 0),
                          ("expertrail bench --dtype bf16 --json a.json", 0),
                          ("expertrail bench --dtype bf16 --json b.json --plot b.png", 0),
                          ("expertrail bench --dtype bf16 --plot c.png --timeline c.png", 0),
                          ("expertrail bench --dtype bf16 --json d.json", 2), ("expertrail bench --dtype fp32", 0)])
    assert runs == sorted([(".venv/bin/expertrail bench --dtype bf16 --json a.json --plot b.png --timeline c.png", 0),
                           ("expertrail bench --dtype bf16 --json d.json", 2), ("expertrail bench --dtype fp32", 0)])


@pytest.mark.parametrize("command,status", distinct_runs([e for e in ALL if e[0] not in NOT_RUN]), ids=lambda v: str(v))
def test_documented_command_runs(command, status, tmp_path, monkeypatch, capsys):
    if NEEDS_NAMESPACES.search(command):
        from expertrail.emulation.cluster import ClusterError, check_prerequisites
        try:
            check_prerequisites()
        except ClusterError as err:
            pytest.skip(f"needs an emulated cluster: {err}")
    argv = runnable(command, tmp_path)
    if Path(argv[0]).name == "expertrail" and argv[1] in IN_PROCESS:
        monkeypatch.chdir(ROOT)
        try:
            rc = main(argv[1:])
        except SystemExit as exit_:
            rc = exit_.code
        out = capsys.readouterr()
        stdout, stderr = out.out, out.err
    else:
        done = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        rc, stdout, stderr = done.returncode, done.stdout, done.stderr
    assert rc == status, f"{command} -> {rc}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    if Path(argv[0]).name == "expertrail" and argv[1] in IN_PROCESS:
        # (launched commands may show torchrun's own logged tracebacks, e.g. an agent's exit
        # barrier racing the store host's exit; their status is what counts there)
        assert "Traceback" not in stderr, stderr[-3000:]
