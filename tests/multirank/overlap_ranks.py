"""Functions run on every rank by tests/multirank/test_overlap_world4.py: fn(rank, world, ...)."""
from __future__ import annotations

import torch

from ranks_common import groups_for


def overlap_matches_sequential(rank, world, backend, dtype, micro_batches=3):
    """The tiny LM trained one step on ``micro_batches`` micro-batches: sequentially, with
    1F1B overlap and delayed weight gradients, and with overlap alone. Returns, per variant,
    the losses and every parameter's gradient (to be compared bitwise)."""
    from expertrail.comm import schedule
    from expertrail.tools.configs import TrainConfig
    from expertrail.moe.layer import router_loss
    from expertrail.tools.train import build_ep_model, lm_loss, make_batch
    cfg = TrainConfig(hidden=16, ffn=16, experts=8, topk=2, layers=2, seq=8, batch=2)
    groups = groups_for(None, 2)
    batches = [make_batch(cfg, m, rank) for m in range(micro_batches)]
    out = {}
    for name, overlap, delay in (("sequential", False, False), ("overlap+delay", True, True),
                                 ("overlap", True, False)):
        model = build_ep_model(cfg, groups, backend).to(dtype)

        def forward(batch, model=model):
            return (lm_loss(model, batch) + router_loss(model)) / micro_batches
        losses = schedule.train_micro_batches(forward, batches, overlap=overlap, delay_wgrad=delay)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (torch.stack(losses), grads)
    return out


def dispatch_backward_posts_before_it_waits(rank, world, backend):
    """The order of a dispatch's backward on this rank: when the weights' gradients are posted
    and when the rows' gradients are waited for. Posted after that wait, the weights' exchange
    queued behind another micro-batch's rows with nothing to run (a 2 x 1 overlapped step lost
    about 150 ms to it)."""
    import expertrail as er
    from expertrail.dispatch import autograd
    from expertrail.dispatch.route import Route
    from scenarios import expert_fn, make_inputs, row_experts
    groups = groups_for(None, 2)
    d = er.make_dispatcher(backend, groups, num_experts=8)
    xs, idxs, ws = make_inputs("random", world, 16, 8, 2, 8)
    events, post, wait = [], Route.weights_transpose_async, autograd.wait_exchange

    def posting(route, grad_weights):
        events.append("weights posted")
        return post(route, grad_weights)

    def waiting(what, *args, **kwargs):
        events.append(what)
        return wait(what, *args, **kwargs)
    Route.weights_transpose_async, autograd.wait_exchange = posting, waiting
    try:
        x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
        res = d.dispatch(x, idxs[rank], w)
        y = d.combine(expert_fn(res.tokens, row_experts(res, groups.ep_rank, 8 // world)), res)
        y.sum().backward()
    finally:
        Route.weights_transpose_async, autograd.wait_exchange = post, wait
    return events, w.grad is not None
