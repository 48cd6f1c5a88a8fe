"""`expertrail.comm.schedule` on one process: turn taking, errors, delayed work."""
import threading
import time
import weakref

import pytest
import torch

from expertrail.comm import schedule
from expertrail.comm.transport import Transfer, later


def test_tasks_take_turns_at_switch_points_and_return_their_results():
    order = []

    def task(name, steps):
        for i in range(steps):
            order.append(f"{name}{i}")
            schedule.switch_point()
        return name

    assert schedule.run_interleaved([lambda: task("a", 3), lambda: task("b", 2)]) == ["a", "b"]
    assert order == ["a0", "b0", "a1", "b1", "a2"]       # b ended: a goes on alone


def _steps(order, name, steps):
    for i in range(steps):
        order.append(f"{name}{i}")
        schedule.switch_point()
    return name


def test_width_keeps_that_many_in_flight_and_starts_the_next_as_one_ends():
    order = []
    tasks = [lambda: _steps(order, "a", 3), lambda: _steps(order, "b", 1), lambda: _steps(order, "c", 2)]
    assert schedule.run_interleaved(tasks, width=2) == ["a", "b", "c"]
    # b ends at its first switch point: c takes its place at once, after a
    assert order == ["a0", "b0", "a1", "c0", "a2", "c1"]


def test_a_task_starts_only_once_the_task_it_comes_after_has_ended():
    order = []
    tasks = [lambda: _steps(order, "x", 1), lambda: _steps(order, "y", 3), lambda: _steps(order, "z", 1)]
    schedule.run_interleaved(tasks, width=2, after=[None, None, 1])
    assert order == ["x0", "y0", "y1", "y2", "z0"]          # a slot was free, but y had not ended


def test_a_task_that_ends_gives_its_turn_to_the_task_it_let_start():
    """The new task runs up to its first switch point while the other's exchange travels; but
    not before a running task that has not passed a switch point yet (of two backwards, the
    earlier one must stay ahead for the gradients' order)."""
    order = []
    tasks = [lambda: _steps(order, "x", 1), lambda: _steps(order, "y", 3), lambda: _steps(order, "z", 2)]
    schedule.run_interleaved(tasks, width=2)
    assert order == ["x0", "y0", "z0", "y1", "z1", "y2"]
    order = []
    tasks = [lambda: _steps(order, "x", 0), lambda: _steps(order, "y", 2), lambda: _steps(order, "z", 1)]
    schedule.run_interleaved(tasks, width=2)
    assert order == ["y0", "z0", "y1"]                      # y had not run when x ended: y first


def test_after_must_name_an_earlier_task_and_width_be_at_least_one():
    with pytest.raises(ValueError, match="after="):
        schedule.run_interleaved([lambda: None, lambda: None], width=1, after=[1, None])
    for width in (0, -1, 1.5):
        with pytest.raises(ValueError, match="width="):
            schedule.run_interleaved([lambda: None], width=width)


def test_no_task_starts_after_one_failed():
    ran = []

    def fails():
        schedule.switch_point()
        raise ValueError("the first task failed")
    tasks = [fails, lambda: _steps(ran, "b", 2), lambda: ran.append("never")]
    with pytest.raises(ValueError, match="the first task failed"):
        schedule.run_interleaved(tasks, width=2)
    assert ran == ["b0", "b1"]                                # the running one ended, the next never began


def test_train_micro_batches_starts_tasks_in_1f1b_order_two_in_flight():
    """F0 F1 B0 F2 B1 F3 B2 B3: each backward right after its forward's neighbour ends."""
    w = torch.ones(1, requires_grad=True)

    def forward(m):
        schedule.switch_point()
        return (w * m).sum()
    with schedule.Timeline() as t:
        losses = schedule.train_micro_batches(forward, [1.0, 2.0, 3.0, 4.0])
    first = {}
    for lane, kind, _, start, _ in t.spans:
        first[lane] = min(first.get(lane, start), start)
    assert sorted(first, key=first.get) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert [x.item() for x in losses] == [1.0, 2.0, 3.0, 4.0] and w.grad.item() == 10.0


def test_small_exchanges_are_waited_for_without_giving_the_turn_away():
    order = []

    def task(name, give_turn):
        order.append(f"{name} posts")
        schedule.wait_exchange("counts", lambda: order.append(f"{name} waits"), give_turn=give_turn)
        order.append(f"{name} goes on")

    schedule.run_interleaved([lambda: task("a", False), lambda: task("b", True)])
    assert order == ["a posts", "a waits", "a goes on", "b posts", "b waits", "b goes on"]
    order.clear()
    schedule.run_interleaved([lambda: task("a", True), lambda: task("b", True)])
    assert order == ["a posts", "b posts", "a waits", "a goes on", "b waits", "b goes on"]


def test_the_first_error_is_raised_after_every_task_ended():
    ended = []

    def fails():
        schedule.switch_point()
        raise ValueError("task 0 failed")

    def goes_on():
        schedule.switch_point()
        schedule.switch_point()
        ended.append(True)

    with pytest.raises(ValueError, match="task 0 failed"):
        schedule.run_interleaved([fails, goes_on])
    assert ended == [True]


class _SlowWork:
    """A posted exchange that lands once ``landed`` is set (or after 5 s)."""

    def __init__(self):
        self.landed, self.returned, self.waits = threading.Event(), threading.Event(), 0

    def wait(self):
        self.waits += 1
        self.landed.wait(5)
        self.returned.set()

    def land_now(self):
        """Let it land, and give the waiting thread time to say so."""
        self.landed.set()
        self.returned.wait(5)
        time.sleep(0.2)


def test_work_is_deferred_only_inside_a_task_with_delayed_weight_gradients():
    done = []
    assert not schedule.defer(lambda: done.append("now"))          # no task: the caller does it
    assert schedule.run_interleaved([lambda: schedule.defer(lambda: done.append("later"))]) == [False]

    def task():
        assert schedule.defer(lambda: done.append("first"))
        assert schedule.defer(lambda: (done.append("second"), work.land_now()))
        assert schedule.defer(lambda: done.append("third"))
        schedule.switch_point()
        assert done == []                            # nothing waits yet: nothing runs
        # an exchange in flight: the queue runs in order until it has landed, then waits
        got = schedule.wait_exchange("rows", lambda: transfer.wait() or "rows", watch=transfer)
        assert got == "rows" and done == ["first", "second"] and work.waits == 1   # waited for once only
        return schedule.defer(lambda: done.append("at the end"))
    done.clear()
    work = _SlowWork()
    transfer = Transfer(works=[work])
    assert schedule.run_interleaved([task], delay_wgrad=True) == [True]
    assert done == ["first", "second", "third", "at the end"]


def test_deferred_work_runs_in_order_across_calls_sharing_a_queue():
    """A queue shared by several calls: work queued by one call may fill the next call's waits;
    a call finishes only the work queued before it began (`train_micro_batches` makes one call
    and runs what is left itself)."""
    done = []
    deferred = schedule._Deferred()
    schedule.run_interleaved([lambda: schedule.defer(lambda: done.append("B0"))], True, deferred=deferred)
    assert done == [] and len(deferred.items) == 1                 # left for the next call's waits
    schedule.run_interleaved([lambda: schedule.defer(lambda: done.append("B1"))], True, deferred=deferred)
    assert done == ["B0"]                                            # queued before: finished
    deferred.run_until(deferred.added)
    assert done == ["B0", "B1"]


def test_the_last_deferred_work_runs_picked_parameters_first_then_the_hook_then_the_rest():
    """`_Deferred.run_all`: the picked parameters' work first, then ``between``, then the
    others, each in queue order, so every parameter's work keeps its order."""
    done, dense, expert = [], torch.zeros(1), torch.zeros(1)
    deferred = schedule._Deferred()
    for name, param in [("e0", expert), ("d0", dense), ("e1", expert), ("x", None), ("d1", dense)]:
        deferred.add(lambda name=name: done.append(name), param)
    deferred.run_all(lambda p: p is dense, lambda: done.append("ready"))
    assert done == ["d0", "d1", "ready", "e0", "e1", "x"] and not deferred.items


@pytest.mark.parametrize("overlap", [False, True])
def test_train_micro_batches_calls_on_ready_once_after_the_picked_gradients(overlap):
    """The hook runs once every gradient but the unpicked parameters' delayed weight gradients
    is in, with or without overlap; the gradients are the same bits as without the hook."""
    from expertrail.moe.experts import GroupedExperts, SwiGLUMLP
    torch.manual_seed(0)
    experts, shared = GroupedExperts(3, 16, 8), SwiGLUMLP(16, 8)
    xs = [torch.randn(10, 16) for _ in range(3)]
    counts = torch.tensor([4, 0, 6])
    is_expert = {id(p) for p in experts.parameters()}

    def forward(x):
        schedule.switch_point()
        return (experts(x, counts) + shared(x)).square().sum()

    def run(hook):
        for p in (*experts.parameters(), *shared.parameters()):
            p.grad = None
        seen = []

        def ready():
            seen.append([p.grad is not None for p in shared.parameters()])
        schedule.train_micro_batches(forward, xs, overlap=overlap,
                                     ready_first=(lambda p: id(p) not in is_expert) if hook else None,
                                     on_ready=ready if hook else None)
        return seen, [p.grad.clone() for p in (*experts.parameters(), *shared.parameters())]
    seen, with_hook = run(True)
    assert seen == [[True] * len(list(shared.parameters()))]
    assert all(torch.equal(a, b) for a, b in zip(with_hook, run(False)[1]))


def test_delayed_weight_gradients_are_the_same_bits():
    from expertrail.moe.experts import GroupedExperts, SwiGLUMLP
    torch.manual_seed(0)
    experts, shared = GroupedExperts(3, 16, 8), SwiGLUMLP(16, 8)
    x = torch.randn(10, 16, requires_grad=True)
    counts = torch.tensor([4, 0, 6])

    def grads(delay):
        for p in (*experts.parameters(), *shared.parameters(), x):
            p.grad = None
        schedule.run_interleaved([lambda: (experts(x, counts) + shared(x)).square().sum().backward()], delay)
        return [p.grad.clone() for p in (*experts.parameters(), *shared.parameters(), x)]
    now, later = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(now, later))
    # and they are the gradients autograd gives for the same maths
    ref = [p.detach().clone().requires_grad_() for p in (experts.gate_up_proj, experts.down_proj)]
    out = torch.cat([torch.nn.functional.silu(r @ g[:8].T) * (r @ g[8:].T) @ d.T
                     for r, g, d in zip(x.detach().split([4, 0, 6]), ref[0], ref[1])])
    (out + shared(x.detach())).square().sum().backward()
    torch.testing.assert_close(ref[0].grad, now[0])
    torch.testing.assert_close(ref[1].grad, now[1])


def test_attention_projections_delay_their_weight_gradients_to_the_same_bits():
    from expertrail.tools.train import Attention
    torch.manual_seed(0)
    attn = Attention(16, 2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    params = (attn.qkv.weight, attn.out.weight, x)

    def grads(delay):
        for p in params:
            p.grad = None

        def task():
            attn(x).square().sum().backward()
            return attn.qkv.weight.grad is None and attn.out.weight.grad is None   # still queued?
        queued = schedule.run_interleaved([task], delay)[0]
        return queued, [p.grad.clone() for p in params]
    (queued_now, now), (queued_later, later) = grads(False), grads(True)
    assert not queued_now and queued_later
    assert all(torch.equal(a, b) for a, b in zip(now, later))
    # and they are what nn.Linear's autograd gives
    ref = [p.detach().clone().requires_grad_() for p in params]
    b, s, h = x.shape
    q, k, v = (ref[2] @ ref[0].T).view(b, s, 3, 2, h // 2).permute(2, 0, 3, 1, 4)
    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    (y.transpose(1, 2).reshape(b, s, h) @ ref[1].T).square().sum().backward()
    for r, got in zip(ref, now):
        torch.testing.assert_close(r.grad, got)


def test_timeline_records_runs_and_exchanges():
    with schedule.Timeline() as t:
        schedule.run_interleaved([lambda: schedule.wait_exchange("dispatch", lambda: None), lambda: None],
                                 lanes=["F1", "B0"])
    kinds = {(lane, kind, what) for lane, kind, what, start, end in t.spans if end >= start}
    assert ("F1", "exchange", "dispatch") in kinds and ("F1", "run", "") in kinds and ("B0", "run", "") in kinds


class _LandsLater:
    """A posted work that lands ``after`` seconds after it is first waited for."""

    def __init__(self, after: float):
        self.after = after

    def wait(self):
        time.sleep(self.after)
        return True


def test_landing_a_transfer_waits_for_the_exchanges_its_rest_consumes():
    """What a dispatch or combine hands the helper thread to land: the rest of the operation,
    whose rows are posted but not among its own works. land() must wait for those rows (so
    the filler runs until they land) and leave the rest to wait(), each work waited once."""
    waited, ran = [], []

    class Rows:
        def wait(self):
            waited.append("rows")
    rows = Transfer(result="landed rows", works=[Rows()])
    rest = later(lambda: ran.append("rest") or rows.wait(), lands=[rows])
    rest.land()
    assert waited == ["rows"] and ran == []
    assert rest.wait() == "landed rows" and waited == ["rows"] and ran == ["rest"]
    assert later(lambda: None).land() is None          # nothing in flight: returns at once


def test_timeline_splits_a_wait_into_filler_and_blocked_time():
    """A wait with delayed weight gradients queued computes them (filler) and then waits
    (blocked); with none queued, or outside any task, it is all blocked."""
    def task(queue_one: bool):
        if queue_one:
            schedule.defer(lambda: time.sleep(0.01))
        schedule.wait_exchange("dispatch", lambda: None, give_turn=False,
                               watch=Transfer(works=[_LandsLater(0.06)]))
    with schedule.Timeline() as t:
        schedule.run_interleaved([lambda: task(True), lambda: task(False)], delay_wgrad=True, lanes=["B0", "F2"])
        schedule.wait_exchange("combine", lambda: None, watch=Transfer(works=[_LandsLater(0.03)]))
    took = {(lane, kind, what): end - start for lane, kind, what, start, end in t.spans}
    assert took[("B0", "filler", "dispatch")] >= 0.01 and took[("B0", "blocked", "dispatch")] >= 0.03
    assert ("F2", "filler", "dispatch") not in took and took[("F2", "blocked", "dispatch")] >= 0.05
    assert took[("main", "blocked", "combine")] >= 0.025


def test_the_helper_threads_keep_nothing_of_a_call_that_returned():
    """The long-lived task and waiter threads drop each job when it is done: a model a task
    used (and the process groups it holds) must not outlive the call until process exit."""
    class Model:
        pass
    model = Model()
    used = weakref.ref(model)

    def task():
        schedule.defer(lambda: model)
        schedule.wait_exchange("dispatch", lambda: None, give_turn=False,
                               watch=Transfer(result=model, works=[_LandsLater(0.01)]))
    schedule.run_interleaved([task, lambda: model], delay_wgrad=True)
    del model
    assert used() is None


def test_tasks_run_under_the_callers_grad_and_inference_modes():
    seen = lambda: (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    with torch.no_grad():
        assert schedule.run_interleaved([seen, seen]) == [(False, False)] * 2
    with torch.inference_mode():
        assert schedule.run_interleaved([seen, seen]) == [(False, True)] * 2
    assert schedule.run_interleaved([seen, seen]) == [(True, False)] * 2
