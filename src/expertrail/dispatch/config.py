"""A dispatcher's settings: frozen, checked, and the same on every rank.

Each backend names its config class (`Dispatcher.Config`); a backend with options of its own
extends `DispatchConfig` with them (alltoall's `land_in_place`). Construction compares every
field across the EP group before checking the values, so a setting that differs between ranks
raises on every rank, naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import ConfigError
from .routing import DROP_POLICIES

PAYLOADS = ("native", "fp8")
WEIGHTS_AT = (None, "source", "expert")


@dataclass(frozen=True)
class DispatchConfig:
    """Settings every backend takes.

    num_experts: E, a multiple of the EP size; expert e lives on EP rank e // E_local.
    hidden: H; when given, inputs are checked against it.
    expert_alignment: pad each local expert's rows up to a multiple of this (zero rows).
    capacity_factor: when set, each rank keeps at most ceil(N * K / E * capacity_factor) rows
        per expert and drops the rest (``drop_policy`` "probs": lowest weights go first;
        "position": latest tokens go first).
    pad_to_capacity: pad every local expert to the sum of the senders' capacities, so the
        output shape depends only on the token counts (static shapes).
    payload: "native" (rows travel in x's dtype) or "fp8" (float8 e4m3 with one fp32 scale per
        128 values, `expertrail.kernels.fp8`; combine still travels in x's dtype).
    dequantize: with fp8, whether ``res.tokens`` are the rows dequantized to x's dtype (True)
        or the fp8 values, with their scales in ``res.scales``, for FP8 experts (False).
    weights_at: where a weighted combine applies the routing weights. "expert": each expert
        row times ``res.weights`` on the expert side, rounded to x's dtype before it travels
        back (every backend). "source": the exact expert outputs travel back and are weighted,
        in fp32, on the source rank with the ``topk_weights`` dispatch was given (backends whose
        first hop sends one row per (token, expert) pair: alltoall); ``res.weights`` is then a
        copy to read, and changing it changes nothing. None (default): "source" where the
        backend supports it, else "expert".
    """

    num_experts: int
    hidden: int | None = None
    expert_alignment: int = 1
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    payload: str = "native"
    dequantize: bool = True
    weights_at: str | None = None

    @classmethod
    def of(cls, backend: str, num_experts: int, options: dict) -> "DispatchConfig":
        """The config of ``make_dispatcher(backend, groups, num_experts, **options)``; an
        unknown option raises `ConfigError` naming the ones there are."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"{backend}: unknown option(s) {', '.join(unknown)}; the options are "
                              f"{', '.join(known[1:])}")
        return cls(num_experts=num_experts, **options)

    def shared_fields(self) -> dict:
        """The fields every backend has, by name (compared across ranks one by one)."""
        return {f.name: getattr(self, f.name) for f in fields(DispatchConfig)}

    def own_options(self) -> dict:
        """The fields of this backend only (compared across ranks as one field, so that ranks
        running different backends still gather as many fields)."""
        shared = self.shared_fields()
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in shared}

    def check(self) -> None:
        """Raise `ConfigError` naming the first bad value."""
        if self.hidden is not None and self.hidden < 1:
            raise ConfigError(f"hidden={self.hidden} must be positive")
        if int(self.expert_alignment) < 1:
            raise ConfigError(f"expert_alignment={self.expert_alignment} must be >= 1")
        if self.drop_policy not in DROP_POLICIES:
            raise ConfigError(f"drop_policy={self.drop_policy!r}; choose one of {DROP_POLICIES}")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ConfigError(f"capacity_factor={self.capacity_factor} must be positive (or None for no dropping)")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ConfigError("pad_to_capacity=True needs a capacity_factor")
        if self.payload not in PAYLOADS:
            raise ConfigError(f"payload={self.payload!r}; choose one of {PAYLOADS}")
        if self.weights_at not in WEIGHTS_AT:
            raise ConfigError(f"weights_at={self.weights_at!r}; choose one of {WEIGHTS_AT}")
        if self.dequantize is not True and self.payload != "fp8":
            raise ConfigError("dequantize=False needs payload='fp8' (native rows are never quantized)")


@dataclass(frozen=True)
class AllToAllConfig(DispatchConfig):
    """alltoall's settings. land_in_place: True / False forces the layout of received rows
    (see `alltoall`); None (default) chooses by size."""

    land_in_place: bool | None = None

    def check(self) -> None:
        super().check()
        if self.land_in_place not in (None, True, False):
            raise ConfigError(f"land_in_place={self.land_in_place!r}; use True, False or None (choose by size)")
