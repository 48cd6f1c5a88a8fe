"""What the estimator assumes of a GPU's GEMMs and attention, against what the kernels reach.

    python benchmarks/gpu_gemm_efficiency.py                  # on an H100 / H200
    python benchmarks/gpu_gemm_efficiency.py --device cpu --tokens 64 --rows 16 --seq 64 --iters 1 \
        --local-experts 2 --models qwen3-30b-a3b,deepseek-v3   # its checks, on the CPU

`expertrail estimate` costs a layer's GEMMs at ``GEMM_EFFICIENCY x width_factor x SYSTEM_SPEED``
of the dense peak (routed experts also ``rows / (rows + GROUPED_HALF_ROWS)``) and core attention
at ``ATTENTION_EFFICIENCY x attention_speed x SYSTEM_SPEED``: constants fitted on whole published
runs (docs/cost-model.md). This script times the kernels alone on each catalog model's shapes,
forward + backward as a training step runs them (for a GEMM: forward, input gradient, weight
gradient), and prints the share of the catalog peak each reaches beside the share the estimator
gives it. Their ratio shows how much of a fitted efficiency is the kernel and how much is the
rest of a step (launches, synchronisations, memory-bound work the model does not count), and
whether the fitted curves (width, rows per expert, FP8 over BF16, head width) have the kernels'
shape. Each timed operation is first checked against a plain reference on the same inputs.
"""
import argparse

import torch
from torch.nn import functional as F

from expertrail.moe.experts import grouped_linear, grouped_weight_grad
from expertrail.plan import estimate as est
from expertrail.plan.architecture import ARCHITECTURES
from expertrail.plan.catalog import load_hardware
from gpu_kernels import timer          # benchmarks/ is on the path when a script there runs

MODELS = ("deepseek-v3", "mixtral-8x22b", "qwen3-235b-a22b", "gpt-oss-120b", "qwen3-30b-a3b")


def close(a, b, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    a, b = a.detach().float(), b.detach().float()
    return torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max()))


def projection_shapes(arch):
    """(in, out) of the attention projections of one layer, as `Architecture.attention_params` counts them."""
    h = arch.hidden
    if arch.mla:
        qk = arch.qk_nope + arch.qk_rope
        return [(h, arch.q_lora), (arch.q_lora, arch.heads * qk), (h, arch.kv_lora + arch.qk_rope),
                (arch.kv_lora, arch.heads * (arch.qk_nope + arch.v_head)), (arch.heads * arch.v_head, h)]
    return [(h, (arch.heads + 2 * arch.kv_heads) * arch.head_dim), (arch.heads * arch.head_dim, h)]


def dense_step(xs, ws, gs):
    """Forward, input gradient and weight gradient of each x @ w.T."""
    for x, w, g in zip(xs, ws, gs):
        x @ w.T
        g @ w
        g.T @ x


def projections(dev, arch, tokens, dtype, iters):
    """(check, seconds, FLOPs) of one layer's attention projections, forward + backward."""
    shapes = projection_shapes(arch)
    xs = [torch.randn(tokens, i, device=dev, dtype=dtype) for i, _ in shapes]
    ws = [torch.randn(o, i, device=dev, dtype=dtype) / i ** 0.5 for i, o in shapes]
    gs = [torch.randn(tokens, o, device=dev, dtype=dtype) for _, o in shapes]
    ok = close(xs[0] @ ws[0].T, (xs[0].double() @ ws[0].double().T).to(dtype), dtype)
    seconds = timer(dev, lambda: dense_step(xs, ws, gs), iters)
    return ok, seconds, sum(3 * 2 * tokens * i * o for i, o in shapes)


def experts(dev, arch, rows, local, dtype, iters):
    """(check, seconds, FLOPs) of ``local`` SwiGLU experts with ``rows`` rows each, forward + backward
    (the activation left out: the estimator counts it among the memory-bound passes)."""
    h, f = arch.hidden, arch.moe_ffn
    counts = [rows] * local
    offsets = torch.cumsum(torch.tensor(counts, device=dev), 0).to(torch.int32)
    x = torch.randn(rows * local, h, device=dev, dtype=dtype)
    w1 = torch.randn(local, 2 * f, h, device=dev, dtype=dtype) / h ** 0.5
    w2 = torch.randn(local, h, f, device=dev, dtype=dtype) / f ** 0.5
    a = torch.randn(rows * local, f, device=dev, dtype=dtype)
    g1 = torch.randn(rows * local, 2 * f, device=dev, dtype=dtype)
    g2 = torch.randn(rows * local, h, device=dev, dtype=dtype)

    def step():
        grouped_linear(x, w1, offsets, counts)
        grouped_linear(a, w2, offsets, counts)
        grouped_linear(g2, w2.transpose(1, 2), offsets, counts)
        grouped_linear(g1, w1.transpose(1, 2), offsets, counts)
        grouped_weight_grad(g2, a, offsets, counts)
        grouped_weight_grad(g1, x, offsets, counts)
    reference = torch.cat([rows_e @ w.T for rows_e, w in zip(x.split(counts), w1)])
    wgrad = torch.stack([g.T @ r for g, r in zip(g1.split(counts), x.split(counts))])
    ok = close(grouped_linear(x, w1, offsets, counts), reference, dtype) \
        and close(grouped_weight_grad(g1, x, offsets, counts), wgrad, dtype)
    seconds = timer(dev, step, iters)
    return ok, seconds, 3 * 2 * rows * local * 3 * h * f


def fp8_over_bf16(dev, arch, tokens, iters):
    """(check, BF16 seconds, FP8 GEMM seconds, FP8 seconds with the input's quantization) of the
    experts' first GEMM shape as one dense GEMM, FP8 with per-tensor scales (current scaling).
    The check compares the FP8 GEMM with the same quantized operands multiplied in FP32."""
    h, n = arch.hidden, 2 * arch.moe_ffn
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, h, device=dev, dtype=torch.bfloat16) / h ** 0.5
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max

    def quantize(t):
        scale = t.abs().max().float() / top
        return (t / scale).to(fp8), scale
    w8, w_scale = quantize(w)
    x8, x_scale = quantize(x)

    def gemm(a8, a_scale):
        return torch._scaled_mm(a8, w8.T, scale_a=a_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    t_bf16 = timer(dev, lambda: x @ w.T, iters)
    if dev.type != "cuda":               # no FP8 GEMM on the CPU: the quantization's check only
        # e4m3 keeps 3 mantissa bits (relative rounding error 2^-4), subnormals below 2^-6
        ok = torch.allclose(x8.float() * x_scale, x.float(), rtol=2 ** -4, atol=float(x_scale) * 2 ** -9)
        return ok, t_bf16, float("nan"), float("nan")
    reference = (x8.float() * x_scale) @ (w8.float() * w_scale).T
    ok = close(gemm(x8, x_scale), reference, torch.bfloat16)
    t_gemm = timer(dev, lambda: gemm(x8, x_scale), iters)
    t_quantized = timer(dev, lambda: gemm(*quantize(x)), iters)
    return ok, t_bf16, t_gemm, t_quantized


def attention(dev, arch, seq, iters):
    """(check, seconds, FLOPs as the estimator counts them) of causal attention over one sequence,
    forward + backward, BF16."""
    qk = arch.qk_nope + arch.qk_rope if arch.mla else arch.head_dim
    v_dim = arch.v_head if arch.mla else arch.head_dim
    heads = arch.heads
    q, k = (torch.randn(1, heads, seq, qk, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(1, heads, seq, v_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, heads, seq, v_dim, device=dev, dtype=torch.bfloat16)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
    small = slice(0, 2)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=dev).tril()
    scores = (q[:, small].float() @ k[:, small].float().transpose(-1, -2)) / qk ** 0.5
    reference = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, small].float()
    ok = close(F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, small].detach(), reference, torch.bfloat16)
    seconds = timer(dev, step, iters)
    return ok, seconds, 3 * seq * arch.attention_flops(seq)[1]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the projections' and FP8 GEMMs")
    p.add_argument("--rows", default="64,256,1024,4096", help="rows per expert of the grouped GEMMs")
    p.add_argument("--local-experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--models", default=",".join(MODELS), help="catalog models whose shapes to time")
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    system = "h200" if "H200" in name else "h100"
    hw = load_hardware(system)
    speed = est._speed(hw)                  # the estimator's: H200 takes H100's fitted speed (catalog.gpu_twin)
    peak = hw.bf16_TFLOPS * 1e12
    print(f"device: {name}; torch {torch.__version__}; shares of the {system} catalog peak "
          f"({hw.bf16_TFLOPS:.0f} BF16 / {hw.fp8_TFLOPS:.0f} FP8 TFLOPS); the estimator's system speed {speed}")
    print("kernel shares are forward + backward; 'estimate' is the share the estimator costs them at; "
          "'kernel/estimate' above 1 is time the fit puts outside the kernel")
    checks = []
    models = args.models.split(",")

    print(f"\nGEMMs (BF16): attention projections at {args.tokens} tokens; routed experts "
          f"({args.local_experts} local, gate+up and down) at rows per expert")
    print(f"{'model':<18}{'hidden':>7}{'GEMMs':>16}{'check':>7}{'TFLOPS':>8}{'kernel':>8}{'estimate':>9}{'kernel/estimate':>16}")
    rows_list = [int(r) for r in args.rows.split(",")]
    for model in models:
        arch = ARCHITECTURES[model]
        width = est.width_factor(arch)
        base = est.GEMM_EFFICIENCY["bf16"] * width * speed
        runs = [("projections", base, projections(dev, arch, args.tokens, dtype, args.iters))]
        for rows in rows_list:
            modelled = base * rows / (rows + est.GROUPED_HALF_ROWS)
            runs.append((f"experts x{rows}", modelled, experts(dev, arch, rows, args.local_experts, dtype, args.iters)))
        for label, modelled, (ok, seconds, flops) in runs:
            checks.append(ok)
            share = flops / seconds / peak
            print(f"{model:<18}{arch.hidden:>7}{label:>16}{'ok' if ok else 'FAIL':>7}{flops / seconds / 1e12:>8.0f}"
                  f"{share:>8.0%}{modelled:>9.0%}{share / modelled:>15.2f}x")

    print(f"\nFP8 over BF16: the experts' gate+up shape as one GEMM, {args.tokens} tokens, forward, "
          "per-tensor scales with the input quantized in the timing")
    modelled = est.GEMM_EFFICIENCY["fp8"] * hw.fp8_TFLOPS / (est.GEMM_EFFICIENCY["bf16"] * hw.bf16_TFLOPS)
    print(f"{'model':<18}{'shape':>12}{'check':>7}{'BF16 us':>9}{'FP8 us':>8}{'+quant us':>10}"
          f"{'GEMM':>7}{'+quant':>8}{'estimate':>9}")
    for model in models:
        arch = ARCHITECTURES[model]
        ok, t_bf16, t_gemm, t_quantized = fp8_over_bf16(dev, arch, args.tokens, args.iters)
        checks.append(ok)
        shape = f"{arch.hidden}x{2 * arch.moe_ffn}"
        print(f"{model:<18}{shape:>12}{'ok' if ok else 'FAIL':>7}{t_bf16 * 1e6:>9.0f}{t_gemm * 1e6:>8.0f}"
              f"{t_quantized * 1e6:>10.0f}{t_bf16 / t_gemm:>6.2f}x{t_bf16 / t_quantized:>7.2f}x{modelled:>8.2f}x")

    print(f"\nCore attention (BF16, causal, sequence {args.seq}, F.scaled_dot_product_attention), forward + backward "
          "counted as three forwards, as the estimator counts it")
    print(f"{'model':<18}{'heads':>6}{'qk/v':>8}{'check':>7}{'TFLOPS':>8}{'kernel':>8}{'estimate':>9}{'kernel/estimate':>16}")
    for model in models:
        arch = ARCHITECTURES[model]
        ok, seconds, flops = attention(dev, arch, args.seq, args.iters)
        checks.append(ok)
        modelled = est.ATTENTION_EFFICIENCY * est.attention_speed(arch) * speed
        share = flops / seconds / peak
        dims = f"{arch.qk_nope + arch.qk_rope}/{arch.v_head}" if arch.mla else f"{arch.head_dim}/{arch.head_dim}"
        print(f"{model:<18}{arch.heads:>6}{dims:>8}{'ok' if ok else 'FAIL':>7}{flops / seconds / 1e12:>8.0f}"
              f"{share:>8.0%}{modelled:>9.0%}{share / modelled:>15.2f}x")

    if not all(checks):
        raise SystemExit("a check failed")


if __name__ == "__main__":
    main()
