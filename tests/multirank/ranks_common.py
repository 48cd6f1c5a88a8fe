"""What the rank-side modules (``<x>_ranks.py``, one per multi-rank test module) share.

``groups_for`` caches EPGroups per process: it lives here only, so every ``*_ranks`` module
shares one cache (a second cache would build new process groups). ``dispatch_rows`` is also
run on its own by test_backends_world4.py."""
from __future__ import annotations

import torch

import expertrail as er

from scenarios import expert_fn, make_inputs, row_experts


_GROUPS = {}


def groups_for(ep_size=None, domain_size=None) -> er.EPGroups:
    """EPGroups cached per (ep_size, domain_size): building groups is collective and slow."""
    key = (ep_size, domain_size)
    if key not in _GROUPS:
        _GROUPS[key] = er.EPGroups.from_default(ep_size=ep_size, domain_size=domain_size)
    return _GROUPS[key]


def _ep_slice(groups, seq):
    """The entries of ``seq`` (indexed by global rank) that belong to this rank's EP group."""
    first = groups.ep_ranks[0]
    return seq[first:first + groups.ep_size]


def _assert_close(actual, expected, rel, what):
    scale = expected.abs().max().item() if expected.numel() else 0.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= rel * max(scale, 1.0), f"{what}: max error {err:.3g} > {rel} x {max(scale, 1.0):.3g}"


def dispatch_rows(rank, world, backend, domain_size, scenario, dtype=torch.float32, seed=3, **options):
    """Dispatch and combine one scenario; return (tokens, tokens_per_expert, weights, y)."""
    groups = groups_for(None, domain_size)
    d = er.make_dispatcher(backend, groups, num_experts=16, **options)
    xs, idxs, ws = make_inputs(scenario, world, 8, 16, 4, seed, dtype)
    res = d.dispatch(xs[rank], idxs[rank], ws[rank])
    y = d.combine(expert_fn(res.tokens, row_experts(res, rank, 16 // world)), res)
    return res.tokens, res.tokens_per_expert, res.weights, y
