// Decode attention over the paged KV cache on CPU: each (sequence, KV head) reads its own blocks
// in place, so no step copies contexts into padded tensors. Two passes over the keys (scores,
// then softmax-weighted values) in fp32; the GQA group's query heads share every K/V read.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 8;  // independent partial sums: vectorizes without reassociation

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t head_size) {
  float acc[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= head_size; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += q[d + j] * static_cast<float>(k[d + j]);
  }
  for (; d < head_size; ++d) acc[0] += q[d] * static_cast<float>(k[d]);
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

template <typename scalar_t>
inline void axpy(float* out, float p, const scalar_t* v, int64_t head_size) {
  for (int64_t d = 0; d < head_size; ++d) out[d] += p * static_cast<float>(v[d]);
}

template <typename scalar_t>
void decode_one(scalar_t* out, const scalar_t* query, const scalar_t* k_cache,
                const scalar_t* v_cache, const int32_t* block_table, int64_t seq_len,
                int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_size,
                float scale, std::vector<float>& q, std::vector<float>& scores,
                std::vector<float>& acc) {
  // query/out: this KV head's `group` query heads, [group, head_size]; caches at this KV head.
  q.resize(group * head_size);
  scores.resize(group * seq_len);
  acc.assign(group * head_size, 0.f);
  for (int64_t i = 0; i < group * head_size; ++i) q[i] = static_cast<float>(query[i]) * scale;
  const int64_t token_stride = num_kv_heads * head_size;
  const int64_t block_stride = block_size * token_stride;
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t block_offset = block_table[start / block_size] * block_stride;
    const int64_t n = std::min(block_size, seq_len - start);
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* k = k_cache + block_offset + t * token_stride;
      for (int64_t g = 0; g < group; ++g)
        scores[g * seq_len + start + t] = dot(q.data() + g * head_size, k, head_size);
    }
  }
  std::vector<float> inv_sum(group);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * seq_len;
    float max_score = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < seq_len; ++t) max_score = std::max(max_score, s[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < seq_len; ++t) {
      s[t] = std::exp(s[t] - max_score);
      sum += s[t];
    }
    inv_sum[g] = 1.f / sum;
  }
  for (int64_t start = 0; start < seq_len; start += block_size) {
    const int64_t block_offset = block_table[start / block_size] * block_stride;
    const int64_t n = std::min(block_size, seq_len - start);
    for (int64_t t = 0; t < n; ++t) {
      const scalar_t* v = v_cache + block_offset + t * token_stride;
      for (int64_t g = 0; g < group; ++g)
        axpy(acc.data() + g * head_size, scores[g * seq_len + start + t], v, head_size);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_size; ++d)
      out[g * head_size + d] = static_cast<scalar_t>(acc[g * head_size + d] * inv_sum[g]);
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_tables,
                            torch::Tensor seq_lens, double scale) {
  // out, query: [num_seqs, num_heads, head_size]; k/v_cache: [num_blocks, block_size,
  // num_kv_heads, head_size]; block_tables: [num_seqs, max_num_blocks] int32; seq_lens: int32.
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_tables rows and seq_lens must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_size,
              "query heads must be a multiple of the cache's KV heads, head sizes equal");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_stride = block_tables.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const scalar_t* q_ptr = query.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> q, scores, acc;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t head_offset = (seq * num_heads + kv_head * group) * head_size;
        decode_one(out_ptr + head_offset, q_ptr + head_offset, k_ptr + kv_head * head_size,
                   v_ptr + kv_head * head_size, tables + seq * table_stride, lens[seq],
                   block_size, num_kv_heads, group, head_size, static_cast<float>(scale), q,
                   scores, acc);
      }
    });
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading the paged KV cache in place (CPU)");
}
