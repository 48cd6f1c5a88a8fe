"""expertrail.hf's checkpoint reading without process groups: names, headers, refusals."""
import json

import pytest
import torch

import expertrail as er
from expertrail.moe.hf_checkpoint import Checkpoint, _conversions, _ranges, expert_suffixes

transformers = pytest.importorskip("transformers")


def _meta_model(kind):
    import transformers as tf
    cfg = {"mixtral": tf.MixtralConfig(vocab_size=16, hidden_size=8, intermediate_size=4, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, num_local_experts=4),
           "qwen3_moe": tf.Qwen3MoeConfig(vocab_size=16, hidden_size=8, moe_intermediate_size=4, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, num_experts=4)}[kind]
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(cfg)


def test_per_expert_names_come_from_transformers_conversion_mapping():
    mixtral = expert_suffixes(_conversions(_meta_model("mixtral"), saving=False)[1])
    assert {s: r for s, r in mixtral.items() if s.startswith("w")} == {"w1.weight": "gate", "w3.weight": "up",
                                                                       "w2.weight": "down"}
    assert next(s for s, r in mixtral.items() if r == "gate") == "w1.weight"        # what save_pretrained writes
    qwen = expert_suffixes(_conversions(_meta_model("qwen3_moe"), saving=False)[1])
    assert qwen == {"gate_proj.weight": "gate", "up_proj.weight": "up", "down_proj.weight": "down"}


def test_checkpoint_reads_headers_only_and_the_index_decides(tmp_path):
    from safetensors.torch import save_file
    save_file({"a": torch.arange(6.0).view(2, 3), "b": torch.zeros(4)}, str(tmp_path / "one.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "one.safetensors"}}))
    ckpt = Checkpoint(tmp_path)
    assert ckpt.tensors == {"a": ("one.safetensors", (2, 3), "F32")}      # "b" is in the file, not the index
    row = torch.empty(3)
    ckpt.read([("a", 1, row)])
    assert row.tolist() == [3.0, 4.0, 5.0]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "two.safetensors"}}))
    with pytest.raises(Exception):
        Checkpoint(tmp_path)


def test_save_pretrained_of_an_unpatched_model_is_refused_by_name(tmp_path):
    with pytest.raises(er.ConfigError, match="has no expert-parallel block; save an unpatched model with its own"):
        er.hf.save_pretrained(torch.nn.Linear(2, 2), tmp_path)


def test_expert_lists_are_shown_as_ranges():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
