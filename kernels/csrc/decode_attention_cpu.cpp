// Paged decode attention on the CPU, fp32: one query token per sequence.
//
// Reads each sequence's K/V straight from the paged cache through its block
// table (no gathered copy). One work item is a sequence and a range of its KV
// heads (all of them when there are enough sequences to keep every thread
// busy, so that each block's K and V are read as one contiguous stream). Two
// passes over the context: scores s = scale * q . k for the G = Hq / Hkv query
// heads sharing each KV head (GQA without expanding K/V), then the softmax and
// the weighted sum of V. Work items are spread over OpenMP threads; the
// library links the libgomp that torch has already loaded (same soname), so
// the kernel and torch's ops share one thread pool.
//
// Layouts (strides in elements):
//   q        [n rows, Hq, D]: row r at q + r * q_row_stride, heads then D contiguous
//   caches   [num_blocks, block_size, Hkv, D] contiguous (K and V alike)
//   tables   [n, table_stride] int64 block ids
//   seq_lens [n] int64 context lengths (>= 1, this step's token included)
//   rows     [n] int64: the q row and out row of decode i
//   out      [T, Hq, D] contiguous
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kMaxHeads = 64;  // query heads per work item

// Calls f(t, row) for t = 0..ctx-1 in order, row = the token's [Hkv, D] slice of `cache`
// found through the block table; prefetches the next block (block ids are scattered, so the
// hardware prefetcher cannot guess it).
template <class F>
inline void for_each_token(const float* cache, const int64_t* table, int64_t ctx,
                           int block_size, int64_t token_stride, F&& f) {
  for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
    const int64_t base = table[t0 / block_size] * block_size;
    if (t0 + block_size < ctx)
      __builtin_prefetch(cache + table[t0 / block_size + 1] * block_size * token_stride);
    const int nt = static_cast<int>(std::min<int64_t>(block_size, ctx - t0));
    for (int j = 0; j < nt; ++j) f(t0 + j, cache + (base + j) * token_stride);
  }
}

// Decode i, KV heads [h0, h1): scores, softmax and output of their G * (h1 - h0) query heads.
template <int D>
void attend(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
            int64_t ctx, int block_size, int Hkv, int G, int h0, int h1, float scale,
            float* out, std::vector<float>& scores) {
  const int heads = (h1 - h0) * G;  // query heads of this item, consecutive in q and out
  scores.resize(static_cast<size_t>(heads) * ctx);
  float* s = scores.data();
  const int64_t token_stride = static_cast<int64_t>(Hkv) * D;
  // Pass 1: s[hq * ctx + t] = scale * q_hq . k_t(hq's KV head)
  for_each_token(k_cache, table, ctx, block_size, token_stride,
                 [&](int64_t t, const float* krow) {
    for (int h = h0; h < h1; ++h) {
      const float* k = krow + static_cast<int64_t>(h) * D;
      for (int g = 0; g < G; ++g) {
        const int hq = (h - h0) * G + g;
        const float* qh = q + static_cast<int64_t>(hq) * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < D; ++d) acc += qh[d] * k[d];
        s[hq * ctx + t] = acc * scale;
      }
    }
  });
  // Softmax of each query head's scores (exp vectorised).
  float inv_sum[kMaxHeads];
  for (int hq = 0; hq < heads; ++hq) {
    float* sh = s + hq * ctx;
    float m = sh[0];
    for (int64_t t = 1; t < ctx; ++t) m = std::max(m, sh[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < ctx; ++t) {
      sh[t] = std::exp(sh[t] - m);
      sum += sh[t];
    }
    inv_sum[hq] = 1.f / sum;
  }
  // Pass 2: out_hq = sum_t p_hq,t v_t(hq's KV head)
  float acc[kMaxHeads][D];
  for (int hq = 0; hq < heads; ++hq)
    for (int d = 0; d < D; ++d) acc[hq][d] = 0.f;
  for_each_token(v_cache, table, ctx, block_size, token_stride,
                 [&](int64_t t, const float* vrow) {
    for (int h = h0; h < h1; ++h) {
      const float* v = vrow + static_cast<int64_t>(h) * D;
      for (int g = 0; g < G; ++g) {
        const int hq = (h - h0) * G + g;
        const float p = s[hq * ctx + t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[hq][d] += p * v[d];
      }
    }
  });
  for (int hq = 0; hq < heads; ++hq)
    for (int d = 0; d < D; ++d) out[static_cast<int64_t>(hq) * D + d] = acc[hq][d] * inv_sum[hq];
}

template <int D>
void run(const float* q, int64_t q_row_stride, const float* k_cache, const float* v_cache,
         const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
         const int64_t* rows, float* out, int n, int Hq, int Hkv, int block_size, float scale,
         int num_threads) {
  const int G = Hq / Hkv;
  // Split each sequence's KV heads into `parts` items when sequences are too few for the threads,
  // and so that no item holds more than kMaxHeads query heads.
  int parts = std::max(1, std::min(Hkv, (2 * num_threads + n - 1) / std::max(n, 1)));
  while ((Hkv + parts - 1) / parts * G > kMaxHeads) ++parts;
  const int per = (Hkv + parts - 1) / parts;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int item = 0; item < n * parts; ++item) {
      const int i = item / parts, h0 = (item % parts) * per, h1 = std::min(Hkv, h0 + per);
      if (h0 >= h1) continue;
      const int64_t row = rows[i];
      attend<D>(q + row * q_row_stride + static_cast<int64_t>(h0) * G * D, k_cache, v_cache,
                tables + i * table_stride, seq_lens[i], block_size, Hkv, G, h0, h1, scale,
                out + (row * Hq + static_cast<int64_t>(h0) * G) * D, scores);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, else (nothing written):
//   1  a head dim not listed below, Hq not a multiple of Hkv, a GQA group wider than
//      kMaxHeads query heads, or a non-positive size;
//   2  a seq_len < 1, or one needing more than table_width blocks;
//   3  a row outside [0, num_rows), or the same row twice;
//   4  a block id outside [0, num_blocks) among the blocks a context needs.
// The checks read n + sum(ceil(seq_len / block_size)) integers: microseconds.
int conveyor_decode_attention_f32(const float* q, int64_t q_row_stride, const float* k_cache,
                                  const float* v_cache, const int64_t* tables,
                                  int64_t table_stride, int64_t table_width,
                                  const int64_t* seq_lens, const int64_t* rows, float* out,
                                  int64_t num_rows, int64_t num_blocks, int n, int Hq, int Hkv,
                                  int head_dim, int block_size, float scale, int num_threads) {
  if (Hkv <= 0 || Hq % Hkv != 0 || Hq / Hkv > kMaxHeads || block_size <= 0 || num_threads <= 0 ||
      n < 0 || num_rows < 0 || num_blocks <= 0)
    return 1;
  std::vector<char> seen(static_cast<size_t>(num_rows), 0);
  for (int i = 0; i < n; ++i) {
    const int64_t ctx = seq_lens[i];
    if (ctx < 1 || (ctx + block_size - 1) / block_size > table_width) return 2;
    const int64_t row = rows[i];
    if (row < 0 || row >= num_rows || seen[row]) return 3;
    seen[row] = 1;
    const int64_t* table = tables + i * table_stride;
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b)
      if (table[b] < 0 || table[b] >= num_blocks) return 4;
  }
  switch (head_dim) {
#define CONVEYOR_CASE(DIM)                                                                    \
  case DIM:                                                                                   \
    run<DIM>(q, q_row_stride, k_cache, v_cache, tables, table_stride, seq_lens, rows, out, n, \
             Hq, Hkv, block_size, scale, num_threads);                                        \
    return 0;
    CONVEYOR_CASE(16)
    CONVEYOR_CASE(32)
    CONVEYOR_CASE(64)
    CONVEYOR_CASE(80)
    CONVEYOR_CASE(96)
    CONVEYOR_CASE(128)
    CONVEYOR_CASE(256)
#undef CONVEYOR_CASE
    default:
      return 1;
  }
}

}  // extern "C"
