"""The planner reads what users write: Megatron's pipeline fields as Megatron means them, Hugging
Face config.json models everywhere, wrong values refused by name, and unmodelled fields named."""
import json

import pytest

from expertrail.errors import ConfigError
from expertrail.plan.architecture import ARCHITECTURES, load_architecture
from expertrail.plan.catalog import HARDWARE
from expertrail.plan.estimate import estimate
from expertrail.plan.layout import TrainingLayout, expand_layout, megatron_split, stage_layers
from expertrail.plan.validate import load_config
from expertrail.tools.cli import main

QWEN, DSV3 = ARCHITECTURES["qwen3-235b-a22b"], ARCHITECTURES["deepseek-v3"]


def test_embedding_and_loss_take_a_layer_slot_as_megatron_splits_them():
    """PP 32 x VPP 3 of a 94-layer model: 96 slots with the embedding and the loss counted."""
    fields = {"pipeline_model_parallel_size": 32, "virtual_pipeline_model_parallel_size": 3,
              "expert_model_parallel_size": 8}
    plain = TrainingLayout.from_fields(fields, 256)
    [problem] = plain.problems(QWEN.experts, QWEN.layers)
    assert problem.startswith("94 layers do not split evenly over PP 32 (Megatron-Core asserts)")
    counted = TrainingLayout.from_fields(dict(fields, account_for_embedding_in_pipeline_split=True,
                                              account_for_loss_in_pipeline_split=True), 256)
    assert counted.problems(QWEN.experts, QWEN.layers) == []
    ranks = stage_layers(counted, QWEN.layers, 0)
    assert sum(r[0] for r in ranks) == 94 and ranks[0][0] == 2 and ranks[-1][0] == 2 and ranks[1][0] == 3
    assert ranks[0][2] and ranks[-1][3]                    # the embedding on the first rank, the loss on the last


def test_splits_megatron_refuses_are_refused_by_validate_and_estimate_alike(capsys):
    """Megatron-Core's pipeline checks, each reported with its reason by validate: layers that do
    not split evenly over PP (or a rank's over VPP), first/last layers beside the account_for_*
    flags, middle ranks left uneven, a layout that misplaces layers. estimate refuses a split the
    configuration gives; where it gives none, it costs the plainest split Megatron builds and
    says so (as Bridge's recipes fill one in), with validate's violation beside it. Bridge's
    DeepSeek-V3 layout for 16 stages is accepted and puts one layer, the MTP layer and the loss
    on the last stage."""
    base = ["--expert-model-parallel-size", "8", "--global-batch-size", "4096", "--moe-token-dispatcher-type", "flex",
            "--moe-flex-dispatcher-backend", "deepep"]
    unsplit = {
        "61 layers do not split evenly over PP 16": (["--pipeline-model-parallel-size", "16"],
                                                     "pipeline_model_parallel_layout='Et*4|(t*4|)*14tmL' (61 layers"),
        "each pipeline rank's 16 layers do not split over VPP 3": (
            ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "3", "--num-layers", "64"],
            "pipeline_model_parallel_layout='Et*6|(t*6|)*8(t*5|)*2mL' (64 layers"),
    }
    refused = {
        "cannot be set together": ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "13",
                                   "--account-for-loss-in-pipeline-split"],
        "the 33 layers left between the first and last pipeline ranks": [
            "--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "12",
            "--decoder-last-pipeline-num-layers", "16"],
        "places 60 decoder layers (t)": ["--pipeline-model-parallel-size", "16",
                                         "--pipeline-model-parallel-layout", "Et*4|(t*4|)*14mL"],
        # validate read VPP as 21 // 5 = 4 here and passed it; estimate refuses it as Megatron does
        "num_layers_per_virtual_pipeline_stage=5 does not divide the 21 layers": [
            "--pipeline-model-parallel-size", "3", "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split", "--num-layers-per-virtual-pipeline-stage", "5"],
    }
    for reason, flags in [*((r, f) for r, (f, _) in unsplit.items()), *refused.items()]:
        assert main(["validate", "--num-layers", "61", *base, *flags]) == 1
        printed = capsys.readouterr().out
        assert "[pipeline-split]" in printed and reason in printed, reason
        shown = printed.split("[pipeline-split]")[1].split("fix:")[0]
        assert "num_layers=" in shown and "=None" not in shown       # the fields the config sets
    for reason, (flags, assumed) in unsplit.items():
        assert main(["estimate", "--hardware", "b200", "--gpus", "256", "--model", "deepseek-v3", *base, *flags]) == 0
        out, err = capsys.readouterr()
        assert assumed in out and "[pipeline-split]" in err and reason in err, reason
    for reason, flags in refused.items():
        assert main(["estimate", "--hardware", "b200", "--gpus", "256", "--model", "deepseek-v3", *base, *flags]) == 2
        assert reason in capsys.readouterr().err, reason
    bridge = ["--pipeline-model-parallel-size", "16", "--pipeline-model-parallel-layout", "Et*4|(t*4|)*14tmL"]
    assert main(["validate", "--num-layers", "61", "--mtp-num-layers", "1", *base, *bridge]) == 0
    capsys.readouterr()
    assert main(["validate", "--num-layers", "61", "--mtp-num-layers", "0", *base, *bridge]) == 1
    assert "places 1 MTP layers (m); mtp_num_layers is 0" in capsys.readouterr().out
    layout = TrainingLayout.from_fields(load_config(None, base + bridge), 256)
    ranks = stage_layers(layout, DSV3.layers, DSV3.mtp_layers, DSV3.dense_layers)
    assert ranks[0] == (4, 3, True, False, 0) and ranks[-1] == (1, 0, False, True, 1)


def test_a_layout_given_as_bridges_list_of_stages_is_its_string(tmp_path, capsys):
    """Megatron-Bridge's recipes (and Megatron-Core) also take pipeline_model_parallel_layout as a
    list of stages of layer names: read as the string it stands for, by validate and estimate
    alike; an unknown layer name and a value of another kind are refused by name."""
    stages = [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14 + [["decoder", "mtp", "loss"]]
    config = tmp_path / "bridge.json"
    config.write_text(json.dumps({"model": {"pipeline_model_parallel_size": 16, "expert_model_parallel_size": 8,
                                            "pipeline_model_parallel_layout": stages}}))
    values = load_config(str(config))
    assert values["pipeline_model_parallel_layout"] == "Etttt|" + "tttt|" * 14 + "tmL"
    listed = TrainingLayout.from_fields(values, 256)
    written = TrainingLayout.from_fields(load_config(None, ["--pipeline-model-parallel-size", "16",
                                                            "--pipeline-model-parallel-layout", "Et*4|(t*4|)*14tmL"]), 256)
    assert stage_layers(listed, DSV3.layers, 1, DSV3.dense_layers) == \
        stage_layers(written, DSV3.layers, 1, DSV3.dense_layers)
    assert main(["validate", str(config), "num_layers=61", "mtp_num_layers=1"]) == 0
    assert main(["estimate", "--hardware", "b200", "--gpus", "256", "--model", "deepseek-v3", str(config)]) == 0
    capsys.readouterr()
    config.write_text(json.dumps({"pipeline_model_parallel_size": 2,
                                  "pipeline_model_parallel_layout": [["embedding", "decoder"], ["dense", "loss"]]}))
    assert main(["validate", str(config)]) == 2
    assert "'dense' is no layer" in capsys.readouterr().err
    flags = ["--pipeline-model-parallel-size", "16", "--pipeline-model-parallel-layout", "5"]
    assert main(["estimate", "--hardware", "b200", "--gpus", "256", "--model", "deepseek-v3", *flags]) == 2
    assert "pipeline_model_parallel_layout must be a layout" in capsys.readouterr().err


def test_tied_embeddings_are_held_once_where_one_rank_holds_both():
    """share_embeddings_and_output_weights (Bridge's GPTModelProvider defaults it on; Megatron-LM's
    --untie-embeddings-and-output-weights turns it off; Hugging Face's tie_word_embeddings): a
    rank holding the embedding and the output layer holds one table; apart (PP > 1) nothing changes."""
    from expertrail.plan.architecture import from_fields, from_hf_config
    qwen30 = ARCHITECTURES["qwen3-30b-a3b"]
    assert from_fields(qwen30, {"share_embeddings_and_output_weights": True}).tied_embeddings
    assert not from_fields(qwen30, {"untie_embeddings_and_output_weights": True}).tied_embeddings
    assert from_fields(qwen30, {"untie_embeddings_and_output_weights": False}).tied_embeddings
    assert not from_fields(qwen30, {}).tied_embeddings
    hf = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
          "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
          "vocab_size": 151936, "tie_word_embeddings": True}
    assert from_hf_config(hf).tied_embeddings
    tied = from_fields(qwen30, {"share_embeddings_and_output_weights": True})
    assert qwen30.total_params() - tied.total_params() == qwen30.embedding_params()
    for pp, saved in ((1, qwen30.embedding_params() * 2 / 1e9), (2, 0.0)):
        layout = TrainingLayout(gpus=16, pp=pp, ep=8, global_batch=64)
        apart, one = (estimate(arch, HARDWARE["h100"], layout) for arch in (qwen30, tied))
        assert apart["memory"]["weights_GB"] - one["memory"]["weights_GB"] == pytest.approx(saved, abs=0.01), pp


@pytest.mark.parametrize("model", sorted(ARCHITECTURES))
def test_the_plainest_split_megatron_builds_for_every_pp_and_vpp(model):
    """`megatron_split` (what plan --fit uses, and estimate where a configuration gives no split)
    returns, for every PP x VPP with a layer a stage, a split Megatron's checks accept that places
    every layer and MTP layer once; a layout it writes leaves no stage more than a layer of work
    beyond the even share (the output layer and each MTP layer counted by their FLOPs), or than
    the last stage's output layer where that alone is more."""
    arch = ARCHITECTURES[model]
    head = arch.output_layers_worth()
    tail = head + arch.mtp_layers * (1 + head)
    for pp in (2, 4, 8, 16, 32):
        for vpp in (1, 2, 3, 4):
            split = megatron_split(arch.layers, arch.mtp_layers, pp, vpp, head)
            if split is None:
                assert arch.layers < pp * vpp
                continue
            layout = TrainingLayout(gpus=pp, pp=pp, vpp=vpp, **split)
            assert layout.problems(arch.experts, arch.layers) == []
            ranks = stage_layers(layout, arch.layers, arch.mtp_layers, arch.dense_layers)
            assert sum(r[0] for r in ranks) == arch.layers and sum(r[4] for r in ranks) == arch.mtp_layers
            if "layout_string" in split:
                counts = [stage.count("t") for stage in expand_layout(split["layout_string"])]
                work = [*counts[:-1], counts[-1] + tail]
                # the output layer cannot be split: a stage holds at least it
                assert max(work) <= max(tail, (arch.layers + tail) / len(counts) + 1), (pp, vpp, split)


def test_the_balanced_layout_is_bridges_for_deepseek_v3_and_kimi_k2():
    """Held out: weighing the output layer and the MTP layer by their FLOPs, `megatron_split`
    writes the layouts Megatron-Bridge's DeepSeek-V3 and Kimi-K2 recipes give by hand for every
    PP x VP their maps name (recipes/deepseek/h100/deepseek_v3.py, recipes/kimi/h100/kimi_k2.py
    at commit 067f987d)."""
    kimi = ARCHITECTURES["kimi-k2"]
    bridge = {
        DSV3: {(16, 1): "Et*4|(t*4|)*14tmL", (8, 2): "Et*4|(t*4|)*14tmL", (4, 4): "Et*4|(t*4|)*14tmL",
               (8, 1): "Et*8|(t*8|)*6t*5mL", (4, 2): "Et*8|(t*8|)*6t*5mL", (4, 1): "Et*16|t*16|t*16|t*13mL"},
        kimi: {(16, 1): "Et*4|(t*4|)*14tL", (8, 2): "Et*4|(t*4|)*14tL", (4, 4): "Et*4|(t*4|)*14tL",
               (2, 8): "Et*4|(t*4|)*14tL", (8, 1): "Et*8|(t*8|)*6t*5L", (4, 2): "Et*8|(t*8|)*6t*5L",
               (4, 1): "Et*16|t*16|t*16|t*13L"}}
    for arch, layouts in bridge.items():
        for (pp, vpp), text in layouts.items():
            split = megatron_split(arch.layers, arch.mtp_layers, pp, vpp, arch.output_layers_worth())
            assert expand_layout(split["layout_string"]) == expand_layout(text), (arch.name, pp, vpp)


def test_first_and_last_pipeline_layers_are_a_whole_ranks_layers():
    """decoder_first/last_pipeline_num_layers count the layers of the first / last pipeline rank,
    over all its virtual stages, and must divide by VPP. (DeepSeek-V3's 61 layers have no such
    split at PP 4 x VPP 4, the layers between an even first and last being odd: a 60-layer
    model here.)"""
    fields = {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 4,
              "decoder_first_pipeline_num_layers": 12, "decoder_last_pipeline_num_layers": 16,
              "expert_model_parallel_size": 32}
    ranks = stage_layers(TrainingLayout.from_fields(fields, 256), 60, 0, DSV3.dense_layers)
    assert [r[0] for r in ranks] == [12, 16, 16, 16] and ranks[0][1] == DSV3.dense_layers
    bad = TrainingLayout.from_fields(dict(fields, decoder_last_pipeline_num_layers=17), 256)
    assert any("decoder_last_pipeline_num_layers=17" in p and "multiple of 4" in p
               for p in bad.problems(DSV3.experts, DSV3.layers))
    assert TrainingLayout.from_fields(fields, 256).problems(DSV3.experts, DSV3.layers) == [
        "the 33 layers left between the first and last pipeline ranks do not split evenly over the other 2 ranks: "
        "choose decoder_first/last_pipeline_num_layers that leave a multiple of 2"]
    # Megatron-Core's (and Bridge's) names for the same split.
    core = {k: v for k, v in fields.items() if not k.startswith("decoder_")}
    core.update(num_layers_in_first_pipeline_stage=12, num_layers_in_last_pipeline_stage=16)
    assert stage_layers(TrainingLayout.from_fields(core, 256), 60, 0, DSV3.dense_layers) == ranks
    with pytest.raises(ConfigError, match="name the same split"):
        TrainingLayout.from_fields(dict(fields, num_layers_in_first_pipeline_stage=8), 256)


def test_virtual_stages_given_as_stages_per_rank_or_layers_per_stage():
    base = {"pipeline_model_parallel_size": 4, "expert_model_parallel_size": 32}
    assert TrainingLayout.from_fields(dict(base, num_virtual_stages_per_pipeline_rank=4), 256).vpp == 4
    layers = TrainingLayout.from_fields(dict(base, num_layers_per_virtual_pipeline_stage=6), 256)
    assert layers.for_model(48).vpp == 2 and layers.for_model(96).vpp == 4
    with pytest.raises(ConfigError, match="does not divide the 12 layers"):
        TrainingLayout.from_fields(dict(base, num_layers_per_virtual_pipeline_stage=5), 256).for_model(48)


def test_validate_counts_virtual_stages_given_either_way_for_ep_overlap(capsys):
    common = ["validate", "--pipeline-model-parallel-size", "4", "--overlap-moe-expert-parallel-comm",
              "--expert-model-parallel-size", "8", "--moe-token-dispatcher-type", "alltoall", "--bf16",
              "--num-experts", "64", "--moe-router-topk", "8"]
    assert main(common + ["--num-virtual-stages-per-pipeline-rank", "4"]) == 0
    assert main(common + ["--num-layers-per-virtual-pipeline-stage", "2"]) == 0
    assert main(common) == 1 and "ep-overlap-vpp" in capsys.readouterr().out


def test_estimate_refuses_a_value_of_the_wrong_kind_by_name(capsys):
    assert main(["estimate", "--hardware", "h100", "--gpus", "256", "--model", "deepseek-v3",
                 "--moe-ffn-hidden-size", "2k"]) == 2
    assert "moe_ffn_hidden_size must be a whole number" in capsys.readouterr().err


def test_fields_the_estimate_does_not_model_are_named(capsys):
    assert main(["estimate", "--hardware", "h100", "--gpus", "256", "--model", "deepseek-v3",
                 "--pipeline-model-parallel-size", "8", "--pipeline-model-parallel-layout", "Et*8|(t*8|)*6t*5mL", "--expert-model-parallel-size", "32",
                 "--moe-router-dtype", "fp64", "--fp8-param-gather"]) == 0
    out = capsys.readouterr().out
    assert "not modelled (set, but the estimate leaves them out): moe_router_dtype, fp8_param_gather" in out
    # An FP32 router is what the estimate costs (BF16 inputs, FP32 logits kept): nothing to name.
    assert main(["estimate", "--hardware", "h100", "--gpus", "256", "--model", "deepseek-v3",
                 "--pipeline-model-parallel-size", "8", "--pipeline-model-parallel-layout", "Et*8|(t*8|)*6t*5mL", "--expert-model-parallel-size", "32",
                 "--moe-router-dtype", "fp32"]) == 0
    assert "moe_router_dtype" not in capsys.readouterr().out


def test_layer_level_cpu_offloading_is_read_and_refused_where_megatron_refuses_it(capsys, tmp_path):
    """cpu_offloading keeps the saved activations of the model's first cpu_offloading_num_layers
    layers on the host (one in transit stays) and pays the copies the next layer's compute does
    not cover; with PP > 1 or recompute Megatron-Core raises, and so do validate and estimate."""
    base = ["estimate", "--hardware", "h100", "--gpus", "8", "--model", "qwen3-30b-a3b", "--expert-model-parallel-size",
            "8", "--global-batch-size", "64", "--moe-token-dispatcher-type", "flex", "--moe-router-force-load-balancing",
            "--json", str(tmp_path / "e.json")]
    assert main(base) == 0
    plain = json.loads((tmp_path / "e.json").read_text())
    assert main(base + ["--cpu-offloading", "--cpu-offloading-num-layers", "24"]) == 0
    assert "not modelled" not in capsys.readouterr().out
    off = json.loads((tmp_path / "e.json").read_text())
    per_layer = sum(off["memory"]["activation_per_layer_GB"].values())
    saved = plain["memory"]["activations_GB"] - off["memory"]["activations_GB"]
    assert saved == pytest.approx(23 * per_layer, rel=0.01)                    # 24 layers out, one in transit
    assert off["terms_s"]["offload"] > 0 and off["step_time_s"] > plain["step_time_s"]
    assert main(base + ["--cpu-offloading", "--cpu-offloading-num-layers", "4", "--pipeline-model-parallel-size", "2",
                        "--expert-model-parallel-size", "4"]) == 2
    assert "cpu_offloading does not support pipeline parallelism" in capsys.readouterr().err
    assert main(["validate", "--cpu-offloading", "--pipeline-model-parallel-size", "2"]) == 1
    assert "[cpu-offload-pp]" in capsys.readouterr().out


def test_megatron_fsdp_and_offloading_are_read_not_named(tmp_path, capsys):
    """Megatron-FSDP, fine-grained activation offloading, CPU optimizer offload and delayed
    weight gradients change the estimate; none is left on the not-modelled line."""
    base = ["estimate", "--hardware", "h100", "--gpus", "256", "--model", "deepseek-v3", "--json", str(tmp_path / "e.json"),
            "--pipeline-model-parallel-size", "8", "--expert-model-parallel-size", "32", "--global-batch-size", "1024",
            "--pipeline-model-parallel-layout", "Et*4|(t*4|)*14tmL"]
    extra = ["--use-megatron-fsdp", "--fine-grained-activation-offloading", "--offload-modules", "moe_act",
             "--optimizer-cpu-offload", "--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute",
             "--moe-token-dispatcher-type", "flex"]
    assert main(base) == 0
    plain = json.loads((tmp_path / "e.json").read_text())
    assert main(base + extra) == 0
    assert "not modelled" not in capsys.readouterr().out
    r = json.loads((tmp_path / "e.json").read_text())
    for part in ("weights", "gradients", "activations"):                          # sharded over DP; offloaded
        assert r["memory"][f"{part}_GB"] < plain["memory"][f"{part}_GB"], part
    # The moments on the host, the FP32 main weights (a third of Adam's 12 bytes) on the GPU.
    assert r["memory"]["optimizer_GB"] == pytest.approx(plain["memory"]["optimizer_GB"] / 3)
    assert r["terms_s"]["optimizer_offload"] > 0 and "data_parallel_sharding_strategy=optim_grads_params" in r["assumed"]


def test_a_hugging_face_config_is_a_model_for_estimate_and_plan(tmp_path, capsys):
    config = {"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
              "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
              "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936}
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = load_architecture(str(tmp_path))
    assert {k: v for k, v in vars(arch).items() if k != "name"} == {k: v for k, v in vars(QWEN).items() if k != "name"}
    layout = TrainingLayout(gpus=256, tp=2, pp=8, vpp=4, ep=32, precision="fp8", global_batch=2048,
                            dispatcher="flex", flex_backend="deepep", embedding_in_split=True, loss_in_split=True)
    assert estimate(arch, HARDWARE["h100"], layout)["tflops_per_gpu"] == \
        pytest.approx(estimate(QWEN, HARDWARE["h100"], layout)["tflops_per_gpu"])
    assert main(["plan", "--hardware", "h100", "--model", str(tmp_path), "--ep", "32"]) == 0
    assert "memory: fits from PP" in capsys.readouterr().out          # the memory check ran
    assert main(["plan", "--fit", "--gpus", "256", "--hardware", "h100", "--model", str(tmp_path), "--top", "1"]) == 0


def test_gradients_reduced_in_bf16_move_less():
    fields = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1,
              "micro_batch_size": 4,
              "global_batch_size": 2048, "use_megatron_fsdp": True, "recompute_granularity": "full",
              "recompute_method": "uniform", "moe_token_dispatcher_type": "flex",
              "megatron_fsdp_main_grads_dtype": "fp32",          # Megatron-FSDP's gradients before its dtype options
              "moe_router_force_load_balancing": True}           # as the ModelZoo's run
    fp32 = estimate(QWEN, HARDWARE["h100"], TrainingLayout.from_fields(fields, 256))
    bf16 = estimate(QWEN, HARDWARE["h100"], TrainingLayout.from_fields(dict(fields, grad_reduce_in_bf16=True), 256))
    assert bf16["terms_s"]["fsdp"] < fp32["terms_s"]["fsdp"]
    assert bf16["memory"]["gradients_GB"] == fp32["memory"]["gradients_GB"]      # kept FP32, reduced in BF16


def test_gradient_buffers_in_bf16_halve_the_gradients_and_their_traffic():
    """Bridge's GPT-OSS recipes set grad_reduce_in_fp32 false: the gradient buffers are BF16."""
    fields = {"pipeline_model_parallel_size": 4, "expert_model_parallel_size": 8, "global_batch_size": 1024,
              "moe_token_dispatcher_type": "alltoall", "account_for_embedding_in_pipeline_split": True,
              "account_for_loss_in_pipeline_split": True}
    fp32 = estimate(QWEN, HARDWARE["h100"], TrainingLayout.from_fields(fields, 256))
    bf16 = estimate(QWEN, HARDWARE["h100"], TrainingLayout.from_fields(dict(fields, grad_reduce_in_fp32=False), 256))
    assert TrainingLayout.from_fields(dict(fields, grad_reduce_in_fp32=True), 256).main_grad_bytes == 4
    assert bf16["memory"]["gradients_GB"] == pytest.approx(fp32["memory"]["gradients_GB"] / 2)
    assert bf16["terms_s"]["dp"] < fp32["terms_s"]["dp"]


def test_every_catalog_model_is_a_model_for_plan_and_estimate():
    """One catalog: each whole-model shape's MoE part is what `plan` and `simulate` take."""
    from expertrail.plan.architecture import MODELS
    from expertrail.plan.catalog import load_model
    assert set(MODELS) == set(ARCHITECTURES)
    for name, arch in ARCHITECTURES.items():
        model = load_model(name)
        assert (model.hidden, model.num_experts, model.topk, model.moe_ffn, model.layers) == \
            (arch.hidden, arch.experts, arch.topk, arch.moe_ffn, arch.moe_layers), name


def test_experts_without_their_own_width_take_ffn_hidden_size_as_megatron_does():
    """A configuration that spells the model out with ffn_hidden_size and no
    moe_ffn_hidden_size (the ModelZoo's Mixtral-8x22B.yaml) has experts as wide as the FFN, as
    Megatron-LM and Megatron-Core default it; with a catalog --model, the model's width stays."""
    from expertrail.plan.architecture import ARCHITECTURES, from_fields
    spelled = {"num_layers": 56, "hidden_size": 6144, "ffn_hidden_size": 16384, "num_attention_heads": 48,
               "num_moe_experts": 8, "moe_router_topk": 2}
    arch = from_fields(None, spelled)
    assert arch.moe_ffn == 16384 == ARCHITECTURES["mixtral-8x22b"].moe_ffn
    assert from_fields(ARCHITECTURES["qwen3-30b-a3b"], {"ffn_hidden_size": 6144}).moe_ffn == 768


def test_experts_split_by_tp_by_default_is_said_when_left_out():
    """Megatron takes ETP = TP when expert_tensor_parallel_size is left out; the estimate says so,
    since a run written for ETP 1 otherwise comes out with split experts (and another memory)."""
    base = {"tensor_model_parallel_size": 2, "expert_model_parallel_size": 8, "micro_batch_size": 1}
    left_out = TrainingLayout.from_fields(base, 64)
    assert left_out.etp == 2 and any(a.startswith("expert_tensor_parallel_size=2") for a in left_out.assumed)
    given = TrainingLayout.from_fields(dict(base, expert_tensor_parallel_size=1), 64)
    assert given.etp == 1 and not any(a.startswith("expert_tensor_parallel_size") for a in given.assumed)
    no_tp = TrainingLayout.from_fields(dict(base, tensor_model_parallel_size=1), 64)
    assert not any(a.startswith("expert_tensor_parallel_size") for a in no_tp.assumed)
