"""Load recorder: tokens per expert per layer over a rolling window, summed over ranks on demand.

Cheap enough to leave on: recording adds the router's counts into a device tensor (no host
sync); ``step()`` closes a step with a host timestamp; the window is a number of steps or of
seconds (``window_seconds=300`` keeps the last five minutes). ``load()`` sums closed steps
only, so call ``step()`` at the end of every training or serving step::

    recorder = LoadRecorder(num_layers, num_experts, window_steps=100)
    for batch in data:
        loss = model(batch)          # MoELayer(..., recorder=recorder) calls record()
        ...
        recorder.step()              # closes the step: its counts join the window
    load = recorder.load(group)      # [layers, experts], summed over the window and the group
"""
from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from ..errors import ConfigError, ExpertrailError


class LoadRecorder:
    """Per-step counts [layers, experts] in a ring of steps: `record` adds to the open step,
    `step` closes it (call it at the end of every step), `load` sums the closed steps of the
    window."""

    def __init__(self, num_layers: int, num_experts: int, window_steps: int | None = None,
                 window_seconds: float | None = None, device=None, clock=time.monotonic):
        if (window_steps is None) == (window_seconds is None):
            raise ConfigError("give exactly one of window_steps and window_seconds")
        self.window_steps, self.window_seconds, self.clock = window_steps, window_seconds, clock
        self.current = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self.steps = deque(maxlen=window_steps)       # (timestamp, counts)
        self.closed_steps = 0                         # step() calls so far

    def record(self, layer: int, tokens_per_expert: torch.Tensor) -> None:
        """Add one forward's counts (int64 [E], on the device) for ``layer``."""
        self.current[layer] += tokens_per_expert

    def step(self) -> None:
        """Close the current step."""
        now = self.clock()
        self.closed_steps += 1
        self.steps.append((now, self.current))
        self.current = torch.zeros_like(self.current)
        if self.window_seconds is not None:
            while self.steps and self.steps[0][0] < now - self.window_seconds:
                self.steps.popleft()

    def load(self, group=None) -> torch.Tensor:
        """Counts [layers, experts] summed over the window's closed steps (and over ``group``'s
        ranks; collective then).

        Raises ExpertrailError if `step` was never called: the counts recorded so far are all
        in the open step, and a load of zeros would plan as if nothing were hot. It does not
        add the open step instead: a window is whole steps (``window_steps=N`` means N of
        them), and a step half-way through would weigh part of a step's tokens like a whole
        one. The test depends only on how often `step` was called, which is the same on every
        rank of a training loop, so with a ``group`` every rank raises alike and none waits in
        the all-reduce for the others. (An empty window of a recorder that has stepped, e.g.
        ``window_seconds`` with no step in the last seconds, is zeros: nothing happened.)"""
        if not self.closed_steps:
            raise ExpertrailError(
                "LoadRecorder.load() before any step(): load() sums closed steps only, and "
                f"{int(self.current.sum())} recorded token(s) are still in the open step; call "
                "recorder.step() at the end of each training or serving step")
        total = torch.zeros_like(self.current)
        now = self.clock()
        for stamp, counts in self.steps:
            if self.window_seconds is None or stamp >= now - self.window_seconds:
                total += counts
        if group is not None:
            dist.all_reduce(total, group=group)
        return total
