"""Input checks both modes run (the normal dispatchers and the low-latency mode), each giving
(error kind, message) instead of raising: a rank in error still takes part in the exchange
that carries every rank's error kind, so that all ranks raise together (`agreement`)."""
from __future__ import annotations

import torch

from .header import DTYPE_CODES

OK = (0, None)


def input_problem(where: str, x, topk_idx, topk_weights, hidden: int | None, device: torch.device) -> tuple:
    """Shapes, dtypes and devices of one dispatch's inputs: x [N, H] (H = ``hidden`` when
    given), topk_idx [N, K] integer, topk_weights [N, K] float, all on ``device``."""
    if x.dim() != 2:
        return 1, f"{where}: x must be [N, H], got shape {tuple(x.shape)}"
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        return 1, f"{where}: topk_idx must be [N={x.shape[0]}, K], got {tuple(topk_idx.shape)}"
    if topk_weights.shape != topk_idx.shape:
        return 1, (f"{where}: topk_weights {tuple(topk_weights.shape)} must have the shape of topk_idx "
                   f"{tuple(topk_idx.shape)} (same N and K)")
    if hidden is not None and x.shape[1] != hidden:
        return 1, f"{where}: x has hidden size {x.shape[1]} but the dispatcher was built with hidden={hidden}"
    if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool or topk_idx.is_complex():
        return 2, f"{where}: topk_idx must be an integer tensor (int64), got {topk_idx.dtype}"
    if not topk_weights.is_floating_point():
        return 2, f"{where}: topk_weights must be floating point, got {topk_weights.dtype}"
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != device:
            return 3, (f"{where}: {name} is on {t.device} but this EP group communicates on {device}; "
                       f"move it with .to('{device}')")
    return OK


def dispatch_problem(where: str, x, topk_idx, topk_weights, hidden: int | None, device: torch.device,
                     num_experts: int) -> tuple:
    """`input_problem`, then what the normal mode needs besides (reading the ids' range on the
    host): x in a supported dtype, ids in [-1, num_experts), finite weights."""
    problem = input_problem(where, x, topk_idx, topk_weights, hidden, device)
    if problem[0]:
        return problem
    if x.dtype not in DTYPE_CODES:
        return 2, f"{where}: x must be float32, bfloat16, float16 or float64, got {x.dtype}"
    # The ids' range and the weights' finiteness read on the host together: one wait for the GPU.
    finite = torch.isfinite(topk_weights).all().to(torch.int64).reshape(1)
    low, high, finite = torch.cat([torch.stack(torch.aminmax(topk_idx.long())) if topk_idx.numel()
                                   else finite.new_tensor([0, 0]), finite]).tolist()
    if low < -1 or high >= num_experts:
        return 4, id_range_message(where, num_experts, low if low < -1 else high)
    if not finite:
        return 5, f"{where}: topk_weights holds NaN or Inf; check the router output"
    return OK


def id_range_message(where: str, num_experts: int, found) -> str:
    return (f"{where}: topk_idx values must be in [-1, {num_experts}) (num_experts={num_experts}, -1 = no expert), "
            f"found {found}")


TWICE = "a token lists the same expert twice in topk_idx; each of its K experts must differ"


def ids_problem(where: str, topk_idx: torch.Tensor, num_experts: int) -> str | None:
    """The ids' values (read on the host): in [-1, num_experts), none twice within a token."""
    if not topk_idx.numel():
        return None
    ordered = topk_idx.sort(1).values
    twice = ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any().to(topk_idx.dtype).reshape(1)
    low, high, twice = torch.cat([torch.stack(torch.aminmax(topk_idx)), twice]).tolist()   # one wait for the GPU
    if low < -1 or high >= num_experts:
        return id_range_message(where, num_experts, low if low < -1 else high)
    if twice:
        return f"{where}: {TWICE}"
    return None


def expert_out_problem(where: str, expert_out, rows: int, hidden: int, device: torch.device) -> tuple:
    """combine's ``expert_out``: a float tensor [rows, hidden] (one row per dispatched row) on
    ``device``."""
    if not isinstance(expert_out, torch.Tensor):
        return 1, f"{where}: expert_out must be a tensor [{rows}, {hidden}], got {type(expert_out).__name__}"
    if expert_out.dim() != 2 or expert_out.shape[0] != rows:
        return 1, (f"{where}: expert_out must be [{rows}, {hidden}] (one row per res.tokens row), "
                   f"got {tuple(expert_out.shape)}")
    if expert_out.shape[1] != hidden:
        return 1, (f"{where}: expert_out has width {expert_out.shape[1]} but dispatch moved rows of hidden "
                   f"size {hidden}; the experts must return rows of the dispatched hidden size")
    if not expert_out.is_floating_point():
        return 2, f"{where}: expert_out must be floating point, got {expert_out.dtype}"
    if expert_out.device != device:
        return 3, (f"{where}: expert_out is on {expert_out.device} but res.tokens is on {device}; "
                   f"move it with .to('{device}')")
    return OK
