"""The whole transformer of an MoE model, and its training FLOPs counted as Megatron-Core counts them.

`MoEModel` (catalog.py) holds what dispatch needs; `Architecture` adds what memory and step
time need: attention (grouped-query or multi-latent, and Gated DeltaNet linear attention in a
share of the layers, averaged in per layer), dense layers, vocabulary, MTP layers.
Shapes of the catalog models are from their published configurations (Hugging Face
config.json); Megatron field names in a training configuration override them
(`from_fields`).

FLOPs (`flops_per_token`) follow Megatron-Core's `num_floating_point_operations`: every GEMM
counted three times (forward, weight gradient, data gradient) at 2 FLOPs per multiply-add;
SwiGLU MLPs as three h x f GEMMs; routed experts top-k times; core attention over half the
sequence (causal); the output layer once per token (and once more per MTP layer, with the MTP
layer's own transformer layer and its 2h -> h projection). Recomputation is not model FLOPs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from ..errors import ConfigError
from .bridge_recipes import recipe_stem
from . import hf_fields
from .catalog import MoEModel, catalog_name, hf_config, leading_name
from .catalog import from_hf_config as hf_moe_model


@dataclass(frozen=True)
class Architecture:
    name: str
    layers: int                     # transformer layers (dense + MoE)
    dense_layers: int               # the first layers, with a dense MLP
    hidden: int
    ffn: int                        # dense MLP width
    moe_ffn: int                    # one routed expert's width
    experts: int
    topk: int
    shared_ffn: int                 # shared-expert width (0: none)
    heads: int
    kv_heads: int                   # grouped-query attention (= heads for MHA)
    head_dim: int
    vocab: int
    mtp_layers: int = 0
    # Multi-latent attention (DeepSeek-V3): all zero for grouped-query attention.
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    num_groups: int | None = None
    group_topk: int | None = None
    # Megatron counts an expert's gated activation as three matrices only when it is SwiGLU;
    # GPT-OSS's clamped GEGLU it counts as two (its FLOPs per token, not its work).
    swiglu_count: bool = True
    # The output layer shares the embedding's weights (share_embeddings_and_output_weights; a
    # rank holding both holds them once). Every catalog model keeps them apart.
    tied_embeddings: bool = False
    # A sigmoid gate on the attention's output, as wide as its queries (attention_output_gate:
    # Qwen3-Next's full-attention layers).
    attention_gate: bool = False
    # Gated DeltaNet linear attention (Qwen3-Next; Megatron's experimental_attention_variant
    # gated_delta_net): this many layers attend linearly, the others (every linear_attention_freq-th)
    # with standard attention; their key and value heads and head widths, and the depthwise
    # convolution's kernel.
    linear_layers: int = 0
    linear_qk_heads: int = 0
    linear_v_heads: int = 0
    linear_qk_dim: int = 0
    linear_v_dim: int = 0
    linear_conv: int = 4
    linear_gdn2: bool = False        # GDN2's input projection (queries, keys, values, output and three gates)
    # How the published checkpoint's router was trained to balance its experts, which sets how
    # unevenly a natural (not force-balanced) router loads them in one micro-batch
    # (estimate.routing_imbalance): "micro_batch" (an auxiliary loss over each micro-batch, as
    # Mixtral's and Megatron's default aux_loss), or "global_batch" (balanced over a step's whole
    # batch, which leaves a micro-batch free to favour some experts: Qwen3's global-batch balancing
    # loss, Qwen3 Technical Report, arXiv 2505.09388, section 2; DeepSeek-V3's expert biases, set
    # from the batch's loads, DeepSeek-V3 Technical Report, arXiv 2412.19437, section 2.1.2; in a
    # configuration, Megatron's global_aux_loss or moe_router_enable_expert_bias).
    router_balance: str = "micro_batch"
    # What the model does that the estimate costs otherwise, said on its not-modelled line
    # (`hf_not_modelled`: sparse, sliding-window and chunked attention, costed as full attention).
    not_modelled: tuple = ()
    # How the shape was read where that is itself an assumption, said on the assumed line
    # (`hf_fields.unchecked_note`: a config.json of a family the tests do not read).
    assumed: tuple = ()

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def query_groups(self) -> int:
        """Megatron's num_query_groups: the key-value heads, or every head with multi-latent attention."""
        return self.heads if self.mla else self.kv_heads

    def split_problems(self, tp: int, etp: int) -> list:
        """Why Megatron-Core cannot split this model over TP ``tp`` and expert-TP ``etp``, each with
        its fix (`width_split_problems` of its heads and widths; the dense MLP's only with dense
        layers, Gated DeltaNet's heads only with linear attention)."""
        linear = self.linear_layers > 0
        return list(width_split_problems(
            tp, etp, num_attention_heads=self.heads, moe_ffn_hidden_size=self.moe_ffn,
            ffn_hidden_size=self.ffn if self.dense_layers else None,
            moe_shared_expert_intermediate_size=self.shared_ffn or None,
            linear_num_key_heads=self.linear_qk_heads if linear else None,
            linear_num_value_heads=self.linear_v_heads if linear else None,
            num_query_groups=self.query_groups).values())

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

    def recompute_problems(self, modules) -> list:
        """What Megatron-Core refuses in ``modules`` (recompute_modules) for this model: the
        modules of an attention it does not have (mla_up_proj without multi-latent attention,
        gdn_norm_out without Gated DeltaNet)."""
        out = []
        if "mla_up_proj" in modules and not self.mla:
            out.append(f"recompute_modules mla_up_proj recomputes multi-latent attention's up projections, which "
                       f"{self.name} does not have (Megatron-Core raises): drop it from recompute_modules")
        if "gdn_norm_out" in modules and not self.linear_layers:
            out.append(f"recompute_modules gdn_norm_out recomputes Gated DeltaNet's output norm, which {self.name} "
                       "does not have (Megatron-Core raises): drop it from recompute_modules")
        return out

    def moe_model(self) -> MoEModel:
        """What the dispatch cost model needs."""
        return MoEModel(self.name, self.hidden, self.experts, self.topk, self.moe_ffn, self.moe_layers,
                        shared_experts=-(-self.shared_ffn // self.moe_ffn), num_groups=self.num_groups,
                        group_topk=self.group_topk)

    # Parameters --------------------------------------------------------------------------
    @property
    def linear_share(self) -> float:
        """The share of the layers with linear (Gated DeltaNet) attention."""
        return self.linear_layers / self.layers if self.layers else 0.0

    def standard_attention_params(self) -> int:
        """One standard attention layer's parameters (multi-latent or grouped-query, with its gate)."""
        h = self.hidden
        if self.mla:
            qk = self.qk_nope + self.qk_rope
            q = h * self.q_lora + self.q_lora * self.heads * qk if self.q_lora else h * self.heads * qk
            kv = h * (self.kv_lora + self.qk_rope) + self.kv_lora * self.heads * (self.qk_nope + self.v_head)
            return q + kv + self.heads * self.v_head * h + self.q_lora + self.kv_lora
        gate = self.heads if self.attention_gate else 0
        return h * self.head_dim * (2 * self.heads + 2 * self.kv_heads + gate)

    def linear_widths(self) -> tuple:
        """(all key heads' width, all value heads' width, the input projection's outputs, the
        convolution's channels) of a Gated DeltaNet layer: its input projection writes queries,
        keys, values, the output gate and two gates per value head; the convolution runs over the
        queries, keys and values (GDN2: queries, keys, values, the output gate and three more)."""
        qk, v = self.linear_qk_heads * self.linear_qk_dim, self.linear_v_heads * self.linear_v_dim
        in_proj = 4 * qk + 3 * v if self.linear_gdn2 else 2 * qk + 2 * v + 2 * self.linear_v_heads
        return qk, v, in_proj, 2 * qk + v

    def linear_attention_params(self) -> int:
        """One Gated DeltaNet layer's parameters: input and output projections, the depthwise
        convolution, each value head's decay and step bias, the gated norm."""
        if not self.linear_layers:
            return 0
        qk, v, in_proj, conv = self.linear_widths()
        return self.hidden * in_proj + self.linear_conv * conv + v * self.hidden + 2 * self.linear_v_heads \
            + self.linear_v_dim

    def attention_params(self) -> float:
        """A layer's attention parameters, averaged over the layers (linear ones and standard ones)."""
        return (1 - self.linear_share) * self.standard_attention_params() \
            + self.linear_share * self.linear_attention_params()

    def expert_params(self) -> int:
        """One routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.hidden * self.moe_ffn

    def dense_layer_params(self) -> int:
        return self.attention_params() + 3 * self.hidden * self.ffn + 2 * self.hidden

    def moe_layer_dense_params(self) -> int:
        """A MoE layer's parameters outside the routed experts: attention, shared expert, router, norms."""
        return self.attention_params() + 3 * self.hidden * self.shared_ffn + self.hidden * self.experts + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        moe = self.moe_layers * (self.moe_layer_dense_params() + self.experts * self.expert_params())
        mtp = self.mtp_layers * (self.moe_layer_dense_params() + self.experts * self.expert_params()
                                 + 2 * self.hidden * self.hidden)
        return self.dense_layers * self.dense_layer_params() + moe + mtp + \
            (1 if self.tied_embeddings else 2) * self.embedding_params()

    # FLOPs -------------------------------------------------------------------------------
    def attention_flops(self, seq: int) -> tuple:
        """(projection GEMM FLOPs, core attention FLOPs, linear attention core FLOPs) of one token
        in one layer, forward only, averaged over the layers: a standard layer's core attends over
        the causal half of the sequence; a Gated DeltaNet layer's projections are GEMMs and its
        core (`linear_core_flops`) is linear in the sequence, as Megatron counts them."""
        core_dims = (self.qk_nope + self.qk_rope + self.v_head) if self.mla else 2 * self.head_dim
        core = 2 * self.heads * core_dims * seq / 2          # QK^T and AV over the causal half
        proj = 2 * self.standard_attention_params()
        if not self.linear_layers:
            return proj, core, 0.0
        qk, v, in_proj, conv = self.linear_widths()
        linear_proj = 2 * (self.hidden * in_proj + v * self.hidden)
        share = self.linear_share
        return (1 - share) * proj + share * linear_proj, (1 - share) * core, share * self.linear_core_flops()

    def linear_core_flops(self) -> float:
        """Forward FLOPs of one token in one Gated DeltaNet layer between its projections, Megatron's
        count: the depthwise convolution over the queries', keys' and values' channels, and four
        products of each value head's state (the delta rule)."""
        qk, v, in_proj, conv = self.linear_widths()
        return 2 * (self.linear_conv * conv + 4 * self.linear_v_heads * self.linear_v_dim ** 2)

    def layer_flops(self, seq: int, moe: bool) -> dict:
        """Forward FLOPs of one token in one layer, by kind (x3 for a training step)."""
        proj, core, linear = self.attention_flops(seq)
        out = {"attention_gemm": proj, "attention_core": core, "linear_core": linear}
        if moe:
            out["experts"] = 2 * self.topk * self.expert_params()
            out["dense_mlp"] = 2 * (3 * self.hidden * self.shared_ffn + self.hidden * self.experts)
        else:
            out["experts"] = 0
            out["dense_mlp"] = 2 * 3 * self.hidden * self.ffn
        return out

    def output_layers_worth(self, seq: int = 4096) -> float:
        """The output layer (and loss) in MoE layers' worth of FLOPs: what a pipeline stage holding
        it carries beside its decoder layers (an MTP layer carries one layer and its own)."""
        return 2 * self.embedding_params() / sum(self.layer_flops(seq, True).values())

    def flops_per_token(self, seq: int) -> float:
        """Model FLOPs of one token in one training step (forward + backward), Megatron's count."""
        moe = self.layer_flops(seq, True)
        if not self.swiglu_count:
            moe["experts"] = moe["experts"] * 2 / 3
        total = sum(self.layer_flops(seq, False).values()) * self.dense_layers
        total += sum(moe.values()) * self.moe_layers
        total += 2 * self.embedding_params()                                   # output layer
        total += self.mtp_layers * (sum(moe.values()) + 2 * 2 * self.hidden * self.hidden
                                    + 2 * self.embedding_params())
        return 3.0 * total


def sliding_window_note(window: int, layers: str) -> str:
    """The not-modelled note of sliding-window attention over ``window`` tokens on ``layers``."""
    return f"sliding-window attention ({window} tokens, {layers}): costed as full causal attention, as Megatron counts it"


GPT_OSS_WINDOW = sliding_window_note(128, "every other layer")
ARCHITECTURES = {a.name: a for a in [
    # DeepSeek-V3 with its one MTP layer (config.json's num_nextn_predict_layers), as Megatron-Bridge's
    # recipes and the ModelZoo's runs train it (mtp_num_layers=0 in a configuration leaves it out).
    Architecture("deepseek-v3", 61, 3, 7168, 18432, 2048, 256, 8, 2048, 128, 128, 128, 129280,
                 q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128, num_groups=8, group_topk=4,
                 mtp_layers=1, router_balance="global_batch"),
    # Kimi-K2 (moonshotai/Kimi-K2-Base config.json): DeepSeek-V3's shape with 384 experts, 64 heads, one dense layer.
    Architecture("kimi-k2", 61, 1, 7168, 18432, 2048, 384, 8, 2048, 64, 64, 128, 163840,
                 q_lora=1536, kv_lora=512, qk_nope=128, qk_rope=64, v_head=128, router_balance="global_batch"),
    Architecture("qwen3-235b-a22b", 94, 0, 4096, 12288, 1536, 128, 8, 0, 64, 4, 128, 151936,
                 router_balance="global_batch"),
    Architecture("qwen3-30b-a3b", 48, 0, 2048, 6144, 768, 128, 8, 0, 32, 4, 128, 151936, router_balance="global_batch"),
    # Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-Instruct config.json): three of every four layers attend
    # with Gated DeltaNet, the fourth with gated full attention.
    Architecture("qwen3-next-80b-a3b", 48, 0, 2048, 5120, 512, 512, 10, 512, 16, 2, 256, 151936,
                 attention_gate=True, linear_layers=36, linear_qk_heads=16, linear_v_heads=32, linear_qk_dim=128,
                 linear_v_dim=128, linear_conv=4, router_balance="global_batch"),
    # GPT-OSS (openai/gpt-oss-120b and -20b config.json): every other layer attends over a
    # 128-token window; counted as full causal attention, as Megatron counts it.
    Architecture("gpt-oss-120b", 36, 0, 2880, 2880, 2880, 128, 4, 0, 64, 8, 64, 201088, swiglu_count=False,
                 not_modelled=(GPT_OSS_WINDOW,)),
    Architecture("gpt-oss-20b", 24, 0, 2880, 2880, 2880, 32, 4, 0, 64, 8, 64, 201088, swiglu_count=False,
                 not_modelled=(GPT_OSS_WINDOW,)),
    Architecture("mixtral-8x7b", 32, 0, 4096, 14336, 14336, 8, 2, 0, 32, 8, 128, 32000),
    Architecture("mixtral-8x22b", 56, 0, 6144, 16384, 16384, 8, 2, 0, 48, 8, 128, 32768),
]}

# The MoE part of each: what the dispatch planner (`plan`, `simulate`) takes.
MODELS = {name: arch.moe_model() for name, arch in ARCHITECTURES.items()}

# Megatron field -> Architecture field, for configurations that spell the model out.
FIELDS = {"num_layers": "layers", "hidden_size": "hidden", "ffn_hidden_size": "ffn", "moe_ffn_hidden_size": "moe_ffn",
          "num_moe_experts": "experts", "moe_router_topk": "topk",
          "moe_shared_expert_intermediate_size": "shared_ffn", "num_attention_heads": "heads",
          "num_query_groups": "kv_heads", "kv_channels": "head_dim", "padded_vocab_size": "vocab",
          "vocab_size": "vocab", "mtp_num_layers": "mtp_layers", "q_lora_rank": "q_lora", "kv_lora_rank": "kv_lora",
          "qk_head_dim": "qk_nope", "qk_pos_emb_head_dim": "qk_rope", "v_head_dim": "v_head",
          "moe_router_num_groups": "num_groups", "moe_router_group_topk": "group_topk",
          "attention_output_gate": "attention_gate", "linear_num_key_heads": "linear_qk_heads",
          "linear_num_value_heads": "linear_v_heads", "linear_key_head_dim": "linear_qk_dim",
          "linear_value_head_dim": "linear_v_dim", "linear_conv_kernel_dim": "linear_conv"}
# Megatron's experimental_attention_variant values of Gated DeltaNet (linear attention), and its
# TransformerConfig defaults of the layer's heads and widths.
GATED_DELTA_NET = ("gated_delta_net", "gdn", "gdn2")
LINEAR_DEFAULTS = {"linear_qk_heads": 16, "linear_v_heads": 32, "linear_qk_dim": 128, "linear_v_dim": 128}


def linear_layers_every(layers: int, freq: int) -> int:
    """Linear-attention layers of ``layers`` when every ``freq``-th keeps standard attention."""
    return layers - layers // freq


def linear_variant(fields: dict):
    """The configuration's attention variant: Megatron's field, or its 2025 dev branch's name."""
    return fields.get("experimental_attention_variant") or fields.get("linear_attention_type")


def linear_layers_of(fields: dict, layers: int) -> int | None:
    """Layers with linear attention under Megatron's ``experimental_attention_variant`` (a Gated
    DeltaNet one; ``linear_attention_type`` in its 2025 dev branch) and ``linear_attention_freq``:
    every freq-th layer keeps standard attention, or a list of 1 (linear) and 0 per layer; None
    where the configuration sets no variant."""
    variant = linear_variant(fields)
    if variant not in GATED_DELTA_NET:
        return None
    freq = fields.get("linear_attention_freq")
    if isinstance(freq, str):
        freq = int(freq) if freq.strip().isdigit() else \
            _expand_pattern(freq, "linear_attention_freq", "write a whole number or a pattern such as [1,1,1,0]*12")
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return linear_layers_every(layers, freq)
    if isinstance(freq, list) and len(freq) == layers:
        return sum(1 for v in freq if v)
    raise ConfigError(f"linear_attention_freq={freq!r}: experimental_attention_variant={variant} needs it: a whole "
                      f"number (every k-th layer keeps standard attention) or a list of {layers} 1s (linear) and 0s")


def dense_layers_of(freq, layers: int) -> int | None:
    """Dense layers of Megatron's ``moe_layer_freq`` over ``layers`` layers: an integer N makes
    every N-th layer MoE (layers 0, N, 2N, ...), a pattern (a list, or text such as
    ``([0]*3+[1]*58)``) marks each layer 0 (dense) or 1 (MoE); None where it is not given. The
    estimate places them first (DeepSeek's are; an interleaved pattern moves layers between
    pipeline ranks, not their sum). A pattern not one entry a layer is refused, as Megatron-Core
    asserts."""
    if freq is None:
        return None
    if isinstance(freq, str) and freq.strip().isdigit():
        freq = int(freq)
    if isinstance(freq, str):
        freq = _expand_pattern(freq)
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ConfigError(f"moe_layer_freq={freq}: give N >= 1 (every N-th layer MoE) or a pattern of 0s and 1s")
        return layers - -(-layers // freq)
    if len(freq) != layers:
        raise ConfigError(f"moe_layer_freq gives {len(freq)} layers, the model has {layers} (Megatron-Core asserts): "
                          "write one 0 (dense) or 1 (MoE) per layer, e.g. ([0]*3+[1]*58)")
    return sum(1 for v in freq if not v)


def _expand_pattern(text: str, name: str = "moe_layer_freq",
                    hint: str = "write 1 or a pattern such as ([0]*3+[1]*58)") -> list:
    """``([0]*3+[1]*58)`` or ``[0,1,1]`` -> the list of 0s and 1s it spells; a text that spells
    none is refused by the field's ``name``, with ``hint``."""
    out = []
    for term in text.strip().strip("()").replace(" ", "").split("+"):
        body, _, times = term.partition("*")
        try:
            values = [int(v) for v in body.strip("[]").split(",") if v]
            out += values * (int(times) if times else 1)
        except ValueError:
            raise ConfigError(f"{name} {text!r}: {hint}") from None
    return out


# The vocabulary of a model spelled out by Megatron fields that give none and whose tokenizer names
# no model known here: Megatron takes it from the tokenizer, which a configuration names but does
# not size.
UNSTATED_VOCAB = 32000
# Megatron-LM's tokenizers of a fixed vocabulary (tokenizer_type), which no tokenizer_model sizes:
# GPT-2's byte-level BPE, read from its vocab.json and merges.txt, as Megatron-LM's examples and
# functional tests train.
FIXED_TOKENIZER_VOCABS = {"GPT2BPETokenizer": 50257}


class Checkpoint(NamedTuple):
    """A published checkpoint as far as a configuration that names it needs: its name, its
    vocabulary (config.json's vocab_size) and how its router was trained to balance."""
    name: str
    vocab: int
    router_balance: str


# MoE checkpoints outside the catalog that Megatron-LM scripts train, by the start of their Hugging
# Face name: their config.json's vocab_size and how their router was trained to balance (DeepSeek-V2,
# Qwen-MoE and Llama 4 with an auxiliary loss; Moonlight and GLM-4.5 with expert biases).
OTHER_CHECKPOINTS = {"deepseek-v2": (102400, "micro_batch"), "qwen2-57b-a14b": (151936, "micro_batch"),
                     "qwen1.5-moe": (151936, "micro_batch"), "moonlight": (163840, "global_batch"),
                     "glm-4.5": (151552, "global_batch"), "llama-4": (202048, "micro_batch")}


def tokenizer_checkpoint(fields: dict) -> Checkpoint | None:
    """The checkpoint a Megatron-LM configuration's ``tokenizer_model`` names, as its scripts name
    the checkpoint they train (``Qwen/Qwen3-235B-A22B``, ``unsloth/DeepSeek-V3``,
    ``Qwen3-Next-80B-A3B-Instruct``, ``deepseek-ai/DeepSeek-V2``): the catalog model or
    `OTHER_CHECKPOINTS` entry whose name begins its last path part, or the MoE model of a Hugging
    Face model directory's config.json or of a repository id the local hub cache holds
    (`catalog.hub_cache_config`); None where it names none of them."""
    name = fields.get("tokenizer_model")
    if not isinstance(name, str) or not name.strip():
        return None
    known = {**{k: (a.vocab, a.router_balance) for k, a in ARCHITECTURES.items()}, **OTHER_CHECKPOINTS}
    key = leading_name(name, known, joiner="")      # DeepSeek-V3.2's vocabulary is DeepSeek-V3's too
    if key:
        return Checkpoint(key, *known[key])
    try:                                            # a model directory, or a repository id the hub cache holds
        found = hf_config(name) if Path(name, "config.json").is_file() or not Path(name).exists() else None
        arch = from_hf_config(*found) if found else None
    except ConfigError:                             # a tokenizer directory that holds no MoE model
        return None
    return Checkpoint(arch.name, arch.vocab, arch.router_balance) if arch else None


def tokenizer_vocab(fields: dict, named: Checkpoint | None) -> tuple | None:
    """(vocabulary, whose it is) of the tokenizer a configuration names: that of ``named``, its
    ``tokenizer_model``'s checkpoint (`tokenizer_checkpoint`), else a ``tokenizer_type`` of a fixed
    vocabulary (`FIXED_TOKENIZER_VOCABS`); None where it sizes none."""
    if named:
        return named.vocab, f"{named.name}'s, named by tokenizer_model"
    fixed = FIXED_TOKENIZER_VOCABS.get(fields.get("tokenizer_type"))
    return (fixed, f"{fields['tokenizer_type']}'s {fixed}") if fixed else None


def padded_vocab(vocab: int, fields: dict) -> int:
    """``vocab`` rounded up as Megatron-LM pads a tokenizer's vocabulary: to a multiple of
    ``make_vocab_size_divisible_by`` (default 128) x TP, so the output layer splits over TP."""
    multiple = (fields.get("make_vocab_size_divisible_by") or 128) * (fields.get("tensor_model_parallel_size") or 1)
    return -(-vocab // multiple) * multiple


def fine_tunes_checkpoint(fields: dict) -> bool:
    """Whether the run starts from a trained checkpoint's weights (Megatron-LM's ``finetune``,
    Megatron-Bridge's ``pretrained_checkpoint``), whose router keeps the balance it was trained to."""
    return bool(fields.get("finetune") or fields.get("pretrained_checkpoint"))


def unstated_model_fields(fields: dict) -> list:
    """What a model spelled out by Megatron fields (no catalog or Hugging Face base) takes from
    elsewhere, for the estimate's assumed line: the vocabulary, when no vocab_size is given (its
    tokenizer's model's, else `UNSTATED_VOCAB`), gated MLPs where it does not say (``swiglu``,
    ``quick_geglu`` and ``gated_linear_unit`` say so), and the router's balance of a checkpoint
    it fine-tunes."""
    named = tokenizer_checkpoint(fields)
    sized = tokenizer_vocab(fields, named)
    out = []
    if not any(fields.get(k) for k in ("vocab_size", "padded_vocab_size")):
        out.append(f"vocab_size={padded_vocab(sized[0], fields)} ({sized[1]}, padded to a multiple of "
                   "make_vocab_size_divisible_by x TP as Megatron-LM pads it)" if sized else
                   f"vocab_size={UNSTATED_VOCAB} (Megatron sizes it from the tokenizer: give vocab_size)")
    if not (fields.get("swiglu") or fields.get("quick_geglu")) and fields.get("gated_linear_unit") is None:
        out.append("swiglu=true (gated MLPs, as every supported family's; Megatron-LM's default without --swiglu, "
                   "an ungated GeLU MLP, is not costed)")
    if named and fine_tunes_checkpoint(fields) and not _balances_globally(fields):
        out.append(f"router_balance={named.router_balance} (the {named.name} checkpoint the run fine-tunes, named by "
                   "tokenizer_model)")
    return out


def _balances_globally(fields: dict) -> bool:
    """Whether the configuration's own router balances over the whole batch: Megatron's
    global_aux_loss, or expert biases (moe_router_enable_expert_bias)."""
    balancing = fields.get("moe_router_load_balancing_type")
    kinds = balancing if isinstance(balancing, (list, tuple)) else str(balancing).split(",")
    return "global_aux_loss" in kinds or bool(fields.get("moe_router_enable_expert_bias"))


def megatron_ffn_default(fields: dict) -> int | None:
    """Megatron-LM's dense MLP width where ``ffn_hidden_size`` is not given: 4 x hidden, or two
    thirds of it rounded down to a multiple of 64 for a gated unit (``swiglu``), which keeps its
    parameters near the ungated MLP's; None without ``hidden_size``."""
    hidden = fields.get("hidden_size")
    if not hidden:
        return None
    gated = fields.get("swiglu") or fields.get("gated_linear_unit")
    return int(4 * hidden * 2 / 3 / 64) * 64 if gated else 4 * hidden


def tied_embeddings_of(fields: dict) -> bool | None:
    """Whether a configuration ties the output layer to the embedding: Megatron-Core's and
    Bridge's ``share_embeddings_and_output_weights``, or Megatron-LM's
    ``untie_embeddings_and_output_weights`` (its opposite); None where it says neither."""
    if fields.get("share_embeddings_and_output_weights") is not None:
        return bool(fields["share_embeddings_and_output_weights"])
    if fields.get("untie_embeddings_and_output_weights") is not None:
        return not fields["untie_embeddings_and_output_weights"]
    return None


def from_fields(base: Architecture | None, fields: dict) -> Architecture:
    """``base`` (a catalog architecture, or None) with the Megatron fields of ``fields`` applied."""
    given = {FIELDS[k]: v for k, v in fields.items() if k in FIELDS and v is not None}
    if fields.get("multi_latent_attention") is False:
        given.update(q_lora=0, kv_lora=0)
    tied = tied_embeddings_of(fields)
    if tied is not None:
        given["tied_embeddings"] = tied
    if _balances_globally(fields):
        given["router_balance"] = "global_batch"     # balanced over the whole batch, as Qwen3's and DeepSeek-V3's
    if fields.get("quick_geglu"):
        given["swiglu_count"] = False    # Megatron counts a gated MLP's third matrix only under swiglu (GPT-OSS's)
    limited = fields.get("moe_router_topk_limited_devices")
    if limited and not fields.get("moe_router_group_topk"):
        # Megatron-Core's reading of the deprecated device-limited routing: groups of one EP rank's experts
        given.update(group_topk=limited, num_groups=fields.get("expert_model_parallel_size") or 1)
    if base is None:
        named = tokenizer_checkpoint(fields)
        sized = tokenizer_vocab(fields, named)
        if sized and "vocab" not in given:
            given["vocab"] = padded_vocab(sized[0], fields)
        if named and fine_tunes_checkpoint(fields) and "router_balance" not in given:
            given["router_balance"] = named.router_balance
        default_ffn = megatron_ffn_default(fields)
        if "ffn" not in given and default_ffn:
            given["ffn"] = default_ffn
        if "moe_ffn" not in given and "ffn" in given:
            given["moe_ffn"] = given["ffn"]      # Megatron's default: the experts as wide as ffn_hidden_size
        needed = ["num_layers", "hidden_size", "num_attention_heads", "num_moe_experts", "moe_ffn_hidden_size"]
        missing = [k for k in needed if FIELDS[k] not in given]
        if missing:
            raise ConfigError(f"the configuration does not spell the model out (no {', '.join(missing)}): give "
                              f"--model NAME (one of {', '.join(ARCHITECTURES)}) or those fields")
        hidden, heads = given["hidden"], given["heads"]
        base = Architecture("config", given["layers"], 0, hidden, given["ffn"], given["moe_ffn"], given["experts"], 2, 0,
                            heads, heads, hidden // heads, UNSTATED_VOCAB)
    dense = dense_layers_of(fields.get("moe_layer_freq"), given.get("layers", base.layers))
    if dense is not None:
        given["dense_layers"] = dense
    linear = linear_layers_of(fields, given.get("layers", base.layers))
    if linear is not None:
        given["linear_layers"] = linear
        for name, default in LINEAR_DEFAULTS.items():            # Megatron's defaults where neither sets them
            given.setdefault(name, getattr(base, name) or default)
        given["linear_gdn2"] = linear_variant(fields) == "gdn2"
    arch = replace(base, **given)
    if not fields.get("group_query_attention") and "num_query_groups" not in fields and "num_attention_heads" in fields \
            and not arch.mla and base.name == "config":
        arch = replace(arch, kv_heads=arch.heads)
    if arch.experts % max(1, arch.num_groups or 1) or arch.topk > arch.experts or arch.dense_layers > arch.layers:
        raise ConfigError(f"model {arch.name}: topk {arch.topk} of {arch.experts} experts, {arch.dense_layers} dense "
                          f"of {arch.layers} layers do not make an MoE model; check the model fields")
    groups, picked = arch.num_groups or 1, arch.group_topk
    if picked and not group_routing_holds(picked, groups, arch.experts, arch.topk):
        raise ConfigError(f"model {arch.name}: group-limited routing picks {arch.group_topk} of {groups} groups of "
                          f"{arch.experts // groups} experts for top-{arch.topk}: set 1 <= moe_router_group_topk "
                          "(moe_router_topk_limited_devices) <= moe_router_num_groups (the EP size), enough for top-k")
    return arch


def group_routing_holds(group_topk: int, groups: int, experts: int, topk: int) -> bool:
    """Whether group-limited routing can route: 1 <= ``group_topk`` <= ``groups`` (Megatron-Core
    asserts it) and the groups it picks hold the top-k experts. The model's groups, and
    moe_router_topk_limited_devices' (one group per EP rank), both: `from_fields` and validate's
    rules ask it."""
    return 1 <= group_topk <= groups and group_topk * (experts // groups) >= topk


def width_split_problems(tp: int, etp: int, **sizes) -> dict:
    """{field: why Megatron-Core cannot split it, with the fix} for the model sizes given (a size
    None is not checked): the attention heads, the dense and shared-expert MLPs' widths and Gated
    DeltaNet's heads over TP, a routed expert's width (``moe_ffn_hidden_size``) over ETP, the
    query groups (``num_query_groups``) a multiple or a divisor of TP (Megatron-Core raises, or
    its parallel linear layers assert). `Architecture.split_problems` and `validate`'s TP rules
    both ask it."""
    out = {}
    for name, size in sizes.items():
        if size is None or name == "num_query_groups":
            continue
        label, ways = ("ETP", etp) if name == "moe_ffn_hidden_size" else ("TP", tp)
        if size % ways:
            out[name] = (f"{name} {size} does not split over {label} {ways} (Megatron-Core asserts): choose a {label} "
                         f"dividing {size}")
    groups = sizes.get("num_query_groups")
    if groups is not None and groups % tp and tp % groups:
        out["num_query_groups"] = (f"num_query_groups {groups} is neither a multiple nor a divisor of TP {tp} "
                                   "(Megatron-Core raises): choose a TP dividing or divided by it")
    return out


def from_hf_config(cfg: dict, name: str = "hf-model") -> Architecture:
    """The whole-model shape of a transformers config.json (DeepSeek-V2/V3 and Kimi-K2 / Moonlight
    with multi-latent attention; GLM-4.5, the Qwen MoEs, Mixtral, GPT-OSS, Llama 4 and the other
    families of `hf_fields.FAMILIES` with grouped-query attention; a multimodal file's language
    model, `hf_fields.language_model`). Dense layers are placed
    first (`hf_fields.dense_layers` counts them; Llama 4 and Qwen interleave them, which moves layers
    between pipeline ranks, not their sum); Qwen3-Next's and Qwen3.5's linear-attention layers are
    Gated DeltaNet (`hf_linear_attention`); GPT-OSS's sliding-window layers are counted as full
    attention (an upper bound of their FLOPs). MTP layers as the file declares them
    (``num_nextn_predict_layers``, Qwen3.5's ``mtp_num_hidden_layers``)."""
    cfg = hf_fields.language_model(cfg)
    moe = hf_moe_model(cfg, name)                       # the MoE part, with its checks
    hidden, heads = cfg["hidden_size"], cfg.get("num_attention_heads") or 1
    dense = cfg["num_hidden_layers"] - moe.layers        # the MoE part's dense layers (`hf_fields.dense_layers`)
    shared = hf_fields.shared_width(cfg, moe.moe_ffn)
    # The dense MLP's width: Llama 4's intermediate_size_mlp (its intermediate_size is an expert's).
    ffn = cfg.get("intermediate_size_mlp") or cfg.get("intermediate_size") or moe.moe_ffn
    linear = hf_linear_attention(cfg)
    return Architecture(
        name=cfg.get("model_type", name), layers=cfg["num_hidden_layers"], dense_layers=dense, hidden=hidden,
        ffn=ffn, moe_ffn=moe.moe_ffn, experts=moe.num_experts, topk=moe.topk,
        shared_ffn=shared, heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads, vocab=cfg.get("vocab_size") or 32000,
        mtp_layers=cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0,
        q_lora=cfg.get("q_lora_rank") or 0,
        kv_lora=cfg.get("kv_lora_rank") or 0, qk_nope=cfg.get("qk_nope_head_dim") or 0,
        qk_rope=cfg.get("qk_rope_head_dim") or 0, v_head=cfg.get("v_head_dim") or 0,
        num_groups=moe.num_groups, group_topk=moe.group_topk,
        swiglu_count=cfg.get("model_type") != "gpt_oss", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        router_balance=hf_router_balance(cfg), not_modelled=hf_not_modelled(cfg),
        assumed=tuple(filter(None, [hf_fields.unchecked_note(cfg)])), **linear)


def hf_not_modelled(cfg: dict) -> tuple:
    """What a config.json declares that changes a step's attention and the estimate costs as full
    causal attention: DeepSeek Sparse Attention (``index_topk``, DeepSeek-V3.2; its indexer left
    out too), sliding windows (``layer_types`` sliding_attention, GPT-OSS's; or ``sliding_window``
    with ``use_sliding_window``) and Llama 4's chunked attention (``attention_chunk_size``)."""
    out = []
    if cfg.get("index_topk"):
        out.append(f"DeepSeek Sparse Attention (index_topk={cfg['index_topk']}): costed as full causal attention, "
                   "its indexer left out")
    types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    window = cfg.get("sliding_window")
    if window and "sliding_attention" in types:
        out.append(sliding_window_note(window, f"{types.count('sliding_attention')} of {len(types)} layers"))
    elif window and cfg.get("use_sliding_window"):
        out.append(sliding_window_note(window, "its layers from max_window_layers on"
                                       if cfg.get("max_window_layers") else "every layer"))
    elif window and cfg.get("model_type") == "gpt_oss":
        out.append(sliding_window_note(window, "every other layer"))
    if cfg.get("attention_chunk_size"):
        out.append(f"chunked attention (attention_chunk_size={cfg['attention_chunk_size']}): costed as full causal "
                   "attention")
    return tuple(out)


def hf_router_balance(cfg: dict) -> str:
    """`Architecture.router_balance` of a config.json: balanced over the whole batch for the Qwen3
    family (``model_type`` qwen3*, Qwen3-Next and Qwen3.5 taken as the family's) and for
    auxiliary-loss-free expert biases (``topk_method`` noaux_tc: DeepSeek-V3, Kimi-K2, Moonlight;
    the model types of `hf_fields.EXPERT_BIAS_TYPES`: GLM-4.5, ERNIE 4.5, MiniMax-M2, ...;
    ``use_routing_bias``, ``use_expert_bias``); within each micro-batch otherwise."""
    kind = str(cfg.get("model_type", ""))
    whole = kind.startswith(("qwen3", *hf_fields.EXPERT_BIAS_TYPES)) or cfg.get("topk_method") == "noaux_tc" \
        or bool(cfg.get("use_routing_bias") or cfg.get("use_expert_bias"))
    return "global_batch" if whole else "micro_batch"


def hf_linear_attention(cfg: dict) -> dict:
    """Architecture fields of a config.json's Gated DeltaNet layers (Qwen3-Next): which layers
    attend linearly (``layer_types``, else every layer but each ``full_attention_interval``-th),
    their heads and widths; its full-attention layers carry an output gate. Empty for models
    without linear attention."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and "linear_attention" in types:
        linear = types.count("linear_attention")
    elif cfg.get("full_attention_interval") and cfg.get("linear_num_value_heads"):
        linear = linear_layers_every(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    else:
        return {}
    return dict(linear_layers=linear, attention_gate=True,
                linear_qk_heads=cfg.get("linear_num_key_heads") or LINEAR_DEFAULTS["linear_qk_heads"],
                linear_v_heads=cfg.get("linear_num_value_heads") or LINEAR_DEFAULTS["linear_v_heads"],
                linear_qk_dim=cfg.get("linear_key_head_dim") or LINEAR_DEFAULTS["linear_qk_dim"],
                linear_v_dim=cfg.get("linear_value_head_dim") or LINEAR_DEFAULTS["linear_v_dim"],
                linear_conv=cfg.get("linear_conv_kernel_dim") or 4)


def recipe_model(values: dict) -> str | None:
    """The catalog model a launcher names: Megatron-Bridge's performance-script recipe
    (``model_recipe_name``, its -mr: qwen3_235b_a22b), the recipe function its run_recipe.py's
    ``--recipe`` names (``recipe``: gpt_oss_20b_pretrain_config), or a Megatron-MoE-ModelZoo launch's MODEL
    whose model file is not at hand (``modelzoo_model``: Qwen3-235B-A22B); None where the
    configuration names none. A name of no catalog model is refused, asking for --model."""
    give = (f"give --model (one of {', '.join(ARCHITECTURES)}, or a Hugging Face config.json or model "
            "directory)")
    recipe = values.get("model_recipe_name")
    if recipe:
        key = catalog_name(str(recipe).replace("_", "-"), ARCHITECTURES)
        if key is None:
            raise ConfigError(f"-mr {recipe}: a Megatron-Bridge recipe of no catalog model: {give}")
        return key
    named = values.get("recipe")                    # run_recipe.py --recipe FUNCTION
    if isinstance(named, str):
        stem = recipe_stem(named)
        key = catalog_name(stem, ARCHITECTURES) if stem else None
        if key is None:
            raise ConfigError(f"--recipe {named}: not a Megatron-Bridge recipe of a catalog model: {give}")
        return key
    zoo = values.get("modelzoo_model")
    if zoo:
        # A ModelZoo name is a catalog name or another model (DeepSeek-V3-Proxy is not DeepSeek-V3).
        if str(zoo).lower() not in ARCHITECTURES:
            raise ConfigError(f"MODEL={zoo}: its ModelZoo model file is not beside the launch script (run from the "
                              f"ModelZoo checkout or set TRAINING_PARAMS_PATH), and no catalog model stands in for "
                              f"it: {give}")
        return str(zoo).lower()
    return None


def load_architecture(name: str | None) -> Architecture | None:
    """A catalog name (or a Hugging Face repository id of it, `catalog.catalog_name`), a Hugging
    Face config.json, or a Hugging Face model directory (its config.json); None for None (the
    configuration spells the model out)."""
    if name is None:
        return None
    key = catalog_name(name, ARCHITECTURES)
    if key:
        return ARCHITECTURES[key]
    found = hf_config(name)
    if found is None:
        raise ConfigError(f"--model {name!r}: choose one of {', '.join(ARCHITECTURES)}, a Hugging Face config.json or "
                          "model directory (or a repository id the local Hugging Face cache holds: `huggingface-cli "
                          "download ORG/NAME config.json` fetches it), or leave --model out and give the model's "
                          "Megatron fields (num_layers, hidden_size, num_attention_heads, num_moe_experts, "
                          "moe_ffn_hidden_size, ...)")
    return from_hf_config(*found)
