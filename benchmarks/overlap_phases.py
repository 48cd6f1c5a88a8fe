"""Where an overlapped training step spends its time, phase by phase, and the most its order can gain.

Runs `expertrail train`'s model (`train.build_ep_model`) on the ranks of a torchrun launch whose
ranks all share one host (the emulated cluster: ``expertrail cluster run``), alternating a step
without and a step with overlap (learning rate 0, so every step does the same work). For the
overlapped step it splits rank 0's timeline (`schedule.Timeline`) into the phases of
`train_micro_batches`' order, each the stretch between one task's end and the next (F0+F1,
F1+B0, B0+F2, ..., the last backward alone), and the tail (dense gradients summed over ranks,
optimizer). A thread samples the host's idle CPU time (``/proc/stat``) and the node link's byte
counters every 5 ms, so each phase gets its wall time, the CPU-seconds the host's cores sat idle
in it, and how long the link was busy.

Printed, median over steps (the first left out):

- per phase: wall ms, idle CPU-s, the CPU floor (busy CPU-s over the cores), on the
  emulated cluster the link's busy time (the bytes of the busier direction of this node's
  link, sampled from its interface counters, at line rate), and rank 0's waits for exchanges:
  blocked (nothing to run) and filled with delayed weight gradients (the Timeline's
  ``blocked`` and ``filler`` spans), beside the time rank 0's own cores sat idle (``r0
  idle``; on the emulated cluster a node's ranks have cores of their own): idle time that a
  phase's waits do not account for is a wait the Timeline does not see;
- the step without and with overlap, their ratio, and the step's CPU floor; on the emulated
  cluster also the link's busy time over the step: no schedule beats the larger of the two;
- the bound of the phase order: the tail and every task alone as measured plus every pair at
  its CPU floor. Even a perfect interleaving of the pairs cannot beat it, because nothing runs
  beside a task alone or the tail.

    expertrail cluster run --nodes 2 --ranks-per-node 2 --inter-link 1gbit -- \\
        benchmarks/overlap_phases.py --hidden 512 --ffn 128 --topk 8 --experts 16 --seq 64 --batch 8
"""
from __future__ import annotations

import argparse
import bisect
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

from expertrail.tools.configs import TrainConfig
from expertrail.comm.schedule import Timeline
from expertrail.comm.topology import EPGroups
from expertrail.emulation.cluster import LinkSpec
from expertrail.tools.train import _train_step, build_ep_model


class HostSampler:
    """Samples every ``period`` s on a thread: the host's idle CPU-seconds so far (``/proc/stat``)
    and, on the emulated cluster, the bytes this node's link has sent and received
    (``/sys/class/net/$GLOO_SOCKET_IFNAME/statistics``; the link's rate from
    ``EXPERTRAIL_INTER_LINK``)."""

    def __init__(self, period: float = 0.005):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")
        self._own = {f"cpu{c}" for c in os.sched_getaffinity(0)}      # this rank's cores
        link, ifname = os.environ.get("EXPERTRAIL_INTER_LINK"), os.environ.get("GLOO_SOCKET_IFNAME")
        self.rate = LinkSpec.parse(link).rate if link and ifname else None       # bits/s
        self._counters = [f"/sys/class/net/{ifname}/statistics/{d}_bytes" for d in ("tx", "rx")] if self.rate else []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> tuple:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
        idle = [(int(row[4]) + int(row[5])) / self._tick for row in rows]       # idle + iowait
        own = sum(t for row, t in zip(rows, idle) if row[0] in self._own)
        counters = []
        for path in self._counters:
            with open(path) as f:
                counters.append(int(f.read()))
        return (idle[0], own, *counters)           # the host's, this rank's cores', tx, rx

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), *self._read()))
            time.sleep(self.period)

    def __enter__(self) -> "HostSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter(), *self._read()))
        self.times = [s[0] for s in self.samples]                # the samples' times, for bisect

    def _between(self, column: int, start: float, end: float) -> float:
        """How much sample column ``column`` grew between two perf_counter times, linearly
        interpolated (after the sampling has ended)."""
        times = self.times

        def at(t):
            i = min(bisect.bisect_left(times, t), len(times) - 1)       # first sample at or after t
            if i == 0 or times[i] == times[i - 1]:
                return self.samples[i][column]
            w = (t - times[i - 1]) / (times[i] - times[i - 1])
            return self.samples[i - 1][column] + w * (self.samples[i][column] - self.samples[i - 1][column])
        return max(0.0, at(end) - at(start))

    def idle_between(self, start: float, end: float) -> float:
        """Idle CPU-seconds of the host between two perf_counter times."""
        return self._between(1, start, end)

    def own_idle_between(self, start: float, end: float) -> float:
        """Idle CPU-seconds of this rank's cores between two perf_counter times."""
        return self._between(2, start, end)

    def link_between(self, start: float, end: float) -> float | None:
        """Seconds the node's link spent sending its busier direction's bytes at line rate between
        two perf_counter times (None off the emulated cluster)."""
        if not self.rate:
            return None
        return max(self._between(3, start, end), self._between(4, start, end)) * 8 / self.rate


def phases(spans: list, step_end: float) -> list:
    """``spans`` (a Timeline's, times relative to the step's start) of one overlapped step ->
    [(name, start, end)]: the stretches between one task's end (the next one's start) and the
    next, each named by the tasks that ran in it ("B0+F2"), then the tail."""
    runs = {}
    for lane, kind, _, a, b in spans:
        if kind == "run":
            lo, hi = runs.get(lane, (a, b))
            runs[lane] = (min(lo, a), max(hi, b))
    start = min(lo for lo, _ in runs.values())
    out = []
    for end in sorted({hi for _, hi in runs.values()}):
        lanes = sorted((lane for lane, (lo, hi) in runs.items() if lo < end and hi > start), key=lambda x: runs[x][0])
        if end > start:
            out.append(("+".join(lanes), start, end))
        start = end
    out.append(("tail", start, step_end))
    return out


def time_in(spans: list, kind: str, start: float, end: float) -> float:
    """Seconds of this rank's ``kind`` spans (``"blocked"``, ``"filler"``) inside [start, end]."""
    return sum(max(0.0, min(b, end) - max(a, start)) for _, k, _, a, b in spans if k == kind)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 512), ("ffn", 128), ("topk", 8), ("experts", 16), ("seq", 64), ("batch", 8),
                          ("micro-batches", 4), ("layers", 2), ("steps", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--backend", default="alltoall")
    args = p.parse_args()
    if args.micro_batches < 2 or args.steps < 2:
        p.error("--micro-batches and --steps must be at least 2 (overlap needs two micro-batches; the first step "
                "is left out)")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cores = os.cpu_count()           # /proc/stat's idle time is the whole host's
    cfg = TrainConfig(hidden=args.hidden, ffn=args.ffn, topk=args.topk, experts=args.experts, seq=args.seq,
                      batch=args.batch, micro_batches=args.micro_batches, layers=args.layers, lr=0.0)
    model = build_ep_model(cfg, EPGroups.from_default(), args.backend)     # a node's ranks form a domain
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = {False: [], True: []}
    for _ in range(args.steps):
        for overlap in (False, True):
            dist.barrier()
            with HostSampler() as host, Timeline() as timeline:
                start = time.perf_counter()
                _train_step(model, opt, cfg, 0, rank, world, overlap)
                end = time.perf_counter()
            rows = []
            if overlap:
                spans = [(lane, kind, what, a - start, b - start) for lane, kind, what, a, b in timeline.spans]
                rows = [(name, b - a, host.idle_between(start + a, start + b), host.link_between(start + a, start + b),
                         time_in(spans, "blocked", a, b), time_in(spans, "filler", a, b),
                         host.own_idle_between(start + a, start + b))
                        for name, a, b in phases(spans, end - start)]
            steps[overlap].append((end - start, host.idle_between(start, end), rows, host.link_between(start, end)))
    if rank == 0:
        report(steps, cores, args)
    dist.destroy_process_group()


def report(steps: dict, cores: int, args) -> None:
    def med(values):
        return statistics.median(values)
    seq, ovl = (steps[o][1:] for o in (False, True))
    seq_ms, ovl_ms = med(s[0] for s in seq) * 1e3, med(s[0] for s in ovl) * 1e3
    floor_ms = med(s[0] - s[1] / cores for s in ovl) * 1e3
    print(f"overlap phases: {args.backend}, hidden {args.hidden}, ffn {args.ffn}, top-{args.topk} of {args.experts}, "
          f"{args.micro_batches} micro-batches of {args.batch} x {args.seq}; {cores} cores on this host; "
          f"medians of {len(ovl)} steps")
    linked = ovl[0][3] is not None
    print(f"{'phase':>9} {'wall ms':>8} {'idle CPU-s':>11} {'CPU floor ms':>13}" + (f" {'link ms':>8}" if linked else "")
          + f" {'blocked ms':>11} {'filler ms':>10} {'r0 idle ms':>11}")
    bound = 0.0
    for j, name in enumerate(r[0] for r in ovl[0][2]):
        wall = med(s[2][j][1] for s in ovl) * 1e3
        idle = med(s[2][j][2] for s in ovl)
        floor = wall - idle / cores * 1e3
        bound += floor if "+" in name else wall
        link = f" {med(s[2][j][3] for s in ovl) * 1e3:8.0f}" if linked else ""
        blocked, filler, own = (med(s[2][j][k] for s in ovl) * 1e3 for k in (4, 5, 6))
        print(f"{name:>9} {wall:8.0f} {idle:11.2f} {floor:13.0f}{link} {blocked:11.0f} {filler:10.0f} {own:11.0f}")
    print(f"without overlap {seq_ms:.0f} ms, with {ovl_ms:.0f} ms: {seq_ms / ovl_ms:.2f}x")
    print(f"CPU floor of the overlapped step {floor_ms:.0f} ms: no schedule beats {seq_ms / floor_ms:.2f}x here")
    if linked:
        link_ms = med(s[3] for s in ovl) * 1e3
        both = max(floor_ms, link_ms)
        print(f"the node's link is busy {link_ms:.0f} ms of the step at line rate (its busier direction): "
              f"with the CPU floor, no schedule beats {both:.0f} ms, {seq_ms / both:.2f}x here")
    print(f"bound of the phase order (the tail as measured, every pair at its CPU floor) "
          f"{bound:.0f} ms: this order cannot beat {seq_ms / bound:.2f}x here")


if __name__ == "__main__":
    main()
