"""The CPU copy reduction of combine: compiled kernel (``kernels/cpu_kernels.py``) vs the torch path.

    python benchmarks/cpu_reduce.py               # 1 thread, as each rank of ./run.sh bench
    python benchmarks/cpu_reduce.py --threads 2 --iters 100

Two shapes: top-2 (8192 rows x 1024 summed in pairs into 4096 tokens) and top-8 (8192 rows x
2048 into 1024 tokens), copies scattered as combine finds them (rows in expert order), bf16
and fp32 rows, with and without fp32 weights, output in the rows' dtype. Prints the median
time of each path (the two timed in turns) and its GB/s (bytes read and written once: rows in,
tokens out).
"""
import argparse
import statistics
import time

import torch

from expertrail.kernels import cpu_kernels, reference
from expertrail.kernels.reference import CopyPositions

NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def median_seconds(fns, iters, warmup=5):
    """Median seconds of each of ``fns``, timed in turns (order alternating) so that drift in
    the machine's load falls on all of them alike."""
    for fn in fns * warmup:
        fn()
    times = [[] for _ in fns]
    for it in range(iters):
        order = range(len(fns)) if it % 2 == 0 else reversed(range(len(fns)))
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.load() is None:
        raise SystemExit("the compiled kernel is not available (EXPERTRAIL_KERNELS=torch, or no compiler)")
    g = torch.Generator().manual_seed(0)
    src = torch.randn(8192, 1024, generator=g).to(torch.bfloat16)
    dst = torch.empty_like(src)
    (t_copy,) = median_seconds([lambda: dst.copy_(src)], args.iters)
    print(f"{args.threads} thread(s), median of {args.iters}; GB/s = (rows read + tokens written) / time; "
          f"a 16 MB copy_ runs at {2 * src.nbytes / t_copy / 1e9:.1f} GB/s")
    print(f"{'shape':<28}{'dtype':<7}{'weights':<9}{'compiled ms':>12}{'torch ms':>10}{'speedup':>9}"
          f"{'compiled GB/s':>15}{'torch GB/s':>12}")
    for tokens, topk, hidden in [(4096, 2, 1024), (1024, 8, 2048)]:
        pairs = torch.randperm(tokens * topk, generator=g)           # row r holds pair pairs[r]
        copies = CopyPositions.build(pairs // topk, pairs % topk, tokens, topk)
        copies.pos                                                   # plan once, as combine does
        for dtype in (torch.bfloat16, torch.float32):
            rows = torch.randn(tokens * topk, hidden, generator=g).to(dtype)
            for weights in (torch.rand(tokens * topk, generator=g), None):
                fast, slow = median_seconds([lambda: reference.reduce_copies(rows, copies, weights, dtype),
                                             lambda: reference.reduce_copies_torch(rows, copies, weights, dtype)],
                                            args.iters)
                torch.testing.assert_close(reference.reduce_copies(rows, copies, weights, dtype),
                                           reference.reduce_copies_torch(rows, copies, weights, dtype))
                gb = (rows.numel() + tokens * hidden) * rows.element_size() / 1e9
                shape = f"{tokens * topk}x{hidden} -> {tokens} (top-{topk})"
                print(f"{shape:<28}{NAMES[dtype]:<7}{'fp32' if weights is not None else 'none':<9}"
                      f"{fast * 1e3:>12.2f}{slow * 1e3:>10.2f}{slow / fast:>8.2f}x{gb / fast:>15.1f}{gb / slow:>12.1f}")


if __name__ == "__main__":
    main()
