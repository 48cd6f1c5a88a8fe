"""Load recorder: tokens per expert per layer over a rolling window, summed over ranks on demand.

Cheap enough to leave on: recording adds the router's counts into a device tensor (no host
sync); ``step()`` closes a step with a host timestamp; the window is a number of steps or of
seconds (``window_seconds=300`` keeps the last five minutes).
"""
from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from ..errors import ConfigError


class LoadRecorder:
    """Per-step counts [layers, experts] in a ring of steps."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int | None = None,
                 window_seconds: float | None = None, device=None, clock=time.monotonic):
        if (window_steps is None) == (window_seconds is None):
            raise ConfigError("give exactly one of window_steps and window_seconds")
        self.window_steps, self.window_seconds, self.clock = window_steps, window_seconds, clock
        self.current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.steps = deque(maxlen=window_steps)       # (timestamp, counts)

    def record(self, layer: int, tokens_per_expert: torch.Tensor) -> None:
        """Add one forward's counts (int64 [E], on the device) for ``layer``."""
        self.current[layer] += tokens_per_expert

    def step(self) -> None:
        """Close the current step."""
        now = self.clock()
        self.steps.append((now, self.current))
        self.current = torch.zeros_like(self.current)
        if self.window_seconds is not None:
            while self.steps and self.steps[0][0] < now - self.window_seconds:
                self.steps.popleft()

    def load(self, group=None) -> torch.Tensor:
        """Counts [layers, experts] summed over the window (and over ``group``'s ranks)."""
        total = torch.zeros_like(self.current)
        now = self.clock()
        for stamp, counts in self.steps:
            if self.window_seconds is None or stamp >= now - self.window_seconds:
                total += counts
        if group is not None:
            dist.all_reduce(total, group=group)
        return total
