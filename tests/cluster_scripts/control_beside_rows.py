"""Run by the cluster test of control exchanges on 2 nodes x 1 rank: rank 0 sends rank 1 MIB
MiB of rows on the EP group and, while they cross the shaped link, both ranks run a dispatch's
control exchange (counts and header, `Agreement`). Rank 1 writes <out dir>/control.json:
whether the control group is a group of its own over the EP ranks, the seconds until the
control exchange landed and until the rows landed."""
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import expertrail as er
from expertrail.dispatch.agreement import Agreement
from expertrail.dispatch.header import Header


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out, mib = Path(sys.argv[1]), int(sys.argv[2])
    groups = er.EPGroups.from_default()
    own = groups.control_group is not None and groups.control_group is not groups.ep_group \
        and dist.get_process_group_ranks(groups.control_group) == list(groups.ep_ranks)
    rows = torch.ones(mib << 18)                                  # float32: 4 bytes a value
    agreement = Agreement("alltoall", groups, 1)
    header = Header.of(torch.zeros(3, 8), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), 0).pack()
    agreement.finish_dispatch(agreement.start(agreement.no_counts(), header), None)     # connections made
    dist.barrier()
    start = time.perf_counter()
    channel = groups.ep_channel
    tag = channel.reserve_tags(1)
    works = channel.post([(rows, 1, tag)] if rank == 0 else [], [(rows, 0, tag)] if rank == 1 else [])
    agreement.finish_dispatch(agreement.start(agreement.no_counts(), header), None)
    control_s = time.perf_counter() - start
    for w in works:
        w.wait()
    rows_s = time.perf_counter() - start
    if rank == 1:
        (out / "control.json").write_text(json.dumps({"own_group": own, "control_s": control_s, "rows_s": rows_s}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
