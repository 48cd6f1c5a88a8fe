"""Weights every rank of an EP group must hold alike, compared across the ranks.

In expert parallelism each rank keeps its own experts but a copy of everything else: the
router, the shared experts (and in a whole model, attention and embeddings). Ranks whose
copies differ (a user who seeded only one rank, or loaded two checkpoints) would run a model
that is none of theirs, silently. `check_replicated` compares them by checksum, one small
all-gather for any number of tensors, and raises on every rank naming what differs where.
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

from ..errors import ConfigMismatchError
from ..comm.topology import EPGroups, all_gather_ints, guarded

_CHUNK = 1 << 22       # words per step of the device checksum: int64 temporaries of 32 MiB
_PRIME = 65521         # position weights 1..65521 keep every product below 2**31


def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] that two ranks holding the same bytes compute alike.

    On the host: the CRC-32 and Adler-32 of the tensor's bytes (about 2.5 GB/s on one core, so
    cheap enough to leave on for a whole model). On a device: `device_checksum`, computed
    there, so nothing is copied to the host. Meta and empty tensors give zeros.
    """
    if t.device.type == "meta" or t.numel() == 0:
        return torch.zeros(2, dtype=torch.int64)
    if t.device.type != "cpu":
        return device_checksum(t)
    data = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return torch.tensor([zlib.crc32(data), zlib.adler32(data)], dtype=torch.int64)


def device_checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 [2]: the sum of ``t``'s bytes read as 16-bit words, and that sum weighted by each
    word's position (mod 65521, plus 1), on ``t``'s device.

    Integer sums are exact, so equal bytes agree whatever the reduction order or thread count;
    one changed bit changes the first sum, swapped rows the second."""
    flat = t.detach().contiguous().view(-1)
    words = flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.int8)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start:start + _CHUNK].to(torch.int64)
        pos = torch.arange(start, start + chunk.numel(), device=t.device) % _PRIME + 1
        out[0] += chunk.sum()
        out[1] += (chunk * pos).sum()
    return out.cpu()


def differing(named: list[tuple[object, torch.Tensor]], groups: EPGroups) -> list[tuple[object, list[list[int]]]]:
    """(key, global ranks grouped by the copy they hold) of every tensor in ``named`` whose
    `tensor_checksum` differs across the EP group (``named`` in the same order on every rank).
    Collective: one all-gather of two ints per tensor."""
    if not named:
        return []
    mine = torch.stack([tensor_checksum(t) for _, t in named]).view(-1).tolist()
    with guarded("the weight check's all_gather", groups):
        table = all_gather_ints(mine, groups.ep_group, groups.device)
    out = []
    for i, (key, _) in enumerate(named):
        copies: dict[tuple, list[int]] = {}
        for ep_rank, row in enumerate(table):
            copies.setdefault(tuple(row[2 * i:2 * i + 2]), []).append(groups.ep_ranks[ep_rank])
        if len(copies) > 1:
            out.append((key, sorted(copies.values())))
    return out


def listed(lines: list, what: str, most: int = 8) -> str:
    """The first ``most`` lines of an error's list, and how many ``what`` were left out."""
    extra = [f"  ... and {len(lines) - most} more {what}"] if len(lines) > most else []
    return "\n".join(lines[:most] + extra)


SEED_ADVICE = ("seed every rank the same (torch.manual_seed(seed) before building the model) or load the same "
               "checkpoint on every rank")


def check_replicated(modules: dict[str, nn.Module | None], groups: EPGroups, what: str) -> None:
    """Raise ConfigMismatchError on every rank of the EP group unless all its ranks hold the
    same parameters and buffers in ``modules`` (name -> module; None entries are skipped).
    Collective; the modules must have the same structure on every rank (their names, shapes
    and dtypes are agreed first, so a differing structure raises on every rank too)."""
    named = [(f"{name}.{n}", t) for name, m in modules.items() if m is not None
             for n, t in [*m.named_parameters(), *m.named_buffers()]]
    structure = ";".join(f"{n}{tuple(t.shape)}{t.dtype}" for n, t in named)
    groups.check_same({"replicated tensors": len(named), "their names, shapes and dtypes (crc32)":
                       zlib.crc32(structure.encode())}, what)
    drift = differing(named, groups)
    if drift:
        lines = [f"  {key} (ranks holding the same copy: {', '.join(map(str, copies))})" for key, copies in drift]
        raise ConfigMismatchError(
            f"{what}: the weights every rank must hold alike differ between ranks of {groups.label}, so the "
            "expert-parallel layer would route and compute with a different model on every rank:\n"
            + listed(lines, "tensors") + f"\nBuild them the same everywhere: {SEED_ADVICE}; or pass "
            "check_weights=False if they are meant to differ.")
