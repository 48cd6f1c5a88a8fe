"""`expertrail estimate`: memory, step time and TFLOPS against published runs, and its sanity properties."""
import json
import shlex
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

from expertrail.errors import ConfigError
from expertrail.tools.cli import main
from expertrail.plan import calibration
from expertrail.plan.architecture import ARCHITECTURES, from_fields
from expertrail.plan.catalog import HARDWARE
from expertrail.plan.cost import Routing
from expertrail.plan.estimate import estimate, fsdp_seconds, layer_seconds
from expertrail.plan.layout import TrainingLayout, stage_layers
from expertrail.plan.memory import usable_GB
from expertrail.plan.simulate import simulate
from expertrail.plan.validate import load_config, validate

DSV3, QWEN = ARCHITECTURES["deepseek-v3"], ARCHITECTURES["qwen3-235b-a22b"]


def run(hardware, arch, **fields):
    """The estimate of a 256-GPU layout (where ``fields`` leave the pipeline split out and the even
    split does not build, the estimate takes the plainest split Megatron builds)."""
    backend = "hybridep" if HARDWARE[hardware].domain_size > 8 else "deepep"
    layout = TrainingLayout(gpus=256, seq=4096, dispatcher="flex", flex_backend=backend, **fields)
    return estimate(arch, HARDWARE[hardware], layout)


MLA_UP = dict(recompute="selective", recompute_modules=("mla_up_proj",))


@pytest.mark.parametrize("run_id", sorted(calibration.TRAINING_RUNS))
def test_published_runs_fit_and_keep_their_documented_error(run_id):
    """Every published run is predicted to fit, and its error stays within 2 points of the
    error docs/cost-model.md documents (published_runs.json's error_pct): a change to the model
    that moves any row shows here, including the rows a constant was not fitted on."""
    run, result = calibration.TRAINING_RUNS[run_id], calibration.predicted(run_id)
    assert result["fits"], (run_id, result["peak_memory_GB"], result["usable_memory_GB"])
    assert abs(calibration.error_pct(run_id) - run["error_pct"]) <= 2.0, (run_id, calibration.error_pct(run_id))


def test_gb200_and_h100_layouts_of_one_model_in_the_published_order():
    """The distinct layouts of one model on GB300 and H100 come out in the published order (on
    H100 Qwen3-235B's 25.09 token-drop run with NCCL's all-to-all below the later DeepEP layouts);
    DeepSeek-V3's five GB200 layouts at 0.9, its 25.09 token-drop run over-predicted."""
    ranks = calibration.ranking_groups()
    for key in (("qwen3-235b-a22b", "h100", "Bridge", 4096), ("qwen3-235b-a22b", "gb300-nvl72", "Bridge", 4096)):
        assert ranks[key] == pytest.approx(1.0), (key, ranks[key])
    assert ranks[("deepseek-v3", "gb200-nvl72", "Bridge", 4096)] >= 0.8


def test_exchanges_are_costed_on_the_routers_group_limited_choices():
    """Under forced balance Megatron's router still applies the model's group limit: DeepSeek-V3's
    tokens reach at most 4 of its 8 expert groups (4 EP ranks at EP 8, one group a rank), so its
    EP 8 exchange is cheaper than on uniform choices; a model without groups is costed uniform."""
    from expertrail.plan.estimate import _routing, dispatch_seconds
    groups = [len(set(row)) for row in (_routing(DSV3, 1024) // (DSV3.experts // 8)).tolist()]
    assert max(groups) == 4
    assert max(len(set(row)) for row in (_routing(QWEN, 1024) // (QWEN.experts // 8)).tolist()) > 4
    layout = TrainingLayout(gpus=64, ep=8, dispatcher="flex", flex_backend="deepep", global_batch=64)
    grouped = dispatch_seconds(DSV3, HARDWARE["h100"], layout)[0]
    uniform = dispatch_seconds(replace(DSV3, num_groups=None, group_topk=None), HARDWARE["h100"], layout)[0]
    assert grouped < 0.85 * uniform


def test_ep_overlap_on_nccl_all_to_all_across_h100_nodes_near_the_published_pair():
    """Qwen3-30B on 16 H100 at EP 16, Megatron's alltoall dispatcher, BF16: 41.25 s a step
    without EP overlap and 31.31 s with it, 1.32x (shared/reference/ep-overlap-validation.txt).
    NCCL's all-to-all is costed at its achieved bandwidth, without the DeepEP / Hybrid-EP
    framework factor: the step without overlap within 10%; the gain, with the hidden share
    measured on expertrail's own schedule, within 10% of the published one (hiding all it
    could, the model would give 1.46x)."""
    layout = TrainingLayout(gpus=16, ep=16, global_batch=1024, precision="bf16", dispatcher="alltoall")
    without = estimate(ARCHITECTURES["qwen3-30b-a3b"], HARDWARE["h100"], layout)["step_time_s"]
    with_overlap = estimate(ARCHITECTURES["qwen3-30b-a3b"], HARDWARE["h100"],
                            replace(layout, ep_overlap=True))["step_time_s"]
    assert without == pytest.approx(41.25, rel=0.10)
    assert without / with_overlap == pytest.approx(41.25 / 31.31, rel=0.10)


def test_ep_overlap_gain_near_the_modelzoo_pair():
    """The ModelZoo's Qwen3-235B on 256 H100 at TP 2 x PP 8 x VP 4 x EP 32 (DeepEP, BF16), held
    out: 245 TFLOPS without EP overlap, 276 with it, 1.13x. The predicted gain comes within 10%
    of it (hiding all it could, 1.35x)."""
    zoo = "modelzoo h100 qwen3-235b-a22b bf16 2/8/4/32 mbs1 gbs2048"
    gain = calibration.predicted(zoo)["step_time_s"] / calibration.predicted(zoo + " ep-overlap")["step_time_s"]
    assert gain == pytest.approx(276 / 245, rel=0.10)


def test_the_modelzoo_launch_lines_ep_overlap_is_read():
    """The Megatron-MoE-ModelZoo's launch lines of May 2025 spell EP overlap as the dev branch's
    combined 1F1B (--combined-1f1b --combined-1f1b-recipe ep_a2a), which ran the experts' weight
    gradients after the dispatch's backward: read as EP overlap with delayed weight gradients,
    and known to validate (no unknown-field warning)."""
    flags = ["--expert-model-parallel-size", "32", "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep",
             "--combined-1f1b", "--combined-1f1b-recipe", "ep_a2a"]
    config = load_config(None, flags)
    layout = TrainingLayout.from_fields(config, 256)
    assert layout.ep_overlap and layout.delay_wgrad
    from expertrail.plan.validate import unknown_fields
    assert unknown_fields(config) == []
    golden = TrainingLayout.from_fields(load_config(None, flags[:-1] + ["golden"]), 256)
    assert not golden.ep_overlap


def test_ep_overlap_leaves_the_unpaired_warm_up_and_cool_down_exposed():
    """Combined 1F1B pairs micro-batches only in the steady phase: one forward and one backward
    run alone without pipelining, 2 (PP - 1) + (VPP - 1) PP of each with interleaving."""
    from expertrail.plan.estimate import unpaired_share
    assert unpaired_share(TrainingLayout(gpus=16, ep=16, global_batch=1024)) == pytest.approx(1 / 64)
    interleaved = TrainingLayout(gpus=256, tp=2, pp=8, vpp=4, ep=32, global_batch=2048)   # 128 micro-batches
    assert unpaired_share(interleaved) == pytest.approx((2 * 7 + 3 * 8) / (128 * 4))
    assert unpaired_share(replace(interleaved, global_batch=16 * 4)) == 1.0              # all warm-up


def test_the_modelzoo_h100_layouts_rank_as_published():
    """Five layouts of Qwen3-235B on 256 H100 (EP 32 with and without EP overlap, Megatron-FSDP,
    PP 32, TP 4), held out: the issue's rank correlation of at least 0.8."""
    assert calibration.ranking_groups()[("qwen3-235b-a22b", "h100", "ModelZoo", 4096)] >= 0.8


def test_every_constant_names_the_rows_it_was_fitted_on():
    from expertrail.plan import cost, estimate as estimate_module
    modules = {"cost": cost, "estimate": estimate_module}
    for name, rows in calibration.FITTED_ON.items():
        module, constant = name.split(".", 1)
        assert hasattr(modules[module], constant.split("[")[0]), name
        if isinstance(rows, list):
            assert rows and all(r in calibration.TRAINING_RUNS or r in calibration.KERNEL_FIGURES for r in rows), name
    numeric = {f"{m}.{k}" for m, mod in modules.items() for k, v in vars(mod).items()
               if k.isupper() and isinstance(v, (int, float, dict)) and not isinstance(v, bool)}
    named = {n.split("[")[0] for n in calibration.FITTED_ON}
    not_fitted = {"estimate.ROUTING_SAMPLE", "estimate.IMBALANCE_SAMPLES", "estimate.ROUTED_SAMPLE", "estimate.GB"}  # samples, a unit
    assert numeric - named <= not_fitted, numeric - named


def test_model_flops_are_megatrons_count():
    """Bridge's table gives TFLOP/s and tokens/s per GPU; their ratio is the FLOPs per token:
    732e12 / 2815 for DeepSeek-V3 with its MTP layer (26.04; Bridge counts MTP since its 2026-03
    FLOPs update) and 782e12 / 3139 without (25.11's count), 728e12 / 4916 for Qwen3-235B,
    428e12 / 15784 for GPT-OSS-120B. DeepSeek-V3 holds 671B parameters and 14B more in its MTP
    module (its README: 685B on Hugging Face)."""
    assert DSV3.flops_per_token(4096) == pytest.approx(732e12 / 2815, rel=0.02)
    no_mtp = replace(DSV3, mtp_layers=0)
    assert no_mtp.flops_per_token(4096) == pytest.approx(782e12 / 3139, rel=0.02)
    assert DSV3.total_params() == pytest.approx(685e9, rel=0.01) and no_mtp.total_params() == pytest.approx(671e9, rel=0.01)
    assert QWEN.flops_per_token(4096) == pytest.approx(728e12 / 4916, rel=0.02)
    gpt_oss = ARCHITECTURES["gpt-oss-120b"]      # its clamped GEGLU experts count as two matrices
    assert gpt_oss.flops_per_token(4096) == pytest.approx(428e12 / 15784, rel=0.02)
    assert gpt_oss.flops_per_token(8192) == pytest.approx(488e12 / 15876, rel=0.02)
    assert QWEN.total_params() == pytest.approx(235e9, rel=0.01)


def test_more_recompute_means_less_memory_and_more_time():
    base = dict(precision="bf16", global_batch=1024, pp=8, ep=32)
    rs = [run("h100", QWEN, **base),
          run("h100", QWEN, recompute="selective", recompute_modules=("moe_act", "layernorm"), **base),
          run("h100", QWEN, recompute="selective", recompute_modules=("moe",), **base),
          run("h100", QWEN, recompute="full", recompute_method="uniform", **base)]
    memory = [r["memory"]["activations_GB"] for r in rs]
    step = [r["step_time_s"] for r in rs]
    assert memory == sorted(memory, reverse=True) and len(set(memory)) == 4
    assert step == sorted(step) and len(set(step)) == 4


def test_more_pipeline_stages_mean_less_weight_memory_per_gpu():
    weights = [run("gb200-nvl72", QWEN, precision="bf16", global_batch=1024, pp=pp, ep=32)["memory"]["weights_GB"]
               for pp in (1, 2, 4, 8)]
    assert weights == sorted(weights, reverse=True) and weights[0] > 6 * weights[-1]


def test_a_235b_moe_on_8_gpus_without_sharding_does_not_fit():
    layout = TrainingLayout(gpus=8, ep=8, distributed_optimizer=False, dispatcher="alltoall")
    r = estimate(QWEN, HARDWARE["h100"], layout)
    assert not r["fits"] and r["wall"] == "memory" and r["peak_memory_GB"] > 5 * r["usable_memory_GB"]
    assert "does not" not in r["wall_reason"] and "needs" in r["wall_reason"]


def test_pipeline_layout_string_and_dense_layers_place_the_work():
    layout = TrainingLayout(gpus=256, pp=4, vpp=2, ep=64, layout_string="Et|(tttttttt|)*6ttttttttttttL")
    from expertrail.plan.layout import stage_layers
    ranks = stage_layers(layout, 61, 0, dense_layers=3)
    assert sum(r[0] for r in ranks) == 61 and ranks[0][1] == 1 and ranks[1][1] == 2     # dense layers 0 | 1, 2
    assert ranks[0][2] and ranks[3][3]                                                  # embedding first, loss last
    assert from_fields(None, {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_moe_experts": 8,
                              "moe_ffn_hidden_size": 128, "moe_layer_freq": "([0]*1+[1]*3)"}).dense_layers == 1


def test_moe_layer_freq_counts_the_dense_layers_as_megatron_builds_them():
    """moe_layer_freq N makes layers 0, N, 2N, ... MoE (Megatron-Core's gpt_layer_specs); a pattern
    marks each layer, interleaved or not; one that is not one entry a layer is refused by estimate
    and validate alike."""
    from expertrail.plan.architecture import dense_layers_of
    assert dense_layers_of(1, 61) == 0 and dense_layers_of("1", 61) == 0
    assert dense_layers_of(2, 48) == 24 and dense_layers_of(3, 10) == 6          # layers 0, 3, 6, 9 MoE
    assert dense_layers_of("([0]*3+[1]*58)", 61) == 3 and dense_layers_of([0, 1] * 24, 48) == 24
    assert dense_layers_of("[0,1]*24", 48) == 24
    interleaved = from_fields(ARCHITECTURES["mixtral-8x7b"], {"moe_layer_freq": 2})
    assert (interleaved.dense_layers, interleaved.moe_layers) == (16, 16)
    assert interleaved.total_params() < ARCHITECTURES["mixtral-8x7b"].total_params()
    with pytest.raises(ConfigError, match="gives 60 layers, the model has 61"):
        from_fields(DSV3, {"moe_layer_freq": "([0]*3+[1]*57)"})
    with pytest.raises(ConfigError, match="N >= 1"):
        dense_layers_of(0, 8)


def test_a_model_spelled_out_by_fields_says_its_vocabulary_was_assumed(capsys):
    """Megatron sizes the vocabulary from the tokenizer, which flags name but do not size: a
    model spelled out by its fields without vocab_size is costed at 32000 entries, and said so;
    GPT-2's BPE tokenizer (Megatron-LM's examples' and tests') is sized by its own 50257."""
    model = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--num-experts", "16",
             "--moe-ffn-hidden-size", "512", "--moe-router-topk", "2", "--expert-model-parallel-size", "8",
             "--moe-router-force-load-balancing"]
    args = ["estimate", "--hardware", "h100", "--gpus", "8", *model]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "vocab_size=32000 (Megatron sizes it from the tokenizer" in out
    assert "swiglu=true (gated MLPs" in out                  # Megatron-LM's default MLP is ungated
    assert main(args + ["--vocab-size", "129280", "--swiglu"]) == 0
    out = capsys.readouterr().out
    assert "vocab_size" not in out and "swiglu" not in out
    assert main(args + ["--quick-geglu"]) == 0             # GPT-OSS's activation, gated too
    assert "swiglu=true" not in capsys.readouterr().out
    assert main(args + ["--tokenizer-type", "GPT2BPETokenizer", "--tensor-model-parallel-size", "2",
                        "--sequence-parallel", "--expert-tensor-parallel-size", "1"]) == 0   # a fixed vocabulary
    assert "vocab_size=50432 (GPT2BPETokenizer's 50257, padded" in capsys.readouterr().out
    assert main(["estimate", "--hardware", "h100", "--gpus", "8", "--model", "qwen3-30b-a3b",
                 "--expert-model-parallel-size", "8", "--moe-router-force-load-balancing"]) == 0
    assert "vocab_size" not in capsys.readouterr().out


def test_a_model_spelled_out_by_fields_takes_megatrons_defaults_and_its_tokenizers_model(tmp_path, capsys):
    """Megatron-LM scripts spell a model out by flags and name its checkpoint by
    ``--tokenizer-model``: the vocabulary is that model's (catalog name at the start of the last
    path part, or a Hugging Face model directory's config.json), padded as Megatron-LM pads it; a
    run that fine-tunes the checkpoint keeps its router's balance; an unset ffn_hidden_size is
    Megatron's 4 x hidden (two thirds of it, to a multiple of 64, with SwiGLU), and the experts are
    as wide unless moe_ffn_hidden_size says otherwise."""
    from expertrail.plan.architecture import padded_vocab, tokenizer_checkpoint, unstated_model_fields
    qwen30 = {"num_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_moe_experts": 128,
              "moe_ffn_hidden_size": 768, "moe_router_topk": 8, "moe_router_load_balancing_type": "aux_loss"}
    named = dict(qwen30, tokenizer_model="Qwen/Qwen3-30B-A3B")
    assert tokenizer_checkpoint(named) == ("qwen3-30b-a3b", 151936, "global_batch")
    assert tokenizer_checkpoint({"tokenizer_model": "Qwen3-Next-80B-A3B-Instruct"}).name == "qwen3-next-80b-a3b"
    assert tokenizer_checkpoint({"tokenizer_model": "deepseek-ai/DeepSeek-V2-Lite"}) == \
        ("deepseek-v2", 102400, "micro_batch")
    assert tokenizer_checkpoint({"tokenizer_model": "meta-llama/Llama-2-7b-hf"}) is None
    assert from_fields(None, named).vocab == 151936                     # 1187 x 128
    assert padded_vocab(151936, {"tensor_model_parallel_size": 4}) == 152064          # to 512s
    assert padded_vocab(151669, {"make_vocab_size_divisible_by": 1187, "tensor_model_parallel_size": 2}) == 151936
    # Trained from scratch with aux_loss, the router balances each micro-batch; fine-tuning the
    # Qwen3 checkpoint, it keeps the checkpoint's balance over the whole batch.
    assert from_fields(None, named).router_balance == "micro_batch"
    assert from_fields(None, dict(named, finetune=True)).router_balance == "global_batch"
    assert from_fields(None, dict(named, pretrained_checkpoint="/ckpt")).router_balance == "global_batch"
    notes = " ".join(unstated_model_fields(dict(named, finetune=True)))
    assert "vocab_size=151936 (qwen3-30b-a3b's, named by tokenizer_model" in notes
    assert "router_balance=global_batch (the qwen3-30b-a3b checkpoint the run fine-tunes" in notes
    # A local Hugging Face directory as the tokenizer: its config.json sizes the vocabulary.
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
        "intermediate_size": 2048, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 50000}))
    assert from_fields(None, dict(qwen30, tokenizer_model=str(tmp_path))).vocab == 50048
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 1024, "vocab_size": 32000,
                                                   "num_hidden_layers": 2, "num_attention_heads": 8}))
    assert tokenizer_checkpoint({"tokenizer_model": str(dense)}) is None          # no MoE model to name
    # Megatron's widths where the flags leave them out.
    shape = {"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "num_moe_experts": 8}
    assert (from_fields(None, dict(shape, swiglu=True)).ffn, from_fields(None, dict(shape, swiglu=True)).moe_ffn) \
        == (5440, 5440)
    assert from_fields(None, shape).moe_ffn == 8192
    assert from_fields(None, dict(shape, ffn_hidden_size=6144)).moe_ffn == 6144
    flags = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--num-experts", "8",
             "--swiglu", "--expert-model-parallel-size", "8", "--tokenizer-model", "mistralai/Mixtral-8x22B-v0.1"]
    assert main(["estimate", "--hardware", "h100", "--gpus", "8", *flags]) == 0
    out = capsys.readouterr().out
    assert "vocab_size=32768 (mixtral-8x22b's, named by tokenizer_model" in out and "fine-tunes" not in out


def test_a_modelzoo_model_file_estimates_as_the_catalog_model_it_spells_out(tmp_path):
    """The Megatron-MoE-ModelZoo's model files spell Qwen3-235B out in Megatron-LM flags (an
    ENV_VARS section beside MODEL_ARGS, the checkpoint named by its tokenizer, fine-tuned with
    aux_loss): estimated from that file, the run costs as the catalog's Qwen3-235B does, its
    vocabulary and its router's balance included, so the natural-router pair calibrated on the
    ModelZoo's runs holds for a user who gives the file itself."""
    path = tmp_path / "Qwen3-235B-A22B.yaml"
    path.write_text("""ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
  NCCL_NVLS_ENABLE: 0
MODEL_ARGS:
  --tensor-model-parallel-size: 4
  --pipeline-model-parallel-size: 8
  --expert-model-parallel-size: 8
  --expert-tensor-parallel-size: 1
  --use-distributed-optimizer: true
  --overlap-grad-reduce: true
  --overlap-param-gather: true
  --sequence-parallel: true
  --micro-batch-size: 1
  --global-batch-size: 256
  --tokenizer-type: HuggingFaceTokenizer
  --tokenizer-model: Qwen/Qwen3-235B-A22B
  --untie-embeddings-and-output-weights: true
  --normalization: RMSNorm
  --swiglu: true
  --num-layers: 94
  --hidden-size: 4096
  --ffn-hidden-size: 12288
  --num-attention-heads: 64
  --group-query-attention: true
  --num-query-groups: 4
  --kv-channels: 128
  --qk-layernorm: true
  --seq-length: 16384
  --make-vocab-size-divisible-by: 1187
  --num-experts: 128
  --moe-ffn-hidden-size: 1536
  --moe-router-topk: 8
  --moe-router-load-balancing-type: aux_loss
  --moe-grouped-gemm: true
  --moe-token-dispatcher-type: alltoall
  --finetune: true
  --bf16: true
""")
    values = load_config(str(path), ["--num-layers-per-virtual-pipeline-stage", "3",
                                     "--account-for-embedding-in-pipeline-split",
                                     "--account-for-loss-in-pipeline-split"])
    spelled = from_fields(None, values)
    assert (spelled.vocab, spelled.router_balance, spelled.kv_heads) == (QWEN.vocab, QWEN.router_balance, QWEN.kv_heads)
    layout = TrainingLayout.from_fields(values, 256)
    ours, catalog = estimate(spelled, HARDWARE["h100"], layout), estimate(QWEN, HARDWARE["h100"], layout)
    assert ours["step_time_s"] == pytest.approx(catalog["step_time_s"], rel=1e-3)
    assert ours["peak_memory_GB"] == pytest.approx(catalog["peak_memory_GB"], rel=1e-3)
    assert ours["layout"]["routing_imbalance"] == catalog["layout"]["routing_imbalance"] > 1.5


def test_a_catalog_model_by_its_hugging_face_name():
    """--model takes a catalog model in any case, or by its Hugging Face repository id, a variant's
    too (Instruct, a version); a name that only begins like one (DeepSeek-V3.2, another attention)
    is not taken for it."""
    from expertrail.plan.architecture import load_architecture
    from expertrail.plan.catalog import load_model
    assert load_architecture("Qwen/Qwen3-30B-A3B") is ARCHITECTURES["qwen3-30b-a3b"]
    assert load_architecture("QWEN3-235B-A22B") is QWEN
    assert load_architecture("moonshotai/Kimi-K2-Instruct") is ARCHITECTURES["kimi-k2"]
    assert load_architecture("Qwen/Qwen3-Next-80B-A3B-Instruct") is ARCHITECTURES["qwen3-next-80b-a3b"]
    assert load_model("mistralai/Mixtral-8x7B-v0.1").num_experts == 8
    with pytest.raises(ConfigError, match="choose one of deepseek-v3"):
        load_architecture("deepseek-ai/DeepSeek-V3.2-Exp")


def test_the_runs_gpus_from_gpus_or_the_configurations_world_size(capsys):
    """--gpus may be left out where the configuration states its world size (world_size, or
    num_nodes x gpus_per_node, as Bridge's and launchers' configurations do); given both, they
    must agree; given neither, the error asks for --gpus."""
    flags = ["estimate", "--hardware", "h100", "--model", "qwen3-30b-a3b", "--expert-model-parallel-size", "8", "--bf16"]
    assert main([*flags, "num_nodes=16", "gpus_per_node=8"]) == 0
    assert "on 128 x h100" in capsys.readouterr().out
    assert main([*flags, "--gpus", "128", "world_size=128"]) == 0
    capsys.readouterr()
    assert main([*flags, "--gpus", "64", "world_size=128"]) == 2
    assert "--gpus 64, but the configuration's world size is 128" in capsys.readouterr().err
    assert main(flags) == 2 and "--gpus N: give the GPUs of the run" in capsys.readouterr().err


def test_a_bridge_performance_script_command_estimates_as_its_fields(capsys, tmp_path):
    """Megatron-Bridge's performance-script flags (-g gb200 -mr qwen3_235b_a22b -ng 256 -tp 1
    -pp 4 -vp 12 -ep 32 -mb 1 -gb 8192 -c fp8_mx) stand for --hardware, --model, --gpus and the
    fields, over the recipe they pick (plan/bridge_recipes.py): the estimate is the one the
    Megatron spelling of the recipe's fields and the line's gives. --hardware or --model that
    contradict them are refused; a recipe of no catalog model asks for --model."""
    from expertrail.plan.bridge_recipes import recipes
    layout = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
              "--moe-router-force-load-balancing"]
    bridge = ["-m", "qwen3", "-mr", "qwen3_235b_a22b", "-g", "gb200", "-ng", "256", "-tp", "1", "-pp", "4", "-vp", "12",
              "-ep", "32", "-mb", "1", "-gb", "8192", "-c", "fp8_mx", *layout]
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(recipes()["qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config"]))
    megatron = [str(recipe), "--hardware", "gb200-nvl72", "--gpus", "256", "--model", "qwen3-235b-a22b",
                "--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "12",
                "--expert-model-parallel-size", "32", "--micro-batch-size", "1", "--global-batch-size", "8192",
                "mixed_precision=bf16_with_mxfp8_mixed", *layout]
    assert main(["estimate", *bridge]) == 0
    ours = capsys.readouterr().out
    assert main(["estimate", *megatron]) == 0
    theirs = capsys.readouterr().out
    def figures(out):
        return [line for line in out.splitlines() if line.startswith(("memory,", "step:", "throughput:"))]
    assert len(figures(ours)) == 3 and figures(ours) == figures(theirs)
    assert "read: qwen3_235b_a22b_pretrain_256gpu_gb200_fp8mx_config" in ours and "TP 1 PP 4 VPP 12" in ours
    assert main(["estimate", "--hardware", "h100", *bridge]) == 2
    assert "--hardware h100, but the configuration's hardware is gb200" in capsys.readouterr().err
    assert main(["estimate", "--hardware", "gb200-nvl72", *bridge]) == 0                  # the same system
    capsys.readouterr()
    assert main(["estimate", "-g", "b200", "-mr", "llama31_405b", "-ng", "8"]) == 2
    assert "-mr llama31_405b: a Megatron-Bridge recipe of no catalog model" in capsys.readouterr().err


def test_estimate_names_fields_no_configuration_has(capsys, tmp_path):
    """A mistyped flag would leave a layout at its default without a word: estimate warns of
    each field no Megatron or Bridge configuration has, with the closest known name, and lists
    them in its JSON."""
    path = tmp_path / "e.json"
    assert main(["estimate", "--hardware", "h100", "--gpus", "64", "--model", "qwen3-30b-a3b", "--bf16",
                 "--expert-model-parallel-size", "8", "--tensor-model-paralel-size", "2", "--json", str(path)]) == 0
    err = capsys.readouterr().err
    assert "unknown field 'tensor_model_paralel_size' (did you mean 'tensor_model_parallel_size'?)" in err
    assert json.loads(path.read_text())["unknown_fields"] == ["tensor_model_paralel_size"]


def test_a_configuration_without_precision_or_grouped_gemm_says_what_it_was_costed_as():
    """Megatron trains in FP32 without bf16 / fp16, and Megatron-LM runs the experts one GEMM after
    another without moe_grouped_gemm: neither is costed, so a configuration that leaves them out
    is costed as BF16 with grouped GEMMs and the assumed line says so; moe_grouped_gemm=false is
    named as not modelled."""
    flags = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "8",
             "--moe-router-force-load-balancing"]
    bare = TrainingLayout.from_fields(load_config(None, flags), 64)
    assert any(a.startswith("bf16=true (the configuration names no precision") for a in bare.assumed)
    assert "moe_grouped_gemm=true" in bare.assumed
    stated = TrainingLayout.from_fields(load_config(None, flags + ["--bf16", "--moe-grouped-gemm"]), 64)
    assert not any(a.startswith(("bf16", "moe_grouped_gemm")) for a in stated.assumed) and not stated.not_modelled
    sequential = TrainingLayout.from_fields(load_config(None, flags + ["--bf16", "--no-moe-grouped-gemm"]), 64)
    assert sequential.not_modelled == ("moe_grouped_gemm",)
    assert not any(a.startswith("bf16") for a in TrainingLayout.from_fields(
        load_config(None, flags + ["--fp8-format", "e4m3"]), 64).assumed)


def test_estimate_cli_is_torch_free_and_writes_json(tmp_path):
    path = tmp_path / "e.json"
    code = ("import sys; from expertrail.tools.cli import main; "
            "rc = main(['estimate', '--hardware', 'gb200-nvl72', '--gpus', '256', '--model', 'qwen3-235b-a22b', "
            "'--pipeline-model-parallel-size', '8', '--account-for-embedding-in-pipeline-split', '--account-for-loss-in-pipeline-split', '--expert-model-parallel-size', '32', '--global-batch-size', "
            f"'1024', 'model.moe_token_dispatcher_type=flex', '--json', r'{path}']); "
            "assert 'torch' not in sys.modules; sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "memory, busiest pipeline rank" in out.stdout and "wall:" in out.stdout
    js = json.loads(path.read_text())
    assert isinstance(js["fits"], bool) and {"peak_memory_GB", "step_time_s", "tflops_per_gpu", "memory", "step"} <= set(js)


def test_estimate_cli_errors_name_the_fix(capsys):
    assert main(["estimate", "--hardware", "h100", "--gpus", "256", "--expert-model-parallel-size", "8"]) == 2
    assert "--model" in capsys.readouterr().err
    assert main(["estimate", "--hardware", "h100", "--gpus", "100", "--model", "qwen3-235b-a22b",
                 "--pipeline-model-parallel-size", "8"]) == 2
    assert "does not divide 100 GPUs" in capsys.readouterr().err


def test_estimate_and_simulate_stay_fast_at_ep_4096():
    arch = replace(QWEN, name="wide", experts=8192)
    layout = TrainingLayout(gpus=4096, ep=4096, pp=1, dispatcher="flex", flex_backend="hybridep", global_batch=4096)
    start = time.perf_counter()
    estimate(arch, HARDWARE["gb200-nvl72"], layout)
    assert time.perf_counter() - start < 2.0
    start = time.perf_counter()                     # every algorithm at the default 4096 tokens per rank
    rows = simulate(HARDWARE["gb200-nvl72"], arch.moe_model(), 4096, [4096], [20])
    assert time.perf_counter() - start < 2.0 and {r["ep"] for r in rows} == {4096}


def test_uniform_routing_draws_distinct_experts_evenly():
    """Floyd's sampler: k distinct experts per token, each expert equally often."""
    model = replace(QWEN.moe_model(), num_experts=64, topk=8)
    idx = Routing("uniform").sample(model, 20000, seed=1)
    assert idx.shape == (20000, 8) and all(len(set(row)) == 8 for row in idx[:2000].tolist())
    counts = np.bincount(idx.ravel(), minlength=64)
    expected = 20000 * 8 / 64
    assert np.abs(counts - expected).max() < 5 * np.sqrt(expected)                # within 5 sigma


def test_plan_fit_lists_fitting_layouts_that_validate(capsys):
    assert main(["plan", "--fit", "--gpus", "64", "--hardware", "h100", "--model", "qwen3-30b-a3b", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count(" | ") == 4 and "peak GB" in out            # the header and 3 layouts
    assert main(["plan", "--fit", "--gpus", "64", "--hardware", "h100", "--model", "qwen3-30b-a3b", "--emit",
                 "megatron"]) == 0
    emitted = capsys.readouterr()
    flags = emitted.out.replace("\\\n", " ").split()
    assert "forced to balance" in emitted.err and "`expertrail estimate`" in emitted.err   # the table's routers, said
    assert main(["validate", *flags, "hardware=h100", "world_size=64"]) == 0
    assert main(["plan", "--fit", "--gpus", "8", "--hardware", "h100", "--model", "deepseek-v3"]) == 1
    out = capsys.readouterr().out
    assert "no layout of deepseek-v3 fits 8 x h100" in out
    # It names the layout that came closest, with the memory that one needs against what there is.
    from expertrail.plan.search import leanest
    r, lay = leanest(DSV3, HARDWARE["h100"], 8)
    assert not r["fits"] and lay.recompute == "full" and lay.micro_batch == 1
    assert f"needs {r['peak_memory_GB']:.0f} GB of {r['usable_memory_GB']:.0f} usable" in out
    assert leanest(DSV3, HARDWARE["h100"], 3) is None


def test_plan_fit_emits_bridge_overrides_in_their_sections_and_they_read_back(capsys):
    """--emit bridge writes each field where Megatron-Bridge's ConfigContainer keeps it (batch
    sizes in train, the distributed optimizer in ddp, EP overlap in comm_overlap, the precision as
    a mixed-precision recipe, the dataset's sequence length beside the model's, lists as
    [a,b]); validate accepts them and estimate reads back the layout the search costed."""
    from expertrail.plan.search import emit_layout, search
    r, layout = search(DSV3, HARDWARE["gb200-nvl72"], 256, global_batch=4096, precision="fp8", top=1)[0]
    lines = shlex.split(emit_layout(DSV3, HARDWARE["gb200-nvl72"], layout, "bridge"))
    assert "mixed_precision=bf16_with_mxfp8_mixed" in lines and "train.global_batch_size=4096" in lines
    assert f"dataset.seq_length={layout.seq}" in lines and "ddp.use_distributed_optimizer=true" in lines
    assert not any(line.startswith(("model.micro_batch_size", "model.fp8", "model.bf16")) for line in lines)
    assert main(["validate", *lines, "hardware=gb200-nvl72", "world_size=256"]) == 0
    capsys.readouterr()
    # The search costs forced balance; the emitted configuration leaves Megatron's natural router.
    assert main(["estimate", "--hardware", "gb200-nvl72", "--gpus", "256", "--model", "deepseek-v3", *lines,
                 "model.moe_router_force_load_balancing=true"]) == 0
    out = capsys.readouterr().out
    assert f"{r['step_time_s']:.2f} s" in out.split("step: ")[1][:12]
    # It states the gradient reduce and parameter gather the search overlapped (Megatron's default
    # is off), so nothing of the costed run is left to the assumed line.
    assert "ddp.overlap_grad_reduce=true" in lines and "ddp.overlap_param_gather=true" in lines
    assert "assumed" not in out
    from expertrail.plan.validate import parse_value
    assert parse_value("[mla_up_proj,moe_act]") == parse_value("['mla_up_proj', 'moe_act']") == ["mla_up_proj", "moe_act"]


def test_plan_fit_ranks_with_the_natural_router_on_request(capsys):
    """--router natural costs each layout with the model's trained router: no layout is faster
    than forced, Qwen3-235B's uneven router moves the lead to a smaller EP, and `estimate` of the
    emitted configuration (which leaves the router natural) gives the step the search costed."""
    from expertrail.plan.search import format_search, search
    qwen30, h100 = ARCHITECTURES["qwen3-30b-a3b"], HARDWARE["h100"]
    forced = search(qwen30, h100, 32, top=1)
    natural = search(qwen30, h100, 32, top=1, natural_routing=True)
    (fast, fast_layout), (slow, slow_layout) = forced[0], natural[0]
    assert slow_layout.ep < fast_layout.ep and slow["step_time_s"] > fast["step_time_s"]
    assert slow["layout"]["routing_imbalance"] > 1.0 == fast["layout"]["routing_imbalance"]
    assert "the model's natural router" in format_search(natural, qwen30, h100, 32)
    assert "routers forced to balance" in format_search(forced, qwen30, h100, 32)
    args = ["plan", "--fit", "--gpus", "32", "--hardware", "h100", "--model", "qwen3-30b-a3b", "--router", "natural"]
    assert main([*args, "--emit", "megatron"]) == 0
    flags = capsys.readouterr().out.replace("\\\n", " ").split()
    assert main(["estimate", "--hardware", "h100", "--gpus", "32", "--model", "qwen3-30b-a3b", *flags]) == 0
    assert f"step: {slow['step_time_s']:.2f} s" in capsys.readouterr().out
    # A router's loads as estimate --routing takes them: a hot-expert skew favours a smaller EP still.
    skewed = search(qwen30, h100, 32, top=1, natural_routing=True, routing="zipf:1.2")[0]
    assert skewed[1].ep <= slow_layout.ep and skewed[0]["layout"]["routing_imbalance"] > slow["layout"][
        "routing_imbalance"]
    assert "--router zipf:1.2" in format_search([skewed], qwen30, h100, 32)
    assert main([*args[:-1], "bogus"]) == 2 and "--router 'bogus'" in capsys.readouterr().err


def test_plan_fit_searches_the_micro_batch(capsys):
    """The micro-batch size is searched (1, 2, 4, 8 up to 32k tokens): Qwen3-30B on one B200 node
    is launch-bound at micro-batch 1 (as its published runs were, 9.3-9.7k tokens/s against
    26.9k at 4), so a larger one leads; each size starts from the recompute its smaller one
    needed, and --micro-batch fixes it."""
    from expertrail.plan.search import _recompute_choices, micro_batches, search
    assert micro_batches(4096) == [1, 2, 4, 8] and micro_batches(16384) == [1, 2] and micro_batches(65536) == [1]
    qwen30 = ARCHITECTURES["qwen3-30b-a3b"]
    found = search(qwen30, HARDWARE["b200"], 8, global_batch=512, precision="fp8", top=1000)
    sizes = {layout.micro_batch for _, layout in found}
    assert found[0][1].micro_batch > 1 and {1, 2, 4} <= sizes
    fixed = search(qwen30, HARDWARE["b200"], 8, global_batch=512, micro_batch=1, precision="fp8", top=100)
    assert {layout.micro_batch for _, layout in fixed} == {1}
    assert found[0][0]["step_time_s"] < fixed[0][0]["step_time_s"]
    # The same layout at a larger micro-batch never takes a lighter recompute than at a smaller one.
    order = {(g, m): i for i, (g, m) in enumerate(_recompute_choices(qwen30))}
    by_layout = {}
    for _, lay in found:
        key = (lay.tp, lay.cp, lay.pp, lay.ep, lay.etp, lay.ep_overlap)
        by_layout.setdefault(key, []).append((lay.micro_batch, order[(lay.recompute, lay.recompute_modules)]))
    for runs in by_layout.values():
        heaviness = [i for _, i in sorted(runs)]
        assert heaviness == sorted(heaviness)
    # Megatron's spellings of the batch sizes, as estimate takes them, work too.
    assert main(["plan", "--fit", "--gpus", "8", "--hardware", "b200", "--model", "qwen3-30b-a3b",
                 "--global-batch-size", "512", "--micro-batch-size", "2", "--top", "2"]) == 0
    rows = [line.split("|")[1].split() for line in capsys.readouterr().out.splitlines() if line.count("|") == 1]
    assert [row[3] for row in rows[1:]] == ["2", "2"]            # the MBS column, under its header


def test_plan_fit_recompute_choices_name_only_the_models_modules():
    """`plan --fit`'s light selective recompute takes MLA's up projection for DeepSeek-V3 and
    Gated DeltaNet's output norm for Qwen3-Next, neither for Qwen3-235B."""
    from expertrail.plan.search import _recompute_choices

    def light(name):
        return _recompute_choices(ARCHITECTURES[name])[1][1]
    assert light("deepseek-v3") == ("mla_up_proj", "moe_act", "layernorm")
    assert light("qwen3-next-80b-a3b") == ("gdn_norm_out", "moe_act", "layernorm")
    assert light("qwen3-235b-a22b") == ("moe_act", "layernorm")


def test_plan_fit_searches_gpu_counts_whose_dp_is_not_a_power_of_two(capsys):
    """72 GPUs (an NVL72 rack): without --global-batch each layout takes the first multiple of its
    DP x micro-batch from 1024 sequences, so layouts are found, PP 3, 9 and the other divisors
    tried too (Qwen3-235B fits one rack only at PP 9 or PP 3, which split its 94 layers unevenly); a
    --global-batch no layout's DP x micro-batch divides is refused naming the multiples that would
    work, not called a memory wall."""
    from expertrail.plan.search import default_global_batch, pp_sizes, search
    assert default_global_batch(72, 4096) == 1080 and default_global_batch(64, 4096) == 1024
    assert default_global_batch(3, 16384) == 258
    assert pp_sizes(72, 94) == [1, 2, 3, 4, 6, 8, 9, 12, 18, 24] and pp_sizes(1024, 61)[-1] == 32
    qwen30 = ARCHITECTURES["qwen3-30b-a3b"]
    found = search(qwen30, HARDWARE["gb200-nvl72"], 72, top=3)
    assert found and all(r["layout"]["global_batch"] % (lay.dp * lay.micro_batch) == 0 for r, lay in found)
    rack = search(QWEN, HARDWARE["gb200-nvl72"], 72, top=3)
    assert rack and {lay.pp for _, lay in rack} <= {3, 9} and all(r["fits"] for r, _ in rack)
    with pytest.raises(ConfigError, match="--global-batch 1001 is not a multiple of DP x micro-batch"):
        search(qwen30, HARDWARE["gb200-nvl72"], 1024, global_batch=1001)        # every DP even at PP <= 32


def test_tp_and_etp_must_split_the_models_heads_and_widths(capsys):
    """Megatron-Core refuses a TP that does not split the attention heads, or whose query groups
    are neither a multiple nor a divisor of it, and a TP / ETP that does not split the MLP widths:
    `estimate` refuses them by name, `validate --model` reports the same rules, and `plan --fit`
    never proposes them (72 GPUs offer TP 3 and 6)."""
    from expertrail.plan.search import _shapes
    assert QWEN.split_problems(8, 1) == [] and QWEN.split_problems(4, 4) == []    # 4 query groups, replicated at TP 8
    assert any("num_attention_heads 64" in p for p in QWEN.split_problems(3, 1))
    assert any("moe_ffn_hidden_size 2048 does not split over ETP 6" in p for p in DSV3.split_problems(2, 6))
    with pytest.raises(ConfigError, match="num_query_groups 4 is neither"):
        run("h100", QWEN, tp=3, pp=1, ep=8, etp=1, global_batch=1024)
    # The sequence: 2 x CP chunks, and each CP rank's part over TP under sequence parallelism.
    with pytest.raises(ConfigError, match="seq_length 4096 is not a multiple of 2 x CP 3"):
        estimate(QWEN, HARDWARE["h100"], TrainingLayout(gpus=48, cp=3, ep=8))
    with pytest.raises(ConfigError, match="does not split over TP 8"):
        estimate(QWEN, HARDWARE["h100"], TrainingLayout(gpus=64, tp=8, etp=1, ep=8, seq=4100))
    flags = ["--tensor-model-parallel-size", "6", "--expert-model-parallel-size", "4"]
    assert main(["validate", *flags, "--model", "deepseek-v3", "--gpus", "48", "hardware=h100"]) == 1
    out = capsys.readouterr().out
    assert all(f"[{rule}]" in out for rule in ("tp-splits-heads", "etp-splits-expert", "tp-splits-shared-expert"))
    for arch in (DSV3, QWEN, ARCHITECTURES["qwen3-next-80b-a3b"]):
        assert all(not arch.split_problems(tp, etp) for _, tp, _, _, _, etp in _shapes(arch, HARDWARE["gb200-nvl72"], 72))


def test_validate_with_model_and_gpus_checks_what_estimate_checks(capsys):
    """`validate --model --gpus` reads the model's layers, experts and top-k as `estimate` does:
    the same arguments give both the same violations (a 61-layer DeepSeek-V3 over PP 8 x VP 3
    among them), and neither option is an unknown field."""
    flags = ["--hardware", "gb200-nvl72", "--pipeline-model-parallel-size", "8",
             "--virtual-pipeline-model-parallel-size", "3", "--expert-model-parallel-size", "8",
             "--overlap-moe-expert-parallel-comm"]
    assert main(["estimate", "--model", "deepseek-v3", "--gpus", "64", *flags]) == 0
    from_estimate = sorted(line.split("]")[0] for line in capsys.readouterr().err.splitlines()
                           if line.startswith("validate: ["))
    assert main(["validate", *flags, "--model", "deepseek-v3", "--gpus", "64"]) == 1
    out = capsys.readouterr().out
    from_validate = sorted("validate: " + line.split("]")[0] for line in out.splitlines() if line.startswith("["))
    assert from_validate == from_estimate and "validate: [pipeline-split" in from_validate
    assert "unknown field" not in out
    assert main(["validate", *flags]) == 1                        # without the model: no layers to split
    assert "[pipeline-split]" not in capsys.readouterr().out


def test_plan_fit_writes_the_pipeline_split_megatron_builds(capsys):
    """A 61-layer DeepSeek-V3 (with its MTP layer) and a 94-layer Qwen3-235B split evenly over
    no PP > 1: `plan --fit` gives each layout a split Megatron builds (the embedding and loss
    counted, or a pipeline_model_parallel_layout), --emit writes it quoted for the shell, and
    validate, given the layers, accepts it as it is."""
    for model, hardware in (("deepseek-v3", "b200"), ("qwen3-235b-a22b", "h100")):
        assert main(["plan", "--fit", "--gpus", "256", "--hardware", hardware, "--model", model, "--emit",
                     "megatron"]) == 0
        printed = capsys.readouterr().out.replace("\\\n", " ")
        for tokens in (shlex.split(printed), printed.split()):      # pasted, or $(...) word splitting
            assert "--num-layers" in tokens and ("--pipeline-model-parallel-layout" in tokens
                                                 or "--account-for-embedding-in-pipeline-split" in tokens)
            assert main(["validate", *tokens, f"hardware={hardware}", "world_size=256"]) == 0
            assert capsys.readouterr().out.startswith("valid: ")
            assert main(["estimate", "--hardware", hardware, "--gpus", "256", "--model", model, *tokens]) == 0
            capsys.readouterr()


def test_plan_fit_tries_ep_overlap_where_megatron_allows_it(capsys):
    """Each layout with EP is searched with and without EP overlap (and delayed weight gradients):
    where the estimate puts it ahead it leads, every overlapped layout keeps validate's rules (VPP
    with PP, no full recompute), and the emitted configuration turns it on and validates."""
    from expertrail.plan.search import layout_fields, search
    found = search(DSV3, HARDWARE["gb200-nvl72"], 256, global_batch=4096, micro_batch=1, precision="fp8", top=40)
    overlapped = [layout for _, layout in found if layout.ep_overlap]
    assert overlapped and found[0][1].ep_overlap
    for layout in overlapped:
        assert layout.delay_wgrad and layout.recompute != "full" and (layout.pp == 1 or layout.vpp > 1)
        fields = layout_fields(DSV3, layout, HARDWARE["gb200-nvl72"])
        assert validate(dict(fields, hardware="gb200-nvl72", world_size=256)) == []
    plain = {(lay.tp, lay.cp, lay.pp, lay.ep, lay.etp) for _, lay in found if not lay.ep_overlap}
    assert plain                                                 # both kinds compete in one ranking
    assert main(["plan", "--fit", "--gpus", "256", "--hardware", "gb200-nvl72", "--model", "deepseek-v3", "--precision",
                 "fp8", "--global-batch", "4096", "--emit", "megatron"]) == 0
    assert "--overlap-moe-expert-parallel-comm" in capsys.readouterr().out


def test_terms_add_up_to_the_step():
    """estimate --json's terms_s: GEMM, attention, elementwise, recompute, EP, TP, pipeline, bubble,
    DP, optimizer (and FSDP, offload where set) sum to the step."""
    every = {"gemm", "attention", "elementwise", "recompute", "host_sync", "ep", "tp", "cp", "pipeline", "fsdp",
             "offload", "pp_bubble", "host_bound", "dp", "optimizer", "optimizer_offload"}
    for fields in (dict(tp=2, pp=8, vpp=4, ep=32, global_batch=2048, precision="fp8"),
                   dict(pp=4, ep=8, global_batch=1024, fsdp="optim_grads_params", offload_modules=("moe_act",),
                        optimizer_offload=1.0, ep_overlap=True, delay_wgrad=True)):
        r = run("h100", QWEN, **fields)
        assert sum(r["terms_s"].values()) == pytest.approx(r["step_time_s"], rel=1e-9)
        assert set(r["terms_s"]) == every                  # one shape, 0.0 for what a layout has none of
        assert all(type(v) is float for v in r["terms_s"].values())
    assert r["terms_s"]["tp"] == 0.0 and r["terms_s"]["cp"] == 0.0
    assert r["terms_s"]["fsdp"] >= 0 and r["terms_s"]["offload"] >= 0 and r["terms_s"]["optimizer_offload"] > 0


def test_fsdp_shards_more_with_each_strategy():
    base = dict(pp=1, ep=8, tp=2, micro_batch=4, global_batch=2048, recompute="full", recompute_method="uniform")
    totals = [run("h100", QWEN, fsdp=s, **base)["peak_memory_GB"] for s in
              (None, "optim", "optim_grads", "optim_grads_params")]
    assert totals == sorted(totals, reverse=True) and totals[-1] < usable_GB(80)
    # A published Megatron-FSDP run (Megatron-MoE-ModelZoo, 256 H100, TP 2 EP 8, no PP) fits only sharded.
    assert not run("h100", QWEN, **base)["fits"] and run("h100", QWEN, fsdp="optim_grads_params", **base)["fits"]


def test_megatron_fsdp_keeps_and_reduces_gradients_in_its_own_dtypes():
    """Megatron-FSDP's megatron_fsdp_main_grads_dtype / megatron_fsdp_grad_comm_dtype are read:
    "auto" (the default, said on the assumed line) keeps BF16 gradients and reduces them as kept,
    so an FP32 setting costs more memory and more FSDP traffic; an unknown dtype is refused
    by name; a non-FP32 megatron_fsdp_main_params_dtype is named as not modelled."""
    flags = ["--use-megatron-fsdp", "--bf16", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "8",
             "--micro-batch-size", "4", "--global-batch-size", "2048", "--recompute-granularity", "full",
             "--recompute-method", "uniform"]

    def layout(*extra):
        return TrainingLayout.from_fields(load_config(None, flags + list(extra)), 256)
    auto, fp32 = layout(), layout("--megatron-fsdp-main-grads-dtype", "fp32")
    assert (auto.main_grad_bytes, auto.grad_reduce_bytes) == (2, 2)
    assert {"megatron_fsdp_main_grads_dtype=auto (BF16)",
            "megatron_fsdp_grad_comm_dtype=auto (as the main gradients)"} <= set(auto.assumed)
    assert (fp32.main_grad_bytes, fp32.grad_reduce_bytes) == (4, 4)
    mixed = layout("--megatron-fsdp-main-grads-dtype", "fp32", "--megatron-fsdp-grad-comm-dtype", "bf16")
    assert (mixed.main_grad_bytes, mixed.grad_reduce_bytes) == (4, 2)
    assert (layout("--grad-reduce-in-bf16").main_grad_bytes, layout("--grad-reduce-in-bf16").assumed) == \
        (2, tuple(a for a in auto.assumed if not a.startswith("megatron_fsdp_")))
    small, large = (estimate(QWEN, HARDWARE["h100"], lay) for lay in (auto, fp32))
    assert small["memory"]["gradients_GB"] < large["memory"]["gradients_GB"]
    assert fsdp_seconds(QWEN, HARDWARE["h100"], auto, True) < fsdp_seconds(QWEN, HARDWARE["h100"], fp32, True)
    with pytest.raises(ConfigError, match="megatron_fsdp_main_grads_dtype='fp8'"):
        layout("--megatron-fsdp-main-grads-dtype", "fp8")
    assert layout("--megatron-fsdp-main-params-dtype", "bf16").not_modelled == ("megatron_fsdp_main_params_dtype",)
    assert layout("--megatron-fsdp-main-params-dtype", "fp32").not_modelled == ()


def test_ddp_keeps_gradients_in_bf16_when_told_to_reduce_them_so():
    """Megatron-LM keeps its DDP gradient buffers in FP32 under BF16 training unless
    grad_reduce_in_bf16 (or Bridge's grad_reduce_in_fp32 false) says otherwise; then it keeps and
    reduces them in BF16: half the gradient memory and half the DP traffic."""
    flags = ["--bf16", "--expert-model-parallel-size", "8", "--micro-batch-size", "1", "--global-batch-size", "256"]
    fp32, bf16, bridge = (TrainingLayout.from_fields(load_config(None, flags + extra), 64)
                          for extra in ([], ["--grad-reduce-in-bf16"], ["grad_reduce_in_fp32=false"]))
    assert (fp32.main_grad_bytes, fp32.grad_reduce_bytes) == (4, 4)
    assert (bf16.main_grad_bytes, bf16.grad_reduce_bytes) == (bridge.main_grad_bytes, bridge.grad_reduce_bytes) == (2, 2)
    a, b = (estimate(QWEN, HARDWARE["h100"], lay) for lay in (fp32, bf16))
    assert b["memory"]["gradients_GB"] == pytest.approx(a["memory"]["gradients_GB"] / 2)


def test_a_pipeline_layout_sets_vpp_as_megatron_derives_it():
    """VPP is the layout's stages over PP, over any VPP given beside it (said on the assumed line);
    a stage count PP does not divide is refused by name."""
    def layout(*flags):
        return TrainingLayout.from_fields(load_config(None, ["--pipeline-model-parallel-size", "2",
                                                             "--expert-model-parallel-size", "64", *flags]), 128)
    derived = layout("--pipeline-model-parallel-layout", "Et|t|(tt|)*29tL")     # ModelZoo's Kimi-K2 128k run
    assert derived.vpp == 16 and not [a for a in derived.assumed if a.startswith("virtual_")]
    given = layout("--pipeline-model-parallel-layout", "Et|t|(tt|)*29tL", "--virtual-pipeline-model-parallel-size", "4")
    assert given.vpp == 16 and any(a.startswith("virtual_pipeline_model_parallel_size=16") for a in given.assumed)
    assert [sum(s[0] for s in stage_layers(derived, 61, 0))] == [61]
    with pytest.raises(ConfigError, match="31 stages, which PP 2 does not divide"):
        layout("--pipeline-model-parallel-layout", "Et|(tt|)*29tL")


def test_optimizer_states_kept_on_the_host_between_updates():
    """chunked_optimizer_state_offload (alias offload_optimizer_states, as ModelZoo's Kimi-K2 128k
    run sets it) takes the optimizer states off the GPU for the forward and backward; the update
    stages them back once the activations are freed (through a window of
    optimizer_state_offload_chunk_size_mb for the moments), and the copies cost time."""
    base = dict(pp=2, vpp=16, layout_string="Et|t|(tt|)*29tL", ep=64, tp=16, etp=1, micro_batch=1, global_batch=128,
                seq=131072, precision="fp8",
                fp8_recipe="mxfp8", optimizer_state_bytes=4, recompute="selective",
                recompute_modules=("mla_up_proj", "mlp", "layernorm", "moe_act"), offload_modules=("expert_fc1",),
                gpus=128, dispatcher="flex", flex_backend="hybridep")
    arch, hw = ARCHITECTURES["kimi-k2"], HARDWARE["gb200-nvl72"]
    kept, away = (estimate(arch, hw, TrainingLayout(**base, optimizer_state_offload=f)) for f in (0.0, 1.0))
    assert not kept["fits"] and away["fits"]
    assert away["memory"]["optimizer_GB"] < kept["memory"]["optimizer_GB"] / 10
    assert away["terms_s"]["optimizer_offload"] > 0 == kept["terms_s"]["optimizer_offload"]
    # Short activations: the staged states set the peak, a small window less of it.
    small = dict(base, seq=4096, global_batch=512, offload_modules=())
    whole, windowed = (estimate(arch, hw, TrainingLayout(**small, optimizer_state_offload=1.0,
                                                         optimizer_state_chunk_MB=mb)) for mb in (0, 256))
    assert whole["peak_memory_GB"] > windowed["peak_memory_GB"]
    flags = ["--expert-model-parallel-size", "8", "--offload-optimizer-states"]
    assert TrainingLayout.from_fields(load_config(None, flags), 64).optimizer_state_offload == 1.0
    both = TrainingLayout.from_fields(load_config(None, flags + ["--optimizer-cpu-offload"]), 64)
    with pytest.raises(ConfigError, match="exclude each other"):
        estimate(QWEN, HARDWARE["h100"], both)


def test_optimizer_offload_as_bridge_measured_it():
    """Megatron-Bridge's measured optimizer CPU offloading (calibration.OFFLOAD_FIGURES, held
    out): the peak memory without it within 10%, each offloaded fraction's saving within 0.5 GB
    (the Adam moments leave the GPU, the FP32 main weights stay) and its step time against none
    within 10% (the host's Adam at CPU_ADAM_PARAMS_PER_S, an assumption this checks)."""
    fig = calibration.OFFLOAD_FIGURES
    arch, hw = ARCHITECTURES[fig["model"]], HARDWARE[fig["hardware"]]

    def at(fraction, *more):
        flags = fig["flags"] + fig["recompute"] + ["--optimizer-cpu-offload", "--optimizer-offload-fraction",
                                                   str(fraction), *more]
        return estimate(arch, hw, TrainingLayout.from_fields(load_config(None, flags), fig["gpus"]))
    none = at(0.0)
    assert none["peak_memory_GB"] == pytest.approx(fig["peak_GB"], rel=0.10)
    for fraction, saved in fig["saved_GB"].items():
        r = at(fraction)
        assert none["peak_memory_GB"] - r["peak_memory_GB"] == pytest.approx(saved, abs=0.5), fraction
        assert r["peak_memory_GB"] == pytest.approx(fig["peak_GB"] - saved, rel=0.10), fraction
        assert r["step_time_s"] / none["step_time_s"] == pytest.approx(fig["step_ratio"][fraction], rel=0.10), fraction
    for fraction, ratio in fig["step_ratio_overlapped"].items():
        r = at(fraction, "--overlap-cpu-optimizer-d2h-h2d")
        assert r["step_time_s"] / none["step_time_s"] == pytest.approx(ratio, rel=0.10)
    # At PP 1 and without recompute, as activation offloading needs, it ran out of memory: so does the estimate.
    flags = fig["flags"] + ["--pipeline-model-parallel-size", "1", "--cpu-offloading", "--cpu-offloading-num-layers", "16"]
    r = estimate(arch, hw, TrainingLayout.from_fields(load_config(None, flags), fig["gpus"]))
    static = sum(r["memory"][f"{part}_GB"] for part in ("weights", "gradients", "optimizer"))
    assert not r["fits"] and static == pytest.approx(fig["pp1_static_GB"], rel=0.10)


def test_host_optimizer_step_beside_its_copies_with_overlap_cpu_optimizer_d2h_h2d():
    """ModelZoo's optimizer-offload runs set overlap_cpu_optimizer_d2h_h2d: the host's step runs
    beside the copies, so the offload costs the longer of the two, not their sum."""
    flags = ["--pipeline-model-parallel-size", "8", "--pipeline-model-parallel-layout", "Et*8|(t*8|)*6t*5mL",
             "--expert-model-parallel-size", "32", "--global-batch-size", "8192",
             "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0"]
    serial, overlapped = (estimate(DSV3, HARDWARE["h100"], TrainingLayout.from_fields(load_config(None, flags + extra),
                                                                                      256))
                          for extra in ([], ["--overlap-cpu-optimizer-d2h-h2d"]))
    assert 0 < overlapped["terms_s"]["optimizer_offload"] < serial["terms_s"]["optimizer_offload"]
    assert "use_torch_optimizer_for_cpu_offload" in TrainingLayout.from_fields(
        load_config(None, flags + ["--use-torch-optimizer-for-cpu-offload"]), 256).not_modelled


def test_flex_dispatcher_fields_of_megatron_core_are_read():
    """Megatron-Core's unified moe_flex_dispatcher_num_sms (over the deprecated per-backend
    counts); the ncclep backend, costed as DeepEP and said so, its wire dtype from
    moe_dispatch_fwd_dtype; moe_expert_rank_capacity_factor bounding HybridEP's receive buffer,
    sized for the worst case without it."""
    def layout(*flags):
        base = ["--expert-model-parallel-size", "64", "--pipeline-model-parallel-size", "4",
                "--pipeline-model-parallel-layout", "Et*4|(t*4|)*14tmL", "--global-batch-size", "4096",
                "--moe-token-dispatcher-type", "flex", "--moe-router-force-load-balancing"]
        return TrainingLayout.from_fields(load_config(None, base + list(flags)), 256)
    hw = HARDWARE["gb200-nvl72"]
    assert layout("--moe-flex-dispatcher-backend", "hybridep", "--moe-flex-dispatcher-num-sms", "32",
                  "--moe-hybridep-num-sms", "16").dispatcher_sms == 32
    nccl, deep = layout("--moe-flex-dispatcher-backend", "ncclep"), layout("--moe-flex-dispatcher-backend", "deepep")
    assert any(a.startswith("moe_flex_dispatcher_backend=ncclep costed as DeepEP") for a in nccl.assumed)
    assert estimate(DSV3, hw, nccl)["terms_s"]["ep"] == pytest.approx(estimate(DSV3, hw, deep)["terms_s"]["ep"])
    fp8 = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--moe-flex-dispatcher-backend", "ncclep"]
    bf16_wire, fp8_wire = layout(*fp8), layout(*fp8, "--moe-dispatch-fwd-dtype", "mxfp8")
    assert estimate(DSV3, hw, fp8_wire)["terms_s"]["ep"] < estimate(DSV3, hw, bf16_wire)["terms_s"]["ep"]
    worst, bounded = (estimate(DSV3, hw, layout("--moe-flex-dispatcher-backend", "hybridep", *extra))
                      for extra in ([], ["--moe-expert-rank-capacity-factor", "1.5"]))
    assert bounded["memory"]["dispatcher_GB"] == pytest.approx(worst["memory"]["dispatcher_GB"] * 1.5 * 8 / 64)
    assert set(layout("--moe-flex-dispatcher-backend", "ncclep", "--moe-paged-stash", "--moe-ncclep-zero-copy",
                      "--moe-combine-bwd-dtype", "mxfp8").not_modelled) == \
        {"moe_paged_stash", "moe_ncclep_zero_copy", "moe_combine_bwd_dtype"}


def test_the_later_recipes_fusions_and_streams_are_named_not_modelled():
    """Megatron-Bridge's recipes after its 26.04 container (DeepSeek-V3 on GB300, MXFP8) set
    kernel fusions and streams that no run the constants were fitted on had: each is named,
    none silently read as the fitted baseline."""
    def layout(*flags):
        base = ["--expert-model-parallel-size", "32", "--pipeline-model-parallel-size", "2",
                "--global-batch-size", "4096", "--moe-token-dispatcher-type", "flex",
                "--moe-router-force-load-balancing"]
        return TrainingLayout.from_fields(load_config(None, base + list(flags)), 256)
    later = layout("--moe-flex-dispatcher-backend", "hybridep", "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8",
                   "--use-transformer-engine-op-fuser", "--moe-mlp-glu-interleave-size", "32", "--fp8-output-proj",
                   "--high-priority-a2a-comm-stream", "--moe-hybridep-num-sms-preprocessing", "32")
    assert {"use_transformer_engine_op_fuser", "moe_mlp_glu_interleave_size", "fp8_output_proj",
            "high_priority_a2a_comm_stream", "moe_hybridep_num_sms_preprocessing"} <= set(later.not_modelled)
    assert not layout("--moe-flex-dispatcher-backend", "hybridep").not_modelled


def test_megatron_lms_later_model_and_schedule_features_are_named_not_modelled():
    """Features of Megatron-LM the estimate does not cost (Mamba hybrids, hyper-connections, a
    non-gated MLP, GTP weight sharding, an all-to-all CP exchange, unfused attention) are named
    when set away from what it costs, and not when set to it (the ring CP exchange, fused or flash
    attention, a gated MLP, no GTP)."""
    def named(*flags):
        base = ["--expert-model-parallel-size", "8", "--global-batch-size", "256", "--context-parallel-size", "2"]
        return set(TrainingLayout.from_fields(load_config(None, base + list(flags)), 64).not_modelled)
    assert named("--enable-mhc-connections", "--cp-comm-type", "a2a", "--attention-backend", "unfused",
                 "--gtp-weight-remat-size", "2", "--hybrid-override-pattern", "M-M*-") == \
        {"enable_mhc_connections", "cp_comm_type", "attention_backend", "gtp_weight_remat_size",
         "hybrid_override_pattern"}
    assert not named("--cp-comm-type", "p2p", "--attention-backend", "flash", "--gtp-weight-remat-size", "1")
    assert named("gated_linear_unit=false") == {"gated_linear_unit"} and not named("gated_linear_unit=true")
    # GPT-OSS's sliding windows are costed as full attention (an upper bound) and named; its
    # quick GeGLU counts two matrices in Megatron's FLOPs, as the catalog's GPT-OSS does.
    assert named("--window-size", "128,0", "--window-attn-skip-freq", "2") == {"window_size"}
    shape = {"num_layers": 36, "hidden_size": 2880, "num_attention_heads": 64, "num_moe_experts": 128,
             "moe_ffn_hidden_size": 2880, "moe_router_topk": 4}
    assert from_fields(None, dict(shape, quick_geglu=True)).swiglu_count is False
    assert from_fields(None, shape).swiglu_count is True


def test_each_moe_layer_pays_a_host_synchronisation_per_micro_batch():
    """SYNC_S_PER_MOE_LAYER once per MoE layer and micro-batch (twice with the MoE recomputed),
    none with full-iteration CUDA graphs: a micro-batch of 2 spreads it over twice the tokens,
    which is why the published DeepSeek-V3 runs at micro-batch 2 beat micro-batch 1."""
    from expertrail.plan.estimate import SYNC_S_PER_MOE_LAYER
    base = dict(pp=2, vpp=8, ep=32, global_batch=4096, precision="fp8", fp8_recipe="mxfp8", **MLA_UP)
    one = run("gb300-nvl72", DSV3, micro_batch=1, **base)
    moe_layers = one["step"]["moe_syncs"]
    assert one["step"]["micro_batch_parts_s"]["host_sync"] == pytest.approx(moe_layers * SYNC_S_PER_MOE_LAYER)
    assert "host_sync" not in run("gb300-nvl72", DSV3, micro_batch=1, sync_free=True, **base)["step"]["micro_batch_parts_s"]
    again = run("gb300-nvl72", DSV3, micro_batch=1, **dict(base, recompute_modules=("mla_up_proj", "moe")))
    assert again["step"]["moe_syncs"] == 2 * moe_layers
    two = run("gb300-nvl72", DSV3, micro_batch=2, **base)
    assert two["terms_s"]["host_sync"] == pytest.approx(one["terms_s"]["host_sync"] / 2)
    assert two["tokens_per_s_per_gpu"] > one["tokens_per_s_per_gpu"]
    flags = ["--expert-model-parallel-size", "8", "--cuda-graph-impl", "full_iteration"]
    assert TrainingLayout.from_fields(load_config(None, flags), 64).sync_free


def test_cuda_graph_scope_is_read_as_megatron_reads_it():
    """cuda_graph_impl and cuda_graph_scope give the parts of each layer in graphs: none without
    an implementation, whole layers without a scope (or "full"), the listed parts otherwise (a
    list, or names split by spaces or commas), everything and no host synchronisation for the
    whole iteration; a value Megatron does not know is refused by name."""
    from expertrail.plan.layout import WHOLE_LAYER, graph_scopes
    assert graph_scopes(None, ["attn"]) == ((), False)
    assert graph_scopes("none", None, enabled=True) == (WHOLE_LAYER, False)
    assert graph_scopes("transformer_engine", []) == graph_scopes("transformer_engine", "full") == (WHOLE_LAYER, False)
    assert graph_scopes("transformer_engine", "moe_preprocess,attn moe_router") == \
        (("attn", "moe_router", "moe_preprocess"), False)
    assert graph_scopes("local", ["full_iteration"]) == graph_scopes("full_iteration", None) == (WHOLE_LAYER, True)
    with pytest.raises(ConfigError, match="cuda_graph_scope\\) 'atn'"):
        graph_scopes("transformer_engine", ["atn"])
    flags = ["--expert-model-parallel-size", "8", "--cuda-graph-impl", "transformer_engine",
             "--cuda-graph-scope", "attn", "moe_router", "moe_preprocess"]
    layout = TrainingLayout.from_fields(load_config(None, flags), 8)
    assert layout.graph_scopes == ("attn", "moe_router", "moe_preprocess") and not layout.sync_free
    assert "cuda_graph_scope" not in layout.not_modelled
    # Megatron-LM's newer name for the same field, read alike; both at once are refused, as it asserts.
    renamed = TrainingLayout.from_fields(load_config(None, [*flags[:4], "--cuda-graph-modules", *flags[5:]]), 8)
    assert renamed.graph_scopes == layout.graph_scopes
    both = load_config(None, flags + ["--cuda-graph-modules", "attn"])
    assert "graph-scope-or-modules" in {v.rule for v in validate(both)}
    with pytest.raises(ConfigError, match="cuda_graph_modules"):
        TrainingLayout.from_fields(both, 8)
    # validate and estimate agree on a scope Megatron refuses.
    bad = load_config(None, ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "atn"])
    assert any(v.rule == "field-value" and "cuda_graph_scope" in v.fields for v in validate(bad))
    with pytest.raises(ConfigError, match="cuda_graph_scope"):
        TrainingLayout.from_fields(bad, 8)


def test_the_host_launches_a_layer_as_its_cuda_graph_scope_says():
    """The host's launch floor counts the parts of a layer its CUDA graphs capture: the fit runs
    that pin the x86 floor (Qwen3-30B on one B200 node at micro-batch 1) captured the router and
    the preprocess, so those leave the floor as it is; attention in graphs takes its share down,
    whole-layer graphs most of it. Before, any implementation counted as whole-layer graphs and
    put those very runs at a quarter of their launch time."""
    from expertrail.plan.estimate import GRAPHED_LAUNCH_SHARE, HOST_S_PER_LAYER, LAUNCH_SHARES
    qwen30 = ARCHITECTURES["qwen3-30b-a3b"]

    def node(**fields):           # one B200 node at micro-batch 1, as the fit runs
        layout = TrainingLayout(gpus=8, ep=8, global_batch=512, precision="fp8", fp8_recipe="mxfp8",
                                dispatcher="flex", flex_backend="deepep", **fields)
        return estimate(qwen30, HARDWARE["b200"], layout)
    eager = node()
    layers = eager["step"]["layers"]
    assert eager["step"]["host_s"] == pytest.approx(HOST_S_PER_LAYER["x86"] * layers)
    assert eager["wall"] == "host"
    recipe = node(graph_scopes=("moe_router", "moe_preprocess"))
    assert recipe["step"]["host_s"] == pytest.approx(eager["step"]["host_s"])
    attn = node(graph_scopes=("attn", "moe_router", "moe_preprocess"))
    saved = LAUNCH_SHARES["moe"]["attn"] * (1 - GRAPHED_LAUNCH_SHARE)
    assert attn["step"]["host_s"] == pytest.approx(eager["step"]["host_s"] * (1 - saved))
    whole = node(graph_scopes=("attn", "mlp", "moe"))
    assert whole["step"]["host_s"] == pytest.approx(eager["step"]["host_s"] * GRAPHED_LAUNCH_SHARE)
    assert eager["tokens_per_s_per_gpu"] == recipe["tokens_per_s_per_gpu"] < attn["tokens_per_s_per_gpu"] \
        < whole["tokens_per_s_per_gpu"]
    # The wall's advice follows the scope: graphs where there are none, more of the layer where some.
    assert eager["wall_reason"].endswith("CUDA graphs or larger micro-batches")
    assert "more of each layer in CUDA graphs (now attn, moe_router, moe_preprocess)" in attn["wall_reason"]


def test_a_natural_router_waits_for_its_busiest_ep_rank():
    """Without moe_router_force_load_balancing (Megatron's default) each MoE layer waits for its
    busiest EP rank: its experts' GEMMs and its exchange take more than the mean rows, the more
    so with more ranks of fewer experts each; nothing changes with one EP rank or forced balance,
    and memory stays at the mean rows (a rank's layers in flight average their loads)."""
    from expertrail.plan.estimate import routing_imbalance
    base = dict(pp=8, vpp=4, tp=4, etp=1, global_batch=256, recompute="selective",
                recompute_modules=("layernorm", "moe"), embedding_in_split=True, loss_in_split=True)
    forced, natural = (run("h100", QWEN, ep=8, natural_routing=n, **base) for n in (False, True))
    excess = routing_imbalance(QWEN, TrainingLayout(gpus=256, ep=8, natural_routing=True))
    assert 1.2 < excess < 3 and natural["layout"]["routing_imbalance"] == excess
    assert forced["layout"]["routing_imbalance"] == 1.0
    parts = ("gemm", "ep", "recompute")
    assert all(natural["terms_s"][p] > forced["terms_s"][p] for p in parts)
    for p in ("attention", "host_sync", "tp"):
        assert natural["terms_s"][p] == pytest.approx(forced["terms_s"][p])
    assert natural["step"]["ep_comm_per_layer_s"] == pytest.approx(excess * forced["step"]["ep_comm_per_layer_s"])
    assert natural["peak_memory_GB"] == pytest.approx(forced["peak_memory_GB"])
    # An all-gather moves every token to every rank whatever the routing: only the GEMMs wait.
    gathered = [estimate(QWEN, HARDWARE["h100"], TrainingLayout(gpus=256, ep=8, dispatcher="allgather",
                                                                natural_routing=n, **base)) for n in (False, True)]
    assert gathered[1]["terms_s"]["ep"] == pytest.approx(gathered[0]["terms_s"]["ep"])
    assert gathered[1]["terms_s"]["gemm"] > gathered[0]["terms_s"]["gemm"]
    excesses = [routing_imbalance(QWEN, TrainingLayout(gpus=256, ep=ep, natural_routing=True)) for ep in (1, 8, 32, 128)]
    assert excesses[0] == 1.0 and excesses == sorted(excesses) and excesses[1] < excesses[2]
    # Megatron's default is the natural router; the flag forces every rank's even share.
    flags = ["--expert-model-parallel-size", "8"]
    assert TrainingLayout.from_fields(load_config(None, flags), 64).natural_routing
    assert not TrainingLayout.from_fields(load_config(None, flags + ["--moe-router-force-load-balancing"]), 64).natural_routing
    layout = TrainingLayout.from_fields(load_config(None, flags), 64)
    said = " ".join(estimate(QWEN, HARDWARE["h100"], layout)["assumed"])
    assert "busiest of 8 EP ranks" in said and "moe_router_force_load_balancing" in said


def test_a_routers_load_follows_how_its_checkpoint_was_balanced():
    """A natural router's busiest rank is costed by how the model's published router was trained
    to balance (`Architecture.router_balance`): over the whole batch (Qwen3's global-batch loss,
    DeepSeek-V3's and Kimi-K2's expert biases; any Hugging Face qwen3* config or noaux_tc router;
    Megatron's global_aux_loss or moe_router_enable_expert_bias) a micro-batch's experts are far
    less even than under a router balanced within each micro-batch (Mixtral's; Megatron's default
    aux_loss; the default), and the assumed line says which it took and where that is an
    extrapolation."""
    from expertrail.plan.architecture import from_hf_config
    from expertrail.plan.estimate import routing_imbalance
    mixtral, gpt_oss = ARCHITECTURES["mixtral-8x22b"], ARCHITECTURES["gpt-oss-120b"]
    assert QWEN.router_balance == DSV3.router_balance == ARCHITECTURES["kimi-k2"].router_balance == "global_batch"
    assert mixtral.router_balance == gpt_oss.router_balance == "micro_batch"
    hf = {"hidden_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 16, "moe_intermediate_size": 768,
          "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 1000}
    assert from_hf_config({**hf, "model_type": "qwen3_moe"}).router_balance == "global_batch"
    assert from_hf_config({**hf, "model_type": "deepseek_v3", "topk_method": "noaux_tc"}).router_balance == "global_batch"
    assert from_hf_config({**hf, "model_type": "deepseek_v2", "topk_method": "greedy"}).router_balance == "micro_batch"
    assert from_hf_config({**hf, "model_type": "mixtral"}).router_balance == "micro_batch"
    # A run that balances over the whole batch itself is costed so too.
    for fields in ({"moe_router_load_balancing_type": "global_aux_loss"},
                   {"moe_router_load_balancing_type": ["aux_loss", "global_aux_loss"]},
                   {"moe_router_enable_expert_bias": True}):
        assert from_fields(mixtral, fields).router_balance == "global_batch"
    assert from_fields(QWEN, {"moe_router_load_balancing_type": "aux_loss"}).router_balance == "global_batch"
    layout = TrainingLayout(gpus=64, ep=8, natural_routing=True)
    assert 1.02 < routing_imbalance(mixtral, layout) < 1.15 < 1.4 < routing_imbalance(QWEN, layout)
    said = " ".join(estimate(mixtral, HARDWARE["h100"], replace(layout, tp=2, etp=1))["assumed"])
    assert "balanced within each micro-batch" in said and "extrapolation" not in said
    said = " ".join(estimate(DSV3, HARDWARE["h100"], TrainingLayout(gpus=512, pp=8, ep=64, natural_routing=True))
                    ["assumed"])
    assert "balanced over the whole batch" in said
    assert "calibrated at 16 experts a rank, so at 4 the load model's extrapolation" in said


def test_a_benchmark_on_mock_data_routes_as_random_choices():
    """Megatron-LM's --mock-data feeds random tokens: a natural router has no text to specialise on,
    so its loads are costed as uniform random choices (--routing uniform), and the assumed line
    says so; forced balance, or --routing given, take precedence."""
    flags = ["--expert-model-parallel-size", "8", "--num-layers", "4", "--hidden-size", "2048",
             "--num-attention-heads", "32", "--num-experts", "128", "--moe-ffn-hidden-size", "768",
             "--moe-router-topk", "8", "--vocab-size", "1000"]
    mock = TrainingLayout.from_fields(load_config(None, flags + ["--mock-data"]), 64)
    assert mock.natural_routing and mock.routing == "uniform"
    assert any(a.startswith("mock_data: random tokens") for a in mock.assumed)
    assert TrainingLayout.from_fields(load_config(None, flags), 64).routing is None
    forced = TrainingLayout.from_fields(load_config(None, flags + ["--mock-data", "--moe-router-force-load-balancing"]), 64)
    assert not forced.natural_routing and forced.routing is None
    from expertrail.plan.estimate import routing_imbalance
    assert routing_imbalance(QWEN, mock) == pytest.approx(1.0, abs=0.05)
    assert routing_imbalance(QWEN, replace(mock, routing=None)) > 1.4


def test_a_capacity_factor_caps_the_busiest_rank_and_padding_sets_every_experts_rows():
    """moe_expert_capacity_factor c: each expert keeps at most c times its even share of the rows
    (the rest dropped), so the busiest EP rank's excess stays under c; padded to capacity
    (moe_pad_expert_input_to_capacity) every expert takes exactly c times its share, routed or
    forced, and keeps those rows' activations."""
    from expertrail.plan.estimate import routing_imbalance
    flags = ["--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall"]

    def layout(*extra):
        return TrainingLayout.from_fields(load_config(None, flags + list(extra)), 64)
    natural = routing_imbalance(QWEN, layout())
    capped = [routing_imbalance(QWEN, layout("--moe-expert-capacity-factor", c)) for c in ("1.0", "1.25", "2.0")]
    assert capped == sorted(capped) and capped[-1] <= natural and all(x < float(c) for x, c in zip(capped, ("1.0", "1.25", "2.0")))
    assert routing_imbalance(QWEN, layout("--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity")) == 1.5
    forced = layout("--moe-router-force-load-balancing", "--moe-expert-capacity-factor", "1.5",
                    "--moe-pad-expert-input-to-capacity")
    assert routing_imbalance(QWEN, forced) == 1.5
    assert routing_imbalance(QWEN, replace(forced, pad_to_capacity=False)) == 1.0
    assert not {"moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity"} & set(forced.not_modelled)
    plain, padded = (estimate(QWEN, HARDWARE["h100"], replace(forced, pad_to_capacity=p)) for p in (False, True))
    assert padded["terms_s"]["gemm"] > plain["terms_s"]["gemm"] and padded["terms_s"]["ep"] > plain["terms_s"]["ep"]
    assert padded["memory"]["activation_per_layer_GB"]["experts"] == \
        pytest.approx(1.5 * plain["memory"]["activation_per_layer_GB"]["experts"], rel=0.01)
    said = " ".join(estimate(QWEN, HARDWARE["h100"], layout("--moe-expert-capacity-factor", "1.0"))["assumed"])
    assert "at most 1x its even share" in said


def test_padding_to_capacity_spares_the_moe_layers_host_synchronisation():
    """Padded to capacity every expert's row count is known on the host (Megatron's drop_and_pad):
    no MoE layer waits on a device-to-host copy, so the step has no host_sync term; a capacity
    factor without padding still syncs (the kept rows are counted on the GPU)."""
    flags = ["--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall",
             "--moe-expert-capacity-factor", "1.0"]
    capped, padded = (estimate(QWEN, HARDWARE["h100"], TrainingLayout.from_fields(load_config(None, flags + extra), 64))
                      for extra in ([], ["--moe-pad-expert-input-to-capacity"]))
    assert capped["step"]["moe_syncs"] > 0 and capped["terms_s"]["host_sync"] > 0
    assert padded["step"]["moe_syncs"] == 0 and padded["terms_s"].get("host_sync", 0) == 0


def test_shared_expert_overlap_hides_the_exchange_behind_the_shared_experts():
    """moe_shared_expert_overlap runs a model's shared experts beside the dispatch and combine:
    each of the four exchanges is left what `pair_exposed` leaves beside its chunk of the shared
    experts' time, so less than without it, more than a chunk larger than every exchange leaves;
    a model without shared experts (Qwen3) is unchanged."""
    from expertrail.plan.estimate import pair_exposed, shared_overlap_exposed
    base = dict(pp=8, vpp=4, ep=32, global_batch=4096, **MLA_UP)
    plain, shared = (run("h100", DSV3, shared_expert_overlap=o, **base) for o in (False, True))
    assert shared["terms_s"]["ep"] < plain["terms_s"]["ep"]
    assert shared["terms_s"]["gemm"] == pytest.approx(plain["terms_s"]["gemm"])
    assert shared_overlap_exposed(4.0, 1e9, 0.0) == pytest.approx(4 * pair_exposed(1.0, 1e9, 0.0))
    assert shared_overlap_exposed(4.0, 0.0, 0.1) == pytest.approx(4.0)          # nothing beside it: all exposed
    assert 0 < shared_overlap_exposed(4.0, 6.0, 0.1) < 4.0
    qwen = [run("h100", QWEN, ep=8, pp=8, global_batch=1024, shared_expert_overlap=o) for o in (False, True)]
    assert qwen[0]["step_time_s"] == pytest.approx(qwen[1]["step_time_s"])


def test_device_limited_routing_is_group_limited_routing_over_the_ep_ranks():
    """moe_router_topk_limited_devices M (DeepSeek-V2's device-limited routing, deprecated) is read
    as Megatron-Core reads it: groups of one EP rank's experts, M of them per token; a token then
    reaches at most M ranks, so the exchange costs less than with free choices."""
    flags = ["--expert-model-parallel-size", "8", "--moe-router-force-load-balancing", "--moe-token-dispatcher-type",
             "flex"]
    free, limited = (from_fields(QWEN, load_config(None, flags + extra))
                     for extra in ([], ["--moe-router-topk-limited-devices", "2"]))
    assert (limited.num_groups, limited.group_topk) == (8, 2) and not free.group_topk
    layout = TrainingLayout.from_fields(load_config(None, flags + ["--moe-router-topk-limited-devices", "2"]), 64)
    assert "moe_router_topk_limited_devices" not in layout.not_modelled
    costs = [estimate(a, HARDWARE["h100"], layout)["step"]["ep_comm_per_layer_s"] for a in (free, limited)]
    assert costs[1] < costs[0]
    with pytest.raises(ConfigError, match="picks 16 of 8 groups"):      # more ranks than EP holds: refused
        from_fields(QWEN, load_config(None, flags + ["--moe-router-topk-limited-devices", "16"]))


def test_nvfp4_is_costed_as_fp8_and_says_so(capsys):
    """fp4 (--fp4-format, Bridge's bf16_with_nvfp4_mixed) runs the GEMMs in NVFP4: no published
    MoE run calibrates it, so they are costed at the FP8 efficiency and the assumed line says so;
    validate refuses it beside fp8 or on Hopper, and estimate prints that violation."""
    flags = ["--expert-model-parallel-size", "8", "--moe-router-force-load-balancing"]
    bf16, fp4 = (TrainingLayout.from_fields(load_config(None, flags + extra), 8)
                 for extra in ([], ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]))
    assert fp4.precision == "fp8" and fp4.fp8_recipe == "nvfp4"
    slow, fast = (estimate(ARCHITECTURES["qwen3-30b-a3b"], HARDWARE["b200"], l) for l in (bf16, fp4))
    assert fast["terms_s"]["gemm"] < slow["terms_s"]["gemm"]
    assert any("fp4 (NVFP4 GEMMs) costed at the FP8 efficiency" in a for a in fast["assumed"])
    assert main(["estimate", "--hardware", "h100", "--gpus", "8", "--model", "qwen3-30b-a3b", *flags,
                 "--fp4-format", "e2m1"]) == 0
    assert "[nvfp4-needs-blackwell]" in capsys.readouterr().err
    bridge = TrainingLayout.from_fields(load_config(None, ["mixed_precision=bf16_with_nvfp4_mixed", *flags]), 8)
    assert bridge.fp8_recipe == "nvfp4"


def test_estimate_takes_a_routers_loads_from_routing(tmp_path, capsys):
    """--routing gives the natural router's loads: a recording of your run's topk_idx (every rank's
    tokens counted), LoadRecorder's token counts, or a Zipf skew. A recording whose tokens all go to rank 0's experts makes
    that rank take every row: EP times the mean; a uniform router's noise leaves about the mean."""
    from expertrail.plan.estimate import routing_imbalance
    hot = tmp_path / "hot.npy"
    rng = np.random.default_rng(0)
    np.save(hot, np.stack([rng.integers(0, 16, size=(512, 8)) for _ in range(2)]))   # [world, N, K]
    layout = TrainingLayout(gpus=64, ep=8, natural_routing=True)
    assert routing_imbalance(QWEN, replace(layout, routing=str(hot))) == pytest.approx(8.0)
    assert routing_imbalance(QWEN, replace(layout, routing="uniform")) == pytest.approx(1.0, abs=0.05)
    assert routing_imbalance(QWEN, replace(layout, routing="zipf:1.2")) > routing_imbalance(QWEN, layout)
    assert routing_imbalance(QWEN, replace(layout, routing=str(hot), natural_routing=False)) == 1.0
    base = ["estimate", "--hardware", "h100", "--gpus", "64", "--model", "qwen3-235b-a22b", "--pipeline-model-parallel-size",
            "8", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "flex", "--global-batch-size", "512"]
    assert main(base + ["--routing", str(hot)]) == 0
    assert "the busiest of 8 EP ranks takes 8.00x the mean rows" in capsys.readouterr().out
    np.save(tmp_path / "wide.npy", np.full((4, 8), 200))
    assert main(base + ["--routing", str(tmp_path / "wide.npy")]) == 2
    assert "do not fit the 128 experts" in capsys.readouterr().err
    # LoadRecorder's token counts [layers, experts], as `expertrail balance --load` reads them:
    # rank 0's 16 experts at 3x the others' load take 48 of every 160 rows, 2.4x the mean.
    counts = np.ones((4, 128))
    counts[:, :16] = 3
    np.savetxt(tmp_path / "loads.csv", counts, delimiter=",")
    assert main(base + ["--routing", str(tmp_path / "loads.csv")]) == 0
    assert "takes 2.40x the mean rows in each MoE layer (the recorded loads" in capsys.readouterr().out
    np.savetxt(tmp_path / "few.csv", np.ones((2, 64)), delimiter=",")
    assert main(base + ["--routing", str(tmp_path / "few.csv")]) == 2
    assert "64 experts' counts, but qwen3-235b-a22b has 128" in capsys.readouterr().err
    np.save(tmp_path / "loads.npy", counts)                      # the same counts as .npy: read once
    assert main(base + ["--routing", str(tmp_path / "loads.npy")]) == 0
    assert "takes 2.40x the mean rows in each MoE layer (the recorded loads" in capsys.readouterr().out
    np.save(tmp_path / "negative.npy", -counts)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    for name, said in (("negative.npy", "--routing"), ("missing.npy", "cannot read it as .npy"),
                       ("objects.npy", "cannot read it as .npy")):
        assert main(base + ["--routing", str(tmp_path / name)]) == 2, name
        assert said in capsys.readouterr().err, name


def test_an_fp8_recipe_the_fit_did_not_run_is_said_to_be_costed_as_the_fitted_one():
    """One FP8 GEMM efficiency is fitted, on current-scaling (tensorwise) runs on Hopper and
    MXFP8 runs on Blackwell: another recipe (blockwise, Megatron's default delayed) is costed the
    same, and the assumed line says so."""
    def assumed(hardware, recipe):
        return [a for a in run(hardware, QWEN, pp=8, ep=32, global_batch=1024, precision="fp8",
                                fp8_recipe=recipe)["assumed"] if a.startswith("fp8_recipe")]
    assert assumed("h100", "tensorwise") == [] and assumed("gb200-nvl72", "mxfp8") == []
    assert assumed("h100", "blockwise") == ["fp8_recipe=blockwise costed at the efficiency fitted on tensorwise "
                                            "runs (hopper)"]
    assert assumed("b200", None) == ["fp8_recipe=delayed costed at the efficiency fitted on mxfp8 runs (blackwell)"]


def test_wall_counts_every_exposed_transfer():
    """The wall names FSDP's exposed collectives when they are the largest transfer, instead of
    calling a run whose micro-batch is half FSDP traffic compute-bound."""
    r = run("h100", QWEN, pp=1, ep=8, tp=2, micro_batch=4, global_batch=2048, recompute="full",
            recompute_method="uniform", fsdp="optim_grads_params")
    assert r["step"]["micro_batch_parts_s"]["fsdp"] > r["step"]["micro_batch_parts_s"]["ep"]
    assert r["wall"] == "communication" and "most of it fsdp" in r["wall_reason"]


def test_activation_offloading_moves_its_modules_tensors():
    base = dict(pp=4, vpp=6, ep=64, micro_batch=3, global_batch=3072, precision="fp8", fp8_recipe="mxfp8",
                recompute="selective", recompute_modules=("moe_act", "layernorm"))
    plain = run("gb200-nvl72", QWEN, **base)
    moved = run("gb200-nvl72", QWEN, offload_modules=("expert_fc1", "moe_act"), **base)
    assert moved["memory"]["activations_GB"] < plain["memory"]["activations_GB"] - 20
    assert not plain["fits"] and moved["fits"]       # ModelZoo: "activation offloading required"


def test_ep_overlap_hides_only_what_the_other_micro_batch_covers():
    from expertrail.plan.estimate import EP_OVERLAP_HIDES as h, ep_overlap_exposed
    assert ep_overlap_exposed(0.0, 1.0, 1.0, True, 0.15) == 0.0
    # Covered: the measured share hidden, the rest exposed; the hidden part costs the SMs it holds.
    assert ep_overlap_exposed(4.0, 30.0, 30.0, True, 0.0) == pytest.approx(4.0 * (1 - h))
    assert ep_overlap_exposed(4.0, 30.0, 30.0, True, 0.15) == pytest.approx(4.0 * (1 - h) + 4.0 * h * 0.15 / 0.85)
    # A chunk shorter than its exchange leaves the rest exposed.
    assert ep_overlap_exposed(4.0, 0.0, 0.0, False, 0.0) == pytest.approx(4.0)
    assert ep_overlap_exposed(4.0, 1.5, 3.0, True, 0.0) == pytest.approx(
        ep_overlap_exposed(4.0, 1.5, 3.0, False, 0.0))                          # wgrad moves, the sum stays


def test_narrow_attention_heads_run_slower():
    """64-wide heads (GPT-OSS) run fused attention at 0.67 of 128-wide heads' speed; MLA's
    192-wide query-key heads and 128-wide heads at full speed."""
    from expertrail.plan.estimate import attention_speed
    assert attention_speed(ARCHITECTURES["gpt-oss-120b"]) == pytest.approx(0.67)
    assert attention_speed(QWEN) == attention_speed(DSV3) == 1.0
    wide, narrow = (layer_seconds(a, HARDWARE["gb200-nvl72"], TrainingLayout(gpus=64, ep=8), True, 0.0)["attention"]
                    for a in (replace(QWEN, head_dim=128), replace(QWEN, head_dim=64)))
    assert narrow == pytest.approx(wide / 2 / 0.67)          # half the FLOPs at 0.67 of the speed


def test_gated_deltanet_core_is_costed_at_its_measured_kernel_share():
    """Qwen3-Next's Gated DeltaNet layers: their projections are GEMMs, their convolution and
    delta rule (Megatron's count) run at LINEAR_ATTENTION_EFFICIENCY of the peak, as measured on
    FLA's kernels, in the layer's attention term; the model FLOPs stay Megatron's."""
    from expertrail.plan import estimate as est
    arch, hw = ARCHITECTURES["qwen3-next-80b-a3b"], HARDWARE["h100"]
    layout = TrainingLayout(gpus=64, ep=8)
    flops = arch.layer_flops(4096, True)
    qk, v, in_proj, conv = arch.linear_widths()
    assert arch.linear_core_flops() == 2 * (4 * conv + 4 * 32 * 128 ** 2)
    assert flops["linear_core"] == pytest.approx(36 / 48 * arch.linear_core_flops())
    no_linear = replace(arch, linear_layers=0)
    softmax_only = layer_seconds(arch, hw, layout, True, 0.0)["attention"] - 3 * layout.tokens_per_gpu * \
        flops["linear_core"] / (hw.bf16_TFLOPS * 1e12 * est.LINEAR_ATTENTION_EFFICIENCY * est.SYSTEM_SPEED["h100"])
    assert softmax_only == pytest.approx(layer_seconds(no_linear, hw, layout, True, 0.0)["attention"] / 4)
    # The linear core weighs more than its FLOPs at a GEMM's rate: 1.8 ms a layer at 4096 tokens.
    linear = layer_seconds(arch, hw, layout, True, 0.0)["attention"] - softmax_only
    assert 1.5e-3 < linear * 48 / 36 < 2.2e-3


def test_moe_enable_deepep_selects_deepep_as_megatron_does(capsys):
    """Megatron-Core maps the deprecated ``--moe-enable-deepep`` onto the DeepEP backend of the flex
    dispatcher: validate then finds no missing backend, and estimate costs DeepEP."""
    flags = ["--pipeline-model-parallel-size", "8", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--expert-model-parallel-size", "32",
             "--global-batch-size", "1024", "--moe-token-dispatcher-type", "flex"]
    values = load_config(None, flags + ["--moe-enable-deepep"])
    assert [v.rule for v in validate(values)] == []
    assert TrainingLayout.from_fields(values, 256).flex_backend == "deepep"
    assert main(["estimate", "--hardware", "h100", "--gpus", "256", "--model", "qwen3-235b-a22b", *flags,
                 "--moe-enable-deepep"]) == 0
    assert "flex-backend" not in capsys.readouterr().err
    # Without a backend, Megatron-Core's default (DeepEP) is costed and said to be assumed.
    assert "moe_flex_dispatcher_backend=deepep" in TrainingLayout.from_fields(load_config(None, flags), 256).assumed
    assert "deepep-needs-flex" in [v.rule for v in validate(load_config(None, ["--moe-enable-deepep"]))]


def test_fields_the_estimate_leaves_out_are_named_and_sequence_parallel_is_required_with_tp(capsys):
    """FP8 weights change memory but are not modelled: the estimate names them (shared-expert
    overlap is read). An MoE model with TP > 1 needs sequence parallelism in Megatron-Core:
    estimate assumes it (and says so), validate refuses an explicit false."""
    flags = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "8", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
             "--expert-model-parallel-size", "32", "--global-batch-size", "1024", "--fp8-format", "e4m3",
             "--fp8-recipe", "blockwise"]
    layout = TrainingLayout.from_fields(load_config(None, flags + ["--fp8-param-gather", "--moe-shared-expert-overlap"]),
                                        512)
    assert "fp8_param_gather" in layout.not_modelled and "moe_shared_expert_overlap" not in layout.not_modelled
    assert layout.shared_expert_overlap
    assert "sequence_parallel=true" in layout.assumed
    assert main(["estimate", "--hardware", "h100", "--gpus", "512", "--model", "qwen3-235b-a22b", *flags,
                 "--no-sequence-parallel"]) == 0
    assert "[moe-tp-needs-sp]" in capsys.readouterr().err


def test_older_recompute_switches_are_read_and_other_memory_fields_named():
    def layout(*flags):
        return TrainingLayout.from_fields(load_config(None, ["--expert-model-parallel-size", "8", *flags]), 64)
    assert (layout("--recompute-activations").recompute, layout("--recompute-activations").recompute_modules) == \
        ("selective", ("core_attn",))
    assert layout("--moe-layer-recompute").recompute_modules == ("moe",)
    assert layout("--recompute-activations", "--moe-layer-recompute").recompute_modules == ("core_attn", "moe")
    assert set(layout("--use-torch-fsdp2", "--main-params-dtype", "bf16").not_modelled) == \
        {"use_torch_fsdp2", "main_params_dtype"}
    assert layout("--num-distributed-optimizer-instances", "2", "--main-params-dtype", "fp32").not_modelled == ()
    # Fields whose Megatron default is true or a number are named only when set away from it.
    assert set(layout("--no-fp8-wgrad", "--moe-latent-size", "1024", "--moe-token-dropping",
                      "--fp8-dot-product-attention", "--first-last-layers-bf16").not_modelled) == \
        {"fp8_wgrad", "moe_latent_size", "moe_token_dropping", "fp8_dot_product_attention", "first_last_layers_bf16"}
    assert layout("--activation-offload-fraction", "1.0").not_modelled == ()


def test_megatrons_newer_recompute_modules_are_read_or_named():
    """gdn_norm_out recomputes Gated DeltaNet's output norm (its output no longer kept, a memory
    pass more), only on a model with Gated DeltaNet; core_attn recomputes softmax attention's core,
    not Gated DeltaNet's; GatedDeltaProduct's and hyper-connections' modules are accepted and named."""
    from expertrail.plan.memory import layer_activation_bytes

    def layout(*modules):
        flags = ["--expert-model-parallel-size", "8", "--recompute-granularity", "selective",
                 "--recompute-modules", *modules]
        return TrainingLayout.from_fields(load_config(None, flags), 64)
    arch, hw = ARCHITECTURES["qwen3-next-80b-a3b"], HARDWARE["h100"]
    plain, norm_out = layout("moe_act"), layout("moe_act", "gdn_norm_out")
    kept = [sum(layer_activation_bytes(arch, lay, True).values()) for lay in (plain, norm_out)]
    v = arch.linear_v_heads * arch.linear_v_dim
    assert kept[0] - kept[1] == pytest.approx(arch.linear_share * v * 2 * plain.tokens_per_gpu)
    assert layer_seconds(arch, hw, norm_out, True, 0.0)["recompute"] > layer_seconds(arch, hw, plain, True, 0.0)["recompute"]
    with pytest.raises(ConfigError, match="gdn_norm_out"):
        estimate(QWEN, hw, replace(norm_out, gpus=256))
    core = layer_seconds(arch, hw, layout("core_attn"), True, 0.0)["recompute"]
    softmax_only = layer_seconds(replace(arch, linear_layers=0), hw, layout("core_attn"), True, 0.0)["recompute"]
    assert core == pytest.approx(softmax_only / 4)            # a quarter of the layers attend with softmax
    named = layout("moe_act", "gdp_qkv", "mhc")
    assert named.recompute_modules == ("moe_act",)
    assert set(named.not_modelled) == {"recompute_modules=gdp_qkv", "recompute_modules=mhc"}
    with pytest.raises(ConfigError, match="choose among"):
        layout("attn_norm")


@pytest.mark.parametrize("run_id, faster, slower, published", [
    ("25.11 gb200 qwen3-235b-a22b bf16 1/8/3/32 mbs1 gbs8192", ("flex", "hybridep"), ("alltoall", None), 698 / 665),
    ("26.02 gb200 qwen3-235b-a22b mxfp8 1/8/1/32 mbs1 gbs8192", ("flex", "hybridep"), ("alltoall", None), 800 / 728),
    ("26.02 gb200 deepseek-v3 mxfp8 1/4/4/64 mbs1 gbs4096", ("flex", "hybridep"), ("flex", "deepep"), 943 / 829),
])
def test_dispatchers_on_gb200_rank_as_hybrid_eps_blog_publishes(run_id, faster, slower, published):
    """Held out: Hybrid-EP's blog runs GB200 with two dispatchers (docs/cost-model.md,
    "Dispatchers, held out"). The order is right; the ratio within 3 points against NCCL's
    all-to-all and within 10 against DeepEP (whose rack bandwidth is a cited measurement)."""
    run = calibration.TRAINING_RUNS[run_id]
    layout, arch, hw = calibration.layout_of(run), ARCHITECTURES[run["model"]], HARDWARE[run["system"]]

    def tflops(dispatcher, backend):
        return estimate(arch, hw, replace(layout, dispatcher=dispatcher, flex_backend=backend))["tflops_per_gpu"]
    ratio = tflops(*faster) / tflops(*slower)
    assert ratio > 1
    assert abs(ratio - published) < (0.03 if slower[0] == "alltoall" else 0.10)


def _random_flags(rng, arch) -> list:
    """One random Megatron-LM command line over the knobs that decide whether a layout builds."""
    pick = rng.choice
    tp, pp, cp = int(pick([1, 1, 2, 4, 8])), int(pick([1, 2, 4, 8, 16])), int(pick([1, 1, 1, 2, 4]))
    ep = int(pick([e for e in (1, 2, 4, 8, 16, 32, 64) if arch.experts % e == 0]))
    flags = ["--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp, "--context-parallel-size", cp,
             "--expert-model-parallel-size", ep, "--micro-batch-size", pick([1, 2, 4]),
             "--seq-length", pick([4096, 8192, 32768]), "--global-batch-size", pick([256, 1024, 4096]), "--bf16"]
    if tp > 1:
        flags.append("--sequence-parallel")
    extra = [["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"],
             ["--num-layers-per-virtual-pipeline-stage", pick([1, 2, 4])],
             ["--num-virtual-stages-per-pipeline-rank", pick([2, 4])],
             ["--decoder-first-pipeline-num-layers", pick([2, 4, 6]), "--decoder-last-pipeline-num-layers", pick([2, 4, 6])],
             ["--expert-tensor-parallel-size", pick([1, 2])], ["--mtp-num-layers", 1],
             ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", pick(["deepep", "hybridep"])],
             ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute", "--moe-token-dispatcher-type", "alltoall"],
             ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1],
             ["--moe-layer-freq", pick([1, 2, "([0]*3+[1]*58)"])], ["--cpu-offloading", "--cpu-offloading-num-layers", 2]]
    for i in rng.choice(len(extra), size=3, replace=False):
        flags += extra[i]
    return [str(f) for f in flags]


def test_validate_and_estimate_agree_on_what_is_valid():
    """A configuration validate accepts, estimate estimates (it refuses nothing validate lets
    through), over random layouts of every catalog model on every system; validate refuses the
    rest with a rule. (Random flags, a fixed seed: 400 configurations, of which a few dozen build.)"""
    rng = np.random.default_rng(37)
    built = 0
    for _ in range(400):
        name, system = rng.choice(sorted(ARCHITECTURES)), rng.choice(sorted(HARDWARE))
        gpus = int(rng.choice([16, 64, 256, 1024]))
        values = load_config(None, _random_flags(rng, ARCHITECTURES[name]))
        try:
            arch = from_fields(ARCHITECTURES[name], values)
        except ConfigError:                     # moe_layer_freq of another model's length: validate's rule too
            assert "moe-layer-pattern" in {v.rule for v in validate(dict(values, num_layers=ARCHITECTURES[name].layers))}
            continue
        from expertrail.plan.validate import with_model_fields
        with_model_fields(values, arch)
        if validate(dict(values, hardware=system, world_size=gpus)):
            continue
        r = estimate(arch, HARDWARE[system], TrainingLayout.from_fields(values, gpus))
        assert r["step_time_s"] > 0 and r["peak_memory_GB"] > 0, (name, system, gpus, values)
        built += 1
    assert built >= 20


def test_a_system_no_published_run_calibrates_says_its_speed_and_refuses_fp8_it_lacks():
    """A100 (and a user's catalog file) has no fitted speed: the assumed line says it runs at
    GB200's share of its datasheet peak; a fitted system, or one on a fitted system's GPU, says
    nothing; FP8 on a GPU without FP8 tensor cores is refused naming bf16, not costed as BF16."""
    from dataclasses import replace

    from expertrail.plan.catalog import HARDWARE
    layout = TrainingLayout.from_fields({"expert_model_parallel_size": 8, "pipeline_model_parallel_size": 4,
                                         "bf16": True}, 64)
    arch = ARCHITECTURES["mixtral-8x7b"]
    said = {h: [a for a in estimate(arch, hw, layout)["assumed"] if "sustained speed" in a]
            for h, hw in (("a100", HARDWARE["a100"]), ("h200", HARDWARE["h200"]),
                          ("mine", replace(HARDWARE["h100"], name="my-h100-pod")))}
    assert said["h200"] == [] and "a100's sustained speed 1.0" in said["a100"][0] and len(said["mine"]) == 1
    fp8 = TrainingLayout.from_fields({"expert_model_parallel_size": 8, "fp8": "hybrid"}, 64)
    with pytest.raises(ConfigError, match="FP8 on a100.*train in bf16"):
        estimate(arch, HARDWARE["a100"], fp8)
    from expertrail.plan.search import format_search, search
    table = format_search(search(arch, HARDWARE["a100"], 64, top=2), arch, HARDWARE["a100"], 64)
    assert "assumed (every layout): a100's sustained speed 1.0" in table


def test_a_system_on_a_fitted_systems_gpu_takes_its_speed():
    """H200 and H800 run H100's GPU (H200 with faster HBM, H800 with fewer NVLink lanes): their
    GEMMs and attention take H100's fitted speed, not the unfitted default; the same layout on
    H200 is then no slower than on H100."""
    from expertrail.plan.catalog import HARDWARE
    from expertrail.plan.estimate import SYSTEM_SPEED, _speed
    assert _speed(HARDWARE["h200"]) == _speed(HARDWARE["h800"]) == SYSTEM_SPEED["h100"] != 1.0
    assert _speed(HARDWARE["gb200-nvl36"]) == SYSTEM_SPEED["gb200-nvl72"]
    layout = TrainingLayout.from_fields({"expert_model_parallel_size": 8, "bf16": True,
                                         "moe_router_force_load_balancing": True}, 64)
    arch = ARCHITECTURES["mixtral-8x7b"]
    h100, h200 = (estimate(arch, HARDWARE[h], layout)["step_time_s"] for h in ("h100", "h200"))
    assert h200 <= h100


def test_muon_keeps_one_moment_and_other_optimizers_are_named():
    """--optimizer muon keeps one FP32 momentum beside the main weight (Adam two moments), sharded
    over DP with the distributed optimizer and by dist_muon itself; an optimizer the estimate does
    not cost (lion) is named as not modelled."""
    base = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--num-experts", "64",
            "--moe-router-topk", "4", "--moe-ffn-hidden-size", "768", "--expert-model-parallel-size", "8", "--bf16"]
    adam, muon, dist = (TrainingLayout.from_fields(load_config(None, base + extra), 64)
                        for extra in ([], ["--optimizer", "muon"], ["--optimizer", "dist_muon",
                                                                   "--no-use-distributed-optimizer"]))
    assert (adam.optimizer_state_bytes, muon.optimizer_state_bytes, dist.optimizer_state_bytes) == (8, 4, 4)
    assert muon.distributed_optimizer and dist.distributed_optimizer
    assert any(a.startswith("optimizer=muon: one moment a parameter, sharded over DP") for a in muon.assumed)
    lion = TrainingLayout.from_fields(load_config(None, base + ["--optimizer", "lion"]), 64)
    assert "optimizer=lion (costed as Adam)" in lion.not_modelled and lion.optimizer_state_bytes == 8


def test_optimizer_instances_shard_the_optimizer_over_each_replica():
    """num_distributed_optimizer_instances=n splits the data-parallel ranks into n replicas of the
    sharded optimizer: its state per GPU grows n-fold (dense over DP x CP / n, experts over
    expert-DP / n), the replicas all-reduce their shard's gradients, and an n that does not divide
    both groups is refused by estimate and validate alike."""
    base = ["--expert-model-parallel-size", "8", "--micro-batch-size", "1", "--global-batch-size", "256", "--bf16"]
    hw = HARDWARE["h100"]
    one, two = (TrainingLayout.from_fields(load_config(None, base + extra), 64)
                for extra in ([], ["--num-distributed-optimizer-instances", "2"]))
    assert (one.shard_groups, two.shard_groups) == ((64, 8), (32, 4)) and not two.not_modelled
    a, b = estimate(QWEN, hw, one), estimate(QWEN, hw, two)
    assert b["memory"]["optimizer_GB"] == pytest.approx(2 * a["memory"]["optimizer_GB"], rel=1e-6)
    assert b["memory"]["weights_GB"] == pytest.approx(a["memory"]["weights_GB"])
    assert b["terms_s"]["dp"] > a["terms_s"]["dp"]
    three = TrainingLayout.from_fields(load_config(None, base + ["--num-distributed-optimizer-instances", "3"]), 64)
    with pytest.raises(ConfigError, match="num_distributed_optimizer_instances=3 must divide"):
        estimate(QWEN, hw, three)
    config = load_config(None, base + ["--num-distributed-optimizer-instances", "3", "--world-size", "64",
                                       "--num-experts", "128"])
    assert [v.rule for v in validate(config)] == ["optimizer-instances-divide"]


def test_hsdp_outer_sharding_spreads_the_optimizer_across_the_replicas():
    """Megatron-FSDP with several optimizer instances (HSDP) shards weights and gradients within a
    replica; outer_dp_sharding_strategy=optim shards the optimizer across the replicas as well
    (back to 1 / DP), no_shard keeps a whole copy of the replica's shard; other values refused."""
    base = ["--expert-model-parallel-size", "8", "--micro-batch-size", "1", "--global-batch-size", "256", "--bf16",
            "--use-megatron-fsdp", "--num-distributed-optimizer-instances", "4"]
    hw = HARDWARE["h100"]
    replicated, sharded = (TrainingLayout.from_fields(load_config(None, base + ["--outer-dp-sharding-strategy", o]), 64)
                           for o in ("no_shard", "optim"))
    flat = TrainingLayout.from_fields(load_config(None, base[:-2]), 64)
    assert sharded.optimizer_groups == flat.optimizer_groups == (64, 8) and replicated.optimizer_groups == (16, 2)
    a, b, c = (estimate(QWEN, hw, lay)["memory"] for lay in (replicated, sharded, flat))
    assert a["optimizer_GB"] == pytest.approx(4 * b["optimizer_GB"], rel=1e-6)
    assert b["optimizer_GB"] == pytest.approx(c["optimizer_GB"], rel=1e-6)
    assert a["weights_GB"] == pytest.approx(b["weights_GB"]) and b["weights_GB"] > c["weights_GB"]
    from expertrail.plan.estimate import format_estimate
    header = format_estimate(estimate(QWEN, hw, sharded)).split("\n")[0]
    assert header.endswith(", Megatron-FSDP optim_grads_params, 4 optimizer instances")
    with pytest.raises(ConfigError, match="outer_dp_sharding_strategy='optim_grads'"):
        TrainingLayout.from_fields(load_config(None, base + ["--outer-dp-sharding-strategy", "optim_grads"]), 64)


def test_kernel_fusions_are_costed_fused_and_said_so():
    """The fusions Megatron leaves off but every calibrating run turns on are assumed (named on
    the assumed line where a configuration leaves them out); any fusion set false is named as
    not modelled, never silently costed fused."""
    def layout(*extra):
        return TrainingLayout.from_fields(load_config(None, ["--expert-model-parallel-size", "8", "--bf16", *extra]), 64)
    fusions = {"moe_permute_fusion=true", "moe_router_fusion=true", "cross_entropy_loss_fusion=true"}
    assert fusions <= set(layout().assumed)
    fused = layout("--moe-permute-fusion", "--moe-router-fusion", "--cross-entropy-loss-fusion")
    assert not fusions & set(fused.assumed) and not fused.not_modelled
    off = layout("moe_permute_fusion=false", "--no-gradient-accumulation-fusion", "--moe-router-fusion")
    assert set(off.not_modelled) == {"moe_permute_fusion", "gradient_accumulation_fusion"}
