// Linear layers on the CPU with weights in fp32, int8 or int4 (scales in fp32, or in fp16 as
// GGUF's Q4_1 / Q8_0 blocks store them), dequantized on the fly:
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias),  x and y fp32.
//
// Built twice from this one file (kernels/quant_linear_cpu.py): with AVX-512 flags and with
// AVX2 + FMA flags; the preprocessor picks the vector type V16 (16 floats: one zmm, or two
// ymm). Everything else is shared, and every output element is computed by the same
// sequence of rounded operations in both builds and for every row count M, tile shape and
// thread count:
//   fp32, int8:  acc = 0;  for k = 0 .. K-1:  acc = fma(x[m, k], w(n, k), acc)   (k in order)
//                with w the stored fp32 value or the int8 value q (exact in fp32);
//                y = acc (fp32)  or  y = acc * scale[n] (int8)
//   int4, q4_1 (w = d[n, g] q + min[n, g], q in [0, 15], g = k / group): for each group g
//                in order:  s = 0;  for k in g, in order:  s = fma(x[m, k], q(n, k), s)
//                acc = fma(xsum[m, g], min[n, g], fma(d[n, g], s, acc)),  y = acc
//                with xsum[m, g] the sum of x[m, k] over the group, added in k order
//   q8_0 (w = d[n, g] q, q in [-127, 127]): for each group g in order:
//                s = 0;  for k in g, in order:  s = fma(x[m, k], q(n, k), s)
//                acc = fma(d[n, g], s, acc),  y = acc
//   (q4_1 and q8_0 keep d and min in fp16, converted exactly to fp32 with F16C before use:
//   int4 and q4_1 over the same values give the same bits.)
//   then y = y + bias[n]. So a row's output does not depend on how many rows share the call
// or how the work is split: batch invariance for free, and the builds are bit-identical.
//
// Packed layouts (kernels/quant_pack.py packs them), N padded to Np, a multiple of 64
// (padded channels have zero weights and scales), channels in blocks of 64, k-major:
//   fp32:  w [Np / 64, K, 64] float      block b holds channels 64b .. 64b+63
//   int8:  w [Np / 64, K, 64] int8       scale [Np] float (one per output channel)
//   int4:  w [Np / 64, ceil(K / 2), 64] uint8: byte c of pair j = q(64b + c, 2j) in the low
//          nibble | q(64b + c, 2j + 1) in the high nibble (0 when 2j + 1 == K);
//          d, min [Np / 64, ceil(K / group), 64] float (group even)
//   q4_1:  w as int4;  d, min [Np / 64, ceil(K / group), 64] fp16 (group even; 5.0 bits a
//          weight at group 32, as GGUF's Q4_1 block; Q4_0 is this with min = -8 d)
//   q8_0:  w as int8;  d [Np / 64, ceil(K / group), 64] fp16 (8.5 bits a weight at group 32,
//          as GGUF's Q8_0 block)
// The C ABI passes scale / minv as float pointers; for q4_1 / q8_0 they point at fp16 data.
// so a one-row call reads each block as one sequential stream. A panel is 16 channels (a
// quarter of a block: one vector). A tile is R rows x C panels: for each k, C weight vectors
// are loaded (and converted) once and multiplied into R x C accumulators by broadcasting
// x[m, k] (the outer-product form of GEMM micro-kernels, as in BLIS: Van Zee and van de
// Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS Functionality", ACM TOMS 2015).
// With many rows, a group of C panels is converted to floats once (unpack_strip) and every
// row block reads those. Work items (groups of C panels, blocks of R rows) are spread over
// OpenMP threads; the library links the libgomp torch has loaded, so both share one pool.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr const char* kIsa = "avx512";
// Tile shapes (rows x panels) for many rows and for one, per format {fp32, int8, int4, q4_1,
// q8_0}: accumulators R x C vectors (grouped formats: twice: group sums and totals) in 32
// vector registers.
constexpr int kGemmRows[5] = {6, 6, 6, 6, 6}, kGemmPanels[5] = {4, 4, 4, 4, 4},
              kGemvPanels[5] = {4, 4, 4, 4, 4};
// Whether many-row calls unpack int8 / int4 weights once per panel group (unpack_strip).
constexpr bool kStrip[5] = {false, true, true, true, true};
struct V16 {
  __m512 v;
};
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 bcast(float x) { return {_mm512_set1_ps(x)}; }
inline V16 fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 load_h(const uint16_t* p) {  // 16 fp16 -> fp32 (exact)
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V16 load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void load_u4x2(const uint8_t* p, V16& lo, V16& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo.v = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
// As above within 16 registers (a V16 is two of them).
constexpr int kGemmRows[5] = {4, 4, 2, 2, 2}, kGemmPanels[5] = {1, 1, 1, 1, 1},
              kGemvPanels[5] = {4, 4, 2, 2, 2};
// int4 from a strip measured 1.5-2.5x slower here than unpacking in each tile (GCC 12 keeps
// the group sums in memory when a V16 is two ymm registers); q8_0's group sums alike.
constexpr bool kStrip[5] = {false, true, false, false, false};
struct V16 {
  __m256 lo, hi;
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 bcast(float x) {
  const __m256 v = _mm256_set1_ps(x);
  return {v, v};
}
inline V16 fma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 load_h(const uint16_t* p) {  // 16 fp16 -> fp32 (exact)
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256 i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V16 load_i8(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
inline void load_u4x2(const uint8_t* p, V16& lo, V16& hi) {
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
#else
#error "quant_linear_cpu.cpp needs AVX-512 (F, BW) or AVX2 + FMA + F16C"
#endif

enum Format { kF32 = 0, kI8 = 1, kI4 = 2, kQ41 = 3, kQ80 = 4 };
constexpr bool is_4bit(int f) { return f == kI4 || f == kQ41; }
constexpr bool is_8bit(int f) { return f == kI8 || f == kQ80; }
constexpr bool is_grouped(int f) { return f == kI4 || f == kQ41 || f == kQ80; }
constexpr bool has_half_scales(int f) { return f == kQ41 || f == kQ80; }

// From this many row blocks on, int8 / int4 weights are unpacked once per panel group into
// floats (unpack_strip) instead of once per tile.
constexpr int64_t kStripRowBlocks = 2;

struct Problem {
  const float* x;
  int64_t x_stride, M, K, N, Np;
  const void* w;
  const void* scale;  // int8: [Np] float; int4: d [Np/64, groups, 64] float; q4_1, q8_0: fp16
  const void* minv;   // int4: [Np/64, groups, 64] float; q4_1: fp16
  int64_t group, groups;
  const float* xsum;  // int4, q4_1: [M, groups], sum of x over each group (k in order)
  const float* bias;  // [Np] or null
  float* y;
  int64_t y_stride;
};

// Offset (in elements) of panel p's 16 lanes at row j of a [Np / 64, rows, 64] array.
inline int64_t at(int64_t p, int64_t rows, int64_t j) { return ((p >> 2) * rows + j) * 64 + (p & 3) * 16; }

// 16 scales (or mins) at element offset `off` of a float array, or of an fp16 one.
template <int Fmt>
inline V16 load_scale(const void* p, int64_t off) {
  if constexpr (has_half_scales(Fmt))
    return load_h(static_cast<const uint16_t*>(p) + off);
  else
    return load(static_cast<const float*>(p) + off);
}

// acc[r][c] = fma(x[r, k], w(panel p0 + c, k), acc[r][c]) for k in order.
template <int R, int C>
inline void tile_f32(const Problem& pb, const float* x, int64_t p0, V16 (&acc)[R][C]) {
  const float* w = static_cast<const float*>(pb.w);
  for (int64_t k = 0; k < pb.K; ++k) {
    V16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(w + at(p0 + c, pb.K, k));
    for (int r = 0; r < R; ++r) {
      const V16 xv = bcast(x[r * pb.x_stride + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
}

// As tile_f32 with w = q, the int8 value (the scale is applied once, at the end).
template <int R, int C>
inline void tile_i8(const Problem& pb, const float* x, int64_t p0, V16 (&acc)[R][C]) {
  const int8_t* w = static_cast<const int8_t*>(pb.w);
  for (int64_t k = 0; k < pb.K; ++k) {
    V16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load_i8(w + at(p0 + c, pb.K, k));
    for (int r = 0; r < R; ++r) {
      const V16 xv = bcast(x[r * pb.x_stride + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
    }
  }
}

// int4, per group g: s = sum over the group's k (in order) of fma(x[k], q[k], s), then
//   acc = fma(d[g], s, acc);  acc = fma(xsum[g], min[g], acc)
// since sum_k x_k (d q_k + min) = d sum_k x_k q_k + min sum_k x_k. Two fmas per weight pair
// instead of four (no dequantized weight); xsum comes from the caller, computed once per row.
template <int Fmt, int R, int C>
inline void tile_i4(const Problem& pb, const float* x, const float* xsum, int64_t p0,
                    V16 (&acc)[R][C]) {
  const int64_t pairs = (pb.K + 1) / 2;
  const uint8_t* w = static_cast<const uint8_t*>(pb.w);
  for (int64_t g = 0; g < pb.groups; ++g) {
    V16 s[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = zero();
    const int64_t k1 = std::min(pb.K, (g + 1) * pb.group);
    int64_t k = g * pb.group;
    for (; k + 1 < k1; k += 2) {
      V16 lo[C], hi[C];
      for (int c = 0; c < C; ++c) load_u4x2(w + at(p0 + c, pairs, k / 2), lo[c], hi[c]);
      for (int r = 0; r < R; ++r) {
        const V16 xa = bcast(x[r * pb.x_stride + k]), xb = bcast(x[r * pb.x_stride + k + 1]);
        for (int c = 0; c < C; ++c) s[r][c] = fma(xb, hi[c], fma(xa, lo[c], s[r][c]));
      }
    }
    if (k < k1) {  // odd K: the last pair has only its low nibble
      V16 lo[C], hi[C];
      for (int c = 0; c < C; ++c) load_u4x2(w + at(p0 + c, pairs, k / 2), lo[c], hi[c]);
      for (int r = 0; r < R; ++r) {
        const V16 xa = bcast(x[r * pb.x_stride + k]);
        for (int c = 0; c < C; ++c) s[r][c] = fma(xa, lo[c], s[r][c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const V16 d = load_scale<Fmt>(pb.scale, at(p0 + c, pb.groups, g));
      const V16 mn = load_scale<Fmt>(pb.minv, at(p0 + c, pb.groups, g));
      for (int r = 0; r < R; ++r)
        acc[r][c] = fma(bcast(xsum[r * pb.groups + g]), mn, fma(d, s[r][c], acc[r][c]));
    }
  }
}

// q8_0, per group g: s = sum over the group's k (in order) of fma(x[k], q[k], s), then
//   acc = fma(d[g], s, acc).
template <int R, int C>
inline void tile_q8(const Problem& pb, const float* x, int64_t p0, V16 (&acc)[R][C]) {
  const int8_t* w = static_cast<const int8_t*>(pb.w);
  for (int64_t g = 0; g < pb.groups; ++g) {
    V16 s[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = zero();
    const int64_t k1 = std::min(pb.K, (g + 1) * pb.group);
    for (int64_t k = g * pb.group; k < k1; ++k) {
      V16 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = load_i8(w + at(p0 + c, pb.K, k));
      for (int r = 0; r < R; ++r) {
        const V16 xv = bcast(x[r * pb.x_stride + k]);
        for (int c = 0; c < C; ++c) s[r][c] = fma(xv, wv[c], s[r][c]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const V16 d = load_scale<kQ80>(pb.scale, at(p0 + c, pb.groups, g));
      for (int r = 0; r < R; ++r) acc[r][c] = fma(d, s[r][c], acc[r][c]);
    }
  }
}

// For many rows: the weights of panels p0 .. p0+C-1 converted once to floats, [C][K][16]
// (the int8 or int4 values q themselves, exact: no scale applied), so that every row block
// reads them without unpacking again. The tiles below do the same fp32 operations on them
// as tile_i8 / tile_i4 do on the packed bytes: the same bits.
template <int Fmt, int C>
void unpack_strip(const Problem& pb, int64_t p0, float* strip) {
  const int64_t K = pb.K;
  for (int c = 0; c < C; ++c) {
    float* dst = strip + static_cast<int64_t>(c) * K * 16;
    if (is_8bit(Fmt)) {
      const int8_t* w = static_cast<const int8_t*>(pb.w);
      for (int64_t k = 0; k < K; ++k) store(dst + k * 16, load_i8(w + at(p0 + c, K, k)));
    } else {
      const uint8_t* w = static_cast<const uint8_t*>(pb.w);
      const int64_t pairs = (K + 1) / 2;
      for (int64_t k = 0; k < K; k += 2) {
        V16 lo, hi;
        load_u4x2(w + at(p0 + c, pairs, k / 2), lo, hi);
        store(dst + k * 16, lo);
        if (k + 1 < K) store(dst + (k + 1) * 16, hi);
      }
    }
  }
}

template <int R, int C>
struct Sums {
  V16 v[R][C];
};

// s[r][c] = sum over k in [k0, k1), in order, of fma(x[r, k], strip(c, k), s): one int4
// group's sums (a function of its own, so that the compiler keeps them in registers).
template <int R, int C>
inline Sums<R, C> group_sums(const float* x, int64_t x_stride, const float* strip, int64_t K,
                             int64_t k0, int64_t k1) {
  Sums<R, C> s;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) s.v[r][c] = zero();
  for (int64_t k = k0; k < k1; ++k) {
    V16 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = load(strip + (c * K + k) * 16);
    for (int r = 0; r < R; ++r) {
      const V16 xv = bcast(x[r * x_stride + k]);
      for (int c = 0; c < C; ++c) s.v[r][c] = fma(xv, wv[c], s.v[r][c]);
    }
  }
  return s;
}

template <int Fmt, int R, int C>
inline void tile_strip(const Problem& pb, const float* x, const float* xsum, int64_t p0,
                       const float* strip, V16 (&acc)[R][C]) {
  const int64_t K = pb.K;
  if (Fmt == kI8) {
    for (int64_t k = 0; k < K; ++k) {
      V16 wv[C];
      for (int c = 0; c < C; ++c) wv[c] = load(strip + (c * K + k) * 16);
      for (int r = 0; r < R; ++r) {
        const V16 xv = bcast(x[r * pb.x_stride + k]);
        for (int c = 0; c < C; ++c) acc[r][c] = fma(xv, wv[c], acc[r][c]);
      }
    }
    return;
  }
  for (int64_t g = 0; g < pb.groups; ++g) {
    Sums<R, C> s = group_sums<R, C>(x, pb.x_stride, strip, K, g * pb.group,
                                    std::min(K, (g + 1) * pb.group));
    for (int c = 0; c < C; ++c) {
      const V16 d = load_scale<Fmt>(pb.scale, at(p0 + c, pb.groups, g));
      if constexpr (Fmt == kQ80) {
        for (int r = 0; r < R; ++r) acc[r][c] = fma(d, s.v[r][c], acc[r][c]);
      } else {
        const V16 mn = load_scale<Fmt>(pb.minv, at(p0 + c, pb.groups, g));
        for (int r = 0; r < R; ++r)
          acc[r][c] = fma(bcast(xsum[r * pb.groups + g]), mn, fma(d, s.v[r][c], acc[r][c]));
      }
    }
  }
}

// Rows m0 .. m0+R-1, panels p0 .. p0+C-1: accumulate (from the packed weights, or from
// `strip` when given), scale, add the bias, store.
template <int Fmt, int R, int C>
void tile(const Problem& pb, int64_t m0, int64_t p0, const float* strip = nullptr) {
  V16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero();
  const float* x = pb.x + m0 * pb.x_stride;
  const float* xsum = is_4bit(Fmt) ? pb.xsum + m0 * pb.groups : nullptr;
  if (Fmt == kF32)
    tile_f32<R, C>(pb, x, p0, acc);
  else if (strip != nullptr)
    tile_strip<Fmt, R, C>(pb, x, xsum, p0, strip, acc);
  else if (Fmt == kI8)
    tile_i8<R, C>(pb, x, p0, acc);
  else if (Fmt == kQ80)
    tile_q8<R, C>(pb, x, p0, acc);
  else
    tile_i4<Fmt, R, C>(pb, x, xsum, p0, acc);
  for (int c = 0; c < C; ++c) {
    const int64_t n0 = (p0 + c) * 16;
    const int64_t valid = std::min<int64_t>(16, pb.N - n0);
    if (valid <= 0) continue;
    for (int r = 0; r < R; ++r) {
      V16 v = acc[r][c];
      if (Fmt == kI8) v = mul(v, load(static_cast<const float*>(pb.scale) + n0));
      if (pb.bias != nullptr) v = add(v, load(pb.bias + n0));
      float* out = pb.y + (m0 + r) * pb.y_stride + n0;
      if (valid == 16) {
        store(out, v);
      } else {
        alignas(64) float tmp[16];
        store(tmp, v);
        std::memcpy(out, tmp, static_cast<size_t>(valid) * sizeof(float));
      }
    }
  }
}

template <int Fmt, int C>
void tile_rows(const Problem& pb, int64_t m0, int rows, int64_t p0, const float* strip) {
  static_assert(kGemmRows[Fmt] <= 6, "add cases below");
  switch (rows) {
    case 1: tile<Fmt, 1, C>(pb, m0, p0, strip); break;
    case 2: if constexpr (kGemmRows[Fmt] >= 2) tile<Fmt, 2, C>(pb, m0, p0, strip); break;
    case 3: if constexpr (kGemmRows[Fmt] >= 3) tile<Fmt, 3, C>(pb, m0, p0, strip); break;
    case 4: if constexpr (kGemmRows[Fmt] >= 4) tile<Fmt, 4, C>(pb, m0, p0, strip); break;
    case 5: if constexpr (kGemmRows[Fmt] >= 5) tile<Fmt, 5, C>(pb, m0, p0, strip); break;
    case 6: if constexpr (kGemmRows[Fmt] >= 6) tile<Fmt, 6, C>(pb, m0, p0, strip); break;
    default: break;
  }
}

template <int Fmt>
void run(const Problem& pb, int num_threads) {
  const int64_t panels = pb.Np / 16;
  if (pb.M == 1) {
    constexpr int C = kGemvPanels[Fmt];
    const int64_t items = panels / C;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t i = 0; i < items; ++i) tile<Fmt, 1, C>(pb, 0, i * C);
    return;
  }
  constexpr int R = kGemmRows[Fmt], C = kGemmPanels[Fmt];
  const int64_t blocks = (pb.M + R - 1) / R, strips = panels / C;
  if (kStrip[Fmt] && blocks >= kStripRowBlocks && strips >= 2 * num_threads) {
    // One item per panel group: unpack its weights once, then run every row block over them.
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> strip(static_cast<size_t>(C) * pb.K * 16);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < strips; ++i) {
        unpack_strip<Fmt, C>(pb, i * C, strip.data());
        for (int64_t m0 = 0; m0 < pb.M; m0 += R)
          tile_rows<Fmt, C>(pb, m0, static_cast<int>(std::min<int64_t>(R, pb.M - m0)), i * C,
                            strip.data());
      }
    }
    return;
  }
  // Items panel-group-major: a thread's consecutive items share a strip of weights.
  const int64_t items = strips * blocks;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t p0 = i / blocks * C, m0 = i % blocks * R;
    tile_rows<Fmt, C>(pb, m0, static_cast<int>(std::min<int64_t>(R, pb.M - m0)), p0, nullptr);
  }
}

}  // namespace

extern "C" {

const char* conveyor_qlinear_isa() { return kIsa; }

// y = x @ W^T (+ bias) for a packed W (layouts above). Returns 0, or 1 (nothing written) for
// an unknown format, a non-positive size, Np not a multiple of 64 or below N, an odd or
// non-positive int4 group, or x / y rows closer than K / N elements.
// fmt: 0 fp32, 1 int8, 2 int4, 3 q4_1, 4 q8_0 (scale / minv then point at fp16 data).
int conveyor_qlinear(int fmt, const float* x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                     int64_t Np, const void* w, const float* scale, const float* minv,
                     int64_t group, const float* bias, float* y, int64_t y_stride,
                     int num_threads) {
  if (fmt < kF32 || fmt > kQ80 || M < 0 || K <= 0 || N <= 0 || Np < N || Np % 64 != 0 ||
      x_stride < K || y_stride < N || num_threads <= 0 ||
      (is_grouped(fmt) && group <= 0) || (is_4bit(fmt) && group % 2 != 0))
    return 1;
  if (M == 0) return 0;
  const int64_t groups = is_grouped(fmt) ? (K + group - 1) / group : 0;
  const int64_t sums = is_4bit(fmt) ? groups : 0;  // xsum only where a min is applied
  std::vector<float> xsum(static_cast<size_t>(M * sums));
  for (int64_t m = 0; m < M; ++m)  // sequential adds: the same bits for a row in any call
    for (int64_t g = 0; g < sums; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) s += x[m * x_stride + k];
      xsum[m * groups + g] = s;
    }
  const Problem pb{x, x_stride, M, K, N, Np, w, scale, minv, group, groups, xsum.data(), bias,
                   y, y_stride};
  switch (fmt) {
    case kF32: run<kF32>(pb, num_threads); break;
    case kI8: run<kI8>(pb, num_threads); break;
    case kI4: run<kI4>(pb, num_threads); break;
    case kQ41: run<kQ41>(pb, num_threads); break;
    default: run<kQ80>(pb, num_threads); break;
  }
  return 0;
}

// out [N, K] row-major float = the weight the kernel multiplies by (int8: q * scale, rounded
// once; int4, q4_1: fma(q, d, min); q8_0: q * d, exact). Returns 0, or 1 for the argument
// errors of conveyor_qlinear.
int conveyor_qdequant(int fmt, const void* w, const float* scale, const float* minv,
                      int64_t group, int64_t K, int64_t N, int64_t Np, float* out,
                      int num_threads) {
  if (fmt < kF32 || fmt > kQ80 || K <= 0 || N <= 0 || Np < N || Np % 64 != 0 ||
      num_threads <= 0 || (is_grouped(fmt) && group <= 0) || (is_4bit(fmt) && group % 2 != 0))
    return 1;
  const int64_t panels = (N + 15) / 16, groups = is_grouped(fmt) ? (K + group - 1) / group : 0;
  const int64_t pairs = (K + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int valid = static_cast<int>(std::min<int64_t>(16, N - p * 16));
    alignas(64) float lo_t[16], hi_t[16];
    for (int64_t k = 0; k < K; k += (is_4bit(fmt) ? 2 : 1)) {
      V16 lo, hi = zero();
      if (fmt == kF32) {
        lo = load(static_cast<const float*>(w) + at(p, K, k));
      } else if (fmt == kI8) {
        lo = mul(load_i8(static_cast<const int8_t*>(w) + at(p, K, k)), load(scale + p * 16));
      } else if (fmt == kQ80) {
        const V16 d = load_scale<kQ80>(scale, at(p, groups, k / group));
        lo = mul(load_i8(static_cast<const int8_t*>(w) + at(p, K, k)), d);
      } else {
        const int64_t g = k / group;
        const V16 d = fmt == kQ41 ? load_scale<kQ41>(scale, at(p, groups, g))
                                  : load(scale + at(p, groups, g));
        const V16 m = fmt == kQ41 ? load_scale<kQ41>(minv, at(p, groups, g))
                                  : load(minv + at(p, groups, g));
        load_u4x2(static_cast<const uint8_t*>(w) + at(p, pairs, k / 2), lo, hi);
        lo = fma(lo, d, m);
        hi = fma(hi, d, m);
      }
      store(lo_t, lo);
      store(hi_t, hi);
      for (int c = 0; c < valid; ++c) {
        float* row = out + (p * 16 + c) * K;
        row[k] = lo_t[c];
        if (is_4bit(fmt) && k + 1 < K) row[k + 1] = hi_t[c];
      }
    }
  }
  return 0;
}

}  // extern "C"
