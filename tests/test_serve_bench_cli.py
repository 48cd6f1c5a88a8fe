"""`expertrail serve-bench`: its JSON contract on 4 local ranks at a tiny size, and its option checks."""
import json
import subprocess
import sys

import pytest

from expertrail.tools.cli import main

TINY = ["--ep", "4", "--rounds", "2", "--topic-every", "1", "--batch", "2", "--prompt-len", "3", "--new-tokens", "4",
        "--layers", "1", "--hidden", "32", "--experts", "8", "--topk", "2", "--vocab", "64", "--redundant", "4"]


@pytest.mark.multirank
def test_serve_bench_writes_the_contract(tmp_path):
    out = subprocess.run([sys.executable, "-m", "expertrail", "serve-bench", "--model", "tiny", *TINY,
                          "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["command"].startswith("expertrail serve-bench") and report["machine"]["cores"] > 0
    assert set(report["decode_p50_s"]) == {"buckets", "normal"} and all(v > 0 for v in report["decode_p50_s"].values())
    assert report["tokens_identical"] is True
    assert set(report["balancedness"]) == {"rebalanced", "static"}
    assert all(0 < v <= 1 for v in report["balancedness"].values())
    assert report["by_mode"]["buckets"]["decode:8"]["steps"] == 2 * 3          # 2 rounds x 3 decode steps
    assert "tokens identical: buckets vs normal yes" in out.stdout and (tmp_path / "r.png").stat().st_size > 0


@pytest.mark.unit
@pytest.mark.parametrize("args,message", [
    (["--buckets", "0,8"], "every bucket must be a positive int"),
    (["--buckets", "8,x"], "--buckets '8,x'"),
    (["--experts", "6"], "multiples of --ep 4"),
    (["--nodes", "2", "--ranks-per-node", "3"], "must equal --ep 4"),
    (["--skew", "-1"], "--skew -1.0"),
])
def test_serve_bench_names_the_bad_option(capsys, args, message):
    assert main(["serve-bench", *args]) == 2
    assert message in capsys.readouterr().err
