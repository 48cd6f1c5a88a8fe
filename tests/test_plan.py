"""`expertrail plan`: recommendations with reasons, EP table, emitted configs that validate."""
import json
import subprocess
import sys

import pytest

from expertrail.plan.advisor import emit, plan
from expertrail.plan.catalog import HARDWARE, MODELS
from expertrail.plan.validate import load_config, validate


def test_h100_cross_node_recommends_the_two_level_deepep_path():
    r = plan(HARDWARE["h100"], MODELS["deepseek-v3"], ep=32, stage="tune")
    assert r["algorithm"] == "hierarchical" and (r["dispatcher"], r["flex_backend"]) == ("flex", "deepep")
    assert r["domain"] == 8
    times = {a: p["dispatch_us"] + p["combine_us"] for a, p in r["predictions"].items()}
    assert times["hierarchical"] == min(times.values()) and set(times) == {"alltoall", "dedup", "hierarchical"}
    assert all(a["reason"] for a in r["advice"])


def test_nvl72_recommends_hybridep_with_the_rack_as_domain():
    r = plan(HARDWARE["gb200-nvl72"], MODELS["qwen3-235b-a22b"], ep=64, stage="tune")
    assert r["flex_backend"] == "hybridep" and r["domain"] == 64
    sms = next(a for a in r["advice"] if a["topic"] == "SM count")
    assert sms["value"]["sweep"] == (16, 32)
    assert next(a for a in r["advice"] if a["topic"] == "FP8 recipe")["value"] == "MXFP8"


def test_bringup_inside_one_node_starts_with_alltoall():
    r = plan(HARDWARE["h100"], MODELS["qwen3-30b-a3b"], ep=8, stage="bringup")
    assert r["dispatcher"] == "alltoall"
    assert "bring-up" in next(a for a in r["advice"] if a["topic"] == "dispatcher")["reason"]


def test_ep_table_verdicts_follow_the_comm_to_compute_ratio():
    r = plan(HARDWARE["h100"], MODELS["deepseek-v3"])
    for row in r["ep_table"]:
        ratio = row["dispatch_combine_us"] / row["expert_gemm_us"]
        expected = "compute-bound" if ratio < 0.3 else "sweet spot" if ratio <= 1 else "communication-bound"
        assert row["verdict"] == expected
        assert row["tokens_per_expert"] == pytest.approx(4096 * 8 * row["ep"] / 256)
    chosen = next(a for a in r["advice"] if a["topic"] == "EP size")
    assert next(t for t in r["ep_table"] if t["ep"] == chosen["value"])["verdict"] != "communication-bound"


@pytest.mark.parametrize("hardware,model,ep", [("h100", "deepseek-v3", 32), ("gb200-nvl72", "deepseek-v3", 64),
                                               ("b200", "mixtral-8x7b", 8)])
def test_emitted_configs_pass_validation(hardware, model, ep):
    r = plan(HARDWARE[hardware], MODELS[model], ep=ep, stage="tune")
    bridge = [line for line in emit(r, MODELS[model], "bridge").splitlines() if not line.startswith("#")]
    values = load_config(None, bridge + [f"num_of_hybrid_ep_ranks_per_nvlink_domain={r['domain']}",
                                         f"hardware={hardware}"])
    assert validate(values) == []
    flags = emit(r, MODELS[model], "megatron")
    assert f"--expert-model-parallel-size {ep}" in flags and f"NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN={r['domain']}" in flags


def test_plan_cli_text_json_emit_without_torch():
    code = ("import sys; from expertrail.cli import main; "
            "rc = main(['plan', '--hardware', 'h100', '--model', 'qwen3-235b-a22b', '--stage', 'tune']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for text in ("recommendations:", "because", "EP choice", "pitfalls:", "keep the routing mode fixed"):
        assert text in out.stdout
    js = json.loads(subprocess.run([sys.executable, "-m", "expertrail", "plan", "--hardware", "b200", "--model",
                                    "mixtral-8x22b", "--json"], capture_output=True, text=True, timeout=120).stdout)
    assert js["ep"] in (4, 8) and js["advice"]
    em = subprocess.run([sys.executable, "-m", "expertrail", "plan", "--hardware", "h100", "--model", "deepseek-v3",
                         "--ep", "16", "--emit", "megatron"], capture_output=True, text=True, timeout=120)
    assert "--moe-token-dispatcher-type" in em.stdout
