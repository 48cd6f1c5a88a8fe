"""Compiled CPU fast path of the fixed-order copy reduction (``reduce_copies``).

A small C++ kernel built with ``torch.utils.cpp_extension.load_inline`` the first time a
process asks for it and cached under the torch extensions directory, so a machine compiles it
once (``run.sh`` does it at set-up). ``load()`` returns the module or None, never raises: no
compiler or ninja, a failed build, or ``EXPERTRAIL_KERNELS=torch`` all mean "use the torch
reference". It computes exactly the reference's definition, with no ``embedding_bag`` detour:
each product ``w * x`` is rounded to the accumulation dtype (fp32, fp64 for fp64 rows) and
added in slot order (``-ffp-contract=off``, no fast-math: no fused multiply-add, no
reassociation), and the sum is rounded to the output dtype once, round-to-nearest-even like
torch's ``.to()`` (fp64 sums reach bf16/fp16 through fp32, as torch converts them).

Speed: the copies are scattered rows (combine receives them in expert order), so the kernel
prefetches the copies a few positions ahead, sums up to four copies per pass over a block of
columns, and does the fp32 lane work with AVX2 where the CPU has it (``benchmarks/cpu_reduce.py``;
numbers in docs/benchmarks.md). One output row is one thread's, in any thread count.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys

import torch

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Inlined without question: a conversion left as a call keeps the loop around it scalar.
#if defined(__GNUC__)
#define ER_INLINE inline __attribute__((always_inline))
#else
#define ER_INLINE inline
#endif

ER_INLINE float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
ER_INLINE uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
// Branch-free select, so that the conversions below vectorize (a ?: becomes a branch).
ER_INLINE uint32_t sel(bool c, uint32_t a, uint32_t b) { uint32_t m = 0u - uint32_t(c); return (a & m) | (b & ~m); }

ER_INLINE float bf16_to_f32(uint16_t h) { return u2f(uint32_t(h) << 16); }
ER_INLINE uint16_t f32_to_bf16(float f) {          // c10::BFloat16's round-to-nearest-even
  uint32_t u = f2u(f);
  return f != f ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
ER_INLINE float f16_to_f32(uint16_t h) {            // exact, subnormals included
  uint32_t o = uint32_t(h & 0x7fffu) << 13, e = o & (0x7c00u << 13);
  o += (127u - 15u) << 23;
  uint32_t sub = f2u(u2f(o + (1u << 23)) - u2f(113u << 23));
  return u2f(sel(e == (0x7c00u << 13), o + ((128u - 16u) << 23), sel(e == 0, sub, o)) | (uint32_t(h & 0x8000u) << 16));
}
ER_INLINE uint16_t f32_to_f16(float f) {            // IEEE round-to-nearest-even, overflow to inf
  const uint32_t magic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  uint32_t u = f2u(f), sign = u & 0x80000000u;
  u ^= sign;
  uint32_t sub = f2u(u2f(u) + u2f(magic)) - magic;   // the fp32 add rounds the subnormal
  uint32_t nrm = (u + ((15u - 127u) << 23) + 0xfffu + ((u >> 13) & 1u)) >> 13;
  uint32_t big = sel(u > (255u << 23), 0x7e00u, 0x7c00u);
  return uint16_t(sel(u >= ((127u + 16u) << 23), big, sel(u < (113u << 23), sub, nrm)) | (sign >> 16));
}

// Storage formats: raw element type, accumulation type, widening load, rounding store.
struct F32 { using raw = float; using acc = float;
  ER_INLINE static float load(raw v) { return v; }
  template <class A> ER_INLINE static raw store(A a) { return float(a); } };
struct F64 { using raw = double; using acc = double;
  ER_INLINE static double load(raw v) { return v; }
  template <class A> ER_INLINE static raw store(A a) { return double(a); } };
struct BF16 { using raw = uint16_t; using acc = float;
  ER_INLINE static float load(raw v) { return bf16_to_f32(v); }
  template <class A> ER_INLINE static raw store(A a) { return f32_to_bf16(float(a)); } };
struct F16 { using raw = uint16_t; using acc = float;
  ER_INLINE static float load(raw v) { return f16_to_f32(v); }
  template <class A> ER_INLINE static raw store(A a) { return f32_to_f16(float(a)); } };

// 8 fp32 lanes of each format, for the fp32-accumulated passes. GCC's own vectorization of the
// scalar loop widens bf16 with extra shuffles and was 25% slower on a pair of bf16 rows.
template <class F> struct Vec8 { static constexpr bool ok = false; };
#if defined(__AVX2__)
template <> struct Vec8<F32> { static constexpr bool ok = true;
  ER_INLINE static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  ER_INLINE static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); } };
template <> struct Vec8<BF16> { static constexpr bool ok = true;
  ER_INLINE static __m256 load(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  ER_INLINE static void store(uint16_t* p, __m256 v) {      // f32_to_bf16 on 8 lanes
    const __m256i u = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)),
                                             _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  } };
#if defined(__F16C__)
template <> struct Vec8<F16> { static constexpr bool ok = true;   // F16C: exact widening, IEEE RNE narrowing
  ER_INLINE static __m256 load(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  ER_INLINE static void store(uint16_t* p, __m256 v) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } };
#endif
#endif

// Columns [c, c + len) of one pass over G <= 4 copies x[k] with weights w[k]:
// s = (((a + p0) + p1) + ...) with p = w * x rounded to Acc (no a term on the first pass),
// kept in a (the partial sums of these columns) for the next pass or, on the last, rounded
// into o.
template <class In, class Out, bool W, bool Add, bool Store, int G>
inline void pass_columns(const typename In::raw* const* x, const typename In::acc* w,
                         typename In::acc* __restrict a, typename Out::raw* __restrict o, int64_t c, int64_t len) {
  using Acc = typename In::acc;
  using Raw = typename In::raw;
  const Raw* __restrict x0 = x[0] + c; const Raw* __restrict x1 = x[G > 1 ? 1 : 0] + c;
  const Raw* __restrict x2 = x[G > 2 ? 2 : 0] + c; const Raw* __restrict x3 = x[G > 3 ? 3 : 0] + c;
  const Acc w0 = w[0], w1 = w[G > 1 ? 1 : 0], w2 = w[G > 2 ? 2 : 0], w3 = w[G > 3 ? 3 : 0];
  typename Out::raw* __restrict y = o + c;
  int64_t i = 0;
  if constexpr (std::is_same<Acc, float>::value && Vec8<In>::ok && Vec8<Out>::ok) {   // the same ops, 8 lanes
#if defined(__AVX2__)
    const __m256 v0 = _mm256_set1_ps(w0), v1 = _mm256_set1_ps(w1), v2 = _mm256_set1_ps(w2), v3 = _mm256_set1_ps(w3);
#define VPRODUCT(k) (W ? _mm256_mul_ps(v##k, Vec8<In>::load(x##k + i)) : Vec8<In>::load(x##k + i))
    for (; i < len - len % 8; i += 8) {
      __m256 s = VPRODUCT(0);
      if (Add) s = _mm256_add_ps(_mm256_loadu_ps(a + i), s);
      if (G > 1) s = _mm256_add_ps(s, VPRODUCT(1));
      if (G > 2) s = _mm256_add_ps(s, VPRODUCT(2));
      if (G > 3) s = _mm256_add_ps(s, VPRODUCT(3));
      if (Store) Vec8<Out>::store(y + i, s); else _mm256_storeu_ps(a + i, s);
    }
#undef VPRODUCT
#endif
  }
#define PRODUCT(k) (W ? Acc(w##k * Acc(In::load(x##k[i]))) : Acc(In::load(x##k[i])))
  for (; i < len; ++i) {
    Acc s = PRODUCT(0);
    if (Add) s = Acc(a[i] + s);
    if (G > 1) s = Acc(s + PRODUCT(1));
    if (G > 2) s = Acc(s + PRODUCT(2));
    if (G > 3) s = Acc(s + PRODUCT(3));
    if (Store) y[i] = Out::store(s); else a[i] = s;
  }
#undef PRODUCT
}

// One pass over a block of columns, two cache lines of each copy at a time, prefetching the
// same lines of the copies kAhead positions on: the copies are scattered rows, which the
// hardware prefetcher only finds after a few misses each (this halved the time of a pair).
template <class In, class Out, bool W, bool Add, bool Store, int G>
void pass_block(const typename In::raw* const* x, const typename In::acc* w, typename In::acc* acc,
                typename Out::raw* o, int64_t c0, int64_t width, const char* const* ahead) {
  constexpr int64_t kStep = 128 / sizeof(typename In::raw);
  int64_t c = c0;
  for (; c + kStep <= c0 + width; c += kStep) {
    for (int k = 0; k < G; ++k) {
      __builtin_prefetch(ahead[k] + c * sizeof(typename In::raw));
      __builtin_prefetch(ahead[k] + c * sizeof(typename In::raw) + 64);
    }
    pass_columns<In, Out, W, Add, Store, G>(x, w, acc + (c - c0), o, c, kStep);
  }
  pass_columns<In, Out, W, Add, Store, G>(x, w, acc + (c - c0), o, c, c0 + width - c);
}

template <class In, class Out, bool W, bool Add, bool Store>
void pass_group(int g, const typename In::raw* const* x, const typename In::acc* w, typename In::acc* acc,
                typename Out::raw* o, int64_t c0, int64_t width, const char* const* ahead) {
  switch (g) {
    case 1: return pass_block<In, Out, W, Add, Store, 1>(x, w, acc, o, c0, width, ahead);
    case 2: return pass_block<In, Out, W, Add, Store, 2>(x, w, acc, o, c0, width, ahead);
    case 3: return pass_block<In, Out, W, Add, Store, 3>(x, w, acc, o, c0, width, ahead);
    default: return pass_block<In, Out, W, Add, Store, 4>(x, w, acc, o, c0, width, ahead);
  }
}

// Output rows [begin, end). Copies are taken four at a time: one read of each, the running sum
// in registers, and between groups in an L1 buffer (more streams at once conflict in L1 when
// rows sit at multiples of 4 KB, as power-of-two hidden sizes put them).
template <class In, class Out, bool W>
void reduce_rows(const typename In::raw* rows, int64_t stride, const int64_t* pos, const int64_t* off,
                 const typename In::acc* w, typename Out::raw* out, int64_t C, int64_t begin, int64_t end) {
  using Acc = typename In::acc;
  constexpr int64_t kBlock = 8192 / sizeof(Acc), kGroup = 4, kAhead = 8;
  alignas(64) Acc acc[kBlock];
  const int64_t last = off[end];
  for (int64_t r = begin; r < end; ++r) {
    typename Out::raw* o = out + r * C;
    const int64_t first = off[r], n = off[r + 1] - first;
    if (n == 0) {
      for (int64_t c = 0; c < C; ++c) o[c] = Out::store(Acc(0));
      continue;
    }
    for (int64_t c0 = 0; c0 < C; c0 += kBlock) {
      const int64_t width = std::min(kBlock, C - c0);
      for (int64_t j = 0; j < n; j += kGroup) {
        const int g = int(std::min(kGroup, n - j));
        const typename In::raw* x[kGroup];
        Acc ws[kGroup];
        const char* ahead[kGroup];
        for (int k = 0; k < g; ++k) {
          const int64_t q = first + j + k, p = pos[q];
          x[k] = rows + p * stride;
          ws[k] = W ? Acc(w[p]) : Acc(1);
          ahead[k] = reinterpret_cast<const char*>(q + kAhead < last ? rows + pos[q + kAhead] * stride : x[k]);
        }
        const bool add = j > 0, store = j + kGroup >= n;
        if (!add && store) pass_group<In, Out, W, false, true>(g, x, ws, acc, o, c0, width, ahead);
        else if (!add) pass_group<In, Out, W, false, false>(g, x, ws, acc, o, c0, width, ahead);
        else if (store) pass_group<In, Out, W, true, true>(g, x, ws, acc, o, c0, width, ahead);
        else pass_group<In, Out, W, true, false>(g, x, ws, acc, o, c0, width, ahead);
      }
    }
  }
}

template <class In, class Out>
void launch(const at::Tensor& rows, const at::Tensor& pos, const at::Tensor& off,
            const c10::optional<at::Tensor>& w, at::Tensor& out) {
  const int64_t num_src = out.size(0), C = out.size(1), stride = rows.stride(0);
  auto* r = reinterpret_cast<const typename In::raw*>(rows.data_ptr());
  auto* o = reinterpret_cast<typename Out::raw*>(out.data_ptr());
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* f = off.data_ptr<int64_t>();
  const auto* wp = w ? reinterpret_cast<const typename In::acc*>(w->data_ptr()) : nullptr;
  // Each output row is summed by one thread, so the result does not depend on the threads.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(C, 1));
  at::parallel_for(0, num_src, grain, [&](int64_t b, int64_t e) {
    if (wp) reduce_rows<In, Out, true>(r, stride, p, f, wp, o, C, b, e);
    else reduce_rows<In, Out, false>(r, stride, p, f, nullptr, o, C, b, e);
  });
}

template <class In>
void pick_out(const at::Tensor& rows, const at::Tensor& pos, const at::Tensor& off,
              const c10::optional<at::Tensor>& w, at::Tensor& out) {
  // Only the rows' dtype and fp32 (cpu_kernels.py converts to others: the same single rounding)
  if (out.scalar_type() == at::kFloat) return launch<In, F32>(rows, pos, off, w, out);
  TORCH_CHECK(out.scalar_type() == rows.scalar_type(), "reduce_copies: out dtype must be fp32 or the rows' dtype");
  launch<In, In>(rows, pos, off, w, out);
}

}  // namespace

// out [num_src, C] = sum over j in [off[i], off[i+1]) of w[pos[j]] * rows[pos[j]], see cpu_kernels.py.
void reduce_copies(at::Tensor rows, at::Tensor pos, at::Tensor off, c10::optional<at::Tensor> w, at::Tensor out) {
  TORCH_CHECK(rows.dim() == 2 && out.dim() == 2 && rows.size(1) == out.size(1), "reduce_copies: rows [R, C], out [N, C]");
  TORCH_CHECK(rows.stride(1) == 1 || rows.size(1) <= 1, "reduce_copies: rows need contiguous columns");
  TORCH_CHECK(out.is_contiguous() && pos.is_contiguous() && off.is_contiguous(), "reduce_copies: contiguous pos, offsets, out");
  TORCH_CHECK(pos.scalar_type() == at::kLong && off.scalar_type() == at::kLong, "reduce_copies: int64 pos and offsets");
  const int64_t num_src = out.size(0), R = rows.size(0), copies = pos.numel();
  TORCH_CHECK(off.numel() == num_src + 1, "reduce_copies: offsets [num_src + 1]");
  const at::ScalarType acc = rows.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (w) TORCH_CHECK(w->scalar_type() == acc && w->is_contiguous() && w->numel() == R,
                     "reduce_copies: weights [R] in the accumulation dtype");
  // Bad positions would read out of bounds: check them once here (O(copies), not O(copies * C)).
  const int64_t* f = off.data_ptr<int64_t>();
  TORCH_CHECK(num_src == 0 || (f[0] >= 0 && f[num_src] <= copies), "reduce_copies: offsets out of range");
  for (int64_t i = 0; i < num_src; ++i) TORCH_CHECK(f[i] <= f[i + 1], "reduce_copies: offsets must not decrease");
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t j = 0; j < copies; ++j) TORCH_CHECK(p[j] >= 0 && p[j] < R, "reduce_copies: position out of range");
  if (num_src == 0 || out.size(1) == 0) return;
  switch (rows.scalar_type()) {
    case at::kFloat: return pick_out<F32>(rows, pos, off, w, out);
    case at::kDouble: return pick_out<F64>(rows, pos, off, w, out);
    case at::kBFloat16: return pick_out<BF16>(rows, pos, off, w, out);
    case at::kHalf: return pick_out<F16>(rows, pos, off, w, out);
    default: TORCH_CHECK(false, "reduce_copies: rows dtype ", rows.scalar_type(), " not supported");
  }
}
"""

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# Exact arithmetic (no FMA contraction, no fast-math); -march=native is why the module name
# carries a digest of the CPU (a shared home directory must not hand one machine's build to
# another); -fopenmp lets at::parallel_for use torch's OpenMP threads (same libgomp soname).
_CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native"]
_module = None                 # the loaded module, False after a failed load (cached per process)


def load():
    """The compiled module (``reduce_copies(rows, pos, offsets, weights, out)``), or None when
    it cannot be had: ``EXPERTRAIL_KERNELS=torch``, no compiler or ninja, a failed build. Never
    raises; builds at most once per process, once per machine with the on-disk cache."""
    global _module
    if os.environ.get("EXPERTRAIL_KERNELS", "auto") == "torch":
        return None
    if _module is None:
        try:
            _module = _build()
        except Exception:      # no toolchain, a compile error, an unwritable cache: torch path
            _module = False
    return _module or None


def _build():
    from torch.utils import cpp_extension
    cflags = _CFLAGS + (["-fopenmp"] if torch._C.has_openmp and sys.platform.startswith("linux") else [])
    ldflags = ["-fopenmp"] if "-fopenmp" in cflags else []
    key = "\n".join([_SOURCE, " ".join(cflags), torch.__version__, sys.version, _cpu_identity()])
    name = "expertrail_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(cpp_extension.get_default_build_root(),
                                                                  f"py{sys.version_info.major}{sys.version_info.minor}_cpu")
    build_dir = os.path.join(root, name)
    os.makedirs(build_dir, exist_ok=True)
    failed = os.path.join(build_dir, "FAILED")
    with _FileLock(os.path.join(root, name + ".lock")), _ninja_on_path():
        import shutil              # a missing tool is checked each time (cheap): it may be installed later
        if not cpp_extension.is_ninja_available() or shutil.which(os.environ.get("CXX", "c++")) is None:
            raise RuntimeError("no ninja or no C++ compiler")
        # A failed build is not retried by every process (each rank of each run would pay
        # for it); deleting the build directory retries it.
        if os.path.exists(failed):
            raise RuntimeError(f"an earlier build failed, see {failed}")
        # Under our lock no other process builds this module, so a torch lock file left here is
        # a killed build's, and would make load_inline wait for ever.
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        try:
            return cpp_extension.load_inline(name, cpp_sources=[_SOURCE], functions=["reduce_copies"],
                                             extra_cflags=cflags, extra_ldflags=ldflags,
                                             build_directory=build_dir, verbose=False)
        except Exception as e:
            with open(failed, "w") as f:
                f.write(f"{type(e).__name__}: {e}\n")
            raise


def _cpu_identity() -> str:
    """The instruction sets -march=native compiles for (Linux: /proc/cpuinfo's model and flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


class _FileLock:
    """An exclusive ``flock`` while the module is built or loaded: the ranks of a job import
    it at once, and one must build while the others wait. The kernel frees it if a process
    dies (unlike torch's own lock file)."""

    def __init__(self, path: str):
        self.path, self.fd = path, None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:    # pragma: no cover - not POSIX: torch's own lock file only
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)  # closing releases the lock


class _ninja_on_path:
    """load_inline runs ``ninja`` from PATH; the pip package installs it next to the venv's
    python, which is not on PATH when that python is run by its path."""

    def __enter__(self):
        import shutil
        self.path = os.environ.get("PATH", "")
        if shutil.which("ninja") is None:
            dirs = [os.path.dirname(sys.executable)]
            try:
                import ninja
                dirs.append(ninja.BIN_DIR)
            except (ImportError, AttributeError):
                pass
            os.environ["PATH"] = os.pathsep.join(dirs + [self.path])
        return self

    def __exit__(self, *exc):
        os.environ["PATH"] = self.path


def supports(rows: torch.Tensor, weights: torch.Tensor | None, out_dtype: torch.dtype) -> bool:
    """Whether the compiled kernel takes these arguments: CPU, 2-D rows and ``out_dtype`` in
    fp32/fp64/bf16/fp16, floating weights, nothing that autograd must see."""
    return (rows.device.type == "cpu" and rows.dim() == 2 and rows.dtype in DTYPES and out_dtype in DTYPES
            and (weights is None or (weights.is_floating_point() and weights.device.type == "cpu"))
            and not (torch.is_grad_enabled() and (rows.requires_grad
                                                  or (weights is not None and weights.requires_grad))))


def reduce_copies(rows: torch.Tensor, pos: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """out[i] = sum over j in [offsets[i], offsets[i + 1]) of weights[pos[j]] * rows[pos[j]].

    rows [R, C] fp32/fp64/bf16/fp16; pos int64 [copies]; offsets int64 [num_src + 1];
    weights [R] or None -> [num_src, C] in ``out_dtype``. Products rounded to fp32 (fp64 for
    fp64 rows) and summed in order, one rounding to ``out_dtype``; rows with no copies are
    zero. Raises RuntimeError when the module is not available (check ``load()`` first).
    """
    module = load()
    if module is None:
        raise RuntimeError("expertrail's compiled CPU kernels are not available")
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    if weights is not None:
        weights = weights.to(acc).contiguous()       # [R]: as the reference, weights in the accumulation dtype
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    # The kernel writes fp32 or the rows' dtype (fewer instantiations, a shorter build), other
    # dtypes are converted from fp32 by torch: an fp32 sum stored as fp32 is exact, so that is
    # still one rounding, and an fp64 sum reaches bf16/fp16 through fp32, as torch's .to() does.
    direct = out_dtype in (rows.dtype, torch.float32)
    out = torch.empty(offsets.numel() - 1, rows.shape[1], dtype=out_dtype if direct else torch.float32)
    module.reduce_copies(rows, pos.contiguous(), offsets.contiguous(), weights, out)
    return out if direct else out.to(out_dtype)
