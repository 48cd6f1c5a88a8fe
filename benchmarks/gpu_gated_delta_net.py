"""What Gated DeltaNet's linear attention costs on a GPU, against the estimator's count of it.

    python benchmarks/gpu_gated_delta_net.py              # on an H100 / H200, with fla-core installed
    python benchmarks/gpu_gated_delta_net.py --device cpu --seq 128 --iters 1   # its checks, on the CPU

Qwen3-Next's linear-attention layers run, between their input and output projections, a causal
depthwise convolution and the chunked gated delta rule: Megatron-LM calls Flash Linear
Attention's Triton kernels for both (``fla.modules.causal_conv1d.causal_conv1d``,
``fla.ops.gated_delta_rule.chunk_gated_delta_rule``; its own PyTorch chunked form when FLA is
missing). Megatron's FLOPs count gives the pair ``2 x (conv_kernel x channels + 4 x v_heads x
v_dim^2)`` per token, and `expertrail estimate` costs those FLOPs
(`Architecture.linear_core_flops`) at ``LINEAR_ATTENTION_EFFICIENCY x SYSTEM_SPEED`` of the BF16
peak. This script times both kernels on one GPU at a catalog model's per-GPU shapes (TP 1), forward
+ backward, and prints the share of the peak they reach on Megatron's count beside the estimator's.

Each timed implementation is first checked on the same inputs against a plain token-by-token
recurrence in FP32 (the definition of the rule), outputs and input gradients. On the CPU, or where
FLA is not installed, the timed implementation is `chunked_gated_delta_rule` below (the chunked form
in PyTorch, as Megatron's fallback computes it).
"""
import argparse
import importlib.metadata

import torch
from torch.nn import functional as F

from expertrail.plan import estimate as est
from expertrail.plan.architecture import ARCHITECTURES
from expertrail.plan.catalog import load_hardware
from gpu_host_syncs import gpu_busy     # benchmarks/ is on the path when a script there runs
from gpu_kernels import timer


def recurrent_gated_delta_rule(q, k, v, g, beta):
    """The rule token by token, FP32: per value head a state S [K, V] decays by exp(g_t), then
    S += k_t beta_t (v_t - S^T k_t)^T, and o_t = S^T q_t / sqrt(K).

    q, k [B, T, H, K]; v [B, T, H, V]; g (log decay, <= 0), beta [B, T, H]. Returns o [B, T, H, V]."""
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    b, t, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        error = v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], state)
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, i], beta[:, i, :, None] * error)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, i] / dk ** 0.5, state))
    return torch.stack(out, dim=1)


def chunked_gated_delta_rule(q, k, v, g, beta, chunk: int = 64):
    """The same rule a chunk of ``chunk`` tokens at a time (shapes as `recurrent_gated_delta_rule`).

    Inside a chunk with entry state S0 and G_t the running sum of g from the chunk's start, the
    rows written to the state, u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t), solve the unit lower
    triangular system (I + L) U = beta V - beta exp(G) K S0, L_tj = beta_t exp(G_t - G_j) k_t.k_j
    for j < t. Then O = exp(G) Q S0 + (M * Q K^T) U, M_tj = exp(G_t - G_j) for j <= t, and the next
    chunk enters with exp(G_C) S0 + (exp(G_C - G) K)^T U. Everything but the state's hand-over is
    computed for all chunks at once."""
    dtype = v.dtype
    b, t, h, dk = k.shape
    pad = -t % chunk
    q, k, v, g, beta = (F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta))
    n = (t + pad) // chunk

    def chunks(x):            # [B, T, H, ...] -> [B, H, N, C, ...]
        return x.reshape(b, n, chunk, h, *x.shape[3:]).movedim(3, 1)
    q, k, v, g, beta = chunks(q) / dk ** 0.5, chunks(k), chunks(v), chunks(g), chunks(beta)
    cum = g.cumsum(-1)                                              # G [B, H, N, C]
    gaps = cum[..., :, None] - cum[..., None, :]                    # G_t - G_j
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = gaps.masked_fill(~causal, float("-inf")).exp()          # M, zero above the diagonal
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = lower + torch.eye(chunk, device=q.device)
    u_values = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    u_state = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False,
                                            unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    entry = (cum[..., -1:] - cum).exp()[..., None] * k              # exp(G_C - G_j) k_j
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for i in range(n):
        rows = u_values[:, :, i] - u_state[:, :, i] @ state
        out.append((cum[:, :, i].exp()[..., None] * q[:, :, i]) @ state + scores[:, :, i] @ rows)
        state = cum[:, :, i, -1, None, None].exp() * state + entry[:, :, i].transpose(-1, -2) @ rows
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, -1).movedim(1, 2)
    return o[:, :t].to(dtype)


def causal_depthwise_conv(x, weight):
    """SiLU of a causal depthwise convolution: x [B, T, D], weight [D, W]."""
    width = weight.shape[1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (width - 1, 0)), weight[:, None, :], groups=x.shape[-1])
    return F.silu(y).transpose(1, 2)


def fla_kernels():
    """(gated delta rule, convolution) of Flash Linear Attention, or None where it is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        try:
            from fla.modules.causal_conv1d import causal_conv1d          # fla-core 0.5 on
        except ImportError:
            from fla.modules.convolution import causal_conv1d            # before, Megatron-LM's import
    except ImportError:
        return None
    return (lambda q, k, v, g, beta: chunk_gated_delta_rule(q, k, v, g, beta)[0],
            lambda x, w: causal_conv1d(x, w, activation="silu")[0])


def inputs(dev, batch, seq, heads, dk, dv, dtype):
    """Inputs as Megatron's layer hands them over: L2-normalised queries and keys (repeated to the
    value heads), a log decay g = -exp(A) softplus(a) and beta = sigmoid(b)."""
    q = F.normalize(torch.randn(batch, seq, heads, dk, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(batch, seq, heads, dk, device=dev), dim=-1).to(dtype)
    v = torch.randn(batch, seq, heads, dv, device=dev, dtype=dtype)
    g = (-F.softplus(torch.randn(batch, seq, heads, device=dev)) * 0.5).to(dtype)
    beta = torch.randn(batch, seq, heads, device=dev).sigmoid().to(dtype)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def close(a, b, tol):
    a, b = a.detach().float(), b.detach().float()
    return bool(torch.allclose(a, b, rtol=tol, atol=tol * float(b.abs().max())))


def check_rule(rule, dev, dtype, heads, dk, dv, seq):
    """The rule's output and its queries', keys' and values' gradients against the recurrence's."""
    xs = inputs(dev, 1, seq, heads, dk, dv, dtype)
    grad = torch.randn(1, seq, heads, dv, device=dev)
    got = rule(*xs)
    got.backward(grad.to(got.dtype))
    mine = [x.grad.clone() for x in xs[:3]]
    ref_inputs = [x.detach().float().requires_grad_() for x in xs]
    want = recurrent_gated_delta_rule(*ref_inputs)
    want.backward(grad)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    return close(got, want, tol) and all(close(a, r.grad, tol) for a, r in zip(mine, ref_inputs[:3]))


def check_conv(conv, dev, dtype, channels, width, seq):
    x = torch.randn(1, seq, channels, device=dev, dtype=dtype)
    w = torch.randn(channels, width, device=dev, dtype=dtype) / width
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    return close(conv(x, w), causal_depthwise_conv(x.float(), w.float()), tol)


def fwd_bwd(fn, xs):
    grad = None

    def step():
        nonlocal grad
        out = fn(*xs)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)
    return step


def row(label, part, mbs, ok, wall, busy, flops, peak, modelled) -> str:
    share = flops / busy / peak
    return (f"{label:<16}{part:>14}{mbs:>5}{'ok' if ok else 'FAIL':>7}{wall * 1e3:>9.3f}{busy * 1e3:>9.3f}"
            f"{flops / busy / 1e12:>8.1f}{share:>8.1%}{modelled:>9.1%}{modelled / share:>15.2f}x")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="qwen3-next-80b-a3b", help="a catalog model with linear attention")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batches", default="1,2", help="micro-batch sizes to time (sequences per call)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--torch-chunked", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the PyTorch chunked form where FLA is installed")
    args = p.parse_args()
    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    arch = ARCHITECTURES[args.model]
    if not arch.linear_layers:
        raise SystemExit(f"--model {args.model}: it has no linear-attention layers; name one that does, "
                         "e.g. qwen3-next-80b-a3b")
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    system = "h200" if "H200" in name else "h100"
    hw = load_hardware(system)
    speed = est.SYSTEM_SPEED.get(system, 1.0)
    peak = hw.bf16_TFLOPS * 1e12
    heads, dk, dv = arch.linear_v_heads, arch.linear_qk_dim, arch.linear_v_dim
    channels = arch.linear_widths()[3]                  # the convolution's: queries, keys and values
    fla = fla_kernels() if on_gpu else None
    implementations = [("fla", *fla)] if fla else []
    if args.torch_chunked or not fla:
        implementations.append(("torch chunked", chunked_gated_delta_rule, causal_depthwise_conv))

    version = importlib.metadata.version("fla-core") if fla else None
    print(f"device: {name}; torch {torch.__version__}; FLA {version or 'not installed'}; {dtype}; "
          f"{args.model} linear attention at TP 1: {heads} value heads of {dk}x{dv} (queries and keys repeated from {arch.linear_qk_heads}), "
          f"{channels} convolution channels of width {arch.linear_conv}, sequence {args.seq}")
    print(f"shares of the {system} catalog BF16 peak ({hw.bf16_TFLOPS:.0f} TFLOPS) on Megatron's FLOPs count, "
          "forward + backward as three forwards; 'estimate' is the share the estimator costs them at "
          f"(LINEAR_ATTENTION_EFFICIENCY {est.LINEAR_ATTENTION_EFFICIENCY} x system speed {speed})")
    check_seq = 192 if on_gpu else min(args.seq, 128)
    checks = []
    modelled = est.LINEAR_ATTENTION_EFFICIENCY * speed
    print("'ms' is a call's wall time (host launches included), 'busy ms' the GPU's (its kernels' union in a "
          "profile); the shares are on the busy time, as the estimator counts the host's launches apart")
    print("'both' is the convolution and the delta rule together, what LINEAR_ATTENTION_EFFICIENCY stands for")
    print(f"{'kernel':<16}{'part':>14}{'mbs':>5}{'check':>7}{'ms':>9}{'busy ms':>9}{'TFLOPS':>8}{'kernel':>8}"
          f"{'estimate':>9}{'estimate/kernel':>16}")
    for label, rule, conv in implementations:
        ok_rule = check_rule(rule, dev, dtype, heads, dk, dv, check_seq)
        ok_conv = check_conv(conv, dev, dtype, channels, arch.linear_conv, check_seq)
        checks += [ok_rule, ok_conv]
        for mbs in (int(m) for m in args.micro_batches.split(",")):
            tokens = mbs * args.seq
            rule_step = fwd_bwd(rule, inputs(dev, mbs, args.seq, heads, dk, dv, dtype))
            x = torch.randn(mbs, args.seq, channels, device=dev, dtype=dtype, requires_grad=True)
            w = (torch.randn(channels, arch.linear_conv, device=dev, dtype=dtype) / arch.linear_conv).requires_grad_()
            conv_step = fwd_bwd(conv, (x, w))
            parts = (("delta rule", ok_rule, rule_step, 2 * 4 * heads * dv ** 2),
                     ("convolution", ok_conv, conv_step, 2 * arch.linear_conv * channels))
            totals = [0.0, 0.0, 0.0]                                  # wall s, busy s, FLOPs
            for part, ok, step, flops_per_token in parts:
                wall = timer(dev, step, args.iters)
                busy = gpu_busy(dev, step, args.iters) if on_gpu else wall
                flops = 3 * tokens * flops_per_token
                totals = [a + b for a, b in zip(totals, (wall, busy, flops))]
                print(row(label, part, mbs, ok, wall, busy, flops, peak, modelled))
            print(row(label, "both", mbs, ok_rule and ok_conv, *totals, peak, modelled))
    if not all(checks):
        raise SystemExit("a check failed")


if __name__ == "__main__":
    main()
