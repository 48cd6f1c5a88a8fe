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

Where a document shows what a command prints (the lines after a ``$ `` command in a fenced
block, up to the next ``$ `` line; a line ``...`` stands for lines left out), the test checks
that the command prints that: the planner's commands run at the documented sizes, in this
process, and their output is deterministic.

A command that cannot or need not run here is marked where it is shown, with the reason, in an
HTML comment (GitHub does not render it):

- a fenced block: ``<!-- not run: REASON -->`` on the line right before its opening fence marks
  every command in the block (so a block holds only commands that run, or only ones that don't);
- an inline command: the same comment written right after the code span's closing backtick,
  as in "`./run.sh test`<!-- not run: the suite itself -->". REASON may go on over the next
  lines, and must not contain ``--`` (Markdown would then print the comment).

A command marked in one place is marked wherever it is shown. `NOT_RUN` collects the markers
(command -> reason); `test_the_docs_show_commands_and_every_exclusion_is_still_shown` checks
that every marker names a reason and marks a command.
"""
from __future__ import annotations

import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

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
    (r"benchmarks/pipeline_trace\.py", "--tokens 64 --hidden 16 --experts 8 --topk 2 --iters 2 --min-rows 1"),
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
# A not-run marker (see the module docstring) and, to find misspelt ones, any HTML comment.
NOT_RUN_MARK = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->", re.S)
COMMENT_OR_SPAN = re.compile(r"<!--.*?-->|(?<!`)`([^`]+)`(?!`)")


class Shown(NamedTuple):
    """A command as a document shows it: ``not_run`` is its marker's reason, None if it runs."""
    command: str
    status: int
    not_run: str | None


def read_document(path: Path) -> tuple[list[Shown], list[str]]:
    """Every command a reader of ``path`` would copy, in order of appearance, each once, and what
    is wrong with its not-run markers (one line each: a marker that names no reason or marks no
    command, an inline reason with ``--``, a misspelt marker)."""
    lines, found, problems, markers = path.read_text().splitlines(), [], [], {}
    fenced, pending, block, i = False, None, None, 0      # pending: a marker line before a fence
    while i < len(lines):
        line, at = lines[i].strip(), f"{path.name}:{i + 1}"
        i += 1
        if line.startswith("```"):
            if not fenced:
                block, pending = pending, None
            fenced = not fenced
            continue
        if fenced:
            line = line[2:] if line.startswith("$ ") else line
            while line.endswith("\\") and i < len(lines):
                line = line[:-1].rstrip() + " " + lines[i].strip()
                i += 1
            found.append((line, block))
            continue
        while "<!--" in COMMENT_OR_SPAN.sub("", line) and i < len(lines):     # a comment goes on
            line += " " + lines[i].strip()
            i += 1
        if pending is not None:
            problems.append(f"{pending}: a not-run marker on a line of its own must be right before a fenced block")
            pending = None
        if NOT_RUN_MARK.fullmatch(line):
            pending = at
            markers[at] = NOT_RUN_MARK.fullmatch(line).group(1)
            continue
        span_end = None
        for m in COMMENT_OR_SPAN.finditer(line):
            if m.group(1) is not None:                                       # a code span
                found.append((m.group(1), None))
                span_end = m.end()
            elif NOT_RUN_MARK.fullmatch(m.group(0)):
                reason, where = NOT_RUN_MARK.fullmatch(m.group(0)).group(1), f"{at}:{m.start() + 1}"
                if "--" in reason:
                    problems.append(f"{where}: an inline not-run reason must not contain '--': {reason!r}")
                if span_end != m.start():
                    problems.append(f"{where}: an inline not-run marker must follow a code span directly")
                else:
                    found[-1] = (found[-1][0], where)
                    markers[where] = reason
            elif re.search(r"not[\s_-]*run", m.group(0), re.I):
                problems.append(f"{at}: not a not-run marker (write <!-- not run: REASON -->): {m.group(0)}")
    if pending is not None:
        problems.append(f"{pending}: a not-run marker on a line of its own must be right before a fenced block")
    shown, used = [], set()
    for line, marker in found:
        status = re.search(r"#\s*exit\s+(\d+)\s*$", line)
        command = re.sub(r"\s+#.*$", "", line).strip()
        synopsis = SYNOPSIS.search(re.sub(r"^([A-Z_]+=\S* )*", "", command))
        if not COMMAND.match(command) or synopsis:
            continue
        used.add(marker)
        entry = Shown(command, int(status.group(1)) if status else 0, markers.get(marker))
        if entry not in shown:
            shown.append(entry)
    problems += [f"{at}: this not-run marker marks no command" for at in markers if at not in used]
    problems += [f"{at}: this not-run marker names no reason" for at, reason in markers.items() if not reason]
    return shown, problems


def shown_outputs(path: Path) -> dict[str, list[str]]:
    """command -> the lines a document shows it printing: in a fenced block, a ``$ `` command
    (continuations joined, a trailing ``# exit N`` dropped) is followed by its output, up to the
    next ``$ `` line or the end of the block."""
    outputs, fenced, current, lines, i = {}, False, None, path.read_text().splitlines(), 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.strip().startswith("```"):
            fenced, current = not fenced, None
        elif fenced and line.startswith("$ "):
            command = line[2:].strip()
            while command.endswith("\\") and i < len(lines):
                command = command[:-1].rstrip() + " " + lines[i].strip()
                i += 1
            current = outputs.setdefault(re.sub(r"\s+#.*$", "", command).strip(), [])
        elif fenced and current is not None:
            current.append(line.rstrip())
    return outputs


def documented_commands(path: Path) -> list[Shown]:
    """(command, expected exit status, not-run reason or None) for every command a reader of
    ``path`` would copy, in order of appearance, each once."""
    return read_document(path)[0]


def first_causes(stderr: str, most: int = 12) -> str:
    """The lines of ``stderr`` that say why a rank died (a C++ abort, a rank's exception), which
    torchrun's own tracebacks push out of the tail a failure shows."""
    causes = [line for line in stderr.splitlines()
              if re.search(r"terminate called|what\(\)|^\[rank\d+\]:.*(Error|Exception)|^\w*(Error|Exception):", line)]
    return "first causes:\n" + "\n".join(causes[:most]) if causes else ""


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


READ = {doc: read_document(doc) for doc in DOCUMENTS}
OUTPUTS_SHOWN = {command: lines for doc in DOCUMENTS for command, lines in shown_outputs(doc).items()}
SHOWN = [entry for shown, _ in READ.values() for entry in shown]
ALL = sorted({(entry.command, entry.status) for entry in SHOWN})
# The commands the docs mark as not run here, and why (the first marker's reason).
NOT_RUN = {}
for _entry in SHOWN:
    if _entry.not_run is not None:
        NOT_RUN.setdefault(_entry.command, _entry.not_run)


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
    assert {"./run.sh bench", ".venv/bin/python examples/quickstart.py"} <= commands
    problems = [problem for _, found in READ.values() for problem in found]
    assert not problems, "\n".join(problems)
    assert NOT_RUN and all(reason.strip() for reason in NOT_RUN.values()), NOT_RUN
    unmarked = sorted({e.command for e in SHOWN if e.command in NOT_RUN and e.not_run is None})
    assert not unmarked, f"marked as not run in one place, shown unmarked in another: {unmarked}"


def test_extraction_joins_continuations_and_reads_the_expected_status(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Run `expertrail plan --ep 8` or `expertrail plan` (a name).\n\n```\n"
                   "$ expertrail validate a=1 \\\n    b=2   # exit 1\noutput line\n```\n")
    assert documented_commands(doc) == [("expertrail plan --ep 8", 0, None), ("expertrail validate a=1 b=2", 1, None)]
    doc.write_text("`expertrail cluster down NAME | --all`, `expertrail bench --nodes N`, `torchrun --rdzv <node 0>`, "
                   "`expertrail bench --emit-hardware PATH.yaml`, `expertrail bench --tokens 8`\n")
    assert documented_commands(doc) == [("expertrail bench --tokens 8", 0, None)]


def test_not_run_markers_mark_a_block_or_the_span_before_them(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("Try `expertrail bench --iters 2`<!-- not run: it is\nslow, see `expertrail bench -h` -->"
                   " and `expertrail bench --iters 3`.\n\n<!-- not run: needs a GPU -->\n```bash\n"
                   "expertrail bench --iters 4\n# a comment line\n```\n\n```\nexpertrail bench --iters 5\n```\n")
    assert read_document(doc) == ([("expertrail bench --iters 2", 0, "it is slow, see `expertrail bench -h`"),
                                   ("expertrail bench --iters 3", 0, None),
                                   ("expertrail bench --iters 4", 0, "needs a GPU"),
                                   ("expertrail bench --iters 5", 0, None)], [])
    doc.write_text("`a file`<!-- not run: no command -->, `expertrail bench --iters 2` <!-- not run: a gap -->\n"
                   "`expertrail bench --iters 3`<!-- not run: has --iters -->, `expertrail bench --iters 4`<!-- not-run: x -->"
                   "\n\n<!-- not run: a blank line follows -->\n\n```\nexpertrail bench --iters 5\n```\n"
                   "<!-- not run:    -->\n```\nexpertrail bench --iters 6\n```\n")
    shown, problems = read_document(doc)
    assert [s.not_run for s in shown] == [None, "has --iters", None, None, ""]
    assert [p.split(": ", 1)[1].split(" (")[0].split(":")[0] for p in problems] == [
        "an inline not-run marker must follow a code span directly",
        "an inline not-run reason must not contain '--'",
        "not a not-run marker",
        "a not-run marker on a line of its own must be right before a fenced block",
        "this not-run marker marks no command",
        "this not-run marker marks no command",
        "this not-run marker names no reason"], problems


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
    assert rc == status, f"{command} -> {rc}\n{stdout[-3000:]}\n{stderr[-3000:]}\n{first_causes(stderr)}"
    if Path(argv[0]).name == "expertrail" and argv[1] in IN_PROCESS:
        # (launched commands may show torchrun's own logged tracebacks, e.g. an agent's exit
        # barrier racing the store host's exit; their status is what counts there)
        assert "Traceback" not in stderr, stderr[-3000:]
    shown = OUTPUTS_SHOWN.get(command)
    if shown:                  # the doc shows what this command prints: it prints that (the planner's are exact)
        printed = [line.rstrip() for line in stdout.replace(str(tmp_path) + "/", "").rstrip("\n").split("\n")]
        assert shows(shown, printed), f"{command}: the doc shows another output than the command prints now:\n" + \
            "\n".join(difflib.unified_diff(shown, printed, "shown", "printed", lineterm=""))


def shows(shown: list, printed: list) -> bool:
    """Whether ``printed`` is what ``shown`` shows: the same lines, where a line ``...`` stands
    for lines left out (the first part starts the output, the others follow in order)."""
    while shown and not shown[-1]:
        shown = shown[:-1]
    parts, at = [], 0
    for line in shown + ["..."]:
        if line.strip() == "...":
            parts.append(shown[at:shown.index(line, at)] if line in shown[at:] else shown[at:])
            at += len(parts[-1]) + 1
    start = 0
    for n, part in enumerate(parts):
        found = next((i for i in range(start, len(printed) - len(part) + 1) if printed[i:i + len(part)] == part), None)
        if found is None or (n == 0 and found != 0):
            return False
        start = found + len(part)
    return len(parts) > 1 or start == len(printed)


def test_shown_output_may_leave_lines_out():
    printed = ["a", "b", "c", "d", "e"]
    assert shows(["a", "b", "c", "d", "e"], printed) and shows(["a", "b", "...", "d"], printed)
    assert shows(["a", "...", "c", "...", "e", ""], printed)
    assert not shows(["b", "...", "e"], printed) and not shows(["a", "b"], printed) and not shows(["a", "...", "x"], printed)
