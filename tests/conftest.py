"""Test-wide settings.

The suite's tiers, one pytest marker each (``./run.sh test -m unit`` runs one):
- ``unit``: one process, no ranks: seconds for the whole tier (the default of a test
  outside tests/multirank/ that names no tier);
- ``multirank``: real gloo rank processes (tests/multirank/, and the commands that start
  local ranks: bench, train, the launcher);
- ``cluster``: emulated multi-node clusters (root, network namespaces);
- ``docs``: the commands and scripts README.md and docs/ show, run as a user runs them.

The Triton kernels are tested on the CPU through Triton's interpreter, which must be chosen
before anything imports triton.
"""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

TIERS = ("unit", "multirank", "cluster", "docs")


def pytest_configure(config):
    for tier, what in zip(TIERS, ("one process, no ranks", "real gloo rank processes",
                                  "emulated multi-node clusters (root, network namespaces)",
                                  "the documented commands and scripts, run as written")):
        config.addinivalue_line("markers", f"{tier}: {what}")


def pytest_collection_modifyitems(config, items):
    """Give every test exactly one tier: its own marker, else by where it lives."""
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} has several tiers {sorted(tiers)}: give it one")
        if not tiers:
            item.add_marker(pytest.mark.multirank if "multirank" in item.path.parts else pytest.mark.unit)
