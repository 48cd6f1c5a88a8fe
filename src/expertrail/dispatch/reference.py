"""Single-process reference of dispatch and combine, written for clarity, not speed.

Given every rank's inputs, it computes what each EP rank must receive and what each rank must
get back. The tests and the benchmark compare every backend against it.
"""
from __future__ import annotations

import torch

from .routing import apply_capacity, expert_capacity


def reference_dispatch(xs, topk_idxs, topk_weights, num_experts: int, ep_size: int, expert_alignment: int = 1,
                       capacity_factor: float | None = None, drop_policy: str = "probs",
                       pad_to_capacity: bool = False):
    """Rows each EP rank receives.

    xs / topk_idxs / topk_weights: lists over EP ranks of [N_r, H], [N_r, K], [N_r, K].
    Returns a list over EP ranks of (tokens [M, H], tokens_per_expert [E_local], weights [M]).
    """
    local = num_experts // ep_size
    if capacity_factor is not None:
        topk_idxs = [apply_capacity(i, w, num_experts, capacity_factor, drop_policy)
                     for i, w in zip(topk_idxs, topk_weights)]
    out = []
    for rank in range(ep_size):
        rows, weights, counts = [], [], []
        for expert in range(rank * local, (rank + 1) * local):
            n_rows = 0
            for x, idx, w in zip(xs, topk_idxs, topk_weights):
                token, k = torch.nonzero(idx == expert, as_tuple=True)     # (token, k) order
                rows.append(x[token])
                weights.append(w[token, k])
                n_rows += token.numel()
            target = n_rows
            if pad_to_capacity:
                target = sum(expert_capacity(x.shape[0], idx.shape[1], num_experts, capacity_factor)
                             for x, idx in zip(xs, topk_idxs))
            target = -(-target // expert_alignment) * expert_alignment
            rows.append(xs[0].new_zeros(target - n_rows, xs[0].shape[1]))
            weights.append(topk_weights[0].new_zeros(target - n_rows))
            counts.append(target)
        out.append((torch.cat(rows), torch.tensor(counts), torch.cat(weights)))
    return out


def reference_moe(xs, topk_idxs, topk_weights, expert_fn, num_experts: int, capacity_factor=None,
                  drop_policy: str = "probs", weighted: bool = True):
    """y_r[n] = sum_k w[n,k] * expert_fn(x_r[n], idx[n,k]) for every rank r, summed in fp64.

    expert_fn(rows [M, H], expert ids [M]) -> [M, H]. Returns a list over ranks of [N_r, H].
    """
    if capacity_factor is not None:
        topk_idxs = [apply_capacity(i, w, num_experts, capacity_factor, drop_policy)
                     for i, w in zip(topk_idxs, topk_weights)]
    ys = []
    for x, idx, w in zip(xs, topk_idxs, topk_weights):
        y = torch.zeros(x.shape, dtype=torch.float64)
        for k in range(idx.shape[1]):
            valid = idx[:, k] >= 0
            out = expert_fn(x[valid], idx[valid, k]).double()
            weight = w[valid, k].double().unsqueeze(1) if weighted else 1.0
            y[valid] += weight * out
        ys.append(y.to(x.dtype))
    return ys
