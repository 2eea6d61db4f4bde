// Paged decode attention on the CPU, fp32 queries and output: one query token per sequence.
// The cache holds fp32, fp16 or bf16 (--kv-cache-dtype float16 / bfloat16: half the bytes a
// step reads), widened to fp32 as it is loaded; every sum is fp32 either way.
//
// Reads each sequence's K/V straight from the paged cache through its block
// table (no gathered copy). A sequence's context is split into chunks of whole
// blocks (about kChunkTokens tokens each, a function of the context length
// alone); a work item is one chunk of one sequence with every query head, and
// reads each of its blocks once, row by row (all KV heads of a token are
// contiguous), as one stream. Two passes over a chunk: scores s = scale * q . k
// for every query head (query head hq uses KV head hq / G: GQA without
// expanding K/V), then the chunk's softmax numerators and their weighted sum of
// V; the chunks of a sequence are then merged by their maxima (flash-decoding's
// split-K). Work items are spread over OpenMP threads; the library links the
// libgomp that torch has already loaded (same soname), so the kernel and
// torch's ops share one thread pool.
//
// Measured on a 2-core Zen 3 (AVX2), 30 layers' caches streamed cold as in a
// step (9 query / 3 KV heads, D = 64): one decode at 300 tokens 1.9 ms against
// 2.6-3.0 for the previous kernel (one item per KV head, no chunks), at 1000
// tokens 5.2 against 8.2-8.9; 16 decodes at 300 tokens within 5% of it.
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
#include <cstring>
#include <vector>

#include "half.h"
#include "softmax_exp.h"

namespace {

constexpr int kMaxHeads = 64;  // query heads per KV head (GQA group): the checks' limit

// 8 floats: one ymm on AVX2, half a zmm on AVX-512 (GCC vector extension: the file is
// built with -march=native, so the operations map onto the machine's vector instructions).
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

using conveyor::load8;

inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

// q . k over D floats: D / 8 products in one vector accumulator, then its lanes.
template <int D, class KV>
inline float dot(const float* q, const KV* k) {
  v8 a = load8(q) * load8(k);
#pragma GCC unroll 32
  for (int c = 1; c < D / 8; ++c) a += load8(q + 8 * c) * load8(k + 8 * c);
  return hsum(a);
}

// Tokens per chunk (about): a decode's context is split into chunks of whole blocks, each
// a work item of its own, and the chunks' partial softmax sums are merged at the end (the
// split-K of flash-decoding: Dao et al., "Flash-Decoding for long-context inference",
// 2023). The split depends on the context length alone, so a row's result never depends
// on the other rows or on the thread count (batch invariance).
constexpr int64_t kChunkTokens = 64;

// The count is rounded up to an even number (still a function of the context alone): one
// decode on two threads then splits evenly (at 300 tokens, 5 chunks had left one thread three
// of them).
inline int64_t num_chunks(int64_t ctx, int block_size) {
  const int64_t blocks = (ctx + block_size - 1) / block_size;
  int64_t chunks = std::max<int64_t>(1, (ctx + kChunkTokens / 2) / kChunkTokens);
  chunks += chunks & 1;
  return std::min(blocks, chunks);
}

// Calls f(t, row) for tokens t of blocks [b0, b1) of a table, in order, up to token t1 - 1;
// row = token t's [Hkv, D] row of `cache` (token_stride floats).
// Prefetching: block ids are scattered, so the hardware prefetcher cannot follow a context
// from block to block, and a step's K/V is cold (the weights streamed through the caches
// since the layer's last step). With each token's row, the same row of the next block is
// prefetched (one block ahead, spread over the block instead of in a burst), and, where
// `also` is given (the V cache, during the K pass), the same token's row there, so that the
// V pass finds its rows fetched. Both go into L2 (prefetcht1 / prefetcht2), not L1: a
// prefetch into L1 holds one of the core's few L1 miss buffers until its line arrives, and
// 24 lines a token in flight left the demand loads waiting for them. Measured on a Zen 4
// (2 threads, 30 layers over 2,912-block pools on huge pages, in a C++ harness, with the even
// chunk count above): the next block into L1 -> L2 took one decode at 300 tokens from
// 0.80-1.00 to 0.64-0.87 ms, 4 decodes at 400 from 4.08 to 3.60, 16 at 400 from 16.9-17.6 to
// 13.5-14.9 (1.12-1.25x); before that, prefetching rows at all (against the next block's first
// line only) had given 1.39-1.69 -> 0.98-1.08 ms and 19.7 -> 15.1 ms. One whole block
// prefetched at a chunk's start, or a second block ahead, gained nothing.
template <class KV, class F>
inline void for_each_row(const KV* cache, const int64_t* table, int64_t b0, int64_t b1,
                         int64_t t1, int block_size, int64_t token_stride, F&& f,
                         const KV* also = nullptr) {
  const int64_t block_floats = block_size * token_stride;
  const int64_t row_bytes = token_stride * static_cast<int64_t>(sizeof(KV));
  for (int64_t b = b0; b < b1; ++b) {
    const KV* rows = cache + table[b] * block_floats;
    const char* next = b + 1 < b1 ? reinterpret_cast<const char*>(cache + table[b + 1] * block_floats)
                                  : nullptr;
    const char* other = also != nullptr ? reinterpret_cast<const char*>(also + table[b] * block_floats)
                                        : nullptr;
    const int64_t nt = std::min<int64_t>(block_size, t1 - b * block_size);
    for (int64_t j = 0; j < nt; ++j) {
      if (next != nullptr)  // locality 2: prefetcht1, into L2
        for (int64_t o = 0; o < row_bytes; o += 64)
          __builtin_prefetch(next + j * row_bytes + o, 0, 2);
      if (other != nullptr)
        for (int64_t o = 0; o < row_bytes; o += 64)
          __builtin_prefetch(other + j * row_bytes + o, 0, 1);  // prefetcht2, into L2
      f(b * block_size + j, rows + j * token_stride);
    }
  }
}

// One chunk of one decode, every query head: blocks [b0, b1) of its table (tokens t0 .. t1-1).
// Each block is read once, as whole rows of all its KV heads, and scored (or summed) while in
// L1. Writes, per query head hq, the chunk's max score m[hq], sum of exp(score - m) l[hq]
// and the unnormalised output acc[hq * D ..] = sum_t exp(score_t - m) v_t.
//   pass 1: token by token, s[hq][t] = scale * q_hq . k_t for three heads at a time (three
//           independent chains)
//   pass 2: token by token, acc_hq += p_hq,t v_t (acc in L1)
template <int D, class KV>
void attend_chunk(const float* q, const KV* k_cache, const KV* v_cache,
                  const int64_t* table, int64_t b0, int64_t b1, int64_t ctx, int block_size,
                  int Hq, int Hkv, float scale, float* s, float* m, float* l, float* acc) {
  const int G = Hq / Hkv;
  const int64_t token_stride = static_cast<int64_t>(Hkv) * D;
  const int64_t t0 = b0 * block_size, t1 = std::min(ctx, b1 * block_size), len = t1 - t0;
  for_each_row(k_cache, table, b0, b1, t1, block_size, token_stride,
               [&](int64_t t, const KV* krow) {
    float* st = s + (t - t0);  // s[hq * len + t - t0]
    int hq = 0;
    for (; hq + 3 <= Hq; hq += 3) {
      const float a0 = dot<D>(q + hq * D, krow + static_cast<int64_t>(hq / G) * D);
      const float a1 = dot<D>(q + (hq + 1) * D, krow + static_cast<int64_t>((hq + 1) / G) * D);
      const float a2 = dot<D>(q + (hq + 2) * D, krow + static_cast<int64_t>((hq + 2) / G) * D);
      st[hq * len] = a0 * scale;
      st[(hq + 1) * len] = a1 * scale;
      st[(hq + 2) * len] = a2 * scale;
    }
    for (; hq < Hq; ++hq)
      st[hq * len] = dot<D>(q + hq * D, krow + static_cast<int64_t>(hq / G) * D) * scale;
  }, v_cache);
  for (int hq = 0; hq < Hq; ++hq) {
    float* sh = s + hq * len;
    float mx = sh[0];
    for (int64_t t = 1; t < len; ++t) mx = std::max(mx, sh[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      sh[t] = conveyor::exp_shifted(sh[t] - mx);
      sum += sh[t];
    }
    m[hq] = mx;
    l[hq] = sum;
  }
  std::fill(acc, acc + static_cast<int64_t>(Hq) * D, 0.f);
  for_each_row(v_cache, table, b0, b1, t1, block_size, token_stride,
               [&](int64_t t, const KV* vrow) {
    for (int hq = 0; hq < Hq; ++hq) {
      const float p = s[hq * len + t - t0];
      const KV* v = vrow + static_cast<int64_t>(hq / G) * D;
      float* ah = acc + static_cast<int64_t>(hq) * D;
#pragma GCC unroll 32
      for (int c = 0; c < D / 8; ++c) {
        const v8 r = load8(ah + 8 * c) + p * load8(v + 8 * c);
        std::memcpy(ah + 8 * c, &r, sizeof(r));
      }
    }
  });
}

template <int D, class KV>
void run(const float* q, int64_t q_row_stride, const KV* k_cache, const KV* v_cache,
         const int64_t* tables, int64_t table_stride, const int64_t* seq_lens,
         const int64_t* rows, float* out, int n, int Hq, int Hkv, int block_size, float scale,
         int num_threads) {
  // Work items: (decode, chunk), numbered through first[i] .. first[i + 1] - 1.
  std::vector<int64_t> first(static_cast<size_t>(n) + 1, 0);
  int64_t max_len = 0;
  for (int i = 0; i < n; ++i) {
    const int64_t chunks = num_chunks(seq_lens[i], block_size);
    first[i + 1] = first[i] + chunks;
    const int64_t blocks = (seq_lens[i] + block_size - 1) / block_size;
    max_len = std::max(max_len, (blocks + chunks - 1) / chunks * block_size);
  }
  const int64_t items = first[n], per_item = static_cast<int64_t>(Hq) * (D + 2);
  std::vector<float> part(static_cast<size_t>(items * per_item));  // m [Hq], l [Hq], acc [Hq, D]
  std::vector<int> owner(static_cast<size_t>(items));
  for (int i = 0; i < n; ++i)
    for (int64_t it = first[i]; it < first[i + 1]; ++it) owner[it] = i;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores(static_cast<size_t>(Hq * max_len));
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int i = owner[it];
      const int64_t ctx = seq_lens[i], chunks = first[i + 1] - first[i], c = it - first[i];
      const int64_t blocks = (ctx + block_size - 1) / block_size;
      float* pm = part.data() + it * per_item;
      attend_chunk<D>(q + rows[i] * q_row_stride, k_cache, v_cache, tables + i * table_stride,
                      c * blocks / chunks, (c + 1) * blocks / chunks, ctx, block_size, Hq, Hkv,
                      scale, scores.data(), pm, pm + Hq, pm + 2 * Hq);
    }
    // Merge each decode's chunks in order: out = sum_c w_c acc_c / sum_c w_c l_c, with
    // w_c = exp(m_c - max_c m_c) (one chunk: w = 1, out = acc / l).
#pragma omp for schedule(static)
    for (int i = 0; i < n; ++i) {
      float* o = out + rows[i] * static_cast<int64_t>(Hq) * D;
      for (int hq = 0; hq < Hq; ++hq) {
        float mx = part[first[i] * per_item + hq];
        for (int64_t it = first[i] + 1; it < first[i + 1]; ++it)
          mx = std::max(mx, part[it * per_item + hq]);
        float den = 0.f;
        v8 a[D / 8];
        for (int c = 0; c < D / 8; ++c) a[c] = v8{};
        for (int64_t it = first[i]; it < first[i + 1]; ++it) {
          const float* pm = part.data() + it * per_item;
          const float w = std::exp(pm[hq] - mx);
          den += w * pm[Hq + hq];
          const float* pa = pm + 2 * Hq + static_cast<int64_t>(hq) * D;
          for (int c = 0; c < D / 8; ++c) a[c] += w * load8(pa + 8 * c);
        }
        const float inv = 1.f / den;
        for (int c = 0; c < D / 8; ++c) {
          const v8 r = a[c] * inv;
          std::memcpy(o + hq * D + 8 * c, &r, sizeof(r));
        }
      }
    }
  }
}

// The checks and the head-dim dispatch of the entry point below, for caches of KV.
template <class KV>
int decode_attention(const float* q, int64_t q_row_stride, const KV* k_cache, const KV* v_cache,
                     const int64_t* tables, int64_t table_stride, int64_t table_width,
                     const int64_t* seq_lens, const int64_t* rows, float* out, int64_t num_rows,
                     int64_t num_blocks, int n, int Hq, int Hkv, int head_dim, int block_size,
                     float scale, int num_threads) {
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

}  // namespace

extern "C" {

// kv_dtype: the caches' element type (half.h's KvDtype: 0 fp32, 1 fp16, 2 bf16; q and out are
// fp32 either way); the caches are `const void*` of that type. Returns 0 on success, else
// (nothing written):
//   1  an unknown kv_dtype, a head dim not listed above, Hq not a multiple of Hkv, a GQA
//      group wider than kMaxHeads query heads, or a non-positive size;
//   2  a seq_len < 1, or one needing more than table_width blocks;
//   3  a row outside [0, num_rows), or the same row twice;
//   4  a block id outside [0, num_blocks) among the blocks a context needs.
// The checks read n + sum(ceil(seq_len / block_size)) integers: microseconds.
// The fused forward calls it through a function pointer of this signature.
int conveyor_decode_attention(int kv_dtype, const float* q, int64_t q_row_stride,
                              const void* k_cache, const void* v_cache, const int64_t* tables,
                              int64_t table_stride, int64_t table_width,
                              const int64_t* seq_lens, const int64_t* rows, float* out,
                              int64_t num_rows, int64_t num_blocks, int n, int Hq, int Hkv,
                              int head_dim, int block_size, float scale, int num_threads) {
  return conveyor::with_kv_dtype(kv_dtype, 1, [&](auto tag) {
    using KV = conveyor::kv_type<decltype(tag)>;
    return decode_attention(q, q_row_stride, static_cast<const KV*>(k_cache),
                            static_cast<const KV*>(v_cache), tables, table_stride, table_width,
                            seq_lens, rows, out, num_rows, num_blocks, n, Hq, Hkv, head_dim,
                            block_size, scale, num_threads);
  });
}

}  // extern "C"
