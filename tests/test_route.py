"""The route engine's local pieces: fixed-order reductions and copy slots."""
import torch

from expertrail.dispatch.base import copy_slots, expand_local
from expertrail.dispatch.route import reduce_rows


def test_reduce_rows_sums_copies_in_slot_order_in_fp32():
    rows = torch.tensor([[1.0], [2.0], [4.0], [8.0]], dtype=torch.bfloat16)
    index = torch.tensor([1, 0, 1, 1])
    slot = torch.tensor([2, 0, 0, 1])
    weights = torch.tensor([0.5, 1.0, 2.0, 0.25])
    out = reduce_rows(rows, index, slot, 3, 3, weights, torch.float32)
    assert out.tolist() == [[2.0], [4.0 * 2 + 8 * 0.25 + 1 * 0.5], [0.0]]
    plain = reduce_rows(rows, index, slot, 3, 3, None, torch.bfloat16)
    assert plain.tolist() == [[2.0], [13.0], [0.0]]


def test_reduce_rows_keeps_fp32_precision_for_bf16_inputs():
    # 256 + 1 + 1 is not representable step by step in bf16 but is in fp32.
    rows = torch.tensor([[256.0], [1.0], [1.0]], dtype=torch.bfloat16)
    out = reduce_rows(rows, torch.zeros(3, dtype=torch.long), torch.arange(3), 1, 3, None, torch.float32)
    assert out.item() == 258.0


def test_reduce_rows_is_bitwise_reproducible():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(500, 64, generator=g)
    index = torch.randint(0, 100, (500,), generator=g)
    slot = copy_slots(index, 100)
    weights = torch.rand(500, generator=g)
    first = reduce_rows(rows, index, slot, 100, int(slot.max()) + 1, weights, torch.float32)
    second = reduce_rows(rows, index, slot, 100, int(slot.max()) + 1, weights, torch.float32)
    assert torch.equal(first, second)
    expected = torch.zeros(100, 64, dtype=torch.float64).index_add_(0, index, rows.double() * weights.double()[:, None])
    torch.testing.assert_close(first.double(), expected, rtol=1e-6, atol=1e-6)


def test_copy_slots_number_copies_in_order_of_appearance():
    index = torch.tensor([3, 1, 3, 3, 0, 1])
    assert copy_slots(index, 4).tolist() == [0, 0, 1, 2, 0, 1]


def test_expand_local_orders_rows_expert_major():
    local = torch.tensor([[1, -1, 0], [0, 1, -1], [-1, -1, 1]])
    row, k, expert = expand_local(local)
    assert list(zip(expert.tolist(), row.tolist(), k.tolist())) == [
        (0, 0, 2), (0, 1, 0), (1, 0, 0), (1, 1, 1), (1, 2, 2)]
