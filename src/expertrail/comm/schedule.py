"""Micro-batches that take turns at their communication: EP overlap across micro-batches.

One micro-batch alone leaves the link idle while it computes and the cores idle while its rows
travel. Two micro-batches in flight fill each other's gaps: while A's dispatch or combine (or
their backwards) is on the wire, B's attention, router and experts run, and the other way
round. `train_micro_batches` keeps two of a step's tasks in flight in 1F1B order (F0 F1 B0 F2
B1 ...: each starts as soon as one ends); `forward_interleaved` is the two-batch overlap of
inference.

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
from functools import partial
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
    ``"combine backward"``, ...). Inside a run, the waits for an exchange (`wait_exchange`
    with a ``watch``): ``"filler"``, a delayed weight gradient computed while it travels, and
    ``"blocked"``, the lane waited with nothing to run.
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
    """Whose turn it is among tasks ``0..n-1``, and which of them have started.

    At most ``width`` tasks are in flight; the others start in list order as running ones end,
    each only once the task it comes ``after`` has ended. The turn goes round the running tasks
    in list order. A task that ends gives its turn to the task it let start, which runs up to
    its first switch point while the exchanges the others wait for travel; but when another
    running task has not yet passed a switch point of its own, to the next running one (the
    new task then comes last), so that of two backwards in flight the earlier one stays ahead
    and every parameter still accumulates its gradients in micro-batch order. Every rank of
    a group sees the same switch points, so every rank starts the same tasks at the same
    places."""

    def __init__(self, n: int, width: int | None = None, after: list | None = None):
        self.cond = threading.Condition()
        self.width = n if width is None else min(width, n)
        self.after = after or [None] * n
        self.started, self.done = [False] * n, [False] * n
        self.passed = [False] * n                 # the task has passed a switch point
        self.slot_of: dict[int, int] = {}         # a started task -> the thread slot it runs on
        self.assigned: dict[int, int] = {}        # a slot -> the task it is to run next
        self.stopped = False                      # a task failed: start no more
        self._start_ready(free_slots=list(range(self.width)))
        self.turn = 0

    def _running(self) -> list[int]:
        return [i for i, (s, d) in enumerate(zip(self.started, self.done)) if s and not d]

    def _start_ready(self, free_slots: list[int]) -> None:
        """Start pending tasks in list order while a slot is free and the next one's
        predecessor has ended."""
        for i in range(len(self.started)):
            if self.started[i]:
                continue
            dep = self.after[i]
            if self.stopped or not free_slots or (dep is not None and not self.done[dep]):
                break
            slot = free_slots.pop(0)
            self.started[i], self.slot_of[i], self.assigned[slot] = True, slot, i

    def _next(self, me: int) -> int | None:
        running = self._running()
        return next((i for i in running if i > me), running[0] if running else None)

    def next_task(self, slot: int) -> int | None:
        """Wait until this slot is given a task (its index) or no task is left to run (None)."""
        with self.cond:
            self.cond.wait_for(lambda: slot in self.assigned or all(
                d or (self.stopped and not s) for s, d in zip(self.started, self.done)))
            return self.assigned.pop(slot, None)

    def wait_for(self, me: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me)

    def pass_on(self, me: int) -> None:
        """Give the turn to the next running task and wait until it comes back."""
        with self.cond:
            nxt = self._next(me)
            if nxt is None or nxt == me:
                return
            self.passed[me] = True
            self.turn = nxt
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.turn == me)

    def finish(self, me: int, failed: bool = False) -> None:
        with self.cond:
            self.done[me] = True
            self.stopped |= failed
            waiting = self._running()
            busy = {self.slot_of[i] for i in waiting} | set(self.assigned)
            mine = self.slot_of[me]                  # its thread goes on with the next task
            self._start_ready([mine] + [s for s in range(self.width) if s not in busy and s != mine])
            new = [i for i in self._running() if i not in waiting]
            nxt = new[0] if new and all(self.passed[i] for i in waiting) else self._next(me)
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
    lane = task.lane if task is not None else getattr(_local, "lane", "main")
    if task is not None and task.deferred is not None and task.deferred.items and watch is not None:
        _fill_until_landed(task.deferred, watch, lane, what)
    elif watch is not None and _timeline is not None:      # the idle wait timed apart from the rest of the operation
        start = time.perf_counter()
        watch.land()
        _record(lane, "blocked", what, start)
    result = wait()
    _record(lane, "exchange", what, posted)
    return result


def _fill_until_landed(deferred: _Deferred, watch, lane: str, what: str) -> None:
    """Run deferred work until ``watch`` (a `transport.Transfer`) has landed: a helper thread
    waits for it (gloo says a receive is complete only once waited for). On a `Timeline`, each
    item run is a ``filler`` span and what is left of the wait a ``blocked`` one."""
    landed, failure = threading.Event(), []
    _waiter().jobs.put((watch, landed, failure))
    while not landed.is_set() and deferred.items:
        start = time.perf_counter()
        deferred.run_one()
        _record(lane, "filler", what, start)
    start = time.perf_counter()
    landed.wait()
    _record(lane, "blocked", what, start)
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
            # Held until the next job otherwise: the job's closures (a model, its micro-batches,
            # its process groups) would live as long as the process, past destroy_process_group.
            del job, done


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
            del transfer, landed, failure      # as `_Worker.run`


_waiters: list[_Waiter] = []


def _waiter() -> _Waiter:
    if not _waiters:
        _waiters.append(_Waiter())
    return _waiters[0]


def run_interleaved(tasks: list[Callable[[], Any]], delay_wgrad: bool = False, lanes: list | None = None,
                    deferred: _Deferred | None = None, width: int | None = None,
                    after: list | None = None) -> list:
    """Run ``tasks`` taking turns at their switch points (task 0 first); returns their results.

    width: at most this many tasks in flight (all by default); the others start in list order
    as running ones end, task ``i`` only once task ``after[i]`` (an index, or None) has ended.
    Tasks run on ``width`` threads (the caller's and long-lived workers), each under the
    caller's grad and inference modes; one runs at a time. With ``delay_wgrad`` the delayable
    weight gradients of the tasks (those their backwards hand to `defer`) fill the tasks' waits
    for exchanges in flight, and what is left runs once every task has ended. ``deferred``
    (with ``delay_wgrad``): a queue shared with the calls before and after this one, where work
    queued by this call may stay for the next call's waits; only the work queued before this
    call is finished at its end. If tasks raise, no further task starts, and the first error
    (in task order) is raised once the running ones have ended. Tasks must reach their switch
    points in the same order on every rank of a group (the same code does). lanes: the tasks'
    names on a `Timeline`. Not from inside a task.
    """
    if getattr(_local, "task", None) is not None:
        raise RuntimeError("run_interleaved was called from inside one of its own tasks; run the inner work directly")
    if not tasks:
        return []
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise ValueError(f"width={width!r}: give how many tasks may be in flight at once, an int of at least 1 "
                         "(or None for all)")
    if after is not None and (len(after) != len(tasks) or any(
            a is not None and not 0 <= a < i for i, a in enumerate(after))):
        raise ValueError(f"after={after!r}: give one entry per task, None or the index of an earlier task")
    own_queue = delay_wgrad and deferred is None
    queue_ = (_Deferred() if own_queue else deferred) if delay_wgrad else None
    queued_before = queue_.added if queue_ is not None else 0
    turns = _Turns(len(tasks), width, after)
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
            turns.finish(i, failed=errors[i] is not None)

    def slot(s: int) -> None:                   # one thread: the tasks given to it, one by one
        while (i := turns.next_task(s)) is not None:
            body(i)

    while len(_workers) < turns.width - 1:
        _workers.append(_Worker(len(_workers) + 1))
    done = [threading.Event() for _ in range(turns.width - 1)]
    for s, event in enumerate(done, start=1):
        _workers[s - 1].jobs.put((lambda s=s: slot(s), event))
    slot(0)
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
    two tasks in flight taking turns at every dispatch and combine (see the module docstring),
    started in the order F0 F1 B0 F2 B1 F3 ... B(M-1), each as soon as one ends (a backward
    once its forward has ended): the forward of micro-batch i runs beside the backwards of i-2
    and i-1, and the first two forwards and the last two backwards pair with each other (one
    micro-batch more in flight than Megatron-Core's combined 1F1B order, whose first forward
    and last backward run alone); ``delay_wgrad`` delays the delayable weight
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
    elif micro_batches:
        # 1F1B with two in flight: F0 F1 B0 F2 B1 F3 ... B(M-1); each starts as soon as one
        # ends (each backward once its forward has ended), so no exchange waits for a phase to end.
        order = [("F", 0)] + [("F", 1)] * (last > 0)
        for i in range(last + 1):
            order += [("B", i)] + [("F", i + 2)] * (i + 2 <= last)
        index = {t: n for n, t in enumerate(order)}
        run_interleaved([partial(fwd if kind == "F" else bwd, i) for kind, i in order],
                        delay_wgrad, [f"{kind}{i}" for kind, i in order], deferred, width=2,
                        after=[index[("F", i)] if kind == "B" else None for kind, i in order])
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
