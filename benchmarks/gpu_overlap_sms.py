"""What an exchange beside a GEMM costs the GEMM on a GPU: the SM side of the estimator's EP overlap.

    python benchmarks/gpu_overlap_sms.py                       # on an H100 / H200
    python benchmarks/gpu_overlap_sms.py --device cpu --rows 16 --local-experts 2 --iters 1   # its checks

`estimate.ep_overlap_exposed` costs an exchange that runs beside another micro-batch's compute
chunk (Megatron's EP overlap) in two parts: of the time the chunk covers, `EP_OVERLAP_HIDES` is
hidden, and while the two run together the compute has only the SMs the dispatcher's kernels
leave it (`OVERLAP_COMM_SMS` of the GPU's SMs), so the hidden time comes back as
``hidden x held / (SMs - held)``. The hidden share was measured on expertrail's own schedule on
CPU ranks; the SM term is an assumption. This script times the SM term on one GPU, on DeepSeek-V3's
shapes at the B200 recipes' rows per expert (EP 8: 1,024; EP 32: 4,096):

- each GEMM alone, forward as the estimator counts it (the experts' gate+up and down over the
  local experts, one batched GEMM each; an attention output projection);
- with cuBLAS told to leave ``k`` SMs free (``torch._C._set_sm_carveout_experimental``), against
  the ``SMs / (SMs - k)`` the estimator assumes;
- beside a stand-in exchange on a second stream, launched first as the schedule launches its
  dispatch: ``k`` blocks, one per SM (their shared memory keeps a GEMM tile off those SMs), that
  hold their SMs for a set wall time and do no arithmetic, as a kernel waiting on the network
  does; without and with the carveout. The pair's time is set against the GEMM alone plus the
  hold (nothing hidden), the longer of the two (all hidden), and the estimator's
  ``ep_overlap_exposed`` for the same pair.

What it cannot show: a real exchange also reads and writes HBM and L2 and waits on links that one
GPU does not have; the stand-in holds SMs and time only. Each GEMM is first checked against a
float64 reference on the same inputs, and each hold checked to last its set time.
"""
import argparse
import statistics

import torch

from expertrail.plan import estimate as est
from expertrail.plan.architecture import ARCHITECTURES
from gpu_kernels import timer          # benchmarks/ is on the path when a script there runs

# Each block holds its SM for ``ns`` nanoseconds of the GPU's global timer, sleeping between reads;
# its dynamic shared memory (set at launch) keeps a GEMM's tile off the SM while it waits.
HOLD_SOURCE = r"""
extern "C" __global__ void hold(unsigned long long ns) {
    extern __shared__ unsigned char pad[];
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(2000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
    if (threadIdx.x == 0) pad[blockIdx.x % 1024] = 1;
}
"""
HOLD_SHARED_BYTES = 120 * 1024          # over half an H100 / H200 SM's 228 KiB: one block per SM


def close(a, b):
    a, b = a.float(), b.float()
    return torch.allclose(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def gemms(dev, arch, rows, local, tokens, dtype):
    """{name: (check, run)}: one layer's forward GEMMs at ``rows`` rows per local expert and
    ``tokens`` tokens through attention."""
    h, f = arch.hidden, arch.moe_ffn
    x = torch.randn(local, rows, h, device=dev, dtype=dtype)
    w1 = torch.randn(local, h, 2 * f, device=dev, dtype=dtype) / h ** 0.5
    a = torch.randn(local, rows, f, device=dev, dtype=dtype)
    w2 = torch.randn(local, f, h, device=dev, dtype=dtype) / f ** 0.5
    o_in = arch.heads * (arch.v_head if arch.mla else arch.head_dim)
    attn = torch.randn(tokens, o_in, device=dev, dtype=dtype)
    wo = torch.randn(o_in, h, device=dev, dtype=dtype) / o_in ** 0.5
    out = {}
    for name, left, right, fn in ((f"experts fc1 x{rows}", x, w1, torch.bmm), (f"experts fc2 x{rows}", a, w2, torch.bmm),
                                  (f"attn out {tokens}", attn, wo, torch.mm)):
        ok = close(fn(left, right), fn(left.double(), right.double()))
        out[name] = (ok, (lambda fn=fn, left=left, right=right: fn(left, right)))
    return out


class Holder:
    """Launches the stand-in exchange: ``blocks`` blocks holding their SMs for ``seconds``."""

    def __init__(self):
        import cupy
        self.cupy = cupy
        self.kernel = cupy.RawKernel(HOLD_SOURCE, "hold", options=("-std=c++17",))
        self.kernel.max_dynamic_shared_size_bytes = HOLD_SHARED_BYTES

    def __call__(self, blocks: int, seconds: float, stream: torch.cuda.Stream):
        with self.cupy.cuda.ExternalStream(stream.cuda_stream):
            self.kernel((blocks,), (128,), (self.cupy.uint64(int(seconds * 1e9)),), shared_mem=HOLD_SHARED_BYTES)


def carved(k: int):
    """Tell cuBLASLt to leave ``k`` SMs free from here on (0: none)."""
    torch._C._set_sm_carveout_experimental(k if k else None)


def paired(dev, gemm, holder, blocks, seconds, iters):
    """Median seconds of the hold launched on a side stream and then the GEMM (if any) on the
    main one, to both ends."""
    side = torch.cuda.Stream(dev)
    main = torch.cuda.current_stream(dev)

    def step():
        side.wait_stream(main)
        holder(blocks, seconds, side)
        if gemm is not None:
            gemm()
        main.wait_stream(side)
    return timer(dev, step, iters)


def sm_kept(k: int, sms: int) -> float:
    """What the estimator's SM term leaves of the time overlap hides with ``k`` of ``sms`` SMs held:
    ``1 - share / (1 - share)`` (`estimate.ep_overlap_exposed`)."""
    share = k / sms
    return 1 - share / (1 - share)


def modelled_pair(gemm_s, hold_s, sms, k):
    """The estimator's time for a hold of ``hold_s`` beside a GEMM of ``gemm_s`` (one chunk pair)."""
    return gemm_s + est.pair_exposed(hold_s, gemm_s, k / sms)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--rows", default="1024,4096", help="rows per local expert")
    p.add_argument("--local-experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=4096, help="tokens through attention (a micro-batch's sequence)")
    p.add_argument("--sms", default="16,20,24", help="SMs the stand-in exchange holds (HybridEP 16, DeepEP 20 / 24)")
    p.add_argument("--hold", default="0.5,1.0", help="the hold's time as shares of the GEMM's time alone")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    dev = torch.device(args.device)
    arch = ARCHITECTURES[args.model]
    checks = []
    tables = {int(r): gemms(dev, arch, int(r), args.local_experts, args.tokens, torch.bfloat16)
              for r in args.rows.split(",")}
    for r, table in tables.items():
        for name, (ok, _) in table.items():
            print(f"check {name}: {'ok' if ok else 'FAIL'}")
            checks.append(ok)
    if dev.type != "cuda":
        print("no CUDA device: the timings need one")
        raise SystemExit(0 if all(checks) else "a check failed")

    # The carveout is read on cuBLASLt's path, the one Transformer Engine's GEMMs take.
    torch.backends.cuda.preferred_blas_library("cublaslt")
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    ks = [int(k) for k in args.sms.split(",")]
    print(f"\ndevice: {props.name}, {sms} SMs; torch {torch.__version__}; BF16, {args.model}, "
          f"{args.local_experts} local experts; medians of {args.iters}")

    print(f"\nGEMMs with cuBLAS leaving k SMs free: time over alone, against the estimator's SMs / (SMs - k)")
    print(f"{'GEMM':<22}{'alone us':>9}" + "".join(f"{f'k={k}':>9}{'model':>7}" for k in [*ks, sms // 2]))
    alone = {}
    for table in tables.values():
        for name, (_, gemm) in table.items():
            carved(0)
            alone[name] = timer(dev, gemm, args.iters)
            cells = []
            for k in [*ks, sms // 2]:
                carved(k)
                cells.append(f"{timer(dev, gemm, args.iters) / alone[name]:>8.2f}x{sms / (sms - k):>6.2f}x")
            carved(0)
            print(f"{name:<22}{alone[name] * 1e6:>9.0f}" + "".join(cells))

    try:
        holder = Holder()
    except Exception as e:        # noqa: BLE001 - the carveout table above stands without it
        print(f"\nthe stand-in exchange needs cupy to build its kernel: {e}")
        raise SystemExit(0 if all(checks) else "a check failed")

    print("\nthe stand-in exchange alone: k blocks holding their SMs for a set time (check: lasts it)")
    for k in ks:
        for want in (200e-6, 2e-3):
            got = paired(dev, None, holder, k, want, 5)
            ok = want <= got < want * 1.2 + 50e-6
            checks.append(ok)
            print(f"  k={k:<3} set {want * 1e6:>6.0f} us, measured {got * 1e6:>6.0f} us: {'ok' if ok else 'FAIL'}")

    print("\nthe GEMM beside the stand-in exchange (launched first on a side stream): the pair's time "
          "over the GEMM alone;\n'serial' hides nothing, 'ideal' all, 'model' is estimate.ep_overlap_exposed's pair, "
          "'hidden' the share of the hold the pair hid,\n'hides' the EP_OVERLAP_HIDES that gives that share "
          "with the estimator's SM term")
    print(f"{'GEMM':<22}{'k':>4}{'hold':>6}{'carveout':>9}{'pair':>7}{'serial':>8}{'ideal':>7}{'model':>7}{'hidden':>8}"
          f"{'hides':>7}")
    hidden_shares = []
    for table in tables.values():
        for name, (_, gemm) in table.items():
            g = alone[name]
            for k in ks:
                for share in (float(s) for s in args.hold.split(",")):
                    hold = share * g
                    for carve in (0, k):
                        carved(carve)
                        t = paired(dev, gemm, holder, k, hold, args.iters)
                        carved(0)
                        hidden = (g + hold - t) / min(g, hold)
                        hides = hidden / sm_kept(k, sms)
                        hidden_shares.append((carve, hidden, hides))
                        print(f"{name:<22}{k:>4}{share:>6.1f}{'k' if carve else 'none':>9}{t / g:>6.2f}x"
                              f"{(g + hold) / g:>7.2f}x{max(g, hold) / g:>6.2f}x{modelled_pair(g, hold, sms, k) / g:>6.2f}x"
                              f"{hidden:>8.2f}{hides:>7.2f}")
    for carve in (False, True):
        values = [(h, e) for c, h, e in hidden_shares if bool(c) == carve]
        hidden, hides = [v[0] for v in values], [v[1] for v in values]
        print(f"carveout {'k' if carve else 'none'}: hidden share median {statistics.median(hidden):.2f} "
              f"(range {min(hidden):.2f}..{max(hidden):.2f}); hides median {statistics.median(hides):.2f}, "
              f"mean {statistics.mean(hides):.2f}")
    k = ks[len(ks) // 2]
    print(f"the estimator: hides {est.EP_OVERLAP_HIDES} (measured on expertrail's own schedule, CPU ranks); "
          f"its hidden share at k={k}: {est.EP_OVERLAP_HIDES * sm_kept(k, sms):.2f}")
    if not all(checks):
        raise SystemExit("a check failed")
    print("all checks ok")


if __name__ == "__main__":
    main()
