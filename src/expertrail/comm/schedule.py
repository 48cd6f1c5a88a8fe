"""Micro-batches that take turns at their communication: EP overlap across micro-batches.

One micro-batch alone leaves the link idle while it computes and the cores idle while its rows
travel. Two micro-batches in flight fill each other's gaps: while A's dispatch or combine (or
their backwards) is on the wire, B's attention, router and experts run, and the other way
round. `train_micro_batches` runs every phase of a step as such a pair (F0 + F1, then the
forward of micro-batch i beside the backward of i-2, then the last two backwards);
`forward_interleaved` is the two-batch overlap of inference.

How: each micro-batch's work runs as a task on its own thread (the caller's for the first,
long-lived workers for the others), but only one task runs at a time. A task gives its turn
away at a *switch point*, right after it has posted a row exchange and before it waits for it
(`switch_point`, called by the dispatchers: the wait of a dispatch or combine in flight and
the backwards of both), and gets it back when the other task reaches one. Exchanges of a few numbers
(dispatch counts, the router's loads) are waited for without one. Every rank runs the same
code, so every rank switches at the same places and issues its collectives in the same order:
no collective can cross another.

Delayed weight gradients (``delay_wgrad``): inside a task, `GroupedExperts`, `SwiGLUMLP` and
any `experts.delayable_linear` projection (`train`'s attention) compute the input gradient at
once (the previous layer needs it) and hand the weight gradient to `defer`. The step's queue of
them fills the waits for exchanges that have not landed, whichever task waits, in the order
they were queued; what is left runs when the step ends. Gradients are the same bits either
way: the same kernels run, and every parameter accumulates the micro-batches' gradients in
micro-batch order.
"""
from __future__ import annotations

import queue
import threading
from collections import deque
import time
from typing import Any, Callable

import torch

_local = threading.local()
_timeline: "Timeline | None" = None


class Timeline:
    """Spans of one process's micro-batch work, for a picture of the overlap (docs/overlap.md).

    ``with Timeline() as t: ...`` records ``t.spans``: (lane, kind, what, start, end), times
    from ``time.perf_counter()``. lane: the work, ``"F1"`` (forward of micro-batch 1) or
    ``"B0"``; kind ``"run"``: the lane held the cores (its turn); kind ``"exchange"``: one of
    its exchanges, from posted to landed, ``what`` naming it (``"dispatch"``,
    ``"combine backward"``, ...).
    """

    def __init__(self):
        self.spans: list = []

    def __enter__(self) -> "Timeline":
        global _timeline
        self._outer, _timeline = _timeline, self
        return self

    def __exit__(self, *exc) -> None:
        global _timeline
        _timeline = self._outer


def _record(lane: str, kind: str, what: str, start: float) -> None:
    if _timeline is not None:
        _timeline.spans.append((lane, kind, what, start, time.perf_counter()))


class _Turns:
    """Whose turn it is among ``n`` tasks; a task that ends passes its turn on."""

    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.turn, self.done = 0, [False] * n

    def _next(self, me: int) -> int | None:
        n = len(self.done)
        return next((j % n for j in range(me + 1, me + 1 + n) if not self.done[j % n]), None)

    def wait_for(self, me: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me)

    def pass_on(self, me: int) -> None:
        """Give the turn to the next unfinished task and wait until it comes back."""
        with self.cond:
            nxt = self._next(me)
            if nxt is None or nxt == me:
                return
            self.turn = nxt
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me)

    def finish(self, me: int) -> None:
        with self.cond:
            self.done[me] = True
            nxt = self._next(me)
            if nxt is not None:
                self.turn = nxt
            self.cond.notify_all()


class _Deferred:
    """Weight gradients handed to `defer`, run in the order they came (so every parameter
    accumulates its micro-batches' gradients in micro-batch order): one at a time in the gaps
    where the task holding the turn waits for an exchange still in flight (`wait_exchange`),
    the rest when the tasks end (`run_interleaved`) or at the end of the step
    (`train_micro_batches`)."""

    def __init__(self):
        self.items: deque = deque()          # (work, the parameter it adds a gradient into, or None)
        self.added = self.done = 0

    def add(self, work: Callable[[], None], param: torch.Tensor | None = None) -> None:
        self.items.append((work, param))
        self.added += 1

    def run_one(self) -> None:
        work, _ = self.items.popleft()
        self.done += 1
        with torch.no_grad():               # as in a backward: gradients are plain tensors
            work()

    def run_all(self, first: Callable[[torch.Tensor], bool] | None = None, between=None) -> None:
        """Run every queued item: those whose parameter ``first`` picks, then ``between()``,
        then the others, each part in queue order (a parameter's items stay in order)."""
        if first is not None:
            picks = [param is not None and first(param) for _, param in self.items]
            rest = deque(item for item, pick in zip(self.items, picks) if not pick)
            self.items = deque(item for item, pick in zip(self.items, picks) if pick)
            self.run_until(self.added)
            self.items = rest
        if between is not None:
            between()
        self.run_until(self.added)

    def run_until(self, count: int) -> None:
        """Run the queued work until ``count`` items in all have run."""
        while self.done < count and self.items:
            self.run_one()


class _Task:
    """This thread's place among the tasks: the turns, its index, where its deferred work goes."""

    def __init__(self, turns: _Turns, index: int, deferred: _Deferred | None, lane: str):
        self.turns, self.index, self.lane = turns, index, lane
        self.deferred = deferred
        self.since = time.perf_counter()          # when this task last got the turn


def switch_point() -> None:
    """Called right after an exchange is posted and before it is waited for: let the other task
    run until its own switch point. A no-op outside `run_interleaved` (one micro-batch, the
    usual case)."""
    task = getattr(_local, "task", None)
    if task is not None:
        _record(task.lane, "run", "", task.since)
        task.turns.pass_on(task.index)
        task.since = time.perf_counter()


def wait_exchange(what: str, wait: Callable[[], Any], give_turn: bool = True, watch=None) -> Any:
    """``wait()`` for an exchange just posted, after a `switch_point` (another task runs while it
    travels); on a `Timeline` its span from posted to landed is recorded as ``what``.

    watch: the exchange's `transport.Transfer`. While it has not landed, the deferred weight
    gradients of the step (any task's, in order) run here, so a wait that would leave the cores
    idle computes them instead.

    give_turn=False: wait without a switch point, for exchanges of a few numbers (dispatch
    counts, the router's loads). Such an exchange lands in milliseconds, while a turn given
    away lasts one whole chunk of the other task; and a forward would get twice as many switch
    points as the backward beside it, so its last layer would find nothing left to overlap."""
    posted = time.perf_counter()
    if give_turn:
        switch_point()
    task = getattr(_local, "task", None)
    if task is not None and task.deferred is not None and task.deferred.items and watch is not None:
        _fill_until_landed(task.deferred, watch)
    result = wait()
    _record(task.lane if task is not None else getattr(_local, "lane", "main"), "exchange", what, posted)
    return result


def _fill_until_landed(deferred: _Deferred, watch) -> None:
    """Run deferred work until ``watch`` (a `transport.Transfer`) has landed: a helper thread
    waits for it (gloo says a receive is complete only once waited for)."""
    landed, failure = threading.Event(), []
    _waiter().jobs.put((watch, landed, failure))
    while not landed.is_set() and deferred.items:
        deferred.run_one()
    landed.wait()
    if failure:
        raise failure[0]


class TaskLocal:
    """A module attribute holding one value per task thread (a data descriptor): two forwards in
    flight together (`run_interleaved`) each read back what they wrote, such as a MoE layer's
    router losses from its last forward. Reads before any write give ``default()``."""

    def __init__(self, default: Callable[[], Any] = dict):
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.key = f"_{name}_per_task"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        values = obj.__dict__.get(self.key, {})
        return values[threading.get_ident()] if threading.get_ident() in values else self.default()

    def __set__(self, obj, value) -> None:
        obj.__dict__.setdefault(self.key, {})[threading.get_ident()] = value


def defer(work: Callable[[], None], param: torch.Tensor | None = None) -> bool:
    """Queue ``work`` (a weight gradient, added into ``param.grad``) to fill a later wait for an
    exchange (`_Deferred`); False, and nothing queued, when weight gradients are not delayed
    here (the caller does it now)."""
    task = getattr(_local, "task", None)
    if task is None or task.deferred is None:
        return False
    task.deferred.add(work, param)
    return True


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` as autograd does (the first gradient is kept as it is)."""
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad.add_(grad)


class _Worker(threading.Thread):
    """A thread that runs the tasks handed to it, kept for the life of the process: glibc gives
    each thread its own malloc arena, and a fresh thread's arena faults in every large tensor
    again (measured: a 1F1B step 14% slower on loopback with new threads per call, 2% with
    these)."""

    def __init__(self, index: int):
        super().__init__(name=f"expertrail-task-{index}", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            job, done = self.jobs.get()
            job()
            done.set()


_workers: list[_Worker] = []


class _Waiter(threading.Thread):
    """Waits for posted works on behalf of the task holding the turn, which meanwhile runs
    deferred work (`_fill_until_landed`); kept for the life of the process."""

    def __init__(self):
        super().__init__(name="expertrail-waiter", daemon=True)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            transfer, landed, failure = self.jobs.get()
            try:
                transfer.land()
            except BaseException as err:       # raised by the task that waits
                failure.append(err)
            landed.set()


_waiters: list[_Waiter] = []


def _waiter() -> _Waiter:
    if not _waiters:
        _waiters.append(_Waiter())
    return _waiters[0]


def run_interleaved(tasks: list[Callable[[], Any]], delay_wgrad: bool = False, lanes: list | None = None,
                    deferred: _Deferred | None = None) -> list:
    """Run ``tasks`` taking turns at their switch points (task 0 first); returns their results.

    Task 0 runs on the calling thread, the others on worker threads, each under the caller's
    grad and inference modes; one runs at a time. With ``delay_wgrad`` the delayable weight
    gradients of the tasks (those their backwards hand to `defer`) fill the tasks' waits for
    exchanges in flight, and what is left runs once every task has ended. ``deferred`` (with
    ``delay_wgrad``): a queue shared with the calls before and after this one, where work
    queued by this call may stay for the next call's waits (`train_micro_batches`); only the
    work queued before this call is finished at its end. If tasks raise, the first one's (in
    task order) error is raised once all have ended. Tasks must reach their switch points in
    the same order on every rank of a group (the same code does). lanes: the tasks' names on a
    `Timeline`. Not from inside a task.
    """
    if getattr(_local, "task", None) is not None:
        raise RuntimeError("run_interleaved was called from inside one of its own tasks; run the inner work directly")
    if not tasks:
        return []
    own_queue = delay_wgrad and deferred is None
    queue_ = (_Deferred() if own_queue else deferred) if delay_wgrad else None
    queued_before = queue_.added if queue_ is not None else 0
    turns = _Turns(len(tasks))
    results: list = [None] * len(tasks)
    errors: list = [None] * len(tasks)
    grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def body(i: int) -> None:
        turns.wait_for(i)
        _local.task = task = _Task(turns, i, queue_, lanes[i] if lanes else f"task {i}")
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
                results[i] = tasks[i]()
        except BaseException as err:            # handed to the caller below
            errors[i] = err
        finally:
            _record(task.lane, "run", "", task.since)
            _local.task = None
            turns.finish(i)

    while len(_workers) < len(tasks) - 1:
        _workers.append(_Worker(len(_workers) + 1))
    done = [threading.Event() for _ in tasks[1:]]
    for i, event in enumerate(done, start=1):
        _workers[i - 1].jobs.put((lambda i=i: body(i), event))
    body(0)
    for event in done:
        event.wait()
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        if queue_ is not None:
            queue_.items.clear()
        raise first
    if queue_ is not None:
        start = time.perf_counter()
        queue_.run_until(queue_.added if own_queue else queued_before)
        if lanes:
            _record(lanes[-1], "run", "", start)
    return results


def train_micro_batches(forward: Callable[[Any], torch.Tensor], micro_batches: list, overlap: bool = True,
                        delay_wgrad: bool = True, ready_first: Callable[[torch.Tensor], bool] | None = None,
                        on_ready: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch, gradients accumulated; returns the losses
    (detached).

    forward(micro_batch) -> the scalar to call ``backward()`` on (scaled as the gradients
    should accumulate). ``overlap=False``: F0 B0 F1 B1 ..., one at a time. ``overlap=True``:
    every phase a pair taking turns at every dispatch and combine (see the module docstring):
    F0 + F1, then the forward of micro-batch i beside the backward of i-2, then the last two
    backwards (one micro-batch more in flight than Megatron-Core's combined 1F1B order, whose
    first forward and last backward run alone); ``delay_wgrad`` delays the delayable weight
    gradients (experts, shared expert, `experts.delayable_linear` projections) into the waits
    for exchanges. Every parameter accumulates its micro-batch gradients in micro-batch order
    either way, so gradients and
    losses are bitwise the same with and without overlap. Collective over every EP group the
    model uses: every rank passes the same number of micro-batches and the same ``overlap``.

    ready_first / on_ready: once every gradient is complete but the delayed weight gradients
    still queued at the end, those of the parameters ``ready_first`` picks are computed, then
    ``on_ready()`` is called, then the rest run: a data-parallel all-reduce of the replicated
    parameters' gradients started there travels while the experts' weight gradients are
    computed. Without delayed weight gradients ``on_ready()`` is called at the end.
    """
    losses: list = [None] * len(micro_batches)

    def fwd(i):
        losses[i] = forward(micro_batches[i])

    def bwd(i):
        losses[i].backward()

    def alone(work, i, lane):               # outside any task: one lane, recorded as it runs
        _local.lane, start = lane, time.perf_counter()
        work(i)
        _record(lane, "run", "", start)
        _local.lane = "main"

    last = len(micro_batches) - 1
    deferred = _Deferred() if delay_wgrad else None
    if not overlap:
        for i in range(last + 1):
            alone(fwd, i, f"F{i}")
            alone(bwd, i, f"B{i}")
    elif last == 0:
        alone(fwd, 0, "F0")
        run_interleaved([lambda: bwd(0)], delay_wgrad, ["B0"], deferred)
    elif micro_batches:
        # Every phase a pair: F0 + F1, then F(i) + B(i-2), then B(M-2) + B(M-1).
        run_interleaved([lambda: fwd(0), lambda: fwd(1)], delay_wgrad, ["F0", "F1"], deferred)
        for i in range(2, last + 1):
            run_interleaved([lambda i=i: fwd(i), lambda i=i: bwd(i - 2)], delay_wgrad, [f"F{i}", f"B{i - 2}"],
                            deferred)
        run_interleaved([lambda: bwd(last - 1), lambda: bwd(last)], delay_wgrad, [f"B{last - 1}", f"B{last}"],
                        deferred)
    if deferred is not None:                # what the last backwards left in the queue
        start = time.perf_counter()
        deferred.run_all(ready_first, on_ready)
        if overlap and micro_batches:
            _record(f"B{last}", "run", "", start)
    elif on_ready is not None:
        on_ready()
    return [loss.detach() for loss in losses]


def forward_interleaved(forward: Callable[[Any], Any], inputs: list) -> list:
    """``[forward(x) for x in inputs]``, the forwards taking turns at every dispatch and combine
    (two-batch overlap for inference); outputs are the same as one after another."""
    return run_interleaved([lambda x=x: forward(x) for x in inputs])
