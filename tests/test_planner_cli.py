"""The planner's command line (`plan`, `simulate`, `validate`): clear errors instead of tracebacks,
JSON with real types, help texts that list the catalogs and both names of each algorithm, a
closed pipe. (Every command the docs show runs in tests/test_documented_commands.py.)"""
import argparse
import json
import re
import subprocess
import sys

import pytest

from expertrail import cli
from expertrail.tools.cli import main
from expertrail.plan.architecture import MODELS
from expertrail.plan.catalog import HARDWARE

def run(capsys, *argv):
    """`expertrail ARGV` in this process: (exit status, stdout, stderr)."""
    try:
        rc = main(list(argv))
    except SystemExit as exit_:              # argparse's own errors and --help
        rc = exit_.code
    out = capsys.readouterr()
    return rc, out.out, out.err


PLAN = ["plan", "--hardware", "h100", "--model", "deepseek-v3"]
SIM = ["simulate", "--hardware", "h100", "--model", "deepseek-v3", "--tokens", "256"]


@pytest.fixture
def empty_dir(tmp_path):
    (tmp_path / "no-config").mkdir()
    return tmp_path / "no-config"


@pytest.mark.parametrize("argv,names", [
    (PLAN + ["--ep", "1"], "--ep 1"),
    (PLAN + ["--ep", "0"], "--ep"),
    (PLAN + ["--ep", "24"], "--ep 24"),
    (PLAN + ["--ep", "x"], "--ep"),
    (PLAN + ["--tokens", "0"], "--tokens"),
    (SIM + ["--tokens", "-5"], "--tokens"),
    (["simulate", "--hardware", "h100", "--model", "deepseek-v3", "--tokens", "0"], "--tokens"),
    (SIM + ["--ep", "24"], "--ep 24"),
    (SIM + ["--ep", "1"], "--ep 1"),
    (SIM + ["--ep", "8..x"], "--ep"),
    (SIM + ["--sms", "abc"], "--sms"),
    (SIM + ["--domain-size", "0"], "--domain-size"),
    (SIM + ["--domain-size", "3", "--ep", "8"], "--domain-size 3"),
    (SIM + ["--backends", "nccl"], "--backends"),
    (SIM + ["--routing", "zipf:abc"], "--routing"),
    (SIM + ["--routing", "grouped", "--model", "mixtral-8x7b", "--ep", "8"], "--routing grouped"),
    (["plan", "--hardware", "h1000", "--model", "deepseek-v3"], "--hardware 'h1000'"),
    (["plan", "--hardware", "h100", "--model", "{dir}"], "--model"),
    (["simulate", "--hardware", "{dir}", "--model", "deepseek-v3"], "--hardware"),
    (["validate"], "nothing to validate"),
    (["validate", "hardware=h1000", "expert_model_parallel_size=8"], "hardware='h1000'"),
])
def test_bad_arguments_give_one_clear_line_and_exit_2(argv, names, empty_dir, capsys):
    """Each of these used to end in a traceback (or pass silently)."""
    argv = [str(empty_dir) if a == "{dir}" else a for a in argv]
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (argv, out, err)
    assert "Traceback" not in err and names in err, err
    message = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert len(message) == 1 and message[0].startswith(f"expertrail {argv[0]}"), err


def test_model_directory_with_config_json_is_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "num_hidden_layers": 48}))
    rc, out, err = run(capsys, "plan", "--hardware", "h100", "--model", str(tmp_path), "--ep", "8", "--tokens", "512")
    assert rc == 0 and "qwen3_moe on h100" in out, err


def _strings(obj, path="$"):
    """Every string in a JSON document, with its path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _strings(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(obj, str):
        yield path, obj


@pytest.mark.parametrize("argv", [PLAN + ["--stage", "tune", "--json"], PLAN + ["--precision", "fp8", "--json"],
                                  ["plan", "--hardware", "gb200-nvl72", "--model", "qwen3-235b-a22b", "--json"],
                                  SIM + ["--ep", "8,16", "--sms", "8,16", "--json"],
                                  ["validate", "--expert-model-parallel-size", "8", "--num-experts", "64",
                                   "overlap_moe_expert_parallel_comm=true", "moe_router_topk=2.5", "--json"]])
def test_json_holds_booleans_and_numbers_not_their_reprs(argv, capsys):
    """`"ep_overlap": "True"` (a NumPy bool through str) is gone, everywhere."""
    rc, out, _ = run(capsys, *argv)
    assert rc in (0, 1)
    doc = json.loads(out)
    bad = [(p, s) for p, s in _strings(doc) if re.fullmatch(r"True|False|None|nan|-?\d+(\.\d+)?(e-?\d+)?", s)]
    assert bad == []
    if argv[0] == "plan":
        assert isinstance(doc["ep_overlap"], bool) and isinstance(doc["ep"], int)
        assert all(isinstance(p["dispatch_us"], float) for p in doc["predictions"].values())
    if argv[0] == "validate":
        assert doc["violations"][0]["fields"] == {"moe_router_topk": 2.5}


def _parser(command):
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cli.command_module(command).add_parser(sub)
    return sub.choices[command]


@pytest.mark.parametrize("command", ["plan", "simulate", "validate"])
def test_help_lists_catalogs_names_and_defaults(command, capsys):
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    text = " ".join(out.split())
    for words in ("hierarchical = DeepEP internode", "HybridEP on NVL36/NVL72", "dedup = DeepEP normal",
                  "deepep-ll = DeepEP low-latency"):
        assert words in text, words
    if command != "validate":
        assert all(name in text for name in [*HARDWARE, *MODELS])
    for action in _parser(command)._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, action.dest
        assert action.required or "default" in action.help, (action.dest, action.help)


def _broken_pipe(argv):
    """Run ``expertrail ARGV`` with its stdout a pipe whose reader has already left."""
    proc = subprocess.Popen([sys.executable, "-m", "expertrail", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()                     # before the command has written anything
    err = proc.stderr.read().decode()
    return proc.wait(timeout=120), err


def test_a_closed_pipe_ends_quietly():
    """`expertrail plan ... | head -1` printed a BrokenPipeError traceback."""
    for argv in (PLAN + ["--json"], SIM + ["--json"]):
        rc, err = _broken_pipe(argv)
        # the command's own status if it had finished writing, else 141 (128 + SIGPIPE, as the shell reports)
        assert err == "" and rc in (0, 141), (argv, rc, err)
