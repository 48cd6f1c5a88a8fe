"""GPU kernels: check each against the torch reference, then time it next to the bandwidth limit.

    python benchmarks/gpu_kernels.py                 # on a CUDA GPU: 4096 x 7168 bf16, top-8, 8 local experts
    TRITON_INTERPRET=1 python benchmarks/gpu_kernels.py --device cpu --tokens 64 --hidden 256 --iters 2

For each of permute, unpermute-reduce and layout counts: a check against the torch reference on
fresh random data, then the median time (CUDA events, after warm-up) of the Triton kernel, of
the torch reference path, and of a device-to-device copy of the same bytes (the bandwidth
limit), with GB/s and ratios. Then the grouped GEMM against one dense GEMM of the same FLOPs,
and MoELayer forward+backward at EP 1 against transformers' Qwen3-MoE block on the same shapes.
"""
import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("EXPERTRAIL_KERNELS", "auto")

from expertrail.kernels import torch_ops as reference  # noqa: E402


def timer(device, fn, iters, warmup=3):
    """Median seconds of fn() over iters (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def expert_major_destinations(topk_idx, experts, align):
    """dest [N, K]: row of each (token, k) in the expert-major output padded to ``align``; padding rows."""
    n, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + align - 1) // align * align
    start = torch.cumsum(padded, 0) - padded
    within = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    dest = torch.empty_like(flat)
    dest[order] = start[flat[order]] + within
    filled = torch.zeros(int(padded.sum()), dtype=torch.bool, device=flat.device)
    filled[dest] = True
    return dest.view(n, k), int(padded.sum()), torch.nonzero(~filled).squeeze(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--align", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    from expertrail.kernels import triton_kernels
    dev = torch.device(args.device)
    torch.manual_seed(0)
    n, h, k, e = args.tokens, args.hidden, args.topk, args.experts
    x = torch.randn(n, h, device=dev).to(torch.bfloat16)
    topk_idx = torch.rand(n, e, device=dev).topk(k, dim=1).indices
    weights = torch.rand(n, k, device=dev)
    dest, rows, padding = expert_major_destinations(topk_idx, e, args.align)
    pos = dest                                         # token n's k-th copy sits at row dest[n, k]
    row_weights = torch.zeros(rows, device=dev)
    row_weights[dest.reshape(-1)] = weights.reshape(-1)

    # Checks on fresh random data.
    checks = {}
    a = triton_kernels.permute_rows(x, dest, rows, padding)
    b = reference.permute_rows(x, dest, rows, padding)
    checks["permute"] = torch.equal(a, b)
    expert_out = torch.randn(rows, h, device=dev).to(torch.bfloat16)
    a = triton_kernels.reduce_copies_dense(expert_out, pos, row_weights, torch.bfloat16)
    b = reference.reduce_copies_dense(expert_out, pos, row_weights, torch.bfloat16)
    checks["unpermute-reduce"] = bool(((a.float() - b.float()).abs() <= 1e-2 * (b.float().abs() + 1)).all())
    a = triton_kernels.layout_counts(topk_idx, e * 8, 8, 8)
    b = reference.layout_counts(topk_idx, e * 8, 8, 8)
    checks["layout counts"] = all(torch.equal(u, v) for u, v in zip(a, b))

    # Timings.
    elt = x.element_size()
    permute_bytes = (n * h + rows * h) * elt
    reduce_bytes = (rows * h + n * h) * elt
    copy_src = torch.empty(max(permute_bytes, reduce_bytes) // 2, dtype=torch.uint8, device=dev)
    copy_dst = torch.empty_like(copy_src)
    t_copy = timer(dev, lambda: copy_dst.copy_(copy_src), args.iters)
    copy_bw = 2 * copy_src.numel() / t_copy
    table = []
    for name, fn_t, fn_r, nbytes in [
        ("permute", lambda: triton_kernels.permute_rows(x, dest, rows, padding),
         lambda: reference.permute_rows(x, dest, rows, padding), permute_bytes),
        ("unpermute-reduce", lambda: triton_kernels.reduce_copies_dense(expert_out, pos, row_weights, torch.bfloat16),
         lambda: reference.reduce_copies_dense(expert_out, pos, row_weights, torch.bfloat16), reduce_bytes),
        ("layout counts", lambda: triton_kernels.layout_counts(topk_idx, e * 8, 8, 8),
         lambda: reference.layout_counts(topk_idx, e * 8, 8, 8), n * k * 8),
    ]:
        t_t, t_r = timer(dev, fn_t, args.iters), timer(dev, fn_r, args.iters)
        table.append((name, checks[name], t_t, t_r, nbytes / t_t / 1e9, nbytes / t_t / copy_bw, t_r / t_t))

    # Grouped GEMM vs one dense GEMM of the same FLOPs.
    from expertrail.moe.experts import grouped_linear, grouped_mm_supported
    counts = torch.bincount(topk_idx.reshape(-1), minlength=e)
    tokens = torch.randn(int(counts.sum()), h, device=dev).to(torch.bfloat16)
    w = torch.randn(e, args.ffn, h, device=dev).to(torch.bfloat16) / h ** 0.5
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    cl = counts.tolist()
    t_grouped = timer(dev, lambda: grouped_linear(tokens, w, offsets, cl), args.iters)
    t_dense = timer(dev, lambda: tokens @ w[0].T, args.iters)

    print(f"device: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}; {n} tokens x {h}, "
          f"bf16, top-{k}, {e} local experts, alignment {args.align}; copy bandwidth {copy_bw / 1e9:.0f} GB/s")
    print(f"{'kernel':<18}{'check':>7}{'triton us':>11}{'torch us':>10}{'GB/s':>8}{'of copy':>9}{'vs torch':>10}")
    for name, ok, t_t, t_r, gbs, frac, speed in table:
        print(f"{name:<18}{'ok' if ok else 'FAIL':>7}{t_t * 1e6:>11.1f}{t_r * 1e6:>10.1f}{gbs:>8.0f}{frac:>9.0%}{speed:>9.2f}x")
    print(f"grouped GEMM ({'torch._grouped_mm' if grouped_mm_supported(dev, torch.bfloat16) else 'per-expert loop'}): "
          f"{t_grouped * 1e6:.1f} us vs one dense GEMM of the same FLOPs {t_dense * 1e6:.1f} us "
          f"({t_dense / t_grouped:.2f}x of dense speed)")
    moe_vs_transformers(dev, args)
    if not all(checks.values()):
        raise SystemExit("a kernel check failed")


def moe_vs_transformers(dev, args):
    """MoELayer (EP 1) forward+backward against transformers' Qwen3-MoE block, same shapes."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError:
        print("transformers not installed: MoE layer comparison skipped")
        return
    import torch.distributed as dist

    import expertrail as er
    from expertrail.hf import ExpertParallelMoE
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    cfg = Qwen3MoeConfig(hidden_size=args.hidden, moe_intermediate_size=args.ffn, num_experts=args.experts,
                         num_experts_per_tok=args.topk, norm_topk_prob=True)
    cfg._experts_implementation = "grouped_mm" if dev.type == "cuda" else None
    block = Qwen3MoeSparseMoeBlock(cfg).to(dev, torch.bfloat16)
    with torch.no_grad():
        for prm in block.parameters():
            prm.normal_(0, 0.02)
    ours = ExpertParallelMoE(block, er.EPGroups.from_default(), "alltoall")
    x = torch.randn(1, args.tokens, args.hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)

    def step(module):
        y = module(x)
        y.float().square().mean().backward()
    t_hf, t_ours = timer(dev, lambda: step(block), max(3, args.iters // 5)), timer(dev, lambda: step(ours), max(3, args.iters // 5))
    print(f"MoE forward+backward: transformers Qwen3-MoE block {t_hf * 1e3:.2f} ms, expertrail MoE (EP 1) "
          f"{t_ours * 1e3:.2f} ms ({t_hf / t_ours:.2f}x)")


if __name__ == "__main__":
    main()
