"""`expertrail bench` end to end on 4 real local ranks at a tiny size."""
import json
import subprocess
import sys

import pytest
import torch

from expertrail import BACKENDS

pytestmark = pytest.mark.multirank

TINY = ["--world", "4", "--hidden", "64", "--tokens", "48", "--experts", "8", "--topk", "2",
        "--iters", "2", "--warmup", "1", "--no-progress"]


def bench(*args, check=True):
    return subprocess.run([sys.executable, "-m", "expertrail", "bench", *TINY, *args],
                          capture_output=True, text=True, timeout=300, check=check)


def test_bench_json_plot_and_overlap(tmp_path):
    out = bench("--domain-size", "2", "--routing", "balanced", "--chunks", "2", "--expert-ffn", "32",
                "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["domain_size"] == 2 and report["config"]["routing"] == "balanced"
    assert set(report["results"]) == set(BACKENDS)
    for name, r in report["results"].items():
        assert r["check"] == "passed"
        for key in ("dispatch_s", "combine_s", "total_s", "bare_total_s"):
            assert 0 < r[key]["min"] <= r[key]["median"] <= r[key]["max"]
        assert r["ratio_to_bare"] > 0 and r["algorithm_bandwidth_GBps"] > 0
        assert set(r["dispatch_bytes"]) == {"self", "intra", "inter"}
        assert r["overlap"]["identical"] and r["overlap"]["chunks"] == 2
        # tiny runs: alltoall sends one block per peer and permutes; no backend lands in place
        assert r["lands_in_place"] is False
        assert name in out.stdout
    rows = {n: r["dispatch_rows"] for n, r in report["results"].items()}
    assert rows["dedup"]["intra"] + rows["dedup"]["inter"] <= rows["alltoall"]["intra"] + rows["alltoall"]["inter"]
    assert rows["hierarchical"]["inter"] <= rows["dedup"]["inter"]
    png = (tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_replays_a_routing_file_with_domain_size_one(tmp_path):
    routing = torch.randint(0, 8, (4, 48, 2))
    routing[1] = -1                      # a rank whose tokens all go nowhere
    torch.save(routing, tmp_path / "route.pt")
    bench("--domain-size", "1", "--routing", str(tmp_path / "route.pt"), "--backends", "alltoall,hierarchical",
          "--json", str(tmp_path / "r.json"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["results"]) == {"alltoall", "hierarchical"}
    assert all(r["check"] == "passed" for r in report["results"].values())


def test_bench_reports_bad_options_clearly():
    out = bench("--routing", "nonsense", check=False)
    assert out.returncode == 2 and "not uniform, zipf:<alpha>, balanced, nor an existing file" in out.stderr
    out = bench("--backends", "alltoall,ring", check=False)
    assert out.returncode == 2 and "unknown ['ring']" in out.stderr


def test_bench_on_one_rank_has_no_transport_to_compare_with(tmp_path):
    out = bench("--world", "1", "--domain-size", "1", "--backends", "alltoall,dedup", "--json", str(tmp_path / "r.json"))
    report = json.loads((tmp_path / "r.json").read_text())
    assert all(r["check"] == "passed" and r["ratio_to_bare"] is None for r in report["results"].values())
    row = next(line for line in out.stdout.splitlines() if line.startswith("alltoall")).split()
    assert row[6] == "-", out.stdout                   # the x bare column


def test_bench_decode_writes_p50_and_p99_per_mode_and_size(tmp_path):
    path = tmp_path / "decode.json"
    out = subprocess.run([sys.executable, "-m", "expertrail", "bench", "--decode", "--world", "2", "--hidden", "64",
                          "--experts", "8", "--topk", "2", "--iters", "5", "--json", str(path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(path.read_text())
    assert set(report["results"]) == {"normal", "lowlatency", "bare"}
    for mode, sizes in report["results"].items():
        assert set(sizes) == {"1", "8", "32", "128"}, mode
        for size, r in sizes.items():
            assert 0 < r["p50_s"] <= r["p99_s"], (mode, size)
    assert report["lowlatency_equals_normal"] is True
    assert "lowlatency output equals the normal mode's: yes" in out.stdout
