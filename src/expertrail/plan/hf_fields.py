"""What a Hugging Face config.json says about an MoE model, in each family's spelling.

Families spell one fact several ways: the routed experts are DeepSeek's ``n_routed_experts``,
Qwen's ``num_experts``, Mixtral's ``num_local_experts`` and ERNIE's ``moe_num_experts``; the
dense layers are DeepSeek's first ``first_k_dense_replace``, Qwen's ``decoder_sparse_step``,
Llama 4's ``interleave_moe_layer_step``, a per-layer ``mlp_layer_types`` list or ERNIE's MoE
layer range. These readers give the planner one answer for each, and refuse, by name, the
layers it cannot cost (state-space, convolution, linear attention other than Gated DeltaNet,
attention experts) instead of costing them as attention. A file of a ``model_type`` outside
`CHECKED_TYPES` is read by the same fields, and `unchecked_note` says so.
"""
from __future__ import annotations

from ..errors import ConfigError

FAMILIES = ("DeepSeek-V2/V3/V3.2, Kimi-K2, Moonlight, GLM-4.5, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE, "
            "Mixtral, GPT-OSS, Llama 4, MiniMax-M2, OLMoE, ERNIE 4.5")
# The model_types whose files the tests read into their published shapes (tests/test_planner_hf.py).
CHECKED_TYPES = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe", "qwen2_moe", "qwen3_moe", "qwen3_next",
    "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "mixtral", "gpt_oss", "llama4",
    "llama4_text", "minimax_m2", "olmoe", "ernie4_5_moe"})
# The model_types whose routers add learned per-expert biases to the scores they pick by
# (``e_score_correction_bias`` in transformers 5.24's modeling files: auxiliary-loss-free
# balancing, set from the batch's loads), which balance over the whole batch, not each
# micro-batch (`Architecture.router_balance`); a model_type that begins with one of these (its
# ``_text`` / ``_vl`` parts) counts too.
EXPERT_BIAS_TYPES = (
    "axk1", "axk2", "beam", "deepseek_v3", "deepseek_v32", "deepseek_v4", "dots1", "dots3_note", "ernie4_5_moe",
    "ernie4_5_vl_moe", "exaone_moe", "glm4_moe", "glm4v_moe", "glm5_next", "glm_moe_dsa", "hy_v3", "hy_v4", "inkling",
    "kolibri1", "laguna", "longcat_flash", "mimo_v2_flash", "minimax_m2", "minimax_m3_vl", "muse_spark", "solar_open",
    "step3p5", "step3p7")
EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_k")
# The whole numbers of a config.json the planner reads (sizes, counts, layer indices' steps).
WHOLE_NUMBERS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "intermediate_size", "intermediate_size_mlp", "moe_intermediate_size", "shared_expert_intermediate_size",
    "shared_intermediate_size", "share_expert_dim", *EXPERT_KEYS, *TOPK_KEYS, "n_shared_experts",
    "num_shared_experts", "moe_num_shared_experts", "first_k_dense_replace", "num_dense_layers", "n_group",
    "topk_group", "moe_layer_freq", "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_start_index",
    "moe_layer_interval", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "sliding_window", "max_window_layers", "attention_chunk_size", "index_topk",
    "full_attention_interval", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
    "linear_value_head_dim", "linear_conv_kernel_dim")
LISTS = ("mlp_only_layers", "moe_layers", "layer_types", "mlp_layer_types")
_HOW_ELSE = ("give its shape another way: its Megatron fields (num_layers, hidden_size, num_moe_experts, "
             "moe_ffn_hidden_size, moe_router_topk, ...) to estimate and validate, a YAML/JSON of MoEModel fields "
             "to plan and simulate")


def language_model(cfg: dict) -> dict:
    """The language model's part of a config.json: a multimodal file's ``text_config`` (Llama 4,
    Qwen3.5, Qwen3-VL; Qwen3-Omni's under ``thinker_config``), else the file itself."""
    if "hidden_size" in cfg:
        return cfg
    for outer in (cfg, cfg.get("thinker_config")):
        if isinstance(outer, dict) and isinstance(outer.get("text_config"), dict):
            return outer["text_config"]
    return cfg


def type_problems(cfg: dict, name: str) -> None:
    """Refuses a config.json whose fields the planner reads hold the wrong kind of value (a size
    written as text, a layer list as a number), naming the field, instead of failing later."""

    def whole(value):
        return not isinstance(value, bool) and isinstance(value, int) and value >= 0

    for key in WHOLE_NUMBERS:
        value = cfg.get(key)
        if key in EXPERT_KEYS + TOPK_KEYS and isinstance(value, list) and value and all(map(whole, value)):
            continue                                 # one per layer (Hunyuan): `_one` takes it if all agree
        if value is not None and not whole(value):
            raise ConfigError(f"{name}: config.json's {key} is {value!r}: write a whole number >= 0 (or null)")
    for key in LISTS:
        if cfg.get(key) is not None and not isinstance(cfg[key], list):
            raise ConfigError(f"{name}: config.json's {key} is {cfg[key]!r}: write a list (or null)")
    if not isinstance(cfg.get("model_type", ""), str):
        raise ConfigError(f"{name}: config.json's model_type is {cfg['model_type']!r}: write the model's type name")


def family_problems(cfg: dict, name: str) -> None:
    """Refuses a config.json with layers the planner cannot cost, naming them: Mamba layers
    (Jamba, Granite 4's hybrids), short convolutions (LFM2), linear attention other than Qwen3-Next's
    Gated DeltaNet (MiniMax-01's lightning attention, Kimi-Linear's and Ling's), attention heads
    that are routed experts (JetMoE). Costed as attention they would come out silently wrong."""
    kind = cfg.get("model_type")
    types = {str(t) for t in cfg.get("layer_types") or ()}
    mamba = sorted(k for k in cfg if k.startswith("mamba_") or k in ("attn_layer_period", "ssm_cfg"))
    if mamba or "mamba" in types:
        what = f"Mamba (state-space) layers ({', '.join(mamba[:3]) or 'layer_types mamba'})"
    elif "conv" in types or "conv_L_cache" in cfg:
        what = "short-convolution layers (layer_types conv)"
    elif "linear_attention" in types and not (cfg.get("linear_num_value_heads") or cfg.get("linear_key_head_dim")):
        what = ("linear-attention layers that are not Gated DeltaNet (they lack linear_num_value_heads / "
                "linear_key_head_dim; the planner costs Qwen3-Next's kind only)")
    elif kind == "jetmoe":
        what = "attention heads that are routed experts (mixture of attention heads)"
    else:
        return
    raise ConfigError(f"{name}: config.json (model_type {kind!r}) has {what}: the planner costs attention, Gated "
                      f"DeltaNet and MoE layers only, and would cost these as attention; {_HOW_ELSE} where the "
                      "layers are of those kinds")


def _one(cfg: dict, keys: tuple, name: str):
    """The first of ``keys`` the file sets; a per-layer list holding one value is that value, a
    list that varies is refused (the planner costs one expert layout for every MoE layer)."""
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, list):
            if len(set(value)) != 1 or isinstance(value[0], bool) or not isinstance(value[0], int):
                raise ConfigError(f"{name}: config.json's {key} is {value!r}, one value per layer or modality: the "
                                  f"planner costs one expert layout for every MoE layer; {_HOW_ELSE}")
            value = value[0]
        if value:
            return value
    return None


def routed_experts(cfg: dict, name: str) -> int:
    experts = _one(cfg, EXPERT_KEYS, name)
    if not experts:
        raise ConfigError(f"{name}: config.json (model_type {cfg.get('model_type')!r}) gives its experts in none of "
                          f"{' / '.join(EXPERT_KEYS)}: not an MoE model of a family the planner reads ({FAMILIES}); "
                          f"{_HOW_ELSE}")
    return experts


def topk(cfg: dict, name: str = "config.json") -> int | None:
    """The experts each token picks; None where the file gives none."""
    return _one(cfg, TOPK_KEYS, name)


def expert_width(cfg: dict) -> int | None:
    """One routed expert's width: ``moe_intermediate_size``, else ``intermediate_size`` (Mixtral,
    GPT-OSS, Llama 4, OLMoE: their experts are the MLP's width)."""
    return cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")


def moe_layer_ids(cfg: dict) -> set:
    """The indices of the layers with experts (the others have a dense MLP), by the first of:
    a per-layer ``mlp_layer_types`` (dense / sparse); DeepSeek's ``first_k_dense_replace`` and
    ``num_dense_layers`` (dense layers first; then DeepSeek's every ``moe_layer_freq``-th);
    Llama 4's ``moe_layers``; ERNIE's
    ``moe_layer_start_index`` .. ``moe_layer_end_index`` (-1: the last) every
    ``moe_layer_interval``-th; every ``interleave_moe_layer_step``-th (Llama 4) or
    ``decoder_sparse_step``-th (Qwen) layer but Qwen's ``mlp_only_layers``."""
    layers = cfg["num_hidden_layers"]
    if isinstance(cfg.get("mlp_layer_types"), list):
        return {i for i, kind in enumerate(cfg["mlp_layer_types"][:layers]) if kind != "dense"}
    first = cfg.get("first_k_dense_replace") or cfg.get("num_dense_layers")
    if first:
        return set(range(first, layers)) & set(range(0, layers, cfg.get("moe_layer_freq") or 1))
    if isinstance(cfg.get("moe_layers"), list):
        return set(cfg["moe_layers"])
    if "moe_layer_start_index" in cfg or "moe_layer_interval" in cfg:
        start, end = cfg.get("moe_layer_start_index") or 0, cfg.get("moe_layer_end_index", -1)
        end = layers - 1 if end in (None, -1) else end
        every = cfg.get("moe_layer_interval") or 1
        return {i for i in range(start, min(end, layers - 1) + 1) if (i + 1) % every == 0}
    step = cfg.get("interleave_moe_layer_step") or cfg.get("decoder_sparse_step") or 1
    return set(range(step - 1, layers, step)) - set(cfg.get("mlp_only_layers") or [])


def dense_layers(cfg: dict) -> int:
    """Layers with a dense MLP instead of experts (`moe_layer_ids`' complement)."""
    return cfg["num_hidden_layers"] - len(moe_layer_ids(cfg))


def shared_width(cfg: dict, moe_ffn: int) -> int:
    """The shared experts' total width beside the routed ones (0: none): a width where the file
    gives one (Qwen's ``shared_expert_intermediate_size``, Granite's ``shared_intermediate_size``,
    Step's ``share_expert_dim``), else a count of routed-expert widths (DeepSeek's
    ``n_shared_experts``, ``num_shared_experts``, ERNIE's ``moe_num_shared_experts``); Llama 4's
    one shared expert."""
    width = cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size") or \
        cfg.get("share_expert_dim")
    if width:
        return width
    count = cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or cfg.get("moe_num_shared_experts") or 0
    if str(cfg.get("model_type", "")).startswith("llama4"):
        count = 1
    return count * moe_ffn


def unchecked_note(cfg: dict) -> str | None:
    """The assumed line's note for a file of a ``model_type`` outside `CHECKED_TYPES`."""
    kind = cfg.get("model_type")
    if kind in CHECKED_TYPES:
        return None
    return (f"config.json's model_type {kind!r} is read by its fields as an MoE transformer (experts, top-k, "
            f"dense and shared layers); the families checked are {FAMILIES}")
