"""Run by the cluster tests on every rank through `expertrail cluster run`: what a user's own
torchrun script sees on the emulated cluster, printed as one JSON line per rank."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import expertrail as er


def timed_exchange(group, rows: torch.Tensor, repeats: int = 2) -> float:
    out = torch.empty_like(rows)
    dist.all_to_all_single(out, rows, group=group)          # warm the connections
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_to_all_single(out, rows, group=group)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(sys.argv) > 1 and sys.argv[1] == "fail" and rank == world - 1:
        sys.exit(3)
    groups = er.EPGroups.from_default()
    rows = torch.randn(4096, 256)                             # 4 MiB per rank
    d = er.make_dispatcher("hierarchical", groups, num_experts=4 * world, hidden=256)
    idx = torch.randint(0, 4 * world, (64, 2), generator=torch.Generator().manual_seed(rank))
    res = d.dispatch(rows[:64], idx, torch.rand(64, 2))
    y = d.combine(res.tokens, res)
    print(json.dumps({"rank": rank, "world": world, "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
                      "domain_size": groups.domain_size, "domain": groups.domain_index,
                      "node": os.environ.get("EXPERTRAIL_CLUSTER", ""), "y_finite": bool(torch.isfinite(y).all()),
                      "inter_bytes": res.stats.bytes["inter"],
                      "cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                      "intra_s": timed_exchange(groups.domain_group, rows),
                      "inter_s": timed_exchange(groups.rail_group, rows)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
