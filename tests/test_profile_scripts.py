"""The CPU profiling probes that docs/benchmarks.md cites run and print their tables (tiny sizes)."""
import json
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


def test_small_exchanges_times_both_transports_for_every_size():
    lines = _run("small_exchanges.py", "--ranks", "2", "--sizes", "64,4096", "--compute-ms", "0", "--iters", "2",
                 "--warmup", "1")
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["64", "4096"]
    assert all(len(r) == 8 and float(r[1]) > 0 and float(r[4]) > 0 and float(r[7]) > 0 for r in rows)


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


def test_user_process_record_shows_what_it_printed(tmp_path):
    from expertrail.tools.records import user_process_table
    path = tmp_path / "up.json"
    lines = _run("user_process.py", "--tokens", "64", "--hidden", "16", "--iters", "2", "--backends", "alltoall",
                 "--json", str(path))
    record = json.loads(path.read_text())
    assert record["command"].startswith(".venv/bin/python benchmarks/user_process.py --tokens 64")
    assert record["machine"]["cores"] > 0 and record["date"] and len(record["per_rank"]) == 4
    assert len(record["code"]["commit"]) == 40 and isinstance(record["code"]["src_changed"], list)
    assert "\n".join(lines) + "\n" == user_process_table(record)
    assert [line.split("|")[1].strip() for line in lines[3:]] == ["bare", "floor", "alltoall"]


PEER = '''import os
print("torch 0 megatron-core 0")
for dtype, ms in (("float32", 30.0), ("bfloat16", 20.0)):
    for kind in ("alltoall", "allgather"):
        print(f"[timing] megatron {kind:9s} dispatch+scale+combine T={os.environ['BENCH_TOKENS']}/rank "
              f"H={os.environ['BENCH_HIDDEN']} E=16 topk=2 EP=4 torch.{dtype}: {ms:.1f} ms/iter")
'''


def test_against_megatron_reads_the_peers_timings_beside_user_process(tmp_path):
    from expertrail.tools.records import against_megatron_table
    peer, path = tmp_path / "peer.py", tmp_path / "against.json"
    peer.write_text(PEER)
    lines = _run("against_megatron.py", "--peer-python", sys.executable, "--peer-script", str(peer), "--tokens", "64",
                 "--hidden", "16", "--iters", "2", "--json", str(path))
    record = json.loads(path.read_text())
    assert record["peer"]["ms"] == {"alltoall": {"fp32": 30.0, "bf16": 20.0}, "allgather": {"fp32": 30.0, "bf16": 20.0}}
    assert "BENCH_TOKENS=64" in record["peer"]["command"] and set(record["expertrail"]) == {"fp32", "bf16"}
    assert "\n".join(lines) + "\n" == against_megatron_table(record)
    assert [line.split("|")[1].strip() for line in lines[3:]] == ["fp32", "bf16"]
    assert lines[3].split("|")[2].strip().startswith("30.0 ms")


def test_pipeline_trace_prints_its_record_and_every_piece(tmp_path):
    """benchmarks/pipeline_trace.py on 4 local ranks in 2 domains: the printed report is its
    record rendered, and the traced call of 3 pieces shows each rail piece land and move on,
    dispatch, and each piece's sums sent back."""
    from expertrail.tools.records import render
    path = tmp_path / "trace.json"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(SCRIPTS / "pipeline_trace.py"), "--domain-size", "2", "--tokens", "32", "--hidden", "16", "--experts", "8",
                          "--topk", "2", "--iters", "2", "--chunks", "1", "3", "--min-rows", "1", "--json", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads(path.read_text())
    assert render("pipeline", record).strip().strip("`").strip() in out.stdout
    events = [what for _, what in record["runs"]["3"]["trace_ms"]]
    for j in range(3):
        assert f"rail piece {j} from domain 1 landed" in events
        assert f"combine: piece {j} for domain 1 summed and sent back" in events
    assert events.index("dispatch returned") < events.index("combine returned")
    assert record["runs"]["alltoall"]["median_s"] > 0 and record["config"]["domain_size"] == 2
