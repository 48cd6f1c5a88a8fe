"""GroupedExperts against a per-expert loop, forward and backward, grouped GEMM and fallback."""
import pytest
import torch
from torch.nn import functional as F

from expertrail import experts as ex
from expertrail.errors import InvalidInputError


def reference(module, tokens, counts):
    outs = []
    for e, rows in enumerate(tokens.split(counts)):
        gate_up = rows.float() @ module.gate_up_proj[e].float().T
        gate, up = gate_up.split(module.ffn_hidden, dim=-1)
        outs.append((F.silu(gate) * up) @ module.down_proj[e].float().T)
    return torch.cat(outs)


@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [7, 1, 1, 1]])
def test_grouped_experts_match_a_loop(monkeypatch, use_grouped_mm, counts):
    if not use_grouped_mm:
        monkeypatch.setattr(ex, "grouped_mm_supported", lambda device, dtype: False)
    torch.manual_seed(0)
    m = ex.GroupedExperts(4, 16, 8)
    tokens = torch.randn(sum(counts), 16, requires_grad=True)
    tpe = torch.tensor(counts)
    out = m(tokens, tpe)
    ref_tokens = tokens.detach().clone().requires_grad_()
    ref = reference(m, ref_tokens, counts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    out.backward(g)
    grads = torch.autograd.grad(ref, [ref_tokens, m.gate_up_proj, m.down_proj], g)
    torch.testing.assert_close(tokens.grad, grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.gate_up_proj.grad, grads[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.down_proj.grad, grads[2], rtol=1e-5, atol=1e-5)
    with torch.no_grad():                  # the path without autograd nodes gives the same bits
        inferred = m(tokens, tpe)
    assert not inferred.requires_grad and torch.equal(inferred, out.detach())


def test_gate_rows_come_first_as_in_transformers():
    m = ex.GroupedExperts(1, 2, 1)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.tensor([[[1.0, 0.0], [0.0, 1.0]]]))   # gate reads x0, up reads x1
        m.down_proj.fill_(1.0)
    x = torch.tensor([[2.0, 3.0]])
    expected = F.silu(torch.tensor(2.0)) * 3.0
    torch.testing.assert_close(m(x, torch.tensor([1]))[0], torch.full((2,), expected.item()))


def test_bad_counts_are_rejected():
    m = ex.GroupedExperts(2, 4, 4)
    with pytest.raises(InvalidInputError, match="sums to 3 but tokens has 2 rows"):
        m(torch.zeros(2, 4), torch.tensor([1, 2]))
    with pytest.raises(InvalidInputError, match="one per local expert"):
        m(torch.zeros(2, 4), torch.tensor([2]))
