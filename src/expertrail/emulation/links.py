"""Measure the two link classes of a run (inside a domain, between domains) with bare
collectives, and the speed of the engine's local passes, and describe the machine to the
planner.

`measure_links` times a bare all-to-all, sent as the engine sends rows (point-to-point
transfers all posted at once on gloo, ``all_to_all_single`` on NCCL; gloo's own
``all_to_all_single`` walks its peers in lockstep and reached 70-80% of a shaped link's rate
where the engine's transfers reached it), over every rank's domain group and, separately, over
every rank's rail group (all groups of a class at once, as in a dispatch), at several sizes:
the latency is the time of the smallest exchange, the bandwidth the slope between the
two largest (so neither is skewed by the other; a least-squares fit over all sizes let noise
at the large sizes push the latency below zero). Bandwidth is per rank, each
way: what one rank pushes through its share of the link while every rank does the same, which
is what the planner calls a GPU's NVLink and NIC bandwidth. `measure_local_passes` times the
row copies and weighted sums a dispatch and combine do around their exchanges, on every rank
at once (the ranks share the machine's cores, as they do in a dispatch). `measured_hardware`
turns both into a planner `Hardware` entry (``measured=True``: the figures are used as they
are).
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..comm.topology import EPGroups

SIZES_BYTES = (4 * 1024, 1024 * 1024, 8 * 1024 * 1024)      # per peer


def _slowest_median(run, repeats: int) -> float:
    """Slowest rank's median seconds of ``run()``, every rank running it at once."""
    samples = []
    for it in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        run()
        if it:                                   # the first one warms caches and allocations
            samples.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _time_exchange(channel, size: int, repeats: int, device) -> float:
    """Slowest rank's median seconds of one all-to-all of ``size`` bytes per peer, sent the way
    the engine sends rows (`Channel.all_to_all`: ``all_to_all_single`` on NCCL, point-to-point
    transfers all posted at once on gloo). The first exchange, which opens the connections, is
    not counted."""
    peers = channel.size
    rows = torch.empty(peers, size // 2, dtype=torch.bfloat16, device=device)
    return _slowest_median(lambda: channel.all_to_all(rows, [1] * peers, [1] * peers).wait(), repeats)


def measure_links(groups: EPGroups, sizes=SIZES_BYTES, repeats: int = 9) -> dict:
    """{"intra" | "inter": {"bytes_per_rank": [...], "seconds": [...], "GBps": b, "latency_us": l}}.

    Collective over the default group. A class with one member per group (domain of one rank,
    or one domain) is absent."""
    out = {}
    for name, channel, members in (("intra", groups.domain_channel, groups.domain_size),
                                   ("inter", groups.rail_channel, groups.num_domains)):
        if members < 2:
            continue
        sent = [size * (members - 1) for size in sizes]
        seconds = [_time_exchange(channel, size, repeats, groups.device) for size in sizes]
        slope = (seconds[-1] - seconds[-2]) / (sent[-1] - sent[-2])
        out[name] = {"bytes_per_rank": sent, "seconds": seconds,
                     "GBps": float(1 / slope / 1e9) if slope > 0 else float(sent[-1] / seconds[-1] / 1e9),
                     "latency_us": float(seconds[0] * 1e6)}
    return out


def measure_local_passes(device, dtype=torch.bfloat16, rows: int = 8192, hidden: int = 1024,
                         repeats: int = 9) -> dict:
    """{"copy_GBps", "reduce_GBps", "rows", "hidden", "dtype"}: how fast one rank runs the
    engine's two kinds of local pass while every rank does the same, in GB/s of rows read:
    a gather of ``rows`` rows in random order (`take_rows`: the copies before each exchange and
    the expansion after it) and a weighted sum of rows in pairs into ``rows / 2`` rows in fp32
    (`reduce_copies`: combine's sums). Collective over the default group."""
    from ..kernels import reduce_copies
    from ..kernels.torch_ops import CopyPositions, take_rows
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    order = torch.randperm(rows, generator=g).to(device)
    source = order // 2
    copies = CopyPositions.build(source, order % 2, rows // 2, 2)
    weights = torch.rand(rows, generator=g).to(dtype).to(device)
    size = rows * hidden * x.element_size()
    copy_s = _slowest_median(lambda: take_rows(x, order), repeats)
    reduce_s = _slowest_median(lambda: reduce_copies(x, copies, weights, dtype), repeats)
    return {"copy_GBps": size / copy_s / 1e9, "reduce_GBps": size / reduce_s / 1e9, "rows": rows,
            "hidden": hidden, "dtype": str(dtype).replace("torch.", "")}


def measured_hardware(links: dict, domain_size: int, name: str = "emulated", local: dict | None = None):
    """A planner `Hardware` for this machine: the measured link figures, the local pass figures
    (``local``, from `measure_local_passes`) when given, and for the parts the communication
    model does not read, figures that say so (compute and memory of one core)."""
    from ..plan.catalog import Hardware
    intra, inter = links.get("intra"), links.get("inter")
    return Hardware(name=name, domain_size=domain_size,
                    nvlink_GBps=round(float(intra["GBps"]), 4) if intra else 1.0,
                    nic_GBps=round(float(inter["GBps"]), 4) if inter else 1.0,
                    sms=1, hbm_GB=1.0, hbm_TBps=0.01, bf16_TFLOPS=0.1, fp8_TFLOPS=0, arch="cpu", measured=True,
                    nvlink_latency_us=round(float(intra["latency_us"]), 1) if intra else None,
                    nic_latency_us=round(float(inter["latency_us"]), 1) if inter else None,
                    local_copy_GBps=round(float(local["copy_GBps"]), 3) if local else None,
                    local_reduce_GBps=round(float(local["reduce_GBps"]), 3) if local else None)


def write_hardware(hw, path: str) -> None:
    """Write ``hw`` as a YAML entry `expertrail plan/simulate --hardware PATH` reads."""
    import dataclasses

    import yaml
    with open(path, "w") as f:
        f.write("# measured by `expertrail bench --nodes ... --emit-hardware`: link figures are per rank, each way\n")
        yaml.safe_dump(dataclasses.asdict(hw), f, sort_keys=False)
