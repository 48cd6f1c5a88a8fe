"""A Hugging Face config.json of every supported MoE family is a model for the planner: the
field names each family's config uses, as minimal dicts."""
import pytest

from expertrail.plan.architecture import ARCHITECTURES, from_hf_config
from expertrail.plan.catalog import HARDWARE
from expertrail.plan.estimate import estimate
from expertrail.plan.layout import TrainingLayout, megatron_split

MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
FAMILIES = {
    "deepseek_v2": ({"model_type": "deepseek_v2", "hidden_size": 5120, "num_hidden_layers": 60, "num_attention_heads": 128,
                     "intermediate_size": 12288, "moe_intermediate_size": 1536, "n_routed_experts": 160,
                     "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "n_group": 8,
                     "topk_group": 3, "vocab_size": 102400, **MLA},
                    dict(experts=160, topk=6, dense_layers=1, shared_ffn=3072, kv_lora=512, num_groups=8)),
    "deepseek_v3": ({"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
                     "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
                     "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 8,
                     "topk_group": 4, "vocab_size": 129280, **MLA},
                    {k: getattr(ARCHITECTURES["deepseek-v3"], k) for k in
                     ("layers", "dense_layers", "hidden", "ffn", "moe_ffn", "experts", "topk", "shared_ffn", "heads",
                      "vocab", "q_lora", "kv_lora", "num_groups", "group_topk")}),
    "kimi_k2": ({"model_type": "kimi_k2", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 64,
                 "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384,
                 "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1,
                 "topk_group": 1, "vocab_size": 163840, **MLA},
                {k: getattr(ARCHITECTURES["kimi-k2"], k) for k in
                 ("layers", "dense_layers", "hidden", "ffn", "moe_ffn", "experts", "topk", "shared_ffn", "heads", "vocab")}),
    "moonlight": ({"model_type": "deepseek_v3", "hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
                   "intermediate_size": 11264, "moe_intermediate_size": 1408, "n_routed_experts": 64,
                   "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "n_group": 1,
                   "topk_group": 1, "vocab_size": 163840, "q_lora_rank": None, "kv_lora_rank": 512,
                   "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128},
                  dict(experts=64, topk=6, dense_layers=1, shared_ffn=2816, q_lora=0, kv_lora=512)),
    "qwen3_moe": ({"model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
                   "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                   "vocab_size": 151936},
                  {k: v for k, v in vars(ARCHITECTURES["qwen3-235b-a22b"]).items() if k != "name"}),
    "qwen3_next": ({"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 2, "head_dim": 256, "intermediate_size": 5120, "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512, "num_experts": 512, "num_experts_per_tok": 10,
                    "decoder_sparse_step": 1, "full_attention_interval": 4, "linear_num_value_heads": 32,
                    "vocab_size": 151936},
                   {k: v for k, v in vars(ARCHITECTURES["qwen3-next-80b-a3b"]).items() if k != "name"}),
    # Qwen3.5's MoE: a multimodal file whose text_config holds the model, Gated DeltaNet by layer_types, an MTP layer.
    "qwen3_5_moe": ({"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                     "vision_config": {"depth": 27, "hidden_size": 1152},
                     "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                                     "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                                     "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                                     "shared_expert_intermediate_size": 512, "linear_num_key_heads": 16,
                                     "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                                     "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
                                     "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
                                     "mtp_num_hidden_layers": 1, "vocab_size": 248320}},
                    dict(layers=40, experts=256, topk=8, moe_ffn=512, shared_ffn=512, linear_layers=30,
                         linear_v_heads=32, attention_gate=True, mtp_layers=1, head_dim=256, kv_heads=2)),
    # GLM-4.5: DeepSeek's MoE field names with grouped-query attention, three dense layers first, an MTP layer.
    "glm4_moe": ({"model_type": "glm4_moe", "hidden_size": 5120, "num_hidden_layers": 92, "num_attention_heads": 96,
                  "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                  "n_routed_experts": 160, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                  "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
                  "vocab_size": 151552},
                 dict(layers=92, dense_layers=3, experts=160, topk=8, moe_ffn=1536, shared_ffn=1536, kv_heads=8,
                      head_dim=128, mtp_layers=1, q_lora=0, kv_lora=0)),
    "mixtral": ({"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "vocab_size": 32000},
                {k: v for k, v in vars(ARCHITECTURES["mixtral-8x7b"]).items() if k != "name"}),
    "gpt_oss": ({"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                 "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "num_local_experts": 128,
                 "experts_per_token": 4, "sliding_window": 128, "vocab_size": 201088},
                dict(experts=128, topk=4, moe_ffn=2880, head_dim=64, kv_heads=8, dense_layers=0, shared_ffn=0)),
    "llama4_maverick": ({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                         "text_config": {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                                         "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                                         "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                                         "num_local_experts": 128, "num_experts_per_tok": 1,
                                         "interleave_moe_layer_step": 2, "vocab_size": 202048}},
                        dict(experts=128, topk=1, moe_ffn=8192, ffn=16384, shared_ffn=8192, dense_layers=24)),
    "llama4_scout": ({"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
                      "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                      "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
                      "vocab_size": 202048},
                     dict(experts=16, topk=1, dense_layers=0, shared_ffn=8192)),
    "deepseek_v32": ({"model_type": "deepseek_v32", "hidden_size": 7168, "num_hidden_layers": 61,
                      "num_attention_heads": 128, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                      "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                      "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "index_topk": 2048,
                      "vocab_size": 129280, **MLA},
                     dict(experts=256, topk=8, dense_layers=3, shared_ffn=2048, num_groups=8, group_topk=4)),
    # Qwen2-57B-A14B: Qwen's field names, a shared expert eight experts wide.
    "qwen2_moe": ({"model_type": "qwen2_moe", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                   "num_key_value_heads": 4, "intermediate_size": 18944, "moe_intermediate_size": 2560,
                   "shared_expert_intermediate_size": 20480, "num_experts": 64, "num_experts_per_tok": 8,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936},
                  dict(experts=64, topk=8, moe_ffn=2560, shared_ffn=20480, dense_layers=0, kv_heads=4)),
    # Qwen3-VL-30B-A3B: Qwen3-MoE's fields in a multimodal file's text_config.
    "qwen3_vl_moe": ({"model_type": "qwen3_vl_moe", "vision_config": {"depth": 27},
                      "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 2048, "num_hidden_layers": 48,
                                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                                      "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
                                      "vocab_size": 151936}},
                     {k: v for k, v in vars(ARCHITECTURES["qwen3-30b-a3b"]).items()
                      if k in ("layers", "hidden", "moe_ffn", "experts", "topk", "heads", "kv_heads", "head_dim")}),
    "olmoe": ({"model_type": "olmoe", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 16, "intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
               "vocab_size": 50304},
              dict(experts=64, topk=8, moe_ffn=1024, dense_layers=0, shared_ffn=0, router_balance="micro_batch")),
    "minimax_m2": ({"model_type": "minimax_m2", "hidden_size": 3072, "num_hidden_layers": 62, "num_attention_heads": 48,
                    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 1536, "num_local_experts": 256,
                    "num_experts_per_tok": 8, "use_routing_bias": True, "vocab_size": 200064},
                   dict(experts=256, topk=8, moe_ffn=1536, dense_layers=0, shared_ffn=0, router_balance="global_batch")),
    # ERNIE 4.5 21B-A3B: experts under moe_* names, MoE layers from moe_layer_start_index on.
    "ernie4_5_moe": ({"model_type": "ernie4_5_moe", "hidden_size": 2560, "num_hidden_layers": 28,
                      "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 12288,
                      "moe_intermediate_size": 1536, "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_k": 6,
                      "moe_layer_start_index": 1, "moe_layer_end_index": 27, "moe_layer_interval": 1,
                      "tie_word_embeddings": True, "vocab_size": 103424},
                     dict(experts=64, topk=6, moe_ffn=1536, ffn=12288, dense_layers=1, shared_ffn=3072,
                          router_balance="global_batch")),
}

# Total parameters as each model's card publishes them (billions), for the families above.
PUBLISHED_PARAMS = {"qwen2_moe": 57.4, "olmoe": 6.92, "minimax_m2": 230, "ernie4_5_moe": 21.8, "deepseek_v32": 671}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_reads_into_the_shape_it_publishes(family):
    cfg, expected = FAMILIES[family]
    arch = from_hf_config(cfg, family)
    assert {k: getattr(arch, k) for k in expected} == expected


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_estimates(family):
    arch = from_hf_config(FAMILIES[family][0], family)
    ep = max(e for e in (1, 2, 4, 8) if arch.experts % e == 0)
    split = megatron_split(arch.layers, arch.mtp_layers, 4, 1)      # as plan --fit splits PP 4
    result = estimate(arch, HARDWARE["h100"], TrainingLayout(gpus=64, pp=4, ep=ep, global_batch=256,
                                                             dispatcher="flex", flex_backend="deepep", **split))
    assert result["step_time_s"] > 0 and result["peak_memory_GB"] > 0


def _megatron_qwen3_next_flops(layers: int = 48, freq: int = 4, seq: int = 4096) -> float:
    """Megatron-Core's num_floating_point_operations for Qwen3-Next without MTP, per token,
    transcribed term by term (megatron/training/training.py): Gated DeltaNet in every layer but
    each freq-th, gated grouped-query attention there, SwiGLU experts and shared expert, logits."""
    h, heads, groups, kv_ch = 2048, 16, 2, 256
    qk, v, qk_heads, v_heads, conv = 16 * 128, 32 * 128, 16, 32, 4
    linear = sum(1 for i in range(layers) if (i + 1) % freq)
    standard = layers - linear
    q = kv_ch * heads
    std_term = 3 * 2 * (h * (q + kv_ch * groups * 2 + q) + q * h)
    core_term = 3 * 2 * q / 2 * 2
    lin_term = 3 * 2 * (h * (2 * qk + 2 * v + 2 * v_heads) + conv * (2 * qk + v) + v_heads * 128 ** 2 * 4 + h * v)
    mlp = 3 * 2 * h * (512 * 10 * 3 + 512 * 3) * layers
    router = 0                                # Megatron leaves the router's GEMM out
    logits = 3 * 2 * h * 151936
    return mlp + router + lin_term * linear + std_term * standard + logits + seq * core_term * standard


def test_qwen3_next_counts_gated_deltanet_as_megatron_does():
    """Qwen3-Next's config.json (layer_types or full_attention_interval) gives 36 Gated DeltaNet
    layers of 48 and gated full attention in the rest; its FLOPs per token are Megatron-Core's
    count (within the router's GEMM, which Megatron leaves out and expertrail counts), 3% above
    counting every layer as full attention, and its parameters 80B."""
    from dataclasses import replace
    cfg = FAMILIES["qwen3_next"][0]
    by_interval = from_hf_config(cfg)
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(48)]
    by_types = from_hf_config({**{k: v for k, v in cfg.items() if k != "full_attention_interval"}, "layer_types": types})
    assert by_interval.linear_layers == by_types.linear_layers == 36 and by_interval.attention_gate
    arch = ARCHITECTURES["qwen3-next-80b-a3b"]
    router = 3 * 2 * arch.hidden * arch.experts * arch.layers
    assert arch.flops_per_token(4096) == pytest.approx(_megatron_qwen3_next_flops() + router, rel=1e-9)
    full = replace(arch, linear_layers=0, attention_gate=False)
    assert 1.02 < arch.flops_per_token(4096) / full.flops_per_token(4096) < 1.04
    assert 79e9 < arch.total_params() < 81e9


def test_linear_attention_from_megatron_fields():
    """Megatron's experimental_attention_variant (or the 2025 linear_attention_type) with
    linear_attention_freq sets the linear layers, Megatron's head defaults where the fields leave
    them out; a variant without its frequency is refused by name; DeepSeek's sparse attention is
    named as not modelled."""
    from expertrail.errors import ConfigError
    from expertrail.plan.architecture import from_fields
    from expertrail.plan.validate import load_config
    base = ARCHITECTURES["qwen3-30b-a3b"]
    every_fourth = from_fields(base, {"experimental_attention_variant": "gated_delta_net", "linear_attention_freq": 4})
    assert every_fourth.linear_layers == 36 and every_fourth.linear_v_heads == 32 and every_fourth.linear_qk_dim == 128
    listed = from_fields(base, {"linear_attention_type": "gated_delta_net", "linear_attention_freq": [1, 0] * 24})
    assert listed.linear_layers == 24
    gdn2 = from_fields(base, {"experimental_attention_variant": "gdn2", "linear_attention_freq": 4})
    assert gdn2.linear_attention_params() > every_fourth.linear_attention_params()
    with pytest.raises(ConfigError, match="linear_attention_freq"):
        from_fields(base, {"experimental_attention_variant": "gdn"})
    assert from_fields(base, {"experimental_attention_variant": "gdn", "linear_attention_freq": "[1,1,1,0]*12"}) \
        .linear_layers == 36
    for text in ("four", "[1,x]*24"):                  # refused by its own name, not a traceback
        with pytest.raises(ConfigError, match=r"linear_attention_freq .*\[1,1,1,0\]\*12"):
            from_fields(base, {"experimental_attention_variant": "gdn", "linear_attention_freq": text})
    flags = ["--expert-model-parallel-size", "8", "--experimental-attention-variant", "dsa"]
    assert "experimental_attention_variant" in TrainingLayout.from_fields(load_config(None, flags), 8).not_modelled


def test_glm45_holds_its_published_parameters():
    """GLM-4.5's config.json (DeepSeek's MoE field names, grouped-query attention, an MTP layer)
    reads into the 355B parameters its model card gives; its router is DeepSeek-V3's (expert
    biases, balanced over the whole batch), as is MiniMax's with use_routing_bias."""
    arch = from_hf_config(FAMILIES["glm4_moe"][0])
    assert arch.total_params() == pytest.approx(355e9, rel=0.01)
    assert arch.router_balance == "global_batch"
    assert from_hf_config({**FAMILIES["mixtral"][0], "model_type": "minimax_m2", "use_routing_bias": True},
                          "m2").router_balance == "global_batch"
    assert from_hf_config(FAMILIES["mixtral"][0]).router_balance == "micro_batch"


def test_attention_the_estimate_costs_as_full_is_named():
    """DeepSeek-V3.2's sparse attention (index_topk), GPT-OSS's sliding windows (layer_types) and
    Llama 4's chunked attention are costed as full causal attention, and the estimate's
    not-modelled line says so; a window the file switches off (Qwen's use_sliding_window false)
    is not named."""
    dsv32 = {**FAMILIES["deepseek_v3"][0], "model_type": "deepseek_v32", "index_topk": 2048, "index_n_heads": 64}
    gpt_oss = {**FAMILIES["gpt_oss"][0], "layer_types": ["sliding_attention", "full_attention"] * 18}
    scout = {**FAMILIES["llama4_scout"][0], "attention_chunk_size": 8192}
    qwen = {**FAMILIES["qwen3_moe"][0], "sliding_window": 4096, "use_sliding_window": False}
    said = {name: from_hf_config(cfg, name).not_modelled
            for name, cfg in (("dsv32", dsv32), ("gpt_oss", gpt_oss), ("scout", scout), ("qwen", qwen))}
    assert "index_topk=2048" in said["dsv32"][0] and "18 of 36 layers" in said["gpt_oss"][0]
    assert "attention_chunk_size=8192" in said["scout"][0] and said["qwen"] == ()
    result = estimate(from_hf_config(dsv32, "dsv32"), HARDWARE["h100"],
                      TrainingLayout(gpus=256, pp=4, ep=8, global_batch=256, **megatron_split(61, 0, 4, 1)))
    assert said["dsv32"][0] in result["not_modelled"]
    assert ARCHITECTURES["gpt-oss-120b"].not_modelled == from_hf_config(FAMILIES["gpt_oss"][0]).not_modelled


@pytest.mark.parametrize("field, value", [("hidden_size", "7168"), ("num_hidden_layers", [61]), ("vocab_size", 1.5e5),
                                          ("qk_rope_head_dim", True), ("mlp_only_layers", 3), ("model_type", {})])
def test_a_config_json_field_of_the_wrong_kind_is_refused_by_name(field, value):
    """A field the planner reads that holds the wrong kind of value (text, a list, a float, a
    boolean for a size; a number for a layer list) is refused naming it, not a TypeError later."""
    from expertrail.errors import ConfigError
    with pytest.raises(ConfigError, match=f"config.json's {field} is"):
        from_hf_config({**FAMILIES["deepseek_v3"][0], field: value}, "bad")


def test_plan_fit_lays_out_a_top1_model_and_names_a_rule_that_refuses_every_layout(monkeypatch, capsys):
    """Llama 4 routes each token to one expert: the layouts plan --fit writes set the softmax
    before top-k that Megatron-Core requires for top-1, so they validate; were every layout that
    fits refused by a rule, the message names the rule, not memory."""
    from expertrail.plan import search
    from expertrail.plan.validate import validate
    scout, hw = from_hf_config(FAMILIES["llama4_scout"][0], "scout"), HARDWARE["gb200-nvl72"]
    (r, layout), = search.search(scout, hw, 128, top=1)
    fields = search.layout_fields(scout, layout, hw)
    assert fields["moe_router_pre_softmax"] is True and validate(dict(fields, world_size=128)) == []
    plain = search.layout_fields
    monkeypatch.setattr(search, "layout_fields", lambda *a: {k: v for k, v in plain(*a).items()
                                                            if k != "moe_router_pre_softmax"})
    assert search.search(scout, hw, 128) == []
    text = search.format_search([], scout, hw, 128, search.leanest(scout, hw, 128))
    assert "passes validate" in text and "[top1-pre-softmax]" in text and "more GPUs" not in text


def test_a_repository_id_reads_from_the_local_hugging_face_cache(tmp_path, monkeypatch, capsys):
    """--model ORG/NAME of a model outside the catalog reads its config.json from the hub cache
    (the revision refs/main names) as transformers leaves it; absent there, the error says how to
    fetch it. Nothing is downloaded."""
    import json
    import os
    from expertrail.tools.cli import main
    repo = tmp_path / "hub" / "models--moonshotai--Moonlight-16B-A3B"
    (repo / "snapshots" / "old").mkdir(parents=True)
    (repo / "snapshots" / "c0ffee").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0ffee\n")
    (repo / "snapshots" / "old" / "config.json").write_text(json.dumps({**FAMILIES["moonlight"][0], "n_routed_experts": 32}))
    (repo / "snapshots" / "c0ffee" / "config.json").write_text(json.dumps(FAMILIES["moonlight"][0]))
    os.utime(repo / "snapshots" / "old", (2e9, 2e9))            # the newest snapshot, but not refs/main's
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    flags = ["estimate", "--hardware", "h100", "--gpus", "16", "--expert-model-parallel-size", "8", "--json"]
    for model, name in (("moonshotai/Moonlight-16B-A3B", "id.json"), (str(repo / "snapshots" / "c0ffee"), "dir.json")):
        assert main([*flags, str(tmp_path / name), "--model", model]) == 0
    by_id, by_dir = (json.loads((tmp_path / name).read_text()) for name in ("id.json", "dir.json"))
    assert by_id["model_flops_per_token"] == by_dir["model_flops_per_token"] and by_id["memory"] == by_dir["memory"]
    # a tokenizer_model naming a cached repository gives its vocabulary, as its directory would
    from expertrail.plan.architecture import tokenizer_checkpoint
    (tmp_path / "hub" / "models--acme--Frontier-MoE").symlink_to(repo)
    assert tokenizer_checkpoint({"tokenizer_model": "acme/Frontier-MoE"}).vocab == FAMILIES["moonlight"][0]["vocab_size"]
    assert tokenizer_checkpoint({"tokenizer_model": "acme/Absent-MoE"}) is None
    capsys.readouterr()
    assert main(["plan", "--hardware", "h100", "--model", "moonshotai/Kimi-Linear-48B"]) == 2
    assert "huggingface-cli download ORG/NAME config.json" in capsys.readouterr().err


def test_a_config_json_of_another_moe_family_is_refused_with_the_families_read():
    """An MoE config.json whose experts sit under names no family read uses (DBRX's nested
    ffn_config) is refused naming its model_type, the families read and the other ways in."""
    from expertrail.errors import ConfigError
    dbrx = {"model_type": "dbrx", "hidden_size": 6144, "num_hidden_layers": 40, "num_attention_heads": 48,
            "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752}}
    with pytest.raises(ConfigError, match=r"model_type 'dbrx'.*Qwen3-MoE.*Megatron fields"):
        from_hf_config(dbrx, "dbrx")


@pytest.mark.parametrize("family", sorted(PUBLISHED_PARAMS))
def test_each_family_holds_its_published_parameters(family):
    assert from_hf_config(FAMILIES[family][0]).total_params() == pytest.approx(PUBLISHED_PARAMS[family] * 1e9, rel=0.01)


def test_every_checked_model_type_is_read_here():
    """`hf_fields.CHECKED_TYPES`, the model_types read without the assumed line's note, are the
    ones this file's FAMILIES read into their published shapes."""
    from expertrail.plan.hf_fields import CHECKED_TYPES, language_model
    read = {cfg.get("model_type") for cfg, _ in FAMILIES.values()} | \
        {language_model(cfg).get("model_type") for cfg, _ in FAMILIES.values()}
    assert CHECKED_TYPES <= read
    assert all(from_hf_config(cfg).assumed == () for cfg, _ in FAMILIES.values())


HYBRIDS = {
    "jamba": ({"model_type": "jamba", "num_experts": 16, "num_experts_per_tok": 2, "attn_layer_period": 8,
               "mamba_d_state": 16}, "Mamba"),
    "granitemoehybrid": ({"model_type": "granitemoehybrid", "num_local_experts": 62, "num_experts_per_tok": 6,
                          "layer_types": ["mamba"] * 9 + ["attention"], "mamba_n_heads": 128}, "Mamba"),
    "lfm2_moe": ({"model_type": "lfm2_moe", "num_experts": 32, "num_experts_per_tok": 4, "num_dense_layers": 2,
                  "layer_types": ["conv", "conv", "full_attention"] * 8}, "short-convolution"),
    "minimax": ({"model_type": "minimax", "num_local_experts": 32, "num_experts_per_tok": 2,
                 "layer_types": ["linear_attention"] * 7 + ["full_attention"]}, "not Gated DeltaNet"),
    "kimi_linear": ({"model_type": "kimi_linear", "num_experts": 256, "num_experts_per_token": 8,
                     "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_heads": 32},
                    "not Gated DeltaNet"),
    "jetmoe": ({"model_type": "jetmoe", "num_local_experts": 8, "num_experts_per_tok": 2}, "attention heads"),
}


@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_layers_the_planner_cannot_cost_are_refused_by_name(family):
    """A config.json with state-space, convolution, non-DeltaNet linear-attention layers or
    attention experts is refused naming them (costed as attention it would be silently wrong),
    by the MoE reader plan and simulate use too."""
    from expertrail.errors import ConfigError
    from expertrail.plan.catalog import from_hf_config as moe_of
    fields, said = HYBRIDS[family]
    cfg = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 14336,
           **fields}
    for read in (from_hf_config, moe_of):
        with pytest.raises(ConfigError, match=f"model_type '{family}'.*{said}.*Megatron fields"):
            read(cfg, family)


def test_another_family_is_read_by_its_fields_and_says_so():
    """A model_type outside the checked families is read by the spellings other families use (a
    per-layer mlp_layer_types, dense layers first by num_dense_layers, num_shared_experts routed
    experts wide, Step's share_expert_dim), and the estimate's assumed line names it; a per-layer
    expert count that varies is refused by name; Qwen3-Omni's language model sits under
    thinker_config."""
    from expertrail.errors import ConfigError
    base = {"hidden_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 16, "intermediate_size": 6144,
            "moe_intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 6}
    exaone = from_hf_config({**base, "model_type": "exaone_moe", "num_shared_experts": 1,
                             "mlp_layer_types": ["dense"] + ["sparse"] * 7})
    assert (exaone.dense_layers, exaone.shared_ffn) == (1, 1024)
    afmoe = from_hf_config({**base, "model_type": "afmoe", "num_dense_layers": 2, "num_shared_experts": 2})
    assert (afmoe.dense_layers, afmoe.shared_ffn) == (2, 2048)
    step = from_hf_config({**base, "model_type": "step3p5", "share_expert_dim": 1280,
                           "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 5})
    assert (step.dense_layers, step.shared_ffn) == (3, 1280)
    biased = [from_hf_config({**base, "model_type": kind}).router_balance
              for kind in ("solar_open", "minimax_m3_vl_text", "olmoe", "phimoe")]
    assert biased == ["global_batch", "global_batch", "micro_batch", "micro_batch"]     # expert-bias routers
    every_other = from_hf_config({**FAMILIES["deepseek_v2"][0], "moe_layer_freq": 2})    # MoE at 2, 4, ..., 58
    assert every_other.dense_layers == 31
    assert "model_type 'afmoe' is read by its fields" in afmoe.assumed[0]
    result = estimate(afmoe, HARDWARE["h100"], TrainingLayout(gpus=8, ep=8, global_batch=64))
    assert afmoe.assumed[0] in result["assumed"]
    with pytest.raises(ConfigError, match=r"num_experts is \[64, 32\], one value per layer"):
        from_hf_config({**base, "model_type": "hunyuan_v1_moe", "num_experts": [64, 32]})
    assert from_hf_config({**base, "model_type": "hunyuan_v1_moe", "num_experts": [64, 64]}).experts == 64
    omni = from_hf_config({"model_type": "qwen3_omni_moe",
                           "thinker_config": {"text_config": {**base, "model_type": "qwen3_omni_moe_text"}}})
    assert omni.experts == 64 and omni.name == "qwen3_omni_moe_text"
