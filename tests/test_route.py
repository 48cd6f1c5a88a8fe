"""The route engine's local pieces: fixed-order reductions, copy numbers and positions, sorts."""
import pytest
import torch

from expertrail.dispatch.base import expand_local
from expertrail import kernels
from expertrail.dispatch.route import number_copies
from expertrail.kernels.torch_ops import CopyPositions, count_kept, count_values, stable_argsort, summing_table, take_rows


def reduce_rows(rows, index, copy, num_out, max_copies, weights, out_dtype):
    """out[i] = sum over s (ascending) of weights * rows[j] where index[j] == i and copy[j] == s."""
    return kernels.reduce_copies(rows, CopyPositions.build(index, copy, num_out, max_copies), weights, out_dtype)


def test_reduce_rows_sums_copies_in_copy_order_in_fp32():
    rows = torch.tensor([[1.0], [2.0], [4.0], [8.0]], dtype=torch.bfloat16)
    index = torch.tensor([1, 0, 1, 1])
    copy = torch.tensor([2, 0, 0, 1])
    weights = torch.tensor([0.5, 1.0, 2.0, 0.25])
    out = reduce_rows(rows, index, copy, 3, 3, weights, torch.float32)
    assert out.tolist() == [[2.0], [4.0 * 2 + 8 * 0.25 + 1 * 0.5], [0.0]]
    plain = reduce_rows(rows, index, copy, 3, 3, None, torch.bfloat16)
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
    copy = number_copies(index, 100, 500)[0]
    weights = torch.rand(500, generator=g)
    first = reduce_rows(rows, index, copy, 100, int(copy.max()) + 1, weights, torch.float32)
    second = reduce_rows(rows, index, copy, 100, int(copy.max()) + 1, weights, torch.float32)
    assert torch.equal(first, second)
    expected = torch.zeros(100, 64, dtype=torch.float64).index_add_(0, index, rows.double() * weights.double()[:, None])
    torch.testing.assert_close(first.double(), expected, rtol=1e-6, atol=1e-6)


def test_number_copies_numbers_copies_in_order_of_appearance():
    index = torch.tensor([3, 1, 3, 3, 0, 1])
    assert number_copies(index, 4, 3)[0].tolist() == [0, 0, 1, 2, 0, 1]


def test_expand_local_orders_rows_expert_major():
    local = torch.tensor([[1, -1, 0], [0, 1, -1], [-1, -1, 1]])
    row, k, expert = expand_local(local)
    assert list(zip(expert.tolist(), row.tolist(), k.tolist())) == [
        (0, 0, 2), (0, 1, 0), (1, 0, 0), (1, 1, 1), (1, 2, 2)]


def test_stable_argsort_matches_torch_stable_sort_on_both_paths():
    g = torch.Generator().manual_seed(3)
    for high in (2, 17, 1 << 16, 1 << 20):          # radix path (keys below 2^16), then torch.sort
        key = torch.randint(0, high, (5000,), generator=g)
        key[:3] = high - 1                            # the largest key, and ties
        assert torch.equal(stable_argsort(key), torch.sort(key, stable=True).indices), high
    negative = torch.tensor([3, -1, 2, -1, 0])       # out of the radix range: not wrapped
    assert stable_argsort(negative).tolist() == [1, 3, 4, 2, 0]
    assert stable_argsort(torch.zeros(0, dtype=torch.long)).numel() == 0


def test_number_copies_gives_the_copy_numbers_and_bags_a_separate_sort_would():
    g = torch.Generator().manual_seed(5)
    index = torch.randint(0, 50, (400,), generator=g)
    copy, positions = number_copies(index, 50, 64)
    earlier_copies = (index.unsqueeze(0) == index.unsqueeze(1)).tril(-1).sum(1)   # order of appearance
    assert torch.equal(copy, earlier_copies)
    rebuilt = CopyPositions.build(index, copy, 50, 64)
    for name in ("pos", "copy", "source", "offsets"):
        assert torch.equal(getattr(positions, name), getattr(rebuilt, name)), name
    assert torch.equal(positions.dense(), rebuilt.dense())
    bags_only = CopyPositions(50, 64, bags=(positions.pos, positions.copy, positions.source, positions.offsets))
    assert torch.equal(bags_only.dense(), rebuilt.dense())          # the dense form from bags alone


def test_take_rows_matches_index_select_for_every_float_width():
    index = torch.tensor([3, 0, 3, 2])
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        rows = torch.randn(4, 5).to(dtype)
        assert torch.equal(take_rows(rows, index), rows.index_select(0, index))
        out = torch.empty(4, 5, dtype=dtype)
        assert take_rows(rows, index, out=out) is out and torch.equal(out, rows[index])


def test_copy_positions_from_a_full_dense_form_list_every_copy_in_copy_order():
    dense = torch.tensor([[4, 1], [0, 3], [2, 5]])
    copies = CopyPositions.from_dense(dense)
    assert copies.pos.tolist() == [4, 1, 0, 3, 2, 5]
    assert copies.copy.tolist() == [0, 1, 0, 1, 0, 1]
    assert copies.source.tolist() == [0, 0, 1, 1, 2, 2]
    assert copies.offsets.tolist() == [0, 2, 4, 6]


def test_bf16_and_fp16_weights_take_fewer_parts_with_the_same_result():
    g = torch.Generator().manual_seed(9)
    rows = torch.randn(300, 64, generator=g).bfloat16()
    index = torch.randint(0, 100, (300,), generator=g)
    copy = number_copies(index, 100, 300)[0]
    for dtype in (torch.bfloat16, torch.float16):
        weights = torch.rand(300, generator=g).to(dtype)
        fewer = reduce_rows(rows, index, copy, 100, int(copy.max()) + 1, weights, torch.bfloat16)
        three = reduce_rows(rows, index, copy, 100, int(copy.max()) + 1, weights.float(), torch.bfloat16)
        assert torch.equal(fewer, three), dtype


def _expand_hop(num_src, max_copies, padded, seed):
    """An ExpandHop over ``num_src`` source rows with up to ``max_copies`` copies each, its
    output rows expert-major (4 experts) and, when ``padded``, padded to multiples of 8."""
    from expertrail.dispatch.route import ExpandHop
    from expertrail.dispatch.planning import padded_positions
    g = torch.Generator().manual_seed(seed)
    local = torch.randint(-1, 4, (num_src, max_copies), generator=g)
    local = torch.where(local >= 0, local, torch.full_like(local, -1))
    # distinct experts per row, as routing gives them
    local = torch.stack([torch.where((local[:, :k] == local[:, k:k + 1]).any(1), -1, local[:, k])
                         for k in range(max_copies)], 1)
    row, _, expert = expand_local(local)
    hop = ExpandHop.numbered(row, num_src, max_copies)
    if padded:
        real = torch.bincount(expert, minlength=4)
        hop.out_pos = padded_positions(expert, real, (real + 7) // 8 * 8)
        hop.out_rows = int(((real + 7) // 8 * 8).sum())
    return hop


class _Landed:
    """A landed part, as `SplitHop`'s Transfer lists it."""

    def __init__(self, rows):
        self.rows, self.waits = rows, 0

    def wait(self):
        self.waits += 1
        return self.rows


def test_expansion_part_by_part_gives_the_same_rows():
    """`ExpandHop.forward_parts`: each part copied as it lands, padding zeroed, the same output
    as the expansion of the whole level; empty parts too."""
    for padded in (False, True):
        hop = _expand_hop(60, 3, padded, seed=1)
        level = torch.randn(60, 5, generator=torch.Generator().manual_seed(2))
        bounds = [0, 17, 17, 40, 51, 60]
        parts = [(a, b, _Landed(level[a:b])) for a, b in zip(bounds, bounds[1:])]
        whole = _Landed(level)
        whole.parts = parts
        streamed = hop.forward_parts(whole)
        assert torch.equal(streamed, hop.forward(level)), padded
        assert all(part.waits == 1 for *_, part in parts) and whole.waits == 1


def test_expert_side_sums_part_by_part_are_the_same_bits():
    """`ExpandHop.transpose_part` over any cut of the source rows: the same bits as `transpose`,
    fp32 and bf16, weighted or not, with padding, and picked rows where a row has one copy."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for padded in (False, True):
            for max_copies in (1, 3):
                hop = _expand_hop(50, max_copies, padded, seed=3)
                rows_out = hop.out_rows or hop.index.numel()
                g = torch.Generator().manual_seed(4)
                rows = torch.randn(rows_out, 7, generator=g).to(dtype)
                for weights in (None, torch.rand(rows_out, generator=g)):
                    whole = hop.transpose(rows, weights, dtype)
                    table = summing_table(rows, dtype)
                    bounds = [0, 9, 9, 31, 50]
                    parts = torch.cat([hop.transpose_part(table, weights, dtype, a, b)
                                       for a, b in zip(bounds, bounds[1:])])
                    assert parts.dtype == whole.dtype
                    assert torch.equal(parts.view(torch.int16 if dtype != torch.float32 else torch.int32),
                                       whole.view(torch.int16 if dtype != torch.float32 else torch.int32)), \
                        (dtype, padded, max_copies, weights is None)


@pytest.mark.parametrize("size,n", [(0, 5), (1, 1), (300, 7), (4096, 257)])
def test_count_values_matches_bincount_of_the_same_size(size, n):
    g = torch.Generator().manual_seed(size + n)
    values = torch.randint(0, n, (size,), generator=g)
    counts = count_values(values, n)
    assert counts.dtype == torch.int64 and counts.shape == (n,)
    assert torch.equal(counts, torch.bincount(values, minlength=n))


def test_count_kept_leaves_negative_values_out():
    values = torch.tensor([[0, -1, 2], [2, 2, -1]])
    assert count_kept(values, 4).tolist() == [1, 0, 3, 0]
    assert count_kept(torch.full((3,), -1), 2).tolist() == [0, 0]
