"""The dispatch engine and its backends behind one API (`base.Dispatcher`, `make_dispatcher`):
the route every backend plans (`route`), its settings (`config`, `header`), the backends
(`alltoall`, `dedup`, `hierarchical`, `allgather`), the low-latency decode mode
(`lowlatency`), routing tables and capacity (`routing`), and the single-process reference
they are tested against (`reference`)."""
from __future__ import annotations

import warnings

from ..errors import ConfigError
from .allgather import AllGatherDispatcher
from .alltoall import AllToAllDispatcher
from .base import DispatchResult, Dispatcher
from .dedup import DedupDispatcher
from .hierarchical import HierarchicalDispatcher
from .lowlatency import LowLatencyDispatcher, LowLatencyResult
from ..comm.transport import TransferStats

BACKENDS = {cls.name: cls for cls in (AllGatherDispatcher, AllToAllDispatcher, DedupDispatcher,
                                      HierarchicalDispatcher)}


def make_dispatcher(name: str, groups, num_experts: int, **options) -> Dispatcher | LowLatencyDispatcher:
    """Create the backend ``name`` (one of `BACKENDS`) on ``groups``; options as `Dispatcher`.
    ``"lowlatency"`` (deprecated: build `LowLatencyDispatcher` itself) makes the fixed-shape
    decode mode instead.

    Collective over the EP group: every rank must call it with the same arguments.
    """
    if name == LowLatencyDispatcher.name:
        warnings.warn("make_dispatcher('lowlatency', ...) is deprecated: the low-latency mode has its own contract "
                      "(3-D rows, no autograd, rows overwritten by the next call); build it with "
                      "expertrail.LowLatencyDispatcher(groups, num_experts, max_tokens_per_rank=..., hidden=...)",
                      DeprecationWarning, stacklevel=2)
        return LowLatencyDispatcher(groups, num_experts, **options)
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)} or 'lowlatency'")
    return BACKENDS[name](groups, num_experts, **options)


__all__ = ["BACKENDS", "DispatchResult", "Dispatcher", "TransferStats", "make_dispatcher",
           "AllGatherDispatcher", "AllToAllDispatcher", "DedupDispatcher", "HierarchicalDispatcher",
           "LowLatencyDispatcher", "LowLatencyResult"]
