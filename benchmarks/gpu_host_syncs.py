"""Where the normal mode makes the host wait for the GPU, and what the GPU loses to it.

    python benchmarks/gpu_host_syncs.py                # on a CUDA GPU (EP 1, NCCL)
    python benchmarks/gpu_host_syncs.py --device cpu --tokens 64 --experts 8 --topk 2 --hidden 128 --ffn 64 --iters 1

A dispatch sizes its exchanges from counts that only the GPU knows, so the host must read them
(a synchronisation) before it can launch what follows, and the GPU idles while it does. For each
backend, one `MoELayer` forward + backward on DeepSeek-V3's expert shapes (by default its share
at EP 8: 32 local experts, top-8, 4096 tokens): the host synchronisations it makes, each
attributed to its line in expertrail (`torch.cuda.set_sync_debug_mode`), the step's time, and
the GPU's busy time in a profile (the union of its kernels' intervals): the rest it waited for
the host. Every backend's output is first checked against the alltoall backend's on the same
weights and tokens. Without a GPU it runs the checks and times the step on the CPU.
"""
import argparse
import collections
import os
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import expertrail as er
from gpu_kernels import timer          # benchmarks/ is on the path when a script there runs

BACKENDS = ("alltoall", "dedup", "allgather", "hierarchical")


def sync_sites(step_forward, step_backward) -> collections.Counter:
    """(phase, expertrail line) -> host synchronisations, over one forward and its backward."""
    sites, phase = collections.Counter(), ["forward"]

    def record(message, category, filename, lineno, file=None, line=None):
        here = [f for f in traceback.extract_stack() if "/expertrail/" in f.filename]
        where = f"{here[-1].filename.split('/expertrail/')[-1]}:{here[-1].lineno}" if here else f"{filename}:{lineno}"
        sites[(phase[0], where)] += 1
    with warnings.catch_warnings():           # restores the filters and showwarning on leaving
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            y = step_forward()
            phase[0] = "backward"
            step_backward(y)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites


def gpu_busy(device, step, iters) -> float:
    """Seconds a step keeps the GPU busy: the union of its kernels' intervals in a profile."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy, reach = 0.0, float("-inf")
    for start, end in kernels:                          # microseconds
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy / 1e6 / iters


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", dev.index or 0)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29535")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    groups = er.EPGroups.from_default()
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; MoELayer forward + backward at EP 1, {args.tokens} tokens, "
          f"hidden {args.hidden}, {args.experts} experts of width {args.ffn}, top-{args.topk}, bf16")
    torch.manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
    reference, rows, all_sites, ok = None, [], {}, True
    for backend in BACKENDS:
        torch.manual_seed(1)                              # the same router and experts for every backend
        router = er.TopKRouter(er.RouterConfig(hidden=args.hidden, num_experts=args.experts, topk=args.topk))
        experts = er.GroupedExperts(args.experts, hidden=args.hidden, ffn_hidden=args.ffn)
        layer = er.MoELayer(router, er.make_dispatcher(backend, groups, num_experts=args.experts),
                            experts).to(dev, dtype)
        inputs = x.clone().requires_grad_(True)

        def forward():
            return layer(inputs)

        def backward(y):
            y.float().square().mean().backward()

        def step():
            backward(forward())
        out = forward().detach().float()
        if reference is None:
            reference = out
        same = torch.allclose(out, reference, rtol=2e-2, atol=2e-2 * float(reference.abs().max()))
        ok &= same
        seconds = timer(dev, step, args.iters)
        if dev.type == "cuda":
            sites = sync_sites(forward, backward)
            all_sites[backend] = sites
            counts = [sum(n for (phase, _), n in sites.items() if phase == p) for p in ("forward", "backward")]
            busy = gpu_busy(dev, step, args.iters)
        else:
            counts, busy = [float("nan")] * 2, float("nan")
        rows.append((backend, same, *counts, seconds, busy))
    print(f"{'backend':<14}{'check':>7}{'syncs fwd':>11}{'syncs bwd':>11}{'step ms':>9}{'GPU busy ms':>13}{'idle ms':>9}")
    for backend, same, fwd, bwd, seconds, busy in rows:
        print(f"{backend:<14}{'ok' if same else 'FAIL':>7}{fwd:>11.0f}{bwd:>11.0f}{seconds * 1e3:>9.2f}"
              f"{busy * 1e3:>13.2f}{(seconds - busy) * 1e3:>9.2f}")
    for backend, sites in all_sites.items():
        print(f"{backend}: where the host waits")
        for (phase, where), n in sorted(sites.items()):
            print(f"  {phase:<9}{n:>3}  {where}")
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("a backend's output differs from alltoall's")


if __name__ == "__main__":
    main()
