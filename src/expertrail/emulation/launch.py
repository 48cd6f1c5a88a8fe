"""Local multi-rank runs: a pool of real processes on torch.distributed (gloo on CPU).

`LocalRanks` starts W processes once, each with a process group, and runs picklable functions
on all of them: ``with LocalRanks(4) as ranks: results = ranks.run(fn, arg)`` calls
``fn(rank, world, arg)`` on every rank and returns the W results. Errors come back with the
rank that raised them. Tests keep one pool per module; the CLI uses it for local runs.
"""
from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def use_heap_for_large_buffers() -> bool:
    """Make glibc serve large allocations from its heap and keep freed memory (no mmap/munmap
    per tensor). Process-wide, so not something a library does to its user's process: only
    ``LocalRanks(malloc_heap=True)`` and ``expertrail bench --malloc-heap`` call it, to show
    what the allocator costs (docs/benchmarks.md). Returns False where glibc's mallopt is not
    available."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))
    except (OSError, AttributeError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankDied(RuntimeError):
    """A rank's process exited while a function was running."""


class RankError(RuntimeError):
    """A function raised on one or more ranks; ``errors`` maps rank -> (repr, traceback, exception)."""

    def __init__(self, errors: dict):
        self.errors = errors
        first = min(errors)
        super().__init__(f"raised on rank(s) {sorted(errors)}; rank {first}:\n{errors[first][1]}")


def _worker(rank: int, world: int, port: int, backend: str, tasks, results, threads: int, malloc_heap: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if malloc_heap:
        use_heap_for_large_buffers()
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    parent = os.getppid()
    try:
        while True:
            try:
                task = tasks.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:     # the pool's owner is gone (killed): do not linger
                    break
                continue
            if task is None:
                break
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(rank, world, *args, **kwargs)))
            except BaseException as exc:   # report, keep serving
                try:
                    pickle.dumps(exc)
                except Exception:
                    exc = RuntimeError(repr(exc))
                results.put((rank, False, (repr(exc), traceback.format_exc(), exc)))
    finally:
        dist.destroy_process_group()


class LocalRanks:
    """W local processes in one process group (gloo, or NCCL with ``backend="nccl"``), each
    with ``threads`` torch threads and the default allocator (``malloc_heap=True``: glibc set
    to keep large blocks, see `use_heap_for_large_buffers`)."""

    def __init__(self, world: int, backend: str = "gloo", threads: int = 1, timeout: float = 600.0,
                 malloc_heap: bool = False):
        self.world, self.backend, self.threads, self.timeout = world, backend, threads, timeout
        self.malloc_heap = malloc_heap
        self._procs = None

    def __enter__(self) -> "LocalRanks":
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [ctx.Process(target=_worker, daemon=True,
                                   args=(r, self.world, port, self.backend, self._tasks[r], self._results,
                                         self.threads, self.malloc_heap)) for r in range(self.world)]
        for p in self._procs:
            p.start()
        return self

    def run(self, fn, *args, **kwargs) -> list:
        """``fn(rank, world, *args, **kwargs)`` on every rank; returns results by rank.

        A rank whose process died counts as an error (RankDied), so the call returns as soon
        as every live rank has answered."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out, errors = {}, {}
        deadline = time.monotonic() + self.timeout
        while len(out) + len(errors) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(self._procs):
                    if r not in out and r not in errors and not p.is_alive():
                        exc = RankDied(f"rank {r} exited with code {p.exitcode}")
                        errors[r] = (repr(exc), str(exc), exc)
                if time.monotonic() > deadline:
                    waiting = [r for r in range(self.world) if r not in out and r not in errors]
                    raise TimeoutError(f"no answer from ranks {waiting} within {self.timeout}s") from None
                continue
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
        if errors:
            raise RankError(errors)
        return [out[r] for r in range(self.world)]

    def run_expect_error(self, fn, *args, **kwargs) -> dict:
        """Like `run`, but every rank must raise; returns rank -> exception."""
        try:
            self.run(fn, *args, **kwargs)
        except RankError as err:
            if len(err.errors) != self.world:
                raise
            return {r: e[2] for r, e in err.errors.items()}
        raise AssertionError("no rank raised")

    def __exit__(self, *exc) -> None:
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
