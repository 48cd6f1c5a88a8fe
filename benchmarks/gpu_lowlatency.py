"""The lowlatency mode's CUDA properties, checked and timed in one run (one process, EP 1).

    .venv/bin/python benchmarks/gpu_lowlatency.py                  # on a CUDA GPU (NCCL, world 1)
    .venv/bin/python benchmarks/gpu_lowlatency.py --device cpu     # the checks that need no GPU

Per size (tokens per rank): the lowlatency rows and output against `dedup`'s normal mode, bit
for bit; then, on CUDA, dispatch + combine under ``torch.cuda.set_sync_debug_mode("error")``
(any host synchronisation raises) with a token count that changes every call, and the same step
captured in a CUDA graph, replayed on new inputs copied into its static buffers, against the
eager step on those inputs (bit for bit). Then the median time of the normal mode's step
(`dedup`), of the eager step, of the graph replay and of the bare all_to_all_single pair of the
mode's blocks, each on inputs made beforehand. Each check prints ok or
FAIL with its error; the exit status is 1 if any failed.
"""
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist

import expertrail as er
from gpu_kernels import timer          # benchmarks/ is on the path when a script there runs


def inputs(n, args, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, args.hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(args.experts, generator=g)[:args.topk] for _ in range(n)]) if n else \
        torch.zeros(0, args.topk, dtype=torch.int64)
    return x.to(device), idx.to(device), torch.rand(n, args.topk, generator=g).to(device)


def step(ll, x, idx, w):
    res = ll.dispatch(x, idx, w)
    return ll.combine(res.tokens, res)


def check(name, fn, failures):
    try:
        fn()
        print(f"  {name}: ok")
    except Exception as err:                                   # report every check, then fail at the end
        failures.append(name)
        print(f"  {name}: FAIL ({type(err).__name__}: {err})")


def run_size(t, args, groups, device, failures) -> dict:
    ll = er.LowLatencyDispatcher(groups, num_experts=args.experts, max_tokens_per_rank=t,
                            hidden=args.hidden, dtype=torch.bfloat16)
    normal = er.make_dispatcher("dedup", groups, num_experts=args.experts)
    print(f"tokens {t}:")

    def same_as_dedup():
        for n in sorted({t, max(t // 2, 1), 0}):
            x, idx, w = inputs(n, args, device, seed=n)
            ref = normal.dispatch(x, idx, w)
            assert torch.equal(step(ll, x, idx, w), normal.combine(ref.tokens, ref)), f"N={n}"

    check("same bits as dedup", same_as_dedup, failures)
    timed = inputs(t, args, device, 1)                       # made once: the step alone is timed
    row = {"eager_us": 1e6 * timer(device, lambda: step(ll, *timed), args.iters),
           "normal_us": 1e6 * timer(device, lambda: step(normal, *timed), args.iters)}
    if device.type != "cuda":
        print("  no host sync, CUDA graph: skipped (no CUDA device)")
        return row

    def no_host_sync():
        batches = [inputs(n, args, device, seed=n) for n in (t, max(t // 2, 1), 1)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, idx, w in batches:
                step(ll, x, idx, w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    check("no host synchronisation (set_sync_debug_mode error)", no_host_sync, failures)
    static = inputs(t, args, device, seed=2)
    graph = torch.cuda.CUDAGraph()

    def captured():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(ll, *static)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = step(ll, *static)
        for seed in (3, 4):
            fresh = inputs(t, args, device, seed)
            for buffer, value in zip(static, fresh):
                buffer.copy_(value)
            graph.replay()
            assert torch.equal(out, step(ll, *fresh)), f"replay with inputs of seed {seed}"
        row["graph_us"] = 1e6 * timer(device, graph.replay, args.iters)

    check("captured in a CUDA graph, replayed on new inputs", captured, failures)
    send, recv = torch.zeros_like(ll._send), torch.zeros_like(ll._recv)
    back_send, back = torch.zeros_like(ll._back_send), torch.zeros_like(ll._back)
    row["bare_us"] = 1e6 * timer(device, lambda: (dist.all_to_all_single(recv, send),
                                                  dist.all_to_all_single(back, back_send)), args.iters)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="1,8,32,128", help="tokens per rank, comma-separated")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=32, help="local experts (EP 1)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    device = torch.device(args.device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    failures, rows = [], {}
    try:
        groups = er.EPGroups.from_default(domain_size=1)
        for t in (int(v) for v in args.tokens.split(",")):
            rows[t] = run_size(t, args, groups, device, failures)
    finally:
        dist.destroy_process_group()
    print(f"\nlowlatency on {device}, EP 1, hidden {args.hidden}, {args.experts} experts, top-{args.topk}, bf16 "
          f"(median of {args.iters})")
    print(f"{'tokens':>6}  {'normal us':>9}  {'eager us':>9}  {'graph us':>9}  {'bare us':>8}")
    for t, r in rows.items():
        cells = [f"{r[k]:.1f}" if k in r else "-" for k in ("normal_us", "eager_us", "graph_us", "bare_us")]
        print(f"{t:>6}  {cells[0]:>9}  {cells[1]:>9}  {cells[2]:>9}  {cells[3]:>8}")
    print("all checks ok" if not failures else f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
