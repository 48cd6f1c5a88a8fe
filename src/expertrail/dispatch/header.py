"""The header of a dispatch: what every rank sends with its counts in the first exchange.

Every rank learns every other rank's token count, hidden size, top-k, dtype, gradient needs
and input error before any row moves, so that a bad input or a mismatched call on one rank
raises on every rank instead of hanging, and so that each rank can size what it receives.
"""
from __future__ import annotations

from dataclasses import astuple, dataclass, fields

import torch

from ..errors import InvalidInputError

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
ERROR_KINDS = {1: "bad shape", 2: "bad dtype", 3: "bad device", 4: "expert index out of range",
               5: "non-finite topk_weights"}


@dataclass(frozen=True)
class Header:
    """One rank's header. dtype: a code of ``DTYPE_CODES`` (0: unsupported); error: 0, or a
    key of ``ERROR_KINDS``."""

    num_tokens: int
    hidden: int
    topk: int
    dtype: int
    x_requires_grad: bool
    weights_require_grad: bool
    error: int

    @classmethod
    def of(cls, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, error: int) -> "Header":
        """This rank's header for ``dispatch(x, topk_idx, topk_weights)`` (shapes taken only
        where valid, so that a bad input still sends a header)."""
        grad = torch.is_grad_enabled()
        return cls(num_tokens=x.shape[0] if x.dim() == 2 else 0, hidden=x.shape[-1] if x.dim() == 2 else 0,
                   topk=topk_idx.shape[-1] if topk_idx.dim() == 2 else 0, dtype=DTYPE_CODES.get(x.dtype, 0),
                   x_requires_grad=grad and x.requires_grad,
                   weights_require_grad=grad and topk_weights.requires_grad, error=error)

    def pack(self) -> list[int]:
        """The header as int64 values, in field order."""
        return [int(v) for v in astuple(self)]


FIELDS = tuple(f.name for f in fields(Header))
# Fields every rank must send alike (the token count may differ).
AGREED = ("hidden", "topk", "dtype", "x_requires_grad", "weights_require_grad")


class Headers:
    """Every EP rank's header as received: ``table`` int64 [P, len(FIELDS)] on the host (read
    field by field, each read would otherwise wait for the GPU), row p from EP rank p; beside
    it ``counts`` int64 [P, C], the counts each rank sent this one, on the host too (None where
    not given). Columns by name (`column`); the agreed fields as plain values (rank 0's, equal on
    every rank once `check` has passed)."""

    def __init__(self, table: torch.Tensor, counts: torch.Tensor | None = None):
        self.table, self.counts = table, counts

    def column(self, name: str) -> torch.Tensor:
        """int64 [P]: field ``name`` of every rank."""
        return self.table[:, FIELDS.index(name)]

    @property
    def num_tokens(self) -> torch.Tensor:
        return self.column("num_tokens")

    @property
    def hidden(self) -> int:
        return int(self.column("hidden")[0])

    @property
    def topk(self) -> int:
        return int(self.column("topk")[0])

    @property
    def dtype(self) -> torch.dtype:
        return CODE_DTYPES[int(self.column("dtype")[0])]

    @property
    def needs_grad(self) -> bool:
        """Whether dispatch attaches gradients (x or topk_weights requires grad)."""
        return bool(self.column("x_requires_grad")[0] or self.column("weights_require_grad")[0])

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    def check(self, backend: str) -> None:
        """Raise `InvalidInputError` (on every rank alike) if an agreed field differs."""
        for name in AGREED:
            values = self.column(name).tolist()
            if len(set(values)) > 1:
                shown = ", ".join(f"rank {r}={_shown(name, v)}" for r, v in enumerate(values))
                raise InvalidInputError(f"{backend} dispatch: {name} differs across EP ranks ({shown}); "
                                        "every rank must call dispatch with the same hidden size, top-k, dtype and "
                                        "requires_grad")


def _shown(name: str, value: int) -> str:
    """A header field as the user wrote it: dtype names and booleans, not their codes."""
    if name == "dtype":
        return str(CODE_DTYPES.get(value, "unsupported dtype")).replace("torch.", "")
    if name in ("x_requires_grad", "weights_require_grad"):
        return str(bool(value))
    return str(value)
