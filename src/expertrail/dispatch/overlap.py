"""Chunked dispatch -> experts -> combine, with communication overlapped with expert compute.

The tokens are split into ``num_chunks`` chunks. While the experts run on chunk i, the rows of
chunk i+1 are travelling to their experts and the outputs of chunk i-1 are travelling back
(asynchronous collectives). Each token's result is summed in the same fixed order as without
chunks, so with a row-wise expert computation the output is bitwise the same.
"""
from __future__ import annotations

from typing import Callable

import torch

ExpertFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def pipelined_moe(dispatcher, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  experts: ExpertFn, num_chunks: int = 1, weighted: bool = True) -> torch.Tensor:
    """y [N, H] = combine(experts(dispatch(x))), in ``num_chunks`` overlapped chunks.

    experts(tokens [M, H], tokens_per_expert int64 [E_local]) -> [M, H]. Every rank must use the
    same ``num_chunks`` (chunks may be empty). Differentiable like dispatch and combine.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks} must be >= 1")
    parts = list(zip(x.tensor_split(num_chunks), topk_idx.tensor_split(num_chunks),
                     topk_weights.tensor_split(num_chunks)))
    in_flight = dispatcher.dispatch(*parts[0], async_op=True)
    combines = []
    for i in range(num_chunks):
        res = in_flight.wait()
        if i + 1 < num_chunks:
            in_flight = dispatcher.dispatch(*parts[i + 1], async_op=True)   # travels while experts run
        out = experts(res.tokens, res.tokens_per_expert)
        combines.append(dispatcher.combine(out, res, weighted=weighted, async_op=True))
    return torch.cat([c.wait() for c in combines])
