"""FP8 rows as dispatch sends them: float8 e4m3 values, one fp32 scale per 128 values.

The format of DeepEP's and Hybrid-EP's FP8 dispatch: each row of H values is cut into blocks of
``BLOCK`` (the last one may be shorter), each block scaled by its own ``amax / 448`` (448: the
largest e4m3 value) and rounded to e4m3 (nearest, ties to even). A row travels as one byte
row, ``[H fp8 bytes | ceil(H / BLOCK) fp32 scales]``, so any transport moves it (gloo has no
fp8 dtype) and every backend sends the same bytes: the same quantization everywhere, rows
identical across backends. Rounding to e4m3 (3 mantissa bits) errs by at most half a step,
2^-4 of the value's power of two: at most 16 in [256, 448], so each value is within
``amax / 28`` of its block's amax (tests check this bound, and the bits against a reference
written from the format's definition); values under 2^-9 of the amax land in e4m3's subnormals.
"""
from __future__ import annotations

import torch

from .workspace import allocate

BLOCK = 128
E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn


def num_blocks(hidden: int) -> int:
    return -(-hidden // BLOCK)


def row_bytes(hidden: int) -> int:
    """Bytes of one packed row of ``hidden`` values: the values plus the fp32 scales."""
    return hidden + 4 * num_blocks(hidden)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [N, H] float -> packed rows uint8 [N, row_bytes(H)] (see the module docstring)."""
    n, h = x.shape
    b = num_blocks(h)
    blocks = (x if h == b * BLOCK else torch.nn.functional.pad(x, (0, b * BLOCK - h))).view(n, b, BLOCK)
    amax = blocks.abs().amax(-1).float()                  # exact in x's dtype: no widened copy for it
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))        # [N, B] fp32
    scaled = torch.div(blocks, scale.unsqueeze(-1)).view(n, b * BLOCK)[:, :h]    # fp32, never in place on x
    out = allocate((n, row_bytes(h)), torch.uint8, x.device)      # a dispatcher's buffer when inside one
    out[:, :h].view(FP8).copy_(scaled)                    # rounded to e4m3 as it is written
    out[:, h:] = scale.view(torch.uint8).view(n, 4 * b)
    return out


def unpack(rows: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows uint8 [M, row_bytes(H)] -> (values float8_e4m3fn [M, H], scales fp32
    [M, ceil(H / 128)]), both contiguous copies."""
    values = allocate((rows.shape[0], hidden), torch.uint8, rows.device).copy_(rows[:, :hidden])
    scales = allocate((rows.shape[0], rows.shape[1] - hidden), torch.uint8, rows.device).copy_(rows[:, hidden:])
    return values.view(FP8), scales.view(torch.float32)


def dequantize(rows: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows uint8 [M, row_bytes(H)] -> [M, H] in ``dtype``."""
    return dequantize_values(*unpack(rows, hidden), dtype)


def dequantize_values(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values float8_e4m3fn [M, H] and scales fp32 [M, ceil(H / 128)] -> [M, H] in ``dtype``:
    each value times its block's scale in fp32, rounded once to ``dtype``."""
    (m, hidden), b = values.shape, scales.shape[1]
    wide = torch.nn.functional.pad(values.float(), (0, b * BLOCK - hidden)).view(m, b, BLOCK)
    out = allocate((m, hidden), dtype, values.device)
    return out.copy_(wide.mul_(scales.unsqueeze(-1)).view(m, b * BLOCK)[:, :hidden])
