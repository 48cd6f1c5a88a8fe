"""The dispatcher's buffer pool and the FP8 row format, single process."""
import pytest
import torch

from expertrail.kernels import fp8
from expertrail.kernels.workspace import MIN_POOLED_BYTES, Workspace, allocate


def test_a_buffer_is_reused_only_once_nothing_views_it():
    ws = Workspace()
    a = ws.empty((256, 256), torch.float32, "cpu")             # 256 KiB: pooled
    a.fill_(1.0)
    b = ws.empty((256, 256), torch.float32, "cpu")             # a is alive: another buffer
    assert a.data_ptr() != b.data_ptr() and ws.allocated == 2
    view = a[10:20]
    ptr = a.data_ptr()
    del a
    c = ws.empty((256, 256), torch.float32, "cpu")             # a's view is alive: not a's buffer
    assert c.data_ptr() != ptr and (view == 1.0).all()
    del view, c
    d = ws.empty((256, 256), torch.bfloat16, "cpu")            # a's and c's buffers are free now
    assert ws.reused == 1 and ws.allocated == 3 and d.data_ptr() != b.data_ptr()


def test_buffers_grow_without_multiplying_and_release_frees_them():
    ws = Workspace()
    for rows in (100, 300, 200, 400, 250, 400):                 # one tensor alive at a time
        t = ws.empty((rows, 1024), torch.float32, "cpu")
        del t
    assert len(ws._buffers) == 1 and ws.nbytes >= 400 * 4096
    assert ws.high_water_bytes == ws.nbytes <= 400 * 4096 * 1.125
    ws.release()
    assert ws.nbytes == 0


def test_small_requests_and_a_disabled_pool_use_torch():
    ws = Workspace()
    small = ws.empty((4, 4), torch.float32, "cpu")
    assert small.numel() * 4 < MIN_POOLED_BYTES and ws.allocated == 0
    off = Workspace(enabled=False)
    off.empty((512, 512), torch.float32, "cpu")
    assert off.allocated == 0 and off.nbytes == 0


def test_allocate_uses_the_active_workspace_only_inside_it():
    ws = Workspace()
    with ws.active():
        t = allocate((512, 512), torch.float32, "cpu")
    assert ws.allocated == 1
    del t
    allocate((512, 512), torch.float32, "cpu")
    assert ws.allocated == 1 and ws.reused == 0


def e4m3_reference(x: torch.Tensor) -> torch.Tensor:
    """The FP8 row format from its definition, independently of torch's float8 conversion:
    per block of 128 values, scale = amax / 448 (1 for a zero block); each scaled value rounded
    to the nearest e4m3 value (3 mantissa bits, normal from 2^-6, subnormal steps of 2^-9),
    ties to even; times the scale in fp32, rounded once to x's dtype."""
    n, h = x.shape
    b = -(-h // 128)
    blocks = torch.nn.functional.pad(x.float(), (0, b * 128 - h)).view(n, b, 128)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    v = (blocks / scale).double()
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -6)))
    step = torch.pow(2.0, exponent - 3)                          # 3 mantissa bits; 2^-9 below 2^-6
    q = torch.round(v / step) * step                              # torch.round: half to even
    return (q.float() * scale).view(n, b * 128)[:, :h].to(x.dtype)


def test_the_e4m3_reference_rounds_as_the_format_says():
    x = torch.tensor([[448.0, 300.0, 17.0, 9.0, 1.0625, 0.001953125 * 3]])   # amax 448: scale 1
    assert e4m3_reference(x).tolist() == [[448.0, 288.0, 16.0, 9.0, 1.0, 0.005859375]]   # 17, 1.0625: ties to even


@pytest.mark.parametrize("hidden", [128, 200, 7168])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_within_e4m3_step_of_the_block_amax(hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(64, hidden, generator=g) * torch.logspace(-4, 4, 64).unsqueeze(1)).to(dtype)
    x[5] = 0                                                    # a zero row: scale 1, values 0
    kept = x.clone()
    rows = fp8.quantize(x)
    assert torch.equal(x, kept), "quantize changed its input"
    assert rows.dtype == torch.uint8 and rows.shape == (64, fp8.row_bytes(hidden))
    assert fp8.row_bytes(hidden) == hidden + 4 * -(-hidden // 128)
    back = fp8.dequantize(rows, hidden, dtype)
    assert back.dtype == dtype and (back[5] == 0).all()
    pad = fp8.num_blocks(hidden) * 128 - hidden
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).view(64, -1, 128)
    err = torch.nn.functional.pad((back.float() - x.float()).abs(), (0, pad)).view(64, -1, 128)
    # e4m3 round-to-nearest errs by at most half a step: 16 in [256, 448], so amax / 28 of the
    # block's amax (a truncating or e5m2-precision quantizer errs up to twice that); then the
    # final rounding of each value to bf16 (half of 2^-7 of a value <= amax).
    rounding = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -20
    assert (err.amax(-1) <= (1 / 28 + rounding) * blocks.abs().amax(-1)).all()
    assert torch.equal(back, e4m3_reference(x))
    values, scales = fp8.unpack(rows, hidden)
    assert values.dtype == fp8.FP8 and scales.shape == (64, fp8.num_blocks(hidden))
    assert torch.equal(fp8.dequantize_values(values, scales, dtype), back)
    assert (values.float().abs().amax(-1) <= fp8.E4M3_MAX).all()
