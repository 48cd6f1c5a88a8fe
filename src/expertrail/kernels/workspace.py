"""Buffers a dispatcher owns and reuses call after call (DeepEP and Hybrid-EP allocate their
communication buffers once, too).

Every dispatch and combine moves tens of MB per rank through a handful of large tensors: sent
rows, received rows, expert-major rows, rows coming back. Allocated fresh each call, each costs
a page fault per 4 KiB page on first touch wherever the allocator maps and unmaps them (glibc
does for blocks of 32 MiB and more, and for smaller ones until its threshold adapts; on CUDA the
caching allocator keeps them, but its pool churns). A `Workspace` keeps them instead.

`Workspace.empty` hands out a view of a pooled buffer that nothing else uses any more: a buffer
is busy while any tensor views its memory, whether the caller's result, a tensor autograd saved,
or an exchange in flight, so a buffer is never reused under a live tensor. That makes reuse safe
without rules for the caller: results may be kept as long as wanted (they only keep their
buffer out of the pool meanwhile), two dispatches may be in flight at once (chunked overlap),
backward may run after a second forward. The pool grows only when a call needs a larger buffer
than any free one (rounded up by an eighth of a power of two, so growth is amortised) and its
size is bounded by the most buffers alive at once times the largest request:
``high_water_bytes`` reports it, `release` gives the free buffers back.

The engine allocates through `allocate` / `allocate_zeros`, which use the workspace that the
dispatcher made current for this thread (`Workspace.active`, entered by every dispatch, combine,
wait and backward), or plain torch allocation outside one.
"""
from __future__ import annotations

import contextlib
import math
import threading

import torch

# Below this a request is served by torch directly: small blocks come from the allocator's
# heap without page faults (glibc's mmap threshold starts at 128 KiB).
MIN_POOLED_BYTES = 128 * 1024

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_current = threading.local()


def _rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of an eighth of its power of two (at most +12.5%)."""
    step = max(1, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class Workspace:
    """A pool of large buffers for one dispatcher, on any device.

    ``empty(shape, dtype, device)`` -> a tensor on a free pooled buffer (see the module
    docstring). ``high_water_bytes``: the most bytes the pool has held; ``nbytes``: held now;
    ``release()``: drop every buffer (busy ones live on until their last tensor goes).
    ``enabled=False`` makes it a pass-through to torch (for comparisons).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and _use_count is not None
        self._buffers: list[torch.Tensor] = []          # flat uint8, one per pooled buffer
        self.high_water_bytes = 0
        self.reused = self.allocated = 0                # requests served from the pool / by growing it

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def empty(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        shape = tuple(int(s) for s in shape)
        nbytes = dtype.itemsize * math.prod(shape)
        if not self.enabled or nbytes < MIN_POOLED_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        device = torch.device(device)
        best = too_small = None
        for i, buf in enumerate(self._buffers):
            if buf.device != device or not self._is_free(buf):
                continue
            if buf.numel() >= nbytes and (best is None or buf.numel() < self._buffers[best].numel()):
                best = i
            elif buf.numel() < nbytes and (too_small is None or buf.numel() > self._buffers[too_small].numel()):
                too_small = i
        if best is not None:
            self.reused += 1
            buf = self._buffers[best]
        else:
            if too_small is not None:     # replace the largest free one: the pool does not grow in count
                self._buffers.pop(too_small)
            buf = torch.empty(_rounded(nbytes), dtype=torch.uint8, device=device)
            self._buffers.append(buf)
            self.allocated += 1
            self.high_water_bytes = max(self.high_water_bytes, self.nbytes)
        return buf[:nbytes].view(dtype).view(shape)

    def release(self) -> None:
        """Give every buffer back (tensors still viewing one keep it alive until they go)."""
        self._buffers.clear()

    @staticmethod
    def _is_free(buf: torch.Tensor) -> bool:
        # The pool's tensor and the temporary storage object count 2: any more is a live view.
        return _use_count(buf.untyped_storage()._cdata) <= 2

    @contextlib.contextmanager
    def active(self):
        """Make this workspace the one `allocate` uses on this thread, for the block."""
        previous = getattr(_current, "workspace", None)
        _current.workspace = self
        try:
            yield self
        finally:
            _current.workspace = previous

    def __repr__(self) -> str:
        return (f"Workspace({len(self._buffers)} buffers, {self.nbytes / 2**20:.1f} MiB, high water "
                f"{self.high_water_bytes / 2**20:.1f} MiB, reused {self.reused}, allocated {self.allocated})")


def current() -> Workspace | None:
    return getattr(_current, "workspace", None)


def allocate(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised tensor from the current workspace (torch.empty outside one)."""
    ws = current()
    return torch.empty(tuple(shape), dtype=dtype, device=device) if ws is None else ws.empty(shape, dtype, device)


def allocate_zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    return allocate(shape, dtype, device).zero_()
