"""Run by the cluster fault test on every rank: dispatch + combine in a loop on groups with a
timeout, while the test takes a node's link down. Each rank writes rank<r>.json beside READY:
the error it got and how long after the link went down (the test writes that moment to DOWN).
(Files, not stdout: torchrun's agents wait for each other at exit, across the dead link.)"""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import expertrail as er

TIMEOUT = float(sys.argv[1])
READY, DOWN = Path(sys.argv[2]), Path(sys.argv[3])


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = er.EPGroups.from_default(timeout=TIMEOUT)
    d = er.make_dispatcher("hierarchical", groups, num_experts=2 * world, hidden=64)
    g = torch.Generator().manual_seed(rank)
    x, idx = torch.randn(256, 64, generator=g), torch.randint(0, 2 * world, (256, 2), generator=g)
    error, step = None, 0
    deadline = time.time() + 120
    while error is None and time.time() < deadline:
        try:
            res = d.dispatch(x, idx, torch.rand(256, 2, generator=g))
            d.combine(res.tokens, res)
        except er.CollectiveError as err:
            error = err
        step += 1
        if rank == 0 and step == 3:
            READY.write_text("ready")
    down_at = float(DOWN.read_text()) if DOWN.exists() else float("nan")
    (READY.parent / f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "error": type(error).__name__ if error else None, "steps": step,
         "after_down_s": time.time() - down_at, "message": str(error)[:300]}))
    os._exit(0)     # the group's links are broken: no teardown handshake to wait for


if __name__ == "__main__":
    main()
