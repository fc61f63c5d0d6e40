// out = x @ weight^T for few rows of x (decode steps) on CPU, fp32, and bf16 where the CPU has
// AVX512-BF16. BLAS packs the weight on every call, an extra pass over memory that costs as much
// as the product at a handful of rows; here each weight row is read in place, 4 rows at a time
// against 4 rows of x, while the 4 rows two tiles ahead are prefetched into L2, a share of them
// by each pass over x. bf16 reads half the bytes: pairs of bf16 products summed into fp32 lanes
// (VDPBF16PS), the result rounded to bf16 once, as oneDNN's bf16 GEMM does.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "avx512_lanes.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kTile = 4;

// out[m0:m0+C, n0:n0+R] from x[M, K] and w[N, K]; this is pass j of nj over the weight rows
template <int R, int C>
inline void tile(const float* x, const float* w, float* out, int64_t K, int64_t N, int64_t m0,
                 int64_t n0, int64_t j, int64_t nj) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  // The tail stays a separate loop: one masked loop keeps `acc` in memory (GCC 12).
  for (; k + 16 <= K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + (n0 + r) * K + k);
    for (int64_t r = j; r < kTile; r += nj)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + 2 * kTile + r) * K + k), _MM_HINT_T1);
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + c) * K + k);
      for (int r = 0; r < R; ++r) acc[c * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[c * R + r]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, w + (n0 + r) * K + k);
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + c) * K + k);
      for (int r = 0; r < R; ++r) acc[c * R + r] = _mm512_fmadd_ps(xv, wv[r], acc[c * R + r]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes16(acc));
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[(m0 + c) * N + n0 + r] = sums[c * R + r];
}

#if defined(__AVX512BF16__)
// tile<R, C>'s bf16 twin: 32 bf16 of a row per 64-byte load, each pair of products summed into
// one fp32 lane
template <int R, int C>
inline void tile(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* out, int64_t K,
                 int64_t N, int64_t m0, int64_t n0, int64_t j, int64_t nj) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k);
    for (int64_t r = j; r < kTile; r += nj)
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + 2 * kTile + r) * K + k), _MM_HINT_T1);
    for (int c = 0; c < C; ++c) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + c) * K + k);
      for (int r = 0; r < R; ++r) acc[c * R + r] = _mm512_dpbf16_ps(acc[c * R + r], xv, wv[r]);
    }
  }
  if (k < K) {  // zeros past the row's end add nothing
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r)
      wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + (n0 + r) * K + k);
    for (int c = 0; c < C; ++c) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (m0 + c) * K + k);
      for (int r = 0; r < R; ++r) acc[c * R + r] = _mm512_dpbf16_ps(acc[c * R + r], xv, wv[r]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, sum_lanes16(acc));
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) out[(m0 + c) * N + n0 + r] = at::BFloat16(sums[c * R + r]);
}
#endif

template <typename T, int R>
inline void weight_rows(const T* x, const T* w, T* out, int64_t M, int64_t K, int64_t N,
                        int64_t n0) {
  int64_t m = 0;
  const int64_t nj = (M + kTile - 1) / kTile;
  for (; m + kTile <= M; m += kTile) tile<R, kTile>(x, w, out, K, N, m, n0, m / kTile, nj);
  switch (M - m) {
    case 3: tile<R, 3>(x, w, out, K, N, m, n0, m / kTile, nj); break;
    case 2: tile<R, 2>(x, w, out, K, N, m, n0, m / kTile, nj); break;
    case 1: tile<R, 1>(x, w, out, K, N, m, n0, m / kTile, nj); break;
    default: break;
  }
}

template <typename T>
void all_weight_rows(const T* x, const T* w, T* out, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + kTile - 1) / kTile, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTile;
      switch (std::min(kTile, N - n0)) {
        case 4: weight_rows<T, 4>(x, w, out, M, K, N, n0); break;
        case 3: weight_rows<T, 3>(x, w, out, M, K, N, n0); break;
        case 2: weight_rows<T, 2>(x, w, out, M, K, N, n0); break;
        default: weight_rows<T, 1>(x, w, out, M, K, N, n0); break;
      }
    }
  });
}
#endif

bool has_vector_path() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool has_bf16_path() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void skinny_linear(torch::Tensor out, torch::Tensor x, torch::Tensor weight) {
  // out: [M, N]; x: [M, K]; weight: [N, K]; all contiguous, all fp32 or (has_bf16_path) bf16.
  TORCH_CHECK(has_vector_path(), "skinny_linear needs AVX-512; use torch.nn.functional.linear");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || (dtype == torch::kBFloat16 && has_bf16_path())) &&
                  weight.scalar_type() == dtype && out.scalar_type() == dtype,
              "x, weight and out must be float32", has_bf16_path() ? ", or all bfloat16" : "");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && out.is_contiguous(),
              "x, weight and out must be contiguous");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1) &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0),
              "shapes must be x [M, K], weight [N, K], out [M, N]");
#if defined(__AVX512F__)
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (dtype == torch::kFloat32) {
    all_weight_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), M, K,
                    N);
    return;
  }
#endif
#if defined(__AVX512BF16__)
  all_weight_rows(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), M, K, N);
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_vector_path", &has_vector_path, "whether this build has the AVX-512 kernel");
  m.def("has_bf16_path", &has_bf16_path, "whether it takes bf16 too (AVX512-BF16)");
  // the GIL is let go while it runs, as torch's own ops do: the host's other threads go on
  m.def("skinny_linear", &skinny_linear, "x @ weight^T for few rows of x (CPU, fp32 or bf16)",
        py::call_guard<py::gil_scoped_release>());
}
