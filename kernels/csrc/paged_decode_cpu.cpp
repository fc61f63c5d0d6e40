// Decode attention over the paged KV cache on CPU: each sequence reads its own blocks in place,
// so no step copies contexts into padded tensors. One pass per block with an online softmax, all
// KV heads of a block together (its K and V are each one contiguous run), in fp32. Long contexts
// split into chunks whose partial softmax states merge at the end, and the threads take runs of
// chunks of equal token counts, so both stream whatever the mix of lengths.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "avx512_lanes.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMinChunkBlocks = 8;  // merging partial states costs about one block's work
constexpr int64_t kChunksPerThread = 8;

struct Shape {
  int64_t block_size, num_kv_heads, group, head_size;
  int64_t token_stride() const { return num_kv_heads * head_size; }
  int64_t block_stride() const { return block_size * token_stride(); }
  int64_t num_heads() const { return num_kv_heads * group; }
};

// The softmax state of every query head over a run of keys: running max, sum of exp, and the
// exp-weighted sum of values, all relative to the running max.
struct State {
  float* max;  // [num_heads]
  float* sum;  // [num_heads]
  float* acc;  // [num_heads, head_size]
};

// A state at its start (no keys yet) laid over `base`: [num_heads] max, [num_heads] sum, then acc.
inline State fresh_state(float* base, int64_t num_heads, int64_t head_size) {
  const State st{base, base + num_heads, base + 2 * num_heads};
  std::fill(st.max, st.max + num_heads, -std::numeric_limits<float>::infinity());
  std::fill(st.sum, st.acc + num_heads * head_size, 0.f);
  return st;
}

// Rescales head h's state to a new maximum; the block's weights p must already use it.
inline float raise_max(const State& st, int64_t h, float block_max, int64_t head_size) {
  const float new_max = std::max(st.max[h], block_max);
  if (new_max != st.max[h]) {
    const float alpha = std::exp(st.max[h] - new_max);  // exp(-inf) = 0 for the first block
    st.sum[h] *= alpha;
    float* acc = st.acc + h * head_size;
    for (int64_t d = 0; d < head_size; ++d) acc[d] *= alpha;
    st.max[h] = new_max;
  }
  return new_max;
}

template <typename scalar_t>
void block_generic(const State& st, const float* q, const scalar_t* k, const scalar_t* v,
                   int64_t n, const Shape& s, float* scores) {
  // q: [num_heads, head_size] scaled; k, v: the block's [block_size, num_kv_heads, head_size].
  const int64_t hs = s.head_size, ts = s.token_stride();
  for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
    for (int64_t g = 0; g < s.group; ++g) {
      const int64_t h = kv * s.group + g;
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* kt = k + t * ts + kv * hs;
        float dot = 0.f;
        for (int64_t d = 0; d < hs; ++d) dot += q[h * hs + d] * static_cast<float>(kt[d]);
        scores[t] = dot;
        block_max = std::max(block_max, dot);
      }
      const float m = raise_max(st, h, block_max, hs);
      float* acc = st.acc + h * hs;
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(scores[t] - m);
        st.sum[h] += p;
        const scalar_t* vt = v + t * ts + kv * hs;
        for (int64_t d = 0; d < hs; ++d) acc[d] += p * static_cast<float>(vt[d]);
      }
    }
  }
}

#if defined(__AVX512F__)
// exp on 16 lanes: 2^n * e^r with |r| <= ln2/2, degree-6 polynomial (rel. error ~2e-7);
// inputs here are <= 0, and anything below -87 flushes to 0 as expf does.
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  const __mmask16 is_tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512 y = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~is_tiny), y);
}

// fp32, block_size <= 16, head_size a multiple of 16 up to 256 (kVecs 16-lane vectors).
template <int64_t kVecs>
void block_avx512(const State& st, const float* q, const float* k, const float* v, int64_t n,
                  const Shape& s) {
  constexpr int64_t hs = kVecs * 16;
  const int64_t ts = s.token_stride();
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
  for (int64_t kv = 0; kv < s.num_kv_heads; ++kv) {
    for (int64_t g = 0; g < s.group; ++g) {
      const int64_t h = kv * s.group + g;
      __m512 qv[kVecs];
      for (int64_t i = 0; i < kVecs; ++i) qv[i] = _mm512_loadu_ps(q + h * hs + 16 * i);
      __m512 prod[16];
      for (int64_t t = 0; t < 16; ++t) {
        const float* kt = k + t * ts + kv * hs;
        prod[t] = _mm512_setzero_ps();
        if (t < n)
          for (int64_t i = 0; i < kVecs; ++i)
            prod[t] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kt + 16 * i), prod[t]);
      }
      const __m512 scores = _mm512_mask_blend_ps(
          valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sum_lanes16(prod));
      const float old_max = st.max[h];
      const float m = std::max(old_max, _mm512_reduce_max_ps(scores));
      const __m512 p = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(scores, _mm512_set1_ps(m))));
      alignas(64) float pw[16];
      _mm512_store_ps(pw, p);
      float* acc = st.acc + h * hs;
      __m512 av[kVecs];
      if (m != old_max) {
        const float alpha = std::exp(old_max - m);  // exp(-inf) = 0 for the first block
        st.sum[h] *= alpha;
        st.max[h] = m;
        for (int64_t i = 0; i < kVecs; ++i)
          av[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * i), _mm512_set1_ps(alpha));
      } else {
        for (int64_t i = 0; i < kVecs; ++i) av[i] = _mm512_loadu_ps(acc + 16 * i);
      }
      st.sum[h] += _mm512_reduce_add_ps(p);
      for (int64_t t = 0; t < n; ++t) {
        const float* vt = v + t * ts + kv * hs;
        const __m512 pt = _mm512_set1_ps(pw[t]);
        for (int64_t i = 0; i < kVecs; ++i)
          av[i] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(vt + 16 * i), av[i]);
      }
      for (int64_t i = 0; i < kVecs; ++i) _mm512_storeu_ps(acc + 16 * i, av[i]);
    }
  }
}

inline void prefetch_block(const float* p, int64_t numel) {
  for (int64_t i = 0; i < numel; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}
#endif

template <typename scalar_t>
void run_chunk(const State& st, const float* q, const scalar_t* k_cache, const scalar_t* v_cache,
               const int32_t* block_table, int64_t first_block, int64_t last_block,
               int64_t seq_len, const Shape& s, float* scores) {
  const int64_t bs = s.block_size, stride = s.block_stride();
  for (int64_t b = first_block; b < last_block; ++b) {
    const int64_t n = std::min(bs, seq_len - b * bs);
    const scalar_t* k = k_cache + block_table[b] * stride;
    const scalar_t* v = v_cache + block_table[b] * stride;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, float>) {
      if (b + 2 < last_block) {
        prefetch_block(k_cache + block_table[b + 2] * stride, stride);
        prefetch_block(v_cache + block_table[b + 2] * stride, stride);
      }
      if (bs <= 16) {
        switch (s.head_size) {
          case 64: block_avx512<4>(st, q, k, v, n, s); continue;
          case 128: block_avx512<8>(st, q, k, v, n, s); continue;
          default: break;
        }
      }
    }
#endif
    block_generic(st, q, k, v, n, s, scores);
  }
}

struct Chunk {
  int64_t seq, first_block, last_block, slot;  // slot: its partial state, -1 = writes `out`
};

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
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_size,
              "query heads must be a multiple of the cache's KV heads, head sizes equal");
  const Shape s{k_cache.size(1), num_kv_heads, num_heads / num_kv_heads, head_size};
  const int64_t table_stride = block_tables.stride(0), bs = s.block_size;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();

  int64_t total_blocks = 0;
  for (int64_t i = 0; i < num_seqs; ++i) total_blocks += (std::max(lens[i], 0) + bs - 1) / bs;
  const int64_t num_threads = at::get_num_threads();
  const int64_t chunk_blocks = std::max(
      kMinChunkBlocks, (total_blocks + num_threads * kChunksPerThread - 1) /
                           (num_threads * kChunksPerThread));
  std::vector<Chunk> chunks;
  int64_t num_slots = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t num_blocks = (std::max(lens[i], 0) + bs - 1) / bs;
    const bool is_split = num_blocks > chunk_blocks;
    for (int64_t b = 0; b < std::max<int64_t>(num_blocks, 1); b += chunk_blocks)
      chunks.push_back({i, b, std::min(b + chunk_blocks, num_blocks), is_split ? num_slots++ : -1});
  }
  // Threads take contiguous runs of chunks holding equal shares of the blocks.
  std::vector<int64_t> bounds(num_threads + 1, static_cast<int64_t>(chunks.size()));
  bounds[0] = 0;
  for (int64_t c = 0, done = 0, t = 1; c < static_cast<int64_t>(chunks.size()) && t < num_threads; ++c) {
    done += chunks[c].last_block - chunks[c].first_block;
    while (t < num_threads && done * num_threads >= total_blocks * t) bounds[t++] = c + 1;
  }
  const int64_t state_numel = num_heads * (head_size + 2);
  std::vector<float> partials(num_slots * state_numel);
  std::vector<float> q_scaled(num_seqs * num_heads * head_size);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode", [&] {
    const scalar_t* q_ptr = query.data_ptr<scalar_t>();
    for (int64_t i = 0; i < num_seqs * num_heads * head_size; ++i)
      q_scaled[i] = static_cast<float>(q_ptr[i]) * static_cast<float>(scale);
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    auto finish = [&](const State& st, int64_t seq) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = st.sum[h] > 0.f ? 1.f / st.sum[h] : 0.f;
        scalar_t* o = out_ptr + (seq * num_heads + h) * head_size;
        for (int64_t d = 0; d < head_size; ++d)
          o[d] = static_cast<scalar_t>(st.acc[h * head_size + d] * inv);
      }
    };
    at::parallel_for(0, num_threads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> local(state_numel), scores(bs);
      for (int64_t c = bounds[begin]; c < bounds[end]; ++c) {
        const Chunk& ch = chunks[c];
        float* base = ch.slot < 0 ? local.data() : partials.data() + ch.slot * state_numel;
        const State st = fresh_state(base, num_heads, head_size);
        run_chunk(st, q_scaled.data() + ch.seq * num_heads * head_size, k_ptr, v_ptr,
                  tables + ch.seq * table_stride, ch.first_block, ch.last_block, lens[ch.seq], s,
                  scores.data());
        if (ch.slot < 0) finish(st, ch.seq);
      }
    });
    // Merge split sequences' chunks, in chunk order: a handful of heads each.
    std::vector<float> merged(state_numel);
    for (size_t c = 0; c < chunks.size();) {
      size_t e = c + 1;
      while (e < chunks.size() && chunks[e].seq == chunks[c].seq) ++e;
      if (chunks[c].slot >= 0) {
        const State m = fresh_state(merged.data(), num_heads, head_size);
        for (size_t p = c; p < e; ++p) {
          const float* part = partials.data() + chunks[p].slot * state_numel;
          const float* acc = part + 2 * num_heads;
          for (int64_t h = 0; h < num_heads; ++h) {
            const float mx = raise_max(m, h, part[h], head_size);
            const float w = std::exp(part[h] - mx);
            m.sum[h] += w * part[num_heads + h];
            for (int64_t d = 0; d < head_size; ++d)
              m.acc[h * head_size + d] += w * acc[h * head_size + d];
          }
        }
        finish(m, chunks[c].seq);
      }
      c = e;
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is let go while it runs, as torch's own ops do: the host's other threads go on
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention reading the paged KV cache in place (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
