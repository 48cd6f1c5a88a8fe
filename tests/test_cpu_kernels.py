"""The compiled CPU copy reduction against its definition, bitwise: products rounded to the
accumulation dtype, summed in slot order, one rounding to the output dtype."""
import pytest
import torch

from expertrail.kernels import cpu_kernels, reference
from expertrail.kernels.reference import CopyPositions

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.fixture(scope="module")
def module():
    m = cpu_kernels.load()       # the first run on a machine compiles it (about a minute on 2 cores)
    if m is None:
        pytest.skip("the compiled CPU kernel cannot be built here (no compiler or ninja, or the build failed)")
    return m


def definition(rows, copies, weights, out_dtype):
    """The reduction in torch elementwise ops, one slot at a time: [num_src, C]."""
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    x = torch.cat([rows.to(acc), rows.new_zeros(1, rows.shape[1], dtype=acc)])   # row R: a hole's
    w = None if weights is None else torch.cat([weights.to(acc), weights.new_zeros(1, dtype=acc)])
    dense = copies.dense()
    total = torch.zeros(copies.num_src, rows.shape[1], dtype=acc)
    started = torch.zeros(copies.num_src, 1, dtype=torch.bool)
    for s in range(copies.num_slots):
        at = torch.where(dense[:, s] >= 0, dense[:, s], rows.shape[0])
        here = (dense[:, s] >= 0).unsqueeze(1)
        p = x[at] if w is None else w[at].unsqueeze(1) * x[at]
        total = torch.where(here, torch.where(started, total + p, p), total)   # p0 + p1 + ..., no leading 0
        started |= here
    return total.to(out_dtype)


def random_copies(num_src, num_slots, rows, gen):
    """CopyPositions of ``rows`` rows scattered over distinct (source, slot) pairs, in random order."""
    pairs = torch.randperm(num_src * num_slots, generator=gen)[:rows]
    return CopyPositions.build(pairs // num_slots, pairs % num_slots, num_src, num_slots)


def bitwise_equal(a, b):
    """Same dtype, shape and bits (-0.0 is not 0.0); any NaN equals any NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return bool(((a.view(bits) == b.view(bits)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", ["none", "fp32", "fp64"])
def test_matches_definition_bitwise(module, dtype, out_dtype, weights):
    g = torch.Generator().manual_seed(DTYPES.index(dtype) * 10 + DTYPES.index(out_dtype))
    for num_src, num_slots, width in [(37, 3, 67), (5, 8, 2100), (64, 2, 1), (9, 1, 40), (16, 5, 300)]:
        num_rows = int(torch.randint(0, num_src * num_slots + 1, (1,), generator=g))
        copies = random_copies(num_src, num_slots, num_rows, g)
        # Spread exponents so that sums round, overflow fp16 now and then, and hit subnormals.
        rows = (torch.randn(num_rows, width, generator=g, dtype=torch.float64)
                * torch.exp2(torch.randint(-20, 18, (num_rows, width), generator=g).double())).to(dtype)
        w = None if weights == "none" else torch.rand(num_rows, generator=g, dtype=getattr(torch, f"float{weights[2:]}"))
        got = cpu_kernels.reduce_copies(rows, copies.pos, copies.offsets, w, out_dtype)
        want = definition(rows, copies, w, out_dtype)
        assert bitwise_equal(got, want), (num_src, num_slots, width, (got != want).sum())


def test_rows_without_copies_are_zero_and_single_copies_keep_their_sign(module):
    rows = torch.tensor([[-0.0, 1.5], [2.0, -3.0]])
    copies = CopyPositions.build(torch.tensor([2, 0]), torch.tensor([1, 0]), num_src=4, num_slots=2)
    got = cpu_kernels.reduce_copies(rows, copies.pos, copies.offsets, None, torch.float32)
    assert bitwise_equal(got, torch.tensor([[2.0, -3.0], [0.0, 0.0], [-0.0, 1.5], [0.0, 0.0]]))
    assert torch.signbit(got[2, 0]) and not torch.signbit(got[1]).any()


@pytest.mark.parametrize("num_src,num_rows,width", [(0, 0, 8), (6, 0, 8), (3, 4, 0), (0, 0, 0)])
def test_empty_shapes(module, num_src, num_rows, width):
    g = torch.Generator().manual_seed(1)
    copies = random_copies(num_src, 2, num_rows, g)
    rows = torch.randn(num_rows, width, generator=g).to(torch.bfloat16)
    got = cpu_kernels.reduce_copies(rows, copies.pos, copies.offsets, torch.rand(num_rows, generator=g), torch.float32)
    assert got.shape == (num_src, width) and (got == 0).all()


def test_strided_rows_and_bad_positions(module):
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(40, 6, generator=g).t()                  # [6, 40], columns not contiguous
    copies = random_copies(4, 2, 6, g)
    w = torch.rand(6, generator=g)
    assert bitwise_equal(cpu_kernels.reduce_copies(rows, copies.pos, copies.offsets, w, torch.float32),
                         definition(rows, copies, w, torch.float32))
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_kernels.reduce_copies(rows, torch.tensor([0, 6]), torch.tensor([0, 1, 2]), None, torch.float32)


def test_result_does_not_depend_on_the_thread_count(module):
    g = torch.Generator().manual_seed(4)
    copies = random_copies(3000, 3, 6000, g)                     # enough rows for at::parallel_for to split
    rows, w = torch.randn(6000, 64, generator=g).to(torch.bfloat16), torch.rand(6000, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.reduce_copies(rows, copies.pos, copies.offsets, w, torch.bfloat16)
        torch.set_num_threads(2)
        two = cpu_kernels.reduce_copies(rows, copies.pos, copies.offsets, w, torch.bfloat16)
    finally:
        torch.set_num_threads(threads)
    assert bitwise_equal(one, two) and bitwise_equal(one, definition(rows, copies, w, torch.bfloat16))


def test_reference_uses_it_on_the_cpu_and_agrees_with_the_torch_path(module):
    g = torch.Generator().manual_seed(3)
    copies = random_copies(50, 4, 150, g)
    rows, w = torch.randn(150, 96, generator=g), torch.rand(150, generator=g)
    got = reference.reduce_copies(rows, copies, w, torch.float32)
    assert bitwise_equal(got, definition(rows, copies, w, torch.float32))
    torch.testing.assert_close(got, reference.reduce_copies_torch(rows, copies, w, torch.float32))


def test_loader_returns_none_when_told_to_use_torch(monkeypatch):
    monkeypatch.setenv("EXPERTRAIL_KERNELS", "torch")
    assert cpu_kernels.load() is None
