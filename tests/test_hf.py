"""expertrail.hf without process groups: reachability, the block check, the weight checksum."""
import subprocess
import sys

import pytest
import torch
from torch import nn

from expertrail.hf import tensor_checksum, why_unsupported
from expertrail.moe.replicated import device_checksum

transformers = pytest.importorskip("transformers")


def test_hf_is_an_attribute_of_the_package():
    # A fresh interpreter: in this one another test may already have imported expertrail.hf.
    code = "import expertrail as er; print(er.hf.patch_model.__name__, 'hf' in dir(er))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["patch_model", "True"]


def _qwen3_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8))


def test_plain_transformers_blocks_are_supported():
    from transformers import DeepseekV3Config, MixtralConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    blocks = [_qwen3_block(), MixtralSparseMoeBlock(MixtralConfig(hidden_size=32, intermediate_size=16, num_local_experts=8)),
              DeepseekV3MoE(DeepseekV3Config(hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                             n_routed_experts=8, n_group=2, topk_group=1))]
    assert [why_unsupported(b) for b in blocks] == [None] * 3


def _with_expert_bias(block):
    block.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(8, 32))
    return block


def _with_clamp(block):
    block.experts.limit = 7.0          # gpt-oss style clamped SwiGLU
    return block


def _transposed(block):
    block.experts.is_transposed = True
    return block


def _scaled(block):
    block.routed_scaling_factor = 2.5
    return block


def _legacy(block):
    block.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
    return block


@pytest.mark.parametrize("change, text", [
    (_with_expert_bias, "its experts hold parameters ['down_proj', 'gate_up_proj', 'gate_up_proj_bias']"),
    (_with_clamp, "its experts have attributes ['limit']"),
    (_transposed, "its experts use another layout: {'is_transposed': True}"),
    (_scaled, "the block has attributes ['routed_scaling_factor']"),
    (_legacy, "transformers 4.x layout"),
])
def test_blocks_that_compute_something_else_are_refused_by_name(change, text):
    assert text in why_unsupported(change(_qwen3_block()))


def test_qwen2_moe_gated_shared_expert_is_refused():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    block = Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(hidden_size=32, moe_intermediate_size=16,
                                                  shared_expert_intermediate_size=16, num_experts=8))
    assert "['shared_expert', 'shared_expert_gate']" in why_unsupported(block)


@pytest.mark.parametrize("checksum", [tensor_checksum, device_checksum])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_checksum_sees_one_bit_and_swapped_rows(checksum, dtype):
    """The host checksum (CRC-32 + Adler-32) and the device one (word sums, run here on CPU)."""
    w = torch.randn(8, 32, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    same = checksum(w.clone())
    assert torch.equal(checksum(w), same)
    one_bit = w.clone()
    one_bit.view(-1).view(torch.int16)[101] ^= 1       # the last bit of one 16-bit word
    assert not torch.equal(checksum(one_bit), same)
    swapped = w[[1, 0, *range(2, 8)]]
    assert not torch.equal(checksum(swapped), same)
    if checksum is device_checksum:                    # the plain sum cannot see order; the weighted one does
        assert checksum(swapped)[0] == same[0] and checksum(swapped)[1] != same[1]
    other_init = torch.randn(8, 32, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert not torch.equal(checksum(other_init), same)


def test_checksum_of_a_strided_view_is_that_of_its_values():
    w = torch.randn(6, 4)
    for checksum in (tensor_checksum, device_checksum):
        assert torch.equal(checksum(w.t()), checksum(w.t().contiguous()))
    assert torch.equal(tensor_checksum(torch.empty(0)), torch.zeros(2, dtype=torch.int64))
