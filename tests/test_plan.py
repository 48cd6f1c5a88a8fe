"""`expertrail plan`: recommendations with reasons, EP table, emitted configs that validate."""
import json
import re
import shlex
import subprocess
import sys

import pytest

from expertrail.tools.cli import main
from expertrail.names import both_names
from expertrail.plan.advisor import DOMAIN_ENV, emit, expert_gemm_seconds, format_plan, megatron_dispatcher, plan
from expertrail.plan.architecture import MODELS
from expertrail.plan.catalog import HARDWARE, MoEModel
from expertrail.plan.validate import load_config, unknown_fields, validate

# (hardware, model, ep): one NVLink domain, several 8-GPU nodes, an NVL72 rack, several racks,
# and the plan's own EP choice (None).
SETUPS = [("h100", "qwen3-30b-a3b", 8), ("h100", "deepseek-v3", 32), ("h100", "deepseek-v3", 64),
          ("gb200-nvl72", "deepseek-v3", 64), ("gb200-nvl72", "qwen3-next-80b-a3b", 128), ("b200", "mixtral-8x7b", 8),
          ("h800", "deepseek-v3", None), ("gb200-nvl36", "qwen3-235b-a22b", None)]


def _plans():
    for hardware, model, ep in SETUPS:
        for stage in ("bringup", "tune"):
            for precision in ("bf16", "fp8"):
                yield (hardware, model, ep, stage, precision), plan(HARDWARE[hardware], MODELS[model], tokens=1024,
                                                                   ep=ep, stage=stage, precision=precision)


@pytest.fixture(scope="module")
def plans():
    return list(_plans())


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
    assert sms["value"]["sweep"] == [16, 32]
    assert next(a for a in r["advice"] if a["topic"] == "FP8 recipe")["value"] == "mxfp8"


def test_bringup_inside_one_node_starts_with_alltoall():
    r = plan(HARDWARE["h100"], MODELS["qwen3-30b-a3b"], ep=8, stage="bringup")
    assert r["dispatcher"] == "alltoall" and r["algorithm"] == "alltoall"
    assert "bring-up" in next(a for a in r["advice"] if a["topic"] == "dispatcher")["reason"]


def test_ep_table_verdicts_follow_the_comm_to_compute_ratio():
    """The verdicts grow with the communication / compute ratio, communication above compute is
    communication-bound, a small fraction of it compute-bound (not the thresholds restated)."""
    r = plan(HARDWARE["h100"], MODELS["deepseek-v3"])
    severity = ("compute-bound", "sweet spot", "communication-bound")
    rows = sorted(r["ep_table"], key=lambda row: row["dispatch_combine_us"] / row["expert_gemm_us"])
    levels = [severity.index(row["verdict"]) for row in rows]
    assert levels == sorted(levels) and len(set(levels)) == 3, [(row["ep"], row["verdict"]) for row in rows]
    for row in rows:
        ratio = row["dispatch_combine_us"] / row["expert_gemm_us"]
        if ratio > 1.05:
            assert row["verdict"] == "communication-bound", row
        if ratio < 0.2:
            assert row["verdict"] == "compute-bound", row
        assert row["tokens_per_expert"] == pytest.approx(4096 * 8 * row["ep"] / 256)
    chosen = next(a for a in r["advice"] if a["topic"] == "EP size")
    fitting = [t for t in r["ep_table"] if t["fits_at_pp"] is not None]
    least = min(t["fits_at_pp"] for t in fitting)
    fits = [t for t in fitting if t["fits_at_pp"] <= max(least, 4)]      # shallow pipelines preferred
    if any(t["verdict"] != "communication-bound" for t in fits):
        assert next(t for t in r["ep_table"] if t["ep"] == chosen["value"])["verdict"] != "communication-bound"
    else:                             # memory rules out the EP sizes communication would pick, and says so
        assert chosen["value"] == fits[0]["ep"] and "that fits" in chosen["reason"]
        assert any(a["topic"] == "memory" for a in r["advice"])


def test_one_recommendation_decides_table_json_advice_and_flags(plans):
    """The table's mark, the JSON algorithm / dispatcher, the advice and the emitted
    flags all say the same thing, at every stage."""
    for key, r in plans:
        hw = HARDWARE[key[0]]
        assert (r["dispatcher"], r["flex_backend"]) == megatron_dispatcher(r["algorithm"], hw), key
        assert [a for a, p in r["predictions"].items() if p["recommended"]] == [r["algorithm"]], key
        marked = [line for line in format_plan(r).splitlines() if line.endswith("<- recommended")]
        assert len(marked) == 1 and marked[0].split()[0] == r["algorithm"], (key, marked)
        assert marked[0].strip().startswith(both_names(r["algorithm"], hw.domain_size, r["ep"])), key
        advice = next(a for a in r["advice"] if a["topic"] == "dispatcher")
        assert advice["value"] == r["dispatcher"] + (f" + {r['flex_backend']}" if r["flex_backend"] else ""), key
        flags = emit(r, MODELS[key[1]], "megatron")
        assert f"--moe-token-dispatcher-type {r['dispatcher']}" in flags, key
        assert (f"--moe-flex-dispatcher-backend {r['flex_backend']}" in flags) == bool(r["flex_backend"]), key
        if r["algorithm"] != r["fastest_algorithm"]:       # only bring-up may start on a slower path, and says so
            assert key[3] == "bringup" and r["algorithm"] == "alltoall"
            assert "--stage tune" in advice["reason"] and r["fastest_algorithm"] in advice["reason"]
        else:
            assert f"{both_names(r['algorithm'], hw.domain_size, r['ep'])} is predicted fastest" in advice["reason"], key


def test_bringup_at_small_ep_differs_from_the_fastest_and_says_so():
    """The case the issue reported: bring-up at EP 8 on one node used to mark hierarchical while
    advising alltoall."""
    r = plan(HARDWARE["h100"], MODELS["deepseek-v3"], ep=8, stage="bringup")
    assert r["fastest_algorithm"] == "hierarchical" and r["algorithm"] == "alltoall"
    text = format_plan(r)
    assert re.search(r"^\s+alltoall .*<- recommended$", text, re.M)
    assert re.search(r"^\s+hierarchical \(deepep\) .*\(fastest; for --stage tune\)$", text, re.M)


def test_ep_overlap_claims_follow_the_comm_to_compute_ratio(plans):
    for key, r in plans:
        hardware, model, _, stage, precision = key
        p = r["predictions"][r["algorithm"]]
        compute = expert_gemm_seconds(HARDWARE[hardware], MODELS[model], r["tokens"], r["ep"], precision)
        ratio = (p["dispatch_us"] + p["combine_us"]) / 1e6 / compute
        assert r["comm_compute_ratio"] == pytest.approx(ratio), key
        reason = next(a for a in r["advice"] if a["topic"] == "EP overlap")["reason"]
        assert f"is {ratio:.0%} of the expert GEMMs" in reason, key
        if stage == "bringup":
            assert r["ep_overlap"] is False and "bring-up" in reason, key
        elif ratio < 0.2:
            assert r["ep_overlap"] is False and "too little" in reason, key
        else:
            assert r["ep_overlap"] is True, key
        if ratio > 1:
            assert "can hide it" not in reason and "stay exposed" in reason, key
            assert f"at most {1 / ratio:.0%}" in reason, key
        else:
            assert "exposed" not in reason, key
    assert any(r["comm_compute_ratio"] > 1 for _, r in plans) and any(r["comm_compute_ratio"] <= 1 for _, r in plans)


def test_fp8_plans_emit_megatrons_fp8_flags(plans):
    for key, r in plans:
        flags = shlex.split(emit(r, MODELS[key[1]], "megatron"))
        bridge = emit(r, MODELS[key[1]], "bridge")
        if key[4] == "fp8":
            recipe = "mxfp8" if HARDWARE[key[0]].arch == "blackwell" else "blockwise"
            for flag, value in (("--fp8-format", "e4m3"), ("--fp8-recipe", recipe), ("--moe-router-dtype", "fp32")):
                assert flags[flags.index(flag) + 1] == value, key
            assert f"model.fp8_recipe={recipe}" in bridge and "model.fp8=e4m3" in bridge, key
        else:
            assert "--fp8-format" not in flags and "fp8" not in bridge, key


def test_domain_variable_only_for_hybridep(plans):
    for key, r in plans:
        texts = [emit(r, MODELS[key[1]], style) for style in ("megatron", "bridge")] + [format_plan(r)]
        if r["flex_backend"] == "hybridep":
            assert r["env"] == {DOMAIN_ENV: r["domain"]}
            assert all(f"{DOMAIN_ENV}={r['domain']}" in t for t in texts), key
        else:
            assert r["env"] == {} and not any(DOMAIN_ENV + "=" in t for t in texts), key


def test_text_output_has_no_python_reprs(plans):
    for key, r in plans:
        text = format_plan(r)
        assert not re.search(r"[{\[(]'|\bTrue\b|\bFalse\b|\bNone\b", text), (key, text)


@pytest.mark.parametrize("hardware,model,ep,precision", [("h100", "deepseek-v3", 32, "bf16"),
                                                          ("gb200-nvl72", "deepseek-v3", 64, "fp8"),
                                                          ("b200", "mixtral-8x7b", 8, "bf16"),
                                                          ("h100", "qwen3-30b-a3b", 16, "fp8"),
                                                          ("gb200-nvl72", "llama4-scout", 16, "bf16")])
def test_emitted_configs_pass_validation_as_they_are(hardware, model, ep, precision):
    """Llama 4 Scout's top-1 router among them: its configuration sets the softmax before top-k."""
    models = {**MODELS, "llama4-scout": MoEModel("llama4-scout", 5120, 16, 1, 8192, 48, shared_experts=1)}
    r = plan(HARDWARE[hardware], models[model], ep=ep, stage="tune", precision=precision)
    bridge = [line for line in emit(r, models[model], "bridge").splitlines() if not line.startswith("#")]
    values = load_config(None, bridge + [f"num_of_hybrid_ep_ranks_per_nvlink_domain={r['domain']}",
                                         f"hardware={hardware}"])
    assert validate(values) == [] and unknown_fields(values) == []
    flags = emit(r, models[model], "megatron")
    assert f"--expert-model-parallel-size {ep}" in flags
    megatron = load_config(None, shlex.split(flags) + [f"hardware={hardware}"])     # as printed, pasted
    assert validate(megatron) == [] and unknown_fields(megatron) == []
    assert megatron["num_moe_experts"] == models[model].num_experts and megatron["moe_grouped_gemm"] is True
    # both styles describe one configuration
    assert {k: v for k, v in values.items() if k in megatron} == {k: v for k, v in megatron.items() if k in values}


def test_emitted_megatron_flags_validate_on_the_command_line(capsys):
    """`expertrail validate $(expertrail plan ... --emit megatron)` passes, the shell's
    split of the backslash continuations included."""
    for hardware, ep in (("h100", 32), ("gb200-nvl72", 64)):
        assert main(["plan", "--hardware", hardware, "--model", "deepseek-v3", "--ep", str(ep), "--stage", "tune",
                     "--emit", "megatron"]) == 0
        printed = capsys.readouterr().out
        for tokens in (shlex.split(printed), printed.split()):      # pasted, or $(...) word splitting
            assert main(["validate", *tokens, f"hardware={hardware}"]) == 0
            out = capsys.readouterr().out
            assert out.startswith("valid: ") and "warning" not in out


def test_plan_cli_text_json_emit_without_torch():
    code = ("import sys; from expertrail.tools.cli import main; "
            "rc = main(['plan', '--hardware', 'h100', '--model', 'qwen3-235b-a22b', '--stage', 'tune']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for text in ("recommendations:", "because", "EP choice", "pitfalls:", "keep the routing mode fixed"):
        assert text in out.stdout


def test_plan_cli_json_and_emit(capsys):
    assert main(["plan", "--hardware", "b200", "--model", "mixtral-8x22b", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["ep"] in (4, 8) and js["advice"] and isinstance(js["ep_overlap"], bool)
    assert main(["plan", "--hardware", "h100", "--model", "deepseek-v3", "--ep", "16", "--emit", "megatron"]) == 0
    assert "--moe-token-dispatcher-type" in capsys.readouterr().out


def test_ep_choice_reason_is_true_when_every_ep_is_communication_bound():
    from expertrail.plan.catalog import Hardware
    slow = Hardware("slow", 1, 1.0, 1.0, 132, 80, 3.35, 989, 1979, "hopper")     # 1 GB/s links, one GPU per domain
    r = plan(slow, MODELS["qwen3-30b-a3b"], tokens=512)
    assert all(row["verdict"] == "communication-bound" for row in r["ep_table"])
    reason = next(a for a in r["advice"] if a["topic"] == "EP size")["reason"]
    assert r["ep"] == r["ep_table"][0]["ep"] and "every EP size that fits is communication-bound" in reason
    assert "does not exceed" not in reason


def test_overlap_advice_predicts_the_gain_of_two_micro_batches_in_flight():
    from expertrail.plan.advisor import overlap_advice
    on, reason = overlap_advice("tuning", 300e-6, 600e-6)
    assert on and "1.50x faster at best" in reason            # (300 + 600) / 600
    assert "about 1.37x as expertrail's own schedule measures" in reason     # 900 / (900 - 0.81 * 300)
    on, reason = overlap_advice("tuning", 900e-6, 300e-6)
    assert on and "1.33x faster at best" in reason            # (900 + 300) / 900


def test_ep_choice_respects_memory():
    """DeepSeek-V3 on GB200 in FP8 used to get EP 4 (64 experts of 58 layers per GPU) on
    communication alone; the estimator finds that EP needs PP 16 to fit, so the plan takes a
    larger EP and says why."""
    r = plan(HARDWARE["gb200-nvl72"], MODELS["deepseek-v3"], precision="fp8", stage="tune")
    assert r["ep"] >= 16
    memory = [a for a in r["advice"] if a["topic"] == "memory"]
    assert memory and any("EP 4 needs PP 16" in a["reason"] for a in memory)
    rows = {t["ep"]: t for t in r["ep_table"]}
    assert rows[r["ep"]]["fits_at_pp"] <= 4 < rows[4]["fits_at_pp"]
    # the table's PP agrees with the estimator run on that layout: it fits there, not one step down
    from expertrail.plan.architecture import ARCHITECTURES
    from expertrail.plan.estimate import estimate
    from expertrail.plan.layout import TrainingLayout, megatron_split
    dsv3 = ARCHITECTURES["deepseek-v3"]

    def fits(pp):
        layout = TrainingLayout(gpus=256, pp=pp, ep=4, precision="fp8", dispatcher="flex", flex_backend="hybridep",
                                global_batch=2048, recompute="selective", recompute_modules=("mla_up_proj", "moe_act"),
                                **megatron_split(dsv3.layers, dsv3.mtp_layers, pp, 1))
        return estimate(dsv3, HARDWARE["gb200-nvl72"], layout)["fits"]
    assert fits(rows[4]["fits_at_pp"]) and not fits(rows[4]["fits_at_pp"] // 2)
    forced = plan(HARDWARE["h100"], MODELS["deepseek-v3"], ep=4, stage="tune")
    assert forced["advice"][0]["topic"] == "memory" and forced["advice"][0]["value"] is False
    assert "no pipeline split up to PP 32 fits" in forced["advice"][0]["reason"]      # every PP tried, named


def test_the_measured_overlap_share_is_the_recorded_runs():
    """`estimate.EP_OVERLAP_HIDES` (the estimate's and the advisor's) is what the recorded 2 x 1
    run of `expertrail train --overlap` hid of the time it could hide: (without - with) /
    (without - CPU floor)."""
    import json
    from pathlib import Path
    from expertrail.plan.estimate import EP_OVERLAP_HIDES
    run = json.loads((Path(__file__).parent.parent / "docs/results/overlap-train-2x1.json").read_text())
    a = run["backends"]["alltoall"]
    without, with_, floor = a["without_overlap"]["step_time_s"], a["step_time_s"], a["cpu_floor_s"]
    assert round((without - with_) / (without - floor), 2) == EP_OVERLAP_HIDES
