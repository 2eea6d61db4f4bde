// Causal paged attention of one prefill chunk on the CPU, fp32 queries and output (flash-
// attention style). The cache holds fp32, fp16 or bf16 (--kv-cache-dtype), widened to
// fp32 as it is read (K once per call into its transposed copy, V row by row).
//
// A chunk is n query tokens of one sequence at positions ctx - n .. ctx - 1 (the chunk's own
// K/V already stored in the cache); query i attends to keys 0 .. ctx - n + i, read straight
// from the paged cache through the block table (no gathered copy, K/V never expanded for
// GQA: query head hq uses KV head hq / G).
//
// The forward of FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", 2023, algorithm 1) with one cache block as the key
// tile: a work item is a KV head and a tile of kTileQueries query tokens (its G query heads
// each: kTileQueries * G rows); for each key block in order it computes the rows' scores
// S = scale * Q K^T, their running max m, sum l and output O (rescaled by exp(m_old - m_new)
// when the max grows), and O / l at the end. Blocks past a tile's last query are skipped,
// the causal mask is applied only on the blocks that cross a query's position.
//
// Micro-kernels: each block's K is transposed once per call into [D, block_size] (every tile
// reads it) and each score row is block_size / 8 vector accumulators over d (eight or four
// rows at a time: kScoreRows, each K^T vector loaded once for them), so a score costs no
// horizontal sum; P V adds each token's V row times its probability into the D / 8
// accumulators of one output row. Work items are spread over OpenMP threads (the libgomp
// torch loaded: one pool).
//
// Measured on a 2-core Zen 3 (AVX2), 9 query / 3 KV heads of 64, block size 16, one process
// alternating with torch's flash SDPA on the gathered K/V (the path it replaces), two runs: a
// 512-token chunk at position 0 3.7-4.1 ms against 5.4-6.2 (1.4-1.5x); after 512 tokens of
// context 10.1-10.3 against 11.0-12.2 (1.07-1.2x); 200 rows at 300 tokens 1.39 against 1.98.
//
// bf16 products (run_bf16, chosen per call; built only where the compiler targets
// AVX512-BF16): the same algorithm with Q K^T and P V as vdpbf16ps (two bf16 products a lane,
// summed in fp32) over K^T and V packed as bf16 pairs once per call, keys in groups of 64 for
// blocks of 16 or 32 tokens. Measured on a Zen 4 (one thread, process CPU time, the machine
// shared), 9 / 3 heads of 64, block size 16, a 512-token chunk: at position 0 4.0-4.1 ms
// against 5.0-5.1 in fp32; after 2,560 tokens of context 25-26 against 47-49; after 5,488,
// 52-57 against 107-112 (about 2x at long contexts).
//
// Layouts (strides in elements):
//   q        [n, Hq, D]: row i at q + i * q_row_stride, heads then D contiguous
//   caches   [num_blocks, block_size, Hkv, D] contiguous (K and V alike)
//   table    [ceil(ctx / block_size)] int64 block ids of the sequence
//   out      [n, Hq, D]: row i at out + i * out_row_stride
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "half.h"
#include "softmax_exp.h"

namespace {

using conveyor::load8;

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

constexpr int kTileQueries = 16;  // query tokens per work item
// Score rows a micro-kernel computes at once (R x BS8 vector accumulators over d): 8 where the
// build has 32 vector registers (AVX-512), 4 with AVX2's 16. Measured on a Zen 4, 9 query / 3
// KV heads of 64, block size 16 (16 accumulators, 16 independent FMA chains against 8): a
// 512-token chunk at position 0 2.79-3.10 -> 2.35-2.60 ms, after 512 tokens 7.6-8.2 -> 6.4-7.0,
// 200 rows at 400 1.30-1.49 -> 1.10-1.29, the same bits (with the two softmax changes in tile);
// built for AVX2 there, R = 8 measured 1-2% slower than 4 (spills).
#if defined(__AVX512F__)
constexpr int kScoreRows = 8;
#else
constexpr int kScoreRows = 4;
#endif
// The running max before the first key, and the score of a masked key: finite (the build is
// -ffast-math, which assumes no infinities and vectorises exp through libmvec), and so far
// below any real score that exp(kMasked - m) is 0.
constexpr float kMasked = -1e30f;
constexpr int kMaxBlock = 64;     // block_size limit (score row in registers / on the stack)

// Rows r0 .. r0+R-1 of the tile: s[r][j] = scale * q_r . k_j for the block's BS8 * 8 keys.
template <int D, int R, int BS8>
inline void scores(const float* const* qrow, const float* kt, float scale, float* s,
                   int s_stride) {
  v8 acc[R][BS8];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < BS8; ++c) acc[r][c] = v8{};
  for (int d = 0; d < D; ++d) {
    v8 kv[BS8];
    for (int c = 0; c < BS8; ++c) kv[c] = load8(kt + d * BS8 * 8 + 8 * c);
    for (int r = 0; r < R; ++r) {
      const v8 qv = splat(qrow[r][d]);
      for (int c = 0; c < BS8; ++c) acc[r][c] += qv * kv[c];
    }
  }
  const v8 sc = splat(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < BS8; ++c) store8(s + r * s_stride + 8 * c, acc[r][c] * sc);
}

// o[0 .. 8W) = alpha o + sum over the first `visible` tokens j of p[j] v_j[0 .. 8W): W vector
// accumulators of one output row.
template <int W>
inline void pv(float* o, const float* v, const float* p, int visible, float alpha,
               int64_t token_stride) {
  v8 a[W];
  const v8 va = splat(alpha);
  for (int c = 0; c < W; ++c) a[c] = load8(o + 8 * c) * va;
  for (int j = 0; j < visible; ++j) {
    const v8 pj = splat(p[j]);
    const float* vj = v + j * token_stride;
    for (int c = 0; c < W; ++c) a[c] += pj * load8(vj + 8 * c);
  }
  for (int c = 0; c < W; ++c) store8(o + 8 * c, a[c]);
}

// One block of one row's online softmax: the max of the row's first `visible` scores (the rest
// masked), the new running max m (updated), sr[j] = exp(sr[j] - m) for every j < BS8 * 8 (0
// past `visible`) and sum = their sum. Returns alpha = exp(m_old - m_new), the factor of the
// row's earlier sum and output: 0 on the first block (m_old = kMasked), 1 while the max holds.
template <int BS8>
inline float softmax_block(float* sr, int visible, float& m, float& sum) {
  constexpr int BS = BS8 * 8;
  float mx;
  if (visible == BS) {  // a whole block: the max in vector lanes
    v8 mv = load8(sr);
    for (int c = 1; c < BS8; ++c) {
      const v8 x = load8(sr + 8 * c);
      mv = mv > x ? mv : x;
    }
    mx = std::max(std::max(std::max(mv[0], mv[1]), std::max(mv[2], mv[3])),
                  std::max(std::max(mv[4], mv[5]), std::max(mv[6], mv[7])));
  } else {
    mx = sr[0];
    for (int j = 1; j < visible; ++j) mx = std::max(mx, sr[j]);
    for (int j = visible; j < BS; ++j) sr[j] = kMasked;
  }
  const float m_new = std::max(m, mx);
  const float alpha = m_new == m ? 1.f : std::exp(m - m_new);  // no exp while the max holds
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int j = 0; j < BS; ++j) {
    sr[j] = conveyor::exp_shifted(sr[j] - m_new);
    total += sr[j];
  }
  m = m_new;
  sum = total;
  return alpha;
}

// Query tokens i0 .. i0 + kTileQueries - 1 (clipped to n) of KV head h's query heads. kt_h:
// [blocks, D, BS] K^T of head h's blocks (made once per call by run).
template <int D, int BS8, class KV>
void tile(const float* q, int64_t q_row_stride, const float* kt_h, const KV* v_cache,
          const int64_t* table, int64_t n, int64_t ctx, float* out, int64_t out_row_stride,
          int Hq, int Hkv, int block_size, float scale, int h, int64_t i0,
          std::vector<float>& buf) {
  constexpr int BS = BS8 * 8;  // block_size rounded up to 8 (padding keys are masked)
  const int G = Hq / Hkv;
  const int64_t i1 = std::min<int64_t>(n, i0 + kTileQueries);
  const int rows = static_cast<int>(i1 - i0) * G;  // row r: query i0 + r / G, head h G + r % G
  const int64_t start = ctx - n;                    // position of query 0
  const int64_t token_stride = static_cast<int64_t>(Hkv) * D;
  constexpr bool kWiden = !std::is_same_v<KV, float>;
  buf.resize(static_cast<size_t>(rows * BS + rows * D + 2 * rows + (kWiden ? BS * D : 0)));
  float* s = buf.data();           // [rows, BS] scores, then probabilities
  float* o = s + rows * BS;        // [rows, D] unnormalised output
  float* m = o + rows * D;         // [rows] running max
  float* l = m + rows;             // [rows] running sum
  float* vw = l + rows;            // [BS, D] a 16-bit block's V widened (kWiden only)
  std::fill(o, o + rows * D, 0.f);
  std::fill(m, m + rows, kMasked);
  std::fill(l, l + rows, 0.f);
  std::vector<const float*> qrow(static_cast<size_t>(rows));
  for (int r = 0; r < rows; ++r)
    qrow[r] = q + (i0 + r / G) * q_row_stride + static_cast<int64_t>(h * G + r % G) * D;
  const int64_t last_key = start + i1 - 1;  // the tile's last query sees keys 0 .. last_key
  const int64_t blocks = last_key / block_size + 1;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t k0 = b * block_size;
    const int nt = static_cast<int>(std::min<int64_t>(block_size, ctx - k0));
    const float* kt = kt_h + b * D * BS;
    const KV* vh = v_cache + table[b] * block_size * token_stride + static_cast<int64_t>(h) * D;
    // V rows of the block: fp32 in place, or a 16-bit block widened once here for all the
    // tile's rows (each row's P V then runs the fp32 code: the same bits as an fp32 cache
    // holding the widened values)
    const float* vb;
    int64_t v_stride;
    if constexpr (kWiden) {
      for (int j = 0; j < nt; ++j)
        for (int d = 0; d < D; d += 8) store8(vw + j * D + d, load8(vh + j * token_stride + d));
      vb = vw;
      v_stride = D;
    } else {
      vb = vh;
      v_stride = token_stride;
    }
    int r = 0;
    if constexpr (kScoreRows == 8)
      for (; r + 8 <= rows; r += 8) scores<D, 8, BS8>(qrow.data() + r, kt, scale, s + r * BS, BS);
    for (; r + 4 <= rows; r += 4) scores<D, 4, BS8>(qrow.data() + r, kt, scale, s + r * BS, BS);
    for (; r < rows; ++r) scores<D, 1, BS8>(qrow.data() + r, kt, scale, s + r * BS, BS);
    // keys past a row's position (or past the block's tokens) get probability 0
    const bool full = k0 + BS - 1 <= start + i0 && nt == BS;
    for (r = 0; r < rows; ++r) {
      float* sr = s + r * BS;
      const int visible = full ? BS
                                : static_cast<int>(std::clamp<int64_t>(
                                      start + i0 + r / G - k0 + 1, 0, nt));
      if (visible == 0) continue;  // a block past this row's position (later rows see it)
      float sum;
      const float alpha = softmax_block<BS8>(sr, visible, m[r], sum);
      l[r] = l[r] * alpha + sum;
      float* orow = o + r * D;
      for (int d0 = 0; d0 + 64 <= D; d0 += 64) pv<8>(orow + d0, vb + d0, sr, visible, alpha, v_stride);
      if constexpr (D % 64 != 0)
        pv<(D % 64) / 8>(orow + D / 64 * 64, vb + D / 64 * 64, sr, visible, alpha, v_stride);
    }
  }
  for (int r = 0; r < rows; ++r) {
    float* dst = out + (i0 + r / G) * out_row_stride + static_cast<int64_t>(h * G + r % G) * D;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
  }
}

#if defined(__AVX512BF16__)
// ---- 16-bit products (AVX512-BF16), chosen per call (bf16_dot) ----------------------------
// Q K^T and P V as vdpbf16ps: bf16 operands, each product exact in fp32, summed in fp32 (two
// products a lane an instruction: 32 multiply-adds per zmm instruction where an fp32 FMA does
// 16). q is rounded to bf16 per tile, K and V per call into their packed copies (exact for a
// bf16 cache), each block's probabilities after the exp; the softmax (max, exp, running sums)
// stays fp32, and the running sum l adds the rounded probabilities, so an output row is a
// convex combination of the V rows it attends to (a constant V comes back exact).
// Packed layouts, bf16 pairs (element 2i in the low half of a 32-bit lane):
//   K^T  [Hkv, blocks, D / 2, BS] pairs (d 2i, 2i + 1) of key j: lane j of a block's zmm
//   V    [Hkv, blocks, BS / 2, D] pairs (keys 2t, 2t + 1) of dim d: lane d
// with BS the block size rounded up to 16 (padding keys 0, their probabilities 0).

inline __m512i as_i512(__m512 x) { return _mm512_castps_si512(x); }

// 16 K/V elements widened to fp32 (exact), then 16 bf16 (round to nearest even) as uint16.
template <class KV>
inline __m256i bf16x16(const KV* p) {
  const v8 lo = load8(p), hi = load8(p + 8);
  __m256 a, b;
  std::memcpy(&a, &lo, sizeof(a));
  std::memcpy(&b, &hi, sizeof(b));
  const __m512 x = _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
  return (__m256i)_mm512_cvtneps_pbh(x);
}

// 16 pairs: a[i] in the low, b[i] in the high half of lane i.
inline __m512i pairs(__m256i a, __m256i b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(a),
                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// Rows r0 .. r0+R-1: s[r][j] = scale * q_r . k_j for the group's C * 16 keys (NB blocks of
// C / NB zmm columns each). qp: [rows, D / 2] bf16 pairs of the tile's queries; kt: the first
// block's packed K^T (the group's blocks follow it).
template <int D, int R, int C, int NB>
inline void scores_bf16(const uint32_t* qp, const uint32_t* kt, float scale, float* s,
                        int s_stride) {
  constexpr int CB = C / NB, BS = CB * 16;  // columns and keys of a block
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i) {
    __m512i kv[C];
    for (int c = 0; c < C; ++c)
      kv[c] = _mm512_loadu_si512(kt + (c / CB) * (D / 2) * BS + i * BS + (c % CB) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i qv = _mm512_set1_epi32(static_cast<int>(qp[r * (D / 2) + i]));
      for (int c = 0; c < C; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)qv, (__m512bh)kv[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(s + r * s_stride + 16 * c, _mm512_mul_ps(acc[r][c], sc));
}

// Rows r0 .. r0+R-1: o_r = alpha_r o_r + sum over key pairs t < npairs of p_r,t . v_t. pp:
// [rows, pp_stride] the rows' probabilities as bf16 pairs; vp: the group's packed V.
template <int D, int R>
inline void pv_bf16(float* o, const uint32_t* pp, int pp_stride, const uint32_t* vp,
                    const float* alpha, int npairs) {
  constexpr int W = D / 16;
  __m512 a[R][W];
  for (int r = 0; r < R; ++r) {
    const __m512 al = _mm512_set1_ps(alpha[r]);
    for (int c = 0; c < W; ++c) a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * c), al);
  }
  for (int t = 0; t < npairs; ++t) {
    __m512i vv[W];
    for (int c = 0; c < W; ++c) vv[c] = _mm512_loadu_si512(vp + (t * W + c) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i p2 = _mm512_set1_epi32(static_cast<int>(pp[r * pp_stride + t]));
      for (int c = 0; c < W; ++c)
        a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)p2, (__m512bh)vv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) _mm512_storeu_ps(o + r * D + 16 * c, a[r][c]);
}

// P V rows at a time: 16 accumulators (R x D / 16) where D allows.
template <int D>
constexpr int kPvRows = D / 16 >= 16 ? 1 : 16 / (D / 16);

// The tile of `tile` with 16-bit products, over key groups of NB blocks (C zmm columns: C * 16
// keys, one online-softmax step; NB > 1 only where the blocks hold a multiple of 16 tokens,
// so that a group's keys are consecutive positions). kt_h, vp_h: KV head h's packed K^T and V
// ([blocks, D / 2, BS] and [blocks, BS / 2, D] pairs, BS = C / NB * 16).
template <int D, int C, int NB>
void tile_bf16(const float* q, int64_t q_row_stride, const uint32_t* kt_h, const uint32_t* vp_h,
               int64_t n, int64_t ctx, float* out, int64_t out_row_stride, int Hq, int Hkv,
               int block_size, float scale, int h, int64_t i0, std::vector<float>& buf,
               std::vector<uint32_t>& pbuf) {
  constexpr int BS = C / NB * 16, KG = C * 16, P = kPvRows<D>;
  constexpr int SR = C >= 4 ? 4 : 8;  // score rows at once: at most 32 accumulators
  const int G = Hq / Hkv;
  const int64_t i1 = std::min<int64_t>(n, i0 + kTileQueries);
  const int rows = static_cast<int>(i1 - i0) * G;  // row r: query i0 + r / G, head h G + r % G
  const int64_t start = ctx - n;
  // buf: s [rows, KG], o [rows, D], m, l, alpha [rows]; pbuf: q [rows, D / 2] and p [rows,
  // KG / 2] as bf16 pairs
  buf.resize(static_cast<size_t>(rows * (KG + D + 3)));
  pbuf.resize(static_cast<size_t>(rows * (D / 2 + KG / 2)));
  float* s = buf.data();
  float* o = s + rows * KG;
  float* m = o + rows * D;
  float* l = m + rows;
  float* alpha = l + rows;
  uint32_t* qp = pbuf.data();
  uint32_t* pp = qp + rows * (D / 2);
  std::fill(o, o + rows * D, 0.f);
  std::fill(m, m + rows, kMasked);
  std::fill(l, l + rows, 0.f);
  for (int r = 0; r < rows; ++r) {  // D bf16 in order are D / 2 pairs
    const float* qr = q + (i0 + r / G) * q_row_stride + static_cast<int64_t>(h * G + r % G) * D;
    for (int d = 0; d < D; d += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qp + r * (D / 2) + d / 2), bf16x16(qr + d));
  }
  const int64_t blocks = (start + i1 - 1) / block_size + 1;
  const int64_t packed = static_cast<int64_t>(D / 2) * BS;  // pairs of one packed block
  for (int64_t b = 0; b < blocks; b += NB) {
    // the group's blocks b .. b + NB - 1 (the last may run past the context: its K^T and V
    // are packed as zeros up to the group, and its keys are masked)
    const int64_t k0 = b * block_size;
    const int nt = static_cast<int>(std::min<int64_t>(NB * block_size, ctx - k0));
    int r = 0;
    for (; r + SR <= rows; r += SR)
      scores_bf16<D, SR, C, NB>(qp + r * (D / 2), kt_h + b * packed, scale, s + r * KG, KG);
    for (; r < rows; ++r)
      scores_bf16<D, 1, C, NB>(qp + r * (D / 2), kt_h + b * packed, scale, s + r * KG, KG);
    const bool full = k0 + KG - 1 <= start + i0 && nt == KG;
    int max_visible = 0;
    for (r = 0; r < rows; ++r) {
      float* sr = s + r * KG;
      const int visible = full ? KG
                                : static_cast<int>(std::clamp<int64_t>(
                                      start + i0 + r / G - k0 + 1, 0, nt));
      uint32_t* pr = pp + r * (KG / 2);
      if (visible == 0) {  // a group past this row's position: o unchanged (0 x v adds 0)
        std::fill(pr, pr + KG / 2, 0u);
        alpha[r] = 1.f;
        continue;
      }
      max_visible = std::max(max_visible, visible);
      float unrounded;
      alpha[r] = softmax_block<KG / 8>(sr, visible, m[r], unrounded);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m256i pb = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(sr + 16 * c));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 8 * c), pb);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(
                                     _mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
      }
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    if (max_visible == 0) continue;
    const int npairs = (max_visible + 1) / 2;
    const uint32_t* vp = vp_h + b * packed;
    for (r = 0; r + P <= rows; r += P)
      pv_bf16<D, P>(o + r * D, pp + r * (KG / 2), KG / 2, vp, alpha + r, npairs);
    for (; r < rows; ++r)
      pv_bf16<D, 1>(o + r * D, pp + r * (KG / 2), KG / 2, vp, alpha + r, npairs);
  }
  for (int r = 0; r < rows; ++r) {
    float* dst = out + (i0 + r / G) * out_row_stride + static_cast<int64_t>(h * G + r % G) * D;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
  }
}

// tile_bf16 over every tile: K^T and V packed once (all KV heads, the context's blocks), then
// the tiles spread over the threads as in `run`.
template <int D, int C, int NB, class KV>
void run_bf16(const float* q, int64_t q_row_stride, const KV* k_cache, const KV* v_cache,
              const int64_t* table, int64_t n, int64_t ctx, float* out, int64_t out_row_stride,
              int Hq, int Hkv, int block_size, float scale, int num_threads) {
  constexpr int BS = C / NB * 16;
  const int64_t tiles = (n + kTileQueries - 1) / kTileQueries, items = tiles * Hkv;
  const int64_t used = (ctx + block_size - 1) / block_size;  // the context's blocks
  const int64_t blocks = (used + NB - 1) / NB * NB;           // packed: whole groups
  const int64_t token_stride = static_cast<int64_t>(Hkv) * D;
  const int64_t per_block = static_cast<int64_t>(D / 2) * BS;  // pairs of one packed block
  std::vector<uint32_t> kt(static_cast<size_t>(Hkv * blocks * per_block));
  std::vector<uint32_t> vp(static_cast<size_t>(Hkv * blocks * per_block));
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t hb = 0; hb < Hkv * blocks; ++hb) {
      const int64_t h = hb / blocks, b = hb % blocks;
      // tokens of block b in the context (none for a block past it: all zeros)
      const int nt = static_cast<int>(
          std::clamp<int64_t>(ctx - b * block_size, 0, block_size));
      const int64_t id = b < used ? table[b] : 0;
      const KV* kb = k_cache + id * block_size * token_stride + h * D;
      const KV* vb = v_cache + id * block_size * token_stride + h * D;
      uint32_t* kdst = kt.data() + hb * per_block;
      uint32_t* vdst = vp.data() + hb * per_block;
      alignas(64) uint16_t row[D];
      for (int j = 0; j < BS; ++j) {  // K^T: pairs along d, lanes along keys
        if (j < nt)
          for (int d = 0; d < D; d += 16)
            _mm256_store_si256(reinterpret_cast<__m256i*>(row + d),
                               bf16x16(kb + j * token_stride + d));
        for (int i = 0; i < D / 2; ++i)
          kdst[i * BS + j] = j < nt ? static_cast<uint32_t>(row[2 * i]) |
                                          static_cast<uint32_t>(row[2 * i + 1]) << 16
                                    : 0u;
      }
      for (int t = 0; t < BS / 2; ++t)  // V: pairs along keys, lanes along d
        for (int d = 0; d < D; d += 16) {
          const __m256i zero = _mm256_setzero_si256();
          const __m256i a = 2 * t < nt ? bf16x16(vb + 2 * t * token_stride + d) : zero;
          const __m256i c = 2 * t + 1 < nt ? bf16x16(vb + (2 * t + 1) * token_stride + d) : zero;
          _mm512_storeu_si512(vdst + t * D + d, pairs(a, c));
        }
    }
    std::vector<float> buf;
    std::vector<uint32_t> pbuf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t t = tiles - 1 - it / Hkv, h = it % Hkv;
      tile_bf16<D, C, NB>(q, q_row_stride, kt.data() + h * blocks * per_block,
                         vp.data() + h * blocks * per_block, n, ctx, out, out_row_stride, Hq,
                         Hkv, block_size, scale, static_cast<int>(h), t * kTileQueries, buf,
                         pbuf);
    }
  }
}
#endif  // __AVX512BF16__

template <int D, int BS8, class KV>
void run(const float* q, int64_t q_row_stride, const KV* k_cache, const KV* v_cache,
         const int64_t* table, int64_t n, int64_t ctx, float* out, int64_t out_row_stride,
         int Hq, int Hkv, int block_size, float scale, int num_threads) {
  constexpr int BS = BS8 * 8;
  const int64_t tiles = (n + kTileQueries - 1) / kTileQueries, items = tiles * Hkv;
  const int64_t blocks = (ctx + block_size - 1) / block_size;
  const int64_t token_stride = static_cast<int64_t>(Hkv) * D;
  // K^T of every block and KV head, once for all the tiles that read it: [Hkv, blocks, D, BS]
  // (keys past the context and padding keys are 0; their scores are masked)
  std::vector<float> kt(static_cast<size_t>(Hkv * blocks * D * BS));
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t hb = 0; hb < Hkv * blocks; ++hb) {
      const int64_t h = hb / blocks, b = hb % blocks;
      const int nt = static_cast<int>(std::min<int64_t>(block_size, ctx - b * block_size));
      const KV* kb = k_cache + table[b] * block_size * token_stride + h * D;
      float* dst = kt.data() + hb * D * BS;
      for (int j = 0; j < BS; ++j) {
        if (j >= nt) {
          for (int d = 0; d < D; ++d) dst[d * BS + j] = 0.f;
          continue;
        }
        float row[D];  // token j's K, widened 8 at a time from a 16-bit cache
        for (int d = 0; d < D; d += 8) store8(row + d, load8(kb + j * token_stride + d));
        for (int d = 0; d < D; ++d) dst[d * BS + j] = row[d];
      }
    }
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      // the last tiles (the most keys) first, so that the short ones fill in at the end
      const int64_t t = tiles - 1 - it / Hkv, h = it % Hkv;
      tile<D, BS8>(q, q_row_stride, kt.data() + h * blocks * D * BS, v_cache, table, n, ctx,
                   out, out_row_stride, Hq, Hkv, block_size, scale, static_cast<int>(h),
                   t * kTileQueries, buf);
    }
  }
}

template <int D, class KV>
void run_d(const float* q, int64_t q_row_stride, const KV* k_cache, const KV* v_cache,
           const int64_t* table, int64_t n, int64_t ctx, float* out, int64_t out_row_stride,
           int Hq, int Hkv, int block_size, float scale, int num_threads, bool bf16_dot) {
#if defined(__AVX512BF16__)
  if (bf16_dot) {
    // a block's keys padded to 16, 32 or 64 (1, 2 or 4 zmm columns); blocks of 16 and 32
    // tokens in groups of 64 keys (fewer softmax steps), other sizes a block a step
#define CONVEYOR_BF16(C, NB)                                                                \
  run_bf16<D, C, NB>(q, q_row_stride, k_cache, v_cache, table, n, ctx, out, out_row_stride, \
                     Hq, Hkv, block_size, scale, num_threads)
    if (block_size == 16)
      CONVEYOR_BF16(4, 4);
    else if (block_size == 32)
      CONVEYOR_BF16(4, 2);
    else if (block_size <= 16)
      CONVEYOR_BF16(1, 1);
    else if (block_size <= 32)
      CONVEYOR_BF16(2, 1);
    else
      CONVEYOR_BF16(4, 1);
#undef CONVEYOR_BF16
    return;
  }
#else
  (void)bf16_dot;  // checked by the entry point: never set without the instructions
#endif
  switch ((block_size + 7) / 8) {
#define CONVEYOR_BS(B8)                                                                     \
  case B8:                                                                                  \
    run<D, B8>(q, q_row_stride, k_cache, v_cache, table, n, ctx, out, out_row_stride, Hq,   \
               Hkv, block_size, scale, num_threads);                                        \
    break;
    CONVEYOR_BS(1)
    CONVEYOR_BS(2)
    CONVEYOR_BS(4)
    CONVEYOR_BS(8)
#undef CONVEYOR_BS
    default:  // 3, 5, 6, 7: the next size up (more padding keys, masked)
      if (block_size <= 32)
        run<D, 4>(q, q_row_stride, k_cache, v_cache, table, n, ctx, out, out_row_stride, Hq,
                  Hkv, block_size, scale, num_threads);
      else
        run<D, 8>(q, q_row_stride, k_cache, v_cache, table, n, ctx, out, out_row_stride, Hq,
                  Hkv, block_size, scale, num_threads);
  }
}

// The checks and the head-dim dispatch of the entry point below, for caches of KV.
template <class KV>
int prefill_attention(const float* q, int64_t q_row_stride, const KV* k_cache, const KV* v_cache,
                      const int64_t* table, int64_t table_len, int64_t n, int64_t ctx,
                      float* out, int64_t out_row_stride, int64_t num_blocks, int Hq, int Hkv,
                      int head_dim, int block_size, float scale, int num_threads,
                      bool bf16_dot) {
  if (Hkv <= 0 || Hq <= 0 || Hq % Hkv != 0 || block_size <= 0 || block_size > kMaxBlock ||
      num_threads <= 0 || n <= 0 || ctx <= 0 || num_blocks <= 0)
    return 1;
  const int64_t need = (ctx + block_size - 1) / block_size;
  if (n > ctx || table_len < need) return 2;
  for (int64_t b = 0; b < need; ++b)
    if (table[b] < 0 || table[b] >= num_blocks) return 4;
  switch (head_dim) {
#define CONVEYOR_CASE(DIM)                                                                  \
  case DIM:                                                                                 \
    run_d<DIM>(q, q_row_stride, k_cache, v_cache, table, n, ctx, out, out_row_stride, Hq,   \
               Hkv, block_size, scale, num_threads, bf16_dot);                              \
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

// Whether this build has the 16-bit products (bf16_dot below): built where the compiler
// targets AVX512-BF16 (-march=native on such a CPU, no ISA cap).
int conveyor_prefill_attention_bf16_dot() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// kv_dtype: the caches' element type (half.h's KvDtype: 0 fp32, 1 fp16, 2 bf16; q and out are
// fp32 either way); the caches are `const void*` of that type. bf16_dot: 0 for fp32 products
// (the bits of an fp32 cache holding the widened values), 1 for bf16 products with fp32 sums
// (run_bf16; only where conveyor_prefill_attention_bf16_dot()). Returns 0 on success, else
// (nothing written):
//   1  an unknown kv_dtype, a head dim not listed above, Hq not a multiple of Hkv, block_size
//      outside [1, kMaxBlock], or a non-positive size;
//   2  n > ctx, or a table shorter than ceil(ctx / block_size);
//   4  a block id outside [0, num_blocks) among the blocks the context needs;
//   5  bf16_dot not 0 or 1, or 1 in a build without the 16-bit products.
int conveyor_prefill_attention(int kv_dtype, int bf16_dot, const float* q, int64_t q_row_stride,
                               const void* k_cache, const void* v_cache, const int64_t* table,
                               int64_t table_len, int64_t n, int64_t ctx, float* out,
                               int64_t out_row_stride, int64_t num_blocks, int Hq, int Hkv,
                               int head_dim, int block_size, float scale, int num_threads) {
  if (bf16_dot != 0 && (bf16_dot != 1 || !conveyor_prefill_attention_bf16_dot())) return 5;
  return conveyor::with_kv_dtype(kv_dtype, 1, [&](auto tag) {
    using KV = conveyor::kv_type<decltype(tag)>;
    return prefill_attention(q, q_row_stride, static_cast<const KV*>(k_cache),
                             static_cast<const KV*>(v_cache), table, table_len, n, ctx, out,
                             out_row_stride, num_blocks, Hq, Hkv, head_dim, block_size, scale,
                             num_threads, bf16_dot == 1);
  });
}

}  // extern "C"
