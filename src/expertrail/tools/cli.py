"""The `expertrail` command: a registry of subcommands, each a module of `tools.commands` with
``add_parser(subparsers)`` and ``run(args) -> exit status``.

Every command module imports nothing heavy at import time, so ``expertrail validate`` and the
other planner commands run without loading torch. An `ExpertrailError` (bad options, a
configuration that cannot run) is one line and exit status 2; Ctrl-C is one line and 130; a
reader that leaves early (``expertrail plan ... | head -1``) ends the command quietly.
"""
from __future__ import annotations

import argparse
import os
import sys
from importlib import import_module

from ..errors import ExpertrailError

# command -> its module in tools.commands, in the order `expertrail --help` lists them
COMMANDS = {"bench": "bench", "train": "train", "validate": "validate", "simulate": "simulate", "plan": "plan",
            "estimate": "estimate", "balance": "balance", "serve-sim": "serve_sim",
            "serve-bench": "serve_bench", "cluster": "cluster"}


def command_module(command: str):
    return import_module(f"{__package__}.commands.{COMMANDS[command]}")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="expertrail", description="Expert-parallel dispatch and combine for MoE.")
    sub = top.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command_module(command).add_parser(sub)
    return top


def main(argv=None) -> int:
    """The `expertrail` command. A reader that leaves early ends it quietly: no traceback, the
    command's own status if it had finished, else 141 (128 + SIGPIPE, what the shell reports for
    a writer whose reader left)."""
    rc = 141
    try:
        rc = _main(argv)
        sys.stdout.flush()                  # a closed pipe shows here, not at interpreter exit
        return rc
    except KeyboardInterrupt as err:        # Ctrl-C: one line (what became of a cluster), no traceback
        print(f"expertrail: interrupted{f'; {err}' if str(err) else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        try:                                # later writes (the interpreter's final flush) go nowhere
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass                            # stdout is not a file (captured in tests)
        return rc


def _main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.argv_seen = list(sys.argv[1:] if argv is None else argv)[1:]     # after the command's name
    try:
        return command_module(args.command).run(args)
    except ExpertrailError as err:
        print(f"expertrail {args.command}: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        launch = sys.modules.get(f"{__package__.rpartition('.')[0]}.emulation.launch")   # loaded if ranks ran
        if launch is not None and isinstance(err, launch.RankError):
            first = min(err.errors)
            exc = err.errors[first][2]
            if isinstance(exc, ExpertrailError):
                print(f"expertrail {args.command}: rank {first}: {exc}", file=sys.stderr)
                return 2
        raise
