"""The CPU profiling probes that docs/benchmarks.md cites run and print their tables (tiny sizes)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

SCRIPTS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = ["--tokens", "64", "--hidden", "8", "--iters", "2", "--warmup", "1"]


def _run(name: str, *args: str) -> list:
    out = subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


def test_cpu_time_reports_every_rank_of_every_backend_and_its_bare_collectives():
    lines = _run("cpu_time.py", *TINY)                   # as docs/benchmarks.md runs it: the default backends
    backends = ("alltoall", "dedup", "hierarchical")
    rows = [line.split() for line in lines if line.startswith(backends)]
    assert [(r[0], r[1]) for r in rows] == [(b, str(k)) for b in backends for k in range(4)]
    assert all(len(r) == 9 and r[5] == "|" and float(r[2]) > 0 for r in rows)


@pytest.mark.parametrize("clock", ["wall", "thread"])
def test_phases_times_every_phase_on_every_rank(clock):
    lines = _run("phases.py", "--backend", "dedup", "--clock", clock, *TINY)
    assert f"({clock} clock)" in lines[0]
    total = next(line for line in lines if line.startswith("total")).split()
    assert len(total) == 5 and all(float(v) > 0 for v in total[1:])


def test_messages_compares_pieces_blocks_and_copies():
    lines = _run("messages.py", "--rows-per-peer", "16", "--hidden", "8", "--iters", "2", "--warmup", "1")
    assert [line.split()[0] for line in lines[1:]] == ["pieces", "blocks", "blocks+copy"]
    assert all(line.count("rank ") == 4 for line in lines[1:])


def test_layouts_times_both_alltoall_layouts_for_every_shape():
    lines = _run("layouts.py", "--shrink", "256", "--iters", "2", "--warmup", "1")
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 5 and all(r[-1] in ("runs", "blocks") for r in rows)
    assert all(float(r[-2]) > 0 for r in rows)          # blocks / runs


def test_combine_flags_times_combine_with_and_without_its_agreement():
    lines = _run("combine_flags.py", "--backend", "hierarchical", *TINY)
    assert lines[1].split()[:2] == ["combine", "no"]
    values = [float(v) for v in lines[2].split()]
    assert len(values) == 4 and all(v > 0 for v in values)
