// A decoder layer's ops outside the GEMMs and attention, on CPU: one call each where the layers'
// torch code runs five to twenty small ops, whose dispatch, not their arithmetic, is most of a
// decode step's time at a few rows. Same math and the same roundings as that code (fp32
// statistics, a cast back to the input dtype after each op), up to the order of a sum's terms.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

namespace {

// the value a torch op in dtype T leaves: computed in float, rounded to T
template <typename T>
inline float rnd(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// rows per task: a decode step's few rows stay on the calling thread
constexpr int64_t kMinElementsPerTask = 1 << 15;

inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kMinElementsPerTask / std::max<int64_t>(1, row_elements));
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, features] with "
              "contiguous features, got shape ", x.sizes(), " strides ", x.strides());
}

// an RMSNorm's weight for rows of n features of dtype
void check_norm_weight(const torch::Tensor& weight, int64_t n, at::ScalarType dtype,
                       const char* name) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n && weight.scalar_type() == dtype,
              name, " must be contiguous [", n, "] of dtype ", dtype, ", got shape ",
              weight.sizes(), " of ", weight.scalar_type());
}

// out[r] = weight * T(x32[r] * rsqrt(mean(x32[r]^2) + eps)), x32 the row in float
template <typename T>
inline void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  // kLanes partial sums, which the compiler keeps in one vector register (a single running
  // sum is a chain of dependent adds it may not reorder)
  constexpr int64_t kLanes = 16;
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = static_cast<float>(x[i + j]);
      partial[j] += v * v;
    }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    partial[0] += v * v;
  }
  float sum = 0.f;
  for (const float p : partial) sum += p;
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (i = 0; i < n; ++i)
    out[i] = static_cast<T>(static_cast<float>(weight[i]) *
                            rnd<T>(static_cast<float>(x[i]) * inv));
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_norm_weight(weight, x.size(1), x.scalar_type(), "weight");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row(xp + r * stride, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// (rms_norm(x + residual), x + residual), the sum rounded to x's dtype as torch's add leaves it
std::tuple<torch::Tensor, torch::Tensor> fused_add_rms_norm(torch::Tensor x,
                                                            torch::Tensor residual,
                                                            torch::Tensor weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "residual must have x's shape and dtype");
  check_norm_weight(weight, x.size(1), x.scalar_type(), "weight");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  auto sum = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * x.stride(0);
        const scalar_t* rr = rp + r * residual.stride(0);
        scalar_t* sr = sp + r * n;
        for (int64_t i = 0; i < n; ++i)
          sr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        norm_row(sr, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

// x: [rows, 2 * d] = gate | up → silu(gate) * up: [rows, d]. torch's own kernels, whose exp is
// vectorized, called from here without the Python around each.
torch::Tensor silu_and_mul(torch::Tensor x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must have an even number of features, got ", x.size(1));
  const int64_t d = x.size(1) / 2;
  return at::silu(x.narrow(1, 0, d)).mul_(x.narrow(1, d, d));
}

// One head of one token turned by its position (neox layout: halves x1 | x2 →
// x1·cos − x2·sin | x2·cos + x1·sin), each product and sum rounded as torch's ops in T leave it;
// with norm_weight, first the head's RMSNorm (Qwen3's q_norm / k_norm).
template <typename T>
inline void turn_head(const T* x, T* out, const float* cos, const float* sin, int64_t half,
                      const T* norm_weight, float eps, T* scratch) {
  if (norm_weight != nullptr) {
    norm_row(x, norm_weight, scratch, 2 * half, eps);
    x = scratch;
  }
  for (int64_t i = 0; i < half; ++i) {
    const float c = rnd<T>(cos[i]), s = rnd<T>(sin[i]);
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
    out[i] = static_cast<T>(rnd<T>(x1 * c) - rnd<T>(x2 * s));
    out[i + half] = static_cast<T>(rnd<T>(x2 * c) + rnd<T>(x1 * s));
  }
}

// Turns query and key by their positions and writes key and value into the paged cache at
// slot_mapping (negative slots, padding, are not written); returns the query turned,
// [tokens, heads, head_size]. query: [tokens, heads * head_size], key, value: [tokens,
// kv_heads * head_size], rows may be strided (views of one qkv output); cos_sin_cache:
// [max_position, head_size] float32, cos | sin; k_cache, v_cache: [blocks, block_size, kv_heads,
// head_size] of the query's dtype.
torch::Tensor rotary_write_kv(torch::Tensor positions, torch::Tensor query, torch::Tensor key,
                              torch::Tensor value, torch::Tensor cos_sin_cache,
                              torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor slot_mapping,
                              std::optional<torch::Tensor> q_norm_weight,
                              std::optional<torch::Tensor> k_norm_weight, double eps) {
  check_rows(query, "query");
  check_rows(key, "key");
  check_rows(value, "value");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache and v_cache must be contiguous [blocks, block_size, kv_heads, head_size]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "query, key, value and the caches must have one dtype");
  const int64_t tokens = query.size(0), kv_heads = k_cache.size(2), head = k_cache.size(3);
  const int64_t heads = query.size(1) / head, half = head / 2;
  TORCH_CHECK(query.size(1) == heads * head && key.size(1) == kv_heads * head &&
                  value.size(1) == kv_heads * head && key.size(0) == tokens &&
                  value.size(0) == tokens,
              "query, key and value do not fit a cache of ", kv_heads, " heads of size ", head);
  TORCH_CHECK(cos_sin_cache.scalar_type() == torch::kFloat32 && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head,
              "cos_sin_cache must be contiguous float32 [max_position, head_size]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == tokens &&
                  positions.is_contiguous() && slot_mapping.scalar_type() == torch::kInt64 &&
                  slot_mapping.numel() == tokens && slot_mapping.is_contiguous(),
              "positions and slot_mapping must be contiguous int64 [tokens]");
  TORCH_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(),
              "q_norm_weight and k_norm_weight come together");
  if (q_norm_weight.has_value()) {
    check_norm_weight(*q_norm_weight, head, dtype, "q_norm_weight");
    check_norm_weight(*k_norm_weight, head, dtype, "k_norm_weight");
  }
  auto out = torch::empty({tokens, heads, head}, query.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t max_position = cos_sin_cache.size(0);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " of token ", t,
                " is outside the rotary table's ", max_position);
    TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " of token ", t, " is outside the "
                "cache's ", num_slots);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rotary_write_kv", [&] {
    const scalar_t* qp = query.data_ptr<scalar_t>();
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const float* table = cos_sin_cache.data_ptr<float>();
    const scalar_t* qw = q_norm_weight ? q_norm_weight->data_ptr<scalar_t>() : nullptr;
    const scalar_t* kw = k_norm_weight ? k_norm_weight->data_ptr<scalar_t>() : nullptr;
    const float e = static_cast<float>(eps);
    at::parallel_for(0, tokens, grain((heads + 2 * kv_heads) * head), [&](int64_t b, int64_t end) {
      std::vector<scalar_t> scratch(qw != nullptr ? head : 0);
      for (int64_t t = b; t < end; ++t) {
        const float* cos = table + pos[t] * head;
        const float* sin = cos + half;
        for (int64_t h = 0; h < heads; ++h)
          turn_head(qp + t * query.stride(0) + h * head, op + (t * heads + h) * head, cos, sin,
                    half, qw, e, scratch.data());
        if (slots[t] < 0) continue;
        scalar_t* k_slot = kc + slots[t] * kv_heads * head;
        for (int64_t h = 0; h < kv_heads; ++h)
          turn_head(kp + t * key.stride(0) + h * head, k_slot + h * head, cos, sin, half, kw, e,
                    scratch.data());
        std::copy_n(vp + t * value.stride(0), kv_heads * head, vc + slots[t] * kv_heads * head);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is let go while they run, as torch's own ops do: the host's other threads go on
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, "RMSNorm of each row", no_gil);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "(rms_norm(x + residual), x + residual)",
        no_gil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [rows, gate | up]", no_gil);
  m.def("rotary_write_kv", &rotary_write_kv,
        "query and key turned by their positions, key and value written to the paged cache; "
        "returns the query", py::arg("positions"), py::arg("query"), py::arg("key"),
        py::arg("value"), py::arg("cos_sin_cache"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("q_norm_weight") = py::none(),
        py::arg("k_norm_weight") = py::none(), py::arg("eps") = 0.0, no_gil);
}
