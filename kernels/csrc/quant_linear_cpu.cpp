// Linear layers on the CPU with weights in fp32, int8 or int4 (scales in fp32, or in fp16 as
// GGUF's Q4_1 / Q8_0 blocks store them), dequantized on the fly:
//   y[M, N] = x[M, K] @ W[N, K]^T (+ bias),  x and y fp32.
//
// Built from this one file (kernels/quant_linear_cpu.py) with AVX-512 flags and with AVX2 +
// FMA flags (and, with -DCONVEYOR_AMX, AVX-512 plus AMX tiles for the int16 activations: see
// run_amx); the preprocessor picks the vector type V16 (16 floats: one zmm, or two
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
//   q4_k, i8_k (GGUF's K-quants, w = (d[n, S] sc[n, g]) q - dmin[n, S] m[n, g], S the
//                super-block of k): as q4_1, with the group's scale and min formed first,
//                exactly: d1 = fp32(d) * sc, min1 = -(fp32(dmin) * m) (at most 11 + 8
//                significant bits: no rounding), then
//                acc = fma(xsum[m, g], min1, fma(d1, s, acc))
//   q6_k (GGUF's Q6_K, w = (d[n, S] sc[n, g]) (q - 32), q in [0, 63], groups of 16): as q8_0
//                with d1 = fp32(d) * sc (exact) for d: acc = fma(d1, s, acc) (i8_k's bits over
//                the same blocks: their mins are 0)
//   q5_k (GGUF's Q5_K, w = (d[n, S] sc[n, g]) q - dmin[n, S] m[n, g], q in [0, 31], groups
//                of 32): as q4_k (its 5-bit q decoded from nibbles and a high-bit line)
//   q4_1x16, q8_0x16, q4_kx16, i8_kx16, q6_kx16, q5_kx16: the same weights times x quantized to int16
//                per row and group of 32 (see "int16 activations" below)
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
//          weight at group 32, as GGUF's Q4_1 block); q4_0: the same without min (a null
//          minv), which the kernel forms as -8 d, exact (4.5 bits: GGUF's Q4_0 block)
//   q8_0:  w as int8;  d [Np / 64, ceil(K / group), 64] fp16 (8.5 bits a weight at group 32,
//          as GGUF's Q8_0 block)
//   q4_k:  w as int4 (group 32);  sc, m [Np / 64, K / 32, 64] uint8 (6-bit);  d, dmin
//          [Np / 64, K / 256, 64] fp16 (4.625 bits a weight; GGUF's Q4_K block is 4.5:
//          ggml's block_q4_K, its 6-bit scales unpacked as get_scale_min_k4 does)
//   i8_k:  w as int8 (group 16);  sc, m [Np / 64, K / 16, 64] int8;  d, dmin
//          [Np / 64, K / S, 64] fp16, S = super_group, 256 or 32 (9.125 bits a weight at
//          256: any mix of GGUF's K-quant and legacy blocks, kernels/gguf_pack.py)
//   q6_k:  w [Np / 64, 3 K / 4, 64] uint8, three lines per quad j of k (4j .. 4j + 3): line
//          3j: byte c = q(c, 4j) & 15 | (q(c, 4j + 1) & 15) << 4, line 3j + 1: the same for
//          4j + 2, 4j + 3, line 3j + 2: byte c = sum over i of (q(c, 4j + i) >> 4) << 2i;
//          sc [Np / 64, K / 16, 64] int8; d [Np / 64, K / 256, 64] fp16 (6.5625 bits a
//          weight: GGUF's Q6_K block, its own bits regrouped; a one-row call streams each
//          block's lines in order)
//   q5_k:  w [Np / 64, 5 K / 8, 64] uint8, five lines per octet j of k (8j .. 8j + 7): lines
//          5j + i (i < 4): byte c = q(c, 8j + 2i) & 15 | (q(c, 8j + 2i + 1) & 15) << 4, line
//          5j + 4: byte c = sum over i < 8 of (q(c, 8j + i) >> 4) << i; sc, m, d, dmin as
//          q4_k's (5.625 bits a weight: GGUF's Q5_K block is 5.5)
// The C ABI passes scale / minv as float pointers; for q4_1 / q8_0 they point at fp16 data,
// for q4_k / i8_k at the bytes sc and m (d and dmin: conveyor_qlinear_ex's sup_scale,
// sup_min); for q6_k scale at sc and sup_scale at d (minv, sup_min unused); q5_k as q4_k.
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
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(CONVEYOR_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr const char* kIsa = "avx512";
// Tile shapes (rows x panels) for many rows and for one, per format {fp32, int8, int4, q4_1,
// q8_0}: accumulators R x C vectors (grouped formats: twice: group sums and totals) in 32
// vector registers.
// q8_0}, then (codes 5-8, 11, 12: the activation-quantizing formats, not run by run<>) {q4_k,
// i8_k}, then q6_k (code 13: unpacked in each tile: 6 x 2 tiles, 24 of the 32 registers),
// then (code 15) q5_k as q6_k.
constexpr int kGemmRows[16] = {6, 6, 6, 6, 6, 0, 0, 0, 0, 6, 6, 0, 0, 6, 0, 6},
              kGemmPanels[16] = {4, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 0, 0, 2, 0, 2},
              kGemvPanels[16] = {4, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 0, 0, 4, 0, 4};
// Whether many-row calls unpack int8 / int4 weights once per panel group (unpack_strip).
constexpr bool kStrip[16] = {false, true, true, true, true, false, false, false, false, true, true,
                             false, false, false, false, false};
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
inline V16 load_u8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline void load_u4x2(const uint8_t* p, V16& lo, V16& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo.v = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  hi.v = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
inline V16 i8_to_f(__m128i q) { return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))}; }
// q5_k's high bits of 16 channels for one octet of k (bit p: k = 8j + p), one per int32 lane.
struct High5 {
  __m512i v;
};
inline High5 load_high5(const uint8_t* p) {
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
// q5_k's values of k = 8j + 2i (lo) and 8j + 2i + 1 (hi) as floats: load_u4x2's nibbles with
// bit 4 set where the octet's high bit 2i (2i + 1) is.
inline void load_u5x2(const uint8_t* p, High5 h, int i, V16& lo, V16& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i sixteen = _mm512_set1_epi32(16);
  const __mmask16 ml = _mm512_test_epi32_mask(h.v, _mm512_set1_epi32(1 << (2 * i)));
  const __mmask16 mh = _mm512_test_epi32_mask(h.v, _mm512_set1_epi32(2 << (2 * i)));
  const __m512i l = _mm512_and_si512(b, _mm512_set1_epi32(15)), u = _mm512_srli_epi32(b, 4);
  lo.v = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(l, ml, l, sixteen));
  hi.v = _mm512_cvtepi32_ps(_mm512_mask_or_epi32(u, mh, u, sixteen));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr const char* kIsa = "avx2";
// As above within 16 registers (a V16 is two of them). The grouped formats keep their group
// sums in registers and the totals in memory (updated once per group): 4-bit, R = 5: 10
// sums + 4 unpacked weight vectors + 1 broadcast; q8_0, R = 6: 12 + 2 + 1. Measured on a
// Zen 3 (AVX2, 2 threads) against R = 2: 1.3-1.6x at 16 rows ([3072 x 576] q4_1: 1.10 ->
// 0.69 ms; the [49152 x 576] q8_0 LM head 14.2 -> 10.4 ms), the same at 1-2 rows.
// q4_k as q4_1, i8_k, q6_k and q5_k as q8_0 (codes 5-8, 11, 12, 14 unused, as above).
constexpr int kGemmRows[16] = {4, 4, 5, 5, 6, 0, 0, 0, 0, 5, 6, 0, 0, 6, 0, 6},
              kGemmPanels[16] = {1, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1},
              kGemvPanels[16] = {4, 4, 2, 2, 2, 0, 0, 0, 0, 2, 2, 0, 0, 2, 0, 2};
// int4 from a strip measured 1.5-2.5x slower here than unpacking in each tile (GCC 12 keeps
// the group sums in memory when a V16 is two ymm registers); q8_0's group sums alike.
constexpr bool kStrip[16] = {false, true, false, false, false, false, false, false, false, false,
                             false, false, false, false, false, false};
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
inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline V16 load_u8(const uint8_t* p) { return {u8x8(p), u8x8(p + 8)}; }
inline void load_u4x2(const uint8_t* p, V16& lo, V16& hi) {
  const __m256i mask = _mm256_set1_epi32(15);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b, mask))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
}
inline V16 i8_to_f(__m128i q) {  // 16 int8 -> fp32 (exact)
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))};
}
struct High5 {
  __m256i lo, hi;
};
inline High5 load_high5(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void load_u5x2(const uint8_t* p, High5 h, int i, V16& lo, V16& hi) {
  const __m256i mask = _mm256_set1_epi32(15), one = _mm256_set1_epi32(1);
  const __m128i n = _mm_cvtsi32_si128(2 * i);
  const auto half = [&](const uint8_t* q, __m256i hv, __m256& l, __m256& u) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
    const __m256i hs = _mm256_srl_epi32(hv, n);  // bit 0: high bit of 2i, bit 1: of 2i + 1
    l = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(b, mask),
                                           _mm256_slli_epi32(_mm256_and_si256(hs, one), 4)));
    u = _mm256_cvtepi32_ps(_mm256_or_si256(
        _mm256_srli_epi32(b, 4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hs, 1), one), 4)));
  };
  half(p, h.lo, lo.lo, hi.lo);
  half(p + 8, h.hi, lo.hi, hi.hi);
}
#else
#error "quant_linear_cpu.cpp needs AVX-512 (F, BW) or AVX2 + FMA + F16C"
#endif

enum Format { kF32 = 0, kI8 = 1, kI4 = 2, kQ41 = 3, kQ80 = 4, kQ4K = 9, kI8K = 10, kQ6K = 13,
              kQ5K = 15 };
constexpr int kAct8Offset = 2;   // fmt 5, 6: q4_1, q8_0 weights with int8 activations
constexpr int kAct16Offset = 4;  // fmt 7, 8: q4_1, q8_0 weights with int16 activations
constexpr int kAct16KOffset = 2;  // fmt 11, 12: q4_k, i8_k weights with int16 activations
constexpr int kQ6KAct16 = 14;     // fmt 14: q6_k weights with int16 activations
constexpr int kQ5KAct16 = 16;     // fmt 16: q5_k weights with int16 activations
// The activation group of int16 activations over the K-quants (q4_k's weight group; two of
// i8_k's groups of 16).
constexpr int64_t kAct16KGroup = 32;
constexpr bool is_4bit(int f) { return f == kI4 || f == kQ41 || f == kQ4K; }
constexpr bool is_8bit(int f) { return f == kI8 || f == kQ80 || f == kI8K; }
constexpr bool is_kquant(int f) { return f == kQ4K || f == kI8K || f == kQ5K; }
constexpr bool has_supers(int f) { return is_kquant(f) || f == kQ6K; }  // sup_scale: d
constexpr bool is_grouped(int f) { return f == kI4 || f == kQ41 || f == kQ80 || has_supers(f); }
constexpr bool has_min(int f) { return f == kI4 || f == kQ41 || is_kquant(f); }
constexpr bool has_half_scales(int f) { return f == kQ41 || f == kQ80; }
// The formats of gemv_vnni_block (one row on AVX512-VNNI): the nibble lines (q4_1, q4_0,
// q4_k), q5_k's (with a fifth line of high bits) and q6_k's (two high lines per octet).
constexpr bool has_gemv_vnni(int f) { return f == kQ41 || f == kQ4K || f == kQ5K || f == kQ6K; }
constexpr bool is_format(int f) { return (f >= kF32 && f <= kQ80) || has_supers(f); }

// From this many row blocks on, int8 / int4 weights are unpacked once per panel group into
// floats (unpack_strip) instead of once per tile.
constexpr int64_t kStripRowBlocks = 2;

// A strip larger than this (C panels x K floats: 256 KiB at K = 1024, C = 4) is not used: it
// does not stay in L2 across the row blocks that read it. Measured on Zen 4 (1 MB L2, 2
// threads, shared machine: indicative), q4_k [14336 x 4096] on AVX-512 (a 1 MiB strip):
// 16 rows 64 -> 24 ms, 512 rows 1635 -> 690-790 ms (AVX2's tiles: 28-32, 716-890 ms).
// Smaller strips (K <= 1024) are kept: their timings here were within this machine's noise.
constexpr int64_t kStripMaxBytes = 256 << 10;

struct Problem {
  const float* x;
  int64_t x_stride, M, K, N, Np;
  const void* w;
  const void* scale;  // int8: [Np] float; int4: d [Np/64, groups, 64] float; q4_1, q8_0: fp16
  const void* minv;   // int4: [Np/64, groups, 64] float; q4_1: fp16; q4_k, q5_k: m, i8_k: m
  int64_t group, groups;
  const float* xsum;  // int4, q4_1, q4_k, i8_k: [M, groups], sum of x over each group (k in order)
  const float* bias;  // [Np] or null
  float* y;
  int64_t y_stride;
  const uint16_t* sup_scale;  // q4_k, i8_k: d [Np/64, supers, 64] fp16
  const uint16_t* sup_min;    // q4_k, i8_k: dmin [Np/64, supers, 64] fp16
  int64_t super_group, supers;
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

// Group g's 16 scales d and mins mn of panel p: loaded (int4, q4_1, q8_0: no mn), or, for
// q4_k / i8_k, formed exactly from the super-block's d, dmin and the group's sc, m:
// d = d_S * sc, mn = -(dmin_S * m).
template <int Fmt>
inline void group_scales(const Problem& pb, int64_t p, int64_t g, V16& d, V16& mn) {
  const int64_t off = at(p, pb.groups, g);
  if constexpr (Fmt == kQ6K) {  // d = d_S * sc (no min)
    const int64_t soff = at(p, pb.supers, g * pb.group / pb.super_group);
    d = mul(load_h(pb.sup_scale + soff), load_i8(static_cast<const int8_t*>(pb.scale) + off));
    mn = zero();
  } else if constexpr (is_kquant(Fmt)) {
    const int64_t soff = at(p, pb.supers, g * pb.group / pb.super_group);
    V16 sc, m;
    if constexpr (Fmt == kQ4K || Fmt == kQ5K) {
      sc = load_u8(static_cast<const uint8_t*>(pb.scale) + off);
      m = load_u8(static_cast<const uint8_t*>(pb.minv) + off);
    } else {
      sc = load_i8(static_cast<const int8_t*>(pb.scale) + off);
      m = load_i8(static_cast<const int8_t*>(pb.minv) + off);
    }
    d = mul(load_h(pb.sup_scale + soff), sc);
    mn = mul(mul(load_h(pb.sup_min + soff), m), bcast(-1.f));
  } else {
    d = load_scale<Fmt>(pb.scale, off);
    if constexpr (has_min(Fmt)) {
      if (Fmt == kQ41 && pb.minv == nullptr)  // q4_0: min = -8 d (exact)
        mn = mul(d, bcast(-8.f));
      else
        mn = load_scale<Fmt>(pb.minv, off);
    }
  }
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
// A one-row call (R = 1) prefetches the weight line this many bytes ahead of the k pair it
// reads (as the int16-activation kernels do, kGemvPrefetchBytes below): such a call is a
// stream of a few tens of MB, each item's too short for the hardware prefetcher to reach
// full depth.
// Measured (indicative: a shared 2-core Zen 4, 2 threads, four [14336 x 4096] weights in
// turn): q4_k 1.36 -> 1.27 ms (AVX-512), 1.74 -> 1.50 ms (AVX2); q4_1 1.29 -> 1.33 and
// 1.67 -> 1.52 ms. Numerics unchanged.
constexpr int64_t kGemvPrefetchI4Bytes = 2048;

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
      if constexpr (R == 1) __builtin_prefetch(w + at(p0, pairs, k / 2) + kGemvPrefetchI4Bytes);
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
      V16 d, mn;
      group_scales<Fmt>(pb, p0 + c, g, d, mn);
      for (int r = 0; r < R; ++r)
        acc[r][c] = fma(bcast(xsum[r * pb.groups + g]), mn, fma(d, s[r][c], acc[r][c]));
    }
  }
}

// q8_0, per group g: s = sum over the group's k (in order) of fma(x[k], q[k], s), then
//   acc = fma(d[g], s, acc)  (i8_k: then acc = fma(xsum[g], min[g], acc), as tile_i4).
template <int Fmt, int R, int C>
inline void tile_q8(const Problem& pb, const float* x, const float* xsum, int64_t p0,
                    V16 (&acc)[R][C]) {
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
      V16 d, mn;
      group_scales<Fmt>(pb, p0 + c, g, d, mn);
      if constexpr (has_min(Fmt)) {
        for (int r = 0; r < R; ++r)
          acc[r][c] = fma(bcast(xsum[r * pb.groups + g]), mn, fma(d, s[r][c], acc[r][c]));
      } else {
        for (int r = 0; r < R; ++r) acc[r][c] = fma(d, s[r][c], acc[r][c]);
      }
    }
  }
}

// q6_k, per group g of 16: s = sum over the group's k (in order) of fma(x[k], q[k] - 32, s),
// then acc = fma(d[g], s, acc) with d = d_S * sc (exact): tile_q8's operations (and so i8_k's
// bits over the same Q6_K blocks, whose mins are 0). The packed lines of a block come in
// threes per quad of k (kQ6Lines): nibbles of pairs 2j and 2j + 1, then the quad's high bits.
constexpr int64_t kQ6Lines = 3;
// q6_k's group of 16 k (kquant_args_ok) in quads.
constexpr int64_t kQ6GroupQuads = 4;

// q - 32 of 16 channels at k = 4j .. 4j + 3 (q[i]: k = 4j + i, int8) from the quad's lines
// (l: the block's line 3j, at the panel's 16 bytes): byte arithmetic on 128-bit registers,
// the same in both builds (cheaper than widening first).
inline void q6_quad(const uint8_t* l, int64_t line_bytes, __m128i (&q)[4]) {
  const __m128i n0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l));
  const __m128i n1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l + line_bytes));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l + 2 * line_bytes));
  const __m128i m0f = _mm_set1_epi8(0x0F), m30 = _mm_set1_epi8(0x30), b32 = _mm_set1_epi8(32);
  const auto six = [&](__m128i low, __m128i high) {  // (low & 15 | high & 0x30) - 32
    return _mm_sub_epi8(_mm_or_si128(_mm_and_si128(low, m0f), _mm_and_si128(high, m30)), b32);
  };
  q[0] = six(n0, _mm_slli_epi16(h, 4));
  q[1] = six(_mm_srli_epi16(n0, 4), _mm_slli_epi16(h, 2));
  q[2] = six(n1, h);
  q[3] = six(_mm_srli_epi16(n1, 4), _mm_srli_epi16(h, 2));
}

// q6_quad's q[k % 4] and q[k % 4 + 1] (k even) alone: a (k), b (k + 1).
inline void q6_pair(const uint8_t* l, int64_t line_bytes, int64_t k, __m128i& a, __m128i& b) {
  const bool second = k % 4 != 0;  // nibbles in line 3j + 1, high fields 2 and 3
  const uint8_t* ln = l + (second ? line_bytes : 0);
  const __m128i n = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ln));
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l + 2 * line_bytes));
  if (second) h = _mm_srli_epi16(h, 4);  // fields 2, 3 to bits 0-3 (masked below)
  const __m128i m0f = _mm_set1_epi8(0x0F), m30 = _mm_set1_epi8(0x30), b32 = _mm_set1_epi8(32);
  const auto six = [&](__m128i low, __m128i high) {  // as q6_quad's
    return _mm_sub_epi8(_mm_or_si128(_mm_and_si128(low, m0f), _mm_and_si128(high, m30)), b32);
  };
  a = six(n, _mm_slli_epi16(h, 4));
  b = six(_mm_srli_epi16(n, 4), _mm_slli_epi16(h, 2));
}

template <int R, int C>
inline void tile_q6(const Problem& pb, const float* x, int64_t p0, V16 (&acc)[R][C]) {
  const uint8_t* w = static_cast<const uint8_t*>(pb.w);
  const int64_t lines = pb.K / 4 * kQ6Lines;
  for (int64_t g = 0; g < pb.groups; ++g) {
    V16 s[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = zero();
    const int64_t k1 = (g + 1) * pb.group;
    for (int64_t k = g * pb.group; k < k1; k += 4) {
      const int64_t j = k / 4 * kQ6Lines;
      if constexpr (R == 1) {  // a one-row call streams: see kGemvPrefetchI4Bytes
        const uint8_t* ahead = w + at(p0, lines, j) + kGemvPrefetchI4Bytes;
        __builtin_prefetch(ahead);
        __builtin_prefetch(ahead + 64);
        __builtin_prefetch(ahead + 128);
      }
      __m128i q[C][4];
      for (int c = 0; c < C; ++c) q6_quad(w + at(p0 + c, lines, j), 64, q[c]);
      for (int i = 0; i < 4; i += 2) {
        V16 lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
          lo[c] = i8_to_f(q[c][i]);
          hi[c] = i8_to_f(q[c][i + 1]);
        }
        for (int r = 0; r < R; ++r) {
          const V16 xa = bcast(x[r * pb.x_stride + k + i]);
          const V16 xb = bcast(x[r * pb.x_stride + k + i + 1]);
          for (int c = 0; c < C; ++c) s[r][c] = fma(xb, hi[c], fma(xa, lo[c], s[r][c]));
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      V16 d, mn;
      group_scales<kQ6K>(pb, p0 + c, g, d, mn);
      for (int r = 0; r < R; ++r) acc[r][c] = fma(d, s[r][c], acc[r][c]);
    }
  }
}

// q5_k, per group g of 32: tile_i4's operations (q4_k's: s = sum over the group's k, in
// order, of fma(x[k], q[k], s), then acc = fma(xsum[g], min1, fma(d1, s, acc))) with q in
// [0, 31] decoded from the octet's lines (kQ5Lines): the nibble lines of pairs
// (8j + 2i, 8j + 2i + 1), i < 4, then the octet's high bits (bit i: k = 8j + i).
constexpr int64_t kQ5Lines = 5;

// Bit p of each byte of h moved to bit 4 (0x10), every other bit 0.
inline __m128i q5_high(__m128i h, int p) {
  const __m128i bit = _mm_set1_epi8(static_cast<char>(1 << p));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, bit), bit), _mm_set1_epi8(0x10));
}

// q of 16 channels at k and k + 1 (k even; int8 in [0, 31]): a (k), b (k + 1), from the
// octet's lines (l: the block's line 5 (k / 8), at the panel's 16 bytes).
inline void q5_pair(const uint8_t* l, int64_t line_bytes, int64_t k, __m128i& a, __m128i& b) {
  const int i = static_cast<int>(k % 8) / 2;
  const __m128i n = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l + i * line_bytes));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(l + 4 * line_bytes));
  const __m128i m0f = _mm_set1_epi8(0x0F);
  a = _mm_or_si128(_mm_and_si128(n, m0f), q5_high(h, 2 * i));
  b = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(n, 4), m0f), q5_high(h, 2 * i + 1));
}

template <int R, int C>
inline void tile_q5(const Problem& pb, const float* x, const float* xsum, int64_t p0,
                    V16 (&acc)[R][C]) {
  const uint8_t* w = static_cast<const uint8_t*>(pb.w);
  const int64_t lines = pb.K / 8 * kQ5Lines;
  for (int64_t g = 0; g < pb.groups; ++g) {
    V16 s[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = zero();
    const int64_t k1 = (g + 1) * pb.group;
    for (int64_t k = g * pb.group; k < k1; k += 8) {
      const int64_t j = k / 8 * kQ5Lines;
      if constexpr (R == 1) {  // a one-row call streams: see kGemvPrefetchI4Bytes
        const uint8_t* ahead = w + at(p0, lines, j) + kGemvPrefetchI4Bytes;
        for (int i = 0; i < kQ5Lines; ++i) __builtin_prefetch(ahead + 64 * i);
      }
      High5 h[C];
      for (int c = 0; c < C; ++c) h[c] = load_high5(w + at(p0 + c, lines, j) + 4 * 64);
      for (int i = 0; i < 4; ++i) {
        V16 lo[C], hi[C];
        for (int c = 0; c < C; ++c) load_u5x2(w + at(p0 + c, lines, j) + 64 * i, h[c], i, lo[c], hi[c]);
        for (int r = 0; r < R; ++r) {
          const V16 xa = bcast(x[r * pb.x_stride + k + 2 * i]);
          const V16 xb = bcast(x[r * pb.x_stride + k + 2 * i + 1]);
          for (int c = 0; c < C; ++c) s[r][c] = fma(xb, hi[c], fma(xa, lo[c], s[r][c]));
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      V16 d, mn;
      group_scales<kQ5K>(pb, p0 + c, g, d, mn);
      for (int r = 0; r < R; ++r)
        acc[r][c] = fma(bcast(xsum[r * pb.groups + g]), mn, fma(d, s[r][c], acc[r][c]));
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
      V16 d, mn;
      group_scales<Fmt>(pb, p0 + c, g, d, mn);
      if constexpr (!has_min(Fmt)) {
        for (int r = 0; r < R; ++r) acc[r][c] = fma(d, s.v[r][c], acc[r][c]);
      } else {
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
  const float* xsum = has_min(Fmt) ? pb.xsum + m0 * pb.groups : nullptr;
  if (Fmt == kF32)
    tile_f32<R, C>(pb, x, p0, acc);
  else if (Fmt == kQ6K)
    tile_q6<R, C>(pb, x, p0, acc);
  else if (Fmt == kQ5K)
    tile_q5<R, C>(pb, x, xsum, p0, acc);
  else if (strip != nullptr)
    tile_strip<Fmt, R, C>(pb, x, xsum, p0, strip, acc);
  else if (Fmt == kI8)
    tile_i8<R, C>(pb, x, p0, acc);
  else if (Fmt == kQ80 || Fmt == kI8K)
    tile_q8<Fmt, R, C>(pb, x, xsum, p0, acc);
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
  const bool strip_fits = C * pb.K * 16 * static_cast<int64_t>(sizeof(float)) <= kStripMaxBytes;
  if (kStrip[Fmt] && strip_fits && blocks >= kStripRowBlocks && strips >= 2 * num_threads) {
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
  // Items panel-group-major: a thread's consecutive items share a strip of weights. The
  // rows are split into `blocks` blocks as even as they go (16 rows at R = 5: 4 x 4, not
  // 5 + 5 + 5 + 1), since each block unpacks the weights again.
  const int64_t items = strips * blocks, base = pb.M / blocks, extra = pb.M % blocks;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t p0 = i / blocks * C, b = i % blocks;
    const int64_t m0 = b * base + std::min(b, extra);
    tile_rows<Fmt, C>(pb, m0, static_cast<int>(base + (b < extra ? 1 : 0)), p0, nullptr);
  }
}

// ---- int8 activations (fmt 5: q4_1 weights, fmt 6: q8_0 weights) ----------------------
// As llama.cpp's AVX2 dot products (ggml's Q8 activation blocks), x is quantized per row
// and per weight group of 32 (any even group dividing K): dx[m, g] = max |x| / 127 over the
// group, qx = round-half-even(x * (1 / dx)) in [-127, 127] (0 where the group is 0). The
// weight's integers meet qx in integer arithmetic, exact, and one output element is
//   acc = 0;  for each group g in order:
//     acc = fma(float(isum[g]), dw[n, g] * dx[m, g], acc)        isum = sum_k qw * qx (exact)
//     q4_1 only: acc = fma(xsum[m, g], min[n, g], acc)           xsum: fp32 sum of x, k in order
//   y = acc (+ bias[n])
// with dw, min converted from fp16 exactly. Integers are exact and the float operations
// are the same for every row count, thread count and both builds (these loops use AVX2
// integer instructions in both): batch-invariant and bit-identical across builds.
// q4_1 x int8: _mm256_maddubs_epi16 multiplies the unsigned nibbles (0..15) by qx and adds
// each channel's pair (k, k + 1); 8 pairs sum in int16 (8 * 2 * 15 * 127 = 30480 < 2^15)
// before widening to int32. q8_0 x int8: the weights are widened to int16 and
// _mm256_madd_epi16 sums each channel's pair in int32 (no int16 bound to respect).
// A work item is a strip of 32 channels (half a block of 64) for a block of rows.

struct Act8 {
  std::vector<int8_t> q;     // [M, K] qx
  std::vector<int16_t> q16;  // [M, K] qx widened (q8_0 weights)
  std::vector<float> d;      // [M, groups] dx
};

inline void quantize_rows(const Problem& pb, bool wide, Act8& a) {
  const int64_t M = pb.M, K = pb.K, G = pb.groups;
  a.q.assign(static_cast<size_t>(M * K), 0);
  a.d.assign(static_cast<size_t>(M * G), 0.f);
  if (wide) a.q16.assign(static_cast<size_t>(M * K), 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* x = pb.x + m * pb.x_stride + g * pb.group;
      float amax = 0.f;
      for (int64_t k = 0; k < pb.group; ++k) amax = std::max(amax, std::fabs(x[k]));
      const float d = amax / 127.f, id = amax > 0.f ? 1.f / d : 0.f;
      a.d[m * G + g] = d;
      int8_t* q = a.q.data() + m * K + g * pb.group;
      for (int64_t k = 0; k < pb.group; ++k) {
        const long v = std::lrintf(x[k] * id);  // the default rounding: half to even
        q[k] = static_cast<int8_t>(std::min(127L, std::max(-127L, v)));
      }
      if (wide)
        for (int64_t k = 0; k < pb.group; ++k) a.q16[m * K + g * pb.group + k] = q[k];
    }
}

// acc[c8] (channels 8 c8 .. 8 c8 + 7 of the strip) += float(isum[c8]) * (dw * dx)
// (+ xsum * min for q4_1): the per-group float step, the same ops in both builds.
template <int Fmt>
inline void group_step(const Problem& pb, int64_t strip, int64_t g, float dx, float xs,
                       const __m256i (&isum)[4], __m256 (&acc)[4]) {
  const int64_t off = ((strip >> 1) * pb.groups + g) * 64 + (strip & 1) * 32;
  const uint16_t* dw = static_cast<const uint16_t*>(pb.scale) + off;
  const __m256 vdx = _mm256_set1_ps(dx);
  for (int c = 0; c < 4; ++c) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw + 8 * c)));
    acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_mul_ps(d, vdx), acc[c]);
  }
  if constexpr (Fmt == 3) {
    const uint16_t* mn = static_cast<const uint16_t*>(pb.minv);  // null: q4_0, min = -8 d
    const __m256 vxs = _mm256_set1_ps(xs);
    for (int c = 0; c < 4; ++c) {
      const __m256 m =
          mn != nullptr
              ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + off + 8 * c)))
              : _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(dw + 8 * c))),
                              _mm256_set1_ps(-8.f));
      acc[c] = _mm256_fmadd_ps(vxs, m, acc[c]);
    }
  }
}

// isum[r][c8] = sum over group g's k of qw(n, k) * qx(row r, k) for the strip's 32
// channels and R rows (qx[r]: row r's quantized x): each weight vector is unpacked once
// for all R rows.
template <int R>
inline void isums_q4(const Problem& pb, int64_t strip, int64_t g, const int8_t* const (&qx)[R],
                     __m256i (&isum)[R][4]) {
  const int64_t pairs = pb.K / 2;
  const uint8_t* w = static_cast<const uint8_t*>(pb.w) + (strip >> 1) * pairs * 64 + (strip & 1) * 32;
  const __m256i mask = _mm256_set1_epi8(15);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) isum[r][c] = _mm256_setzero_si256();
  const int64_t j0 = g * pb.group / 2, j1 = j0 + pb.group / 2;
  for (int64_t j = j0; j < j1; j += 8) {
    __m256i s0[R], s1[R];
    for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm256_setzero_si256();
    const int64_t je = std::min(j1, j + 8);
    for (int64_t i = j; i < je; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i * 64));
      const __m256i lo = _mm256_and_si256(v, mask);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
      const __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);
      for (int r = 0; r < R; ++r) {
        int16_t pair;
        std::memcpy(&pair, qx[r] + 2 * i, 2);
        const __m256i xp = _mm256_set1_epi16(pair);
        s0[r] = _mm256_add_epi16(s0[r], _mm256_maddubs_epi16(a, xp));
        s1[r] = _mm256_add_epi16(s1[r], _mm256_maddubs_epi16(b, xp));
      }
    }
    // s0: channels 0-7 | 16-23, s1: 8-15 | 24-31 (unpack works within 128-bit lanes)
    for (int r = 0; r < R; ++r) {
      isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s0[r])));
      isum[r][1] = _mm256_add_epi32(isum[r][1], _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s1[r])));
      isum[r][2] = _mm256_add_epi32(isum[r][2], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s0[r], 1)));
      isum[r][3] = _mm256_add_epi32(isum[r][3], _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s1[r], 1)));
    }
  }
}

template <int R>
inline void isums_q8(const Problem& pb, int64_t strip, int64_t g, const int16_t* const (&qx)[R],
                     __m256i (&isum)[R][4]) {
  const int8_t* w = static_cast<const int8_t*>(pb.w) + (strip >> 1) * pb.K * 64 + (strip & 1) * 32;
  __m256i t[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) t[r][c] = _mm256_setzero_si256();
  const int64_t k1 = (g + 1) * pb.group;
  for (int64_t k = g * pb.group; k < k1; k += 2) {
    const int8_t* r0 = w + k * 64;
    const int8_t* r1 = r0 + 64;
    __m256i wv[4];
    for (int h = 0; h < 2; ++h) {  // channels 16 h .. 16 h + 15
      const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 16 * h)));
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + 16 * h)));
      // lo: channels 0-3 | 8-11, hi: 4-7 | 12-15 of these 16, as (k, k + 1) int16 pairs
      wv[2 * h] = _mm256_unpacklo_epi16(a, b);
      wv[2 * h + 1] = _mm256_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, qx[r] + k, 4);
      const __m256i xp = _mm256_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) t[r][c] = _mm256_add_epi32(t[r][c], _mm256_madd_epi16(wv[c], xp));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      isum[r][2 * h] = _mm256_permute2x128_si256(t[r][2 * h], t[r][2 * h + 1], 0x20);      // 0-7
      isum[r][2 * h + 1] = _mm256_permute2x128_si256(t[r][2 * h], t[r][2 * h + 1], 0x31);  // 8-15
    }
}

// Rows m0 .. m0+R-1 of one strip: every group's integer sums, the float steps, the bias.
template <int Fmt, int R>
void strip_tile(const Problem& pb, const Act8& a, int64_t strip, int64_t m0) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t g = 0; g < pb.groups; ++g) {
    __m256i isum[R][4];
    if constexpr (Fmt == 3) {
      const int8_t* qx[R];
      for (int r = 0; r < R; ++r) qx[r] = a.q.data() + (m0 + r) * pb.K;
      isums_q4<R>(pb, strip, g, qx, isum);
    } else {
      const int16_t* qx[R];
      for (int r = 0; r < R; ++r) qx[r] = a.q16.data() + (m0 + r) * pb.K;
      isums_q8<R>(pb, strip, g, qx, isum);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      const float xs = Fmt == 3 ? pb.xsum[m * pb.groups + g] : 0.f;
      group_step<Fmt>(pb, strip, g, a.d[m * pb.groups + g], xs, isum[r], acc[r]);
    }
  }
  const int64_t n0 = strip * 32;
  const int64_t valid = std::min<int64_t>(32, pb.N - n0);
  if (valid <= 0) return;
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[32];
    for (int c = 0; c < 4; ++c) {
      __m256 v = acc[r][c];
      if (pb.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(pb.bias + n0 + 8 * c));
      _mm256_store_ps(out + 8 * c, v);
    }
    float* yr = pb.y + (m0 + r) * pb.y_stride + n0;
    if (valid == 32) {  // not a `rep movsq` memcpy (see tile16)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(yr + 8 * c, _mm256_load_ps(out + 8 * c));
    } else {
      std::memcpy(yr, out, static_cast<size_t>(valid) * sizeof(float));
    }
  }
}

// Rows a tile shares each unpacked weight vector over (register budget: q4_1 keeps 2 int16
// sums a row, q8_0 4 int32 sums a row, in 16 ymm registers).
template <int Fmt>
constexpr int kAct8Tile = Fmt == 3 ? 4 : 2;

template <int Fmt>
void strip_rows(const Problem& pb, const Act8& a, int64_t strip, int64_t m0, int64_t m1) {
  constexpr int T = kAct8Tile<Fmt>;
  int64_t m = m0;
  for (; m + T <= m1; m += T) strip_tile<Fmt, T>(pb, a, strip, m);
  for (; m + 2 <= m1 && T > 2; m += 2) strip_tile<Fmt, 2>(pb, a, strip, m);
  for (; m < m1; ++m) strip_tile<Fmt, 1>(pb, a, strip, m);
}

// Rows per work item: a few, so that a strip's weights are reused from L1 across them.
constexpr int64_t kAct8Rows = 8;

template <int Fmt>
void run_act8(const Problem& pb, int num_threads) {
  Act8 a;
  quantize_rows(pb, Fmt == 4, a);
  const int64_t strips = pb.Np / 32, blocks = (pb.M + kAct8Rows - 1) / kAct8Rows;
  const int64_t items = strips * blocks;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t s = i / blocks, m0 = i % blocks * kAct8Rows;
    strip_rows<Fmt>(pb, a, s, m0, std::min(pb.M, m0 + kAct8Rows));
  }
}


// ---- int16 activations (fmt 7: q4_1 weights, fmt 8: q8_0 weights) ---------------------
// As the int8 activations above, with 16-bit ones: per row and weight group (any even group
// of at most 256 dividing K), dx[m, g] = max |x| / 32767 over the group, qx =
// round-half-even(x * (1 / dx)) in [-32767, 32767] (0 where the group is 0): a rounding of
// at most 2^-16 of the group's largest |x|, 256 times finer than int8's. One output element:
//   acc = 0;  for each group g in order:
//     acc = fma(float(isum[g]), dw[n, g] * dx[m, g], acc)        isum = sum_k qw * qx (exact)
//     q4_1 only: acc = fma(xsum[m, g], min[n, g], acc)
//   y = acc (+ bias[n])
// Why: _mm256_madd_epi16 multiplies 16 int16 pairs and adds each pair in int32, twice the
// multiply-adds of an fp32 FMA per instruction at the same rate (Zen 3: 5.5 G madd/s
// against 5.8 G FMA/s on one core, measured), so a compute-bound (many-row) call can run up
// to twice as fast as fp32 activations; the weights are read as they are stored. (In
// practice, in a 512-token prefill on that Zen 3: 44 G MAC/s a thread for the 6-row tile,
// against 41.5 for MKL's fp32 sgemm in the same profile: the gain there is bytes, not
// time.) The sums stay exact: |qw qx| <= 127 * 32767, 256 of them < 2^31. The same integer
// and float operations in both builds and for every row count: batch-invariant,
// bit-identical builds.
// A work item is a panel of 16 channels for a block of rows; a tile is R <= 6 rows (12
// int32 sums, 2 weight vectors and a broadcast in 16 ymm registers; totals in memory).
// K-quant weights (fmt 11: q4_k, 12: i8_k, 14: q6_k), the same scheme: x is quantized per row and
// group of 32 (kAct16KGroup) whatever the weight's group; each weight group g (q4_k: 32
// input channels, i8_k: 16) gets its exact integer sum and its own float steps, with the
// d1 = fp32(d) * sc and min1 = -(fp32(dmin) * m) of the fp32 paths (group_scales: exact)
// and dx of the activation group that holds it:
//   acc = fma(float(isum[g]), d1[n, g] * dx[m, g * group / 32], acc)
//   acc = fma(xsum[m, g], min1[n, g], acc)                 xsum: over g's k, as the fp32 path
// i8_k's two weight groups in one activation group are two steps each, in k order: their
// sums are never added in integers (isum * sc would need 33 bits) nor in floats before the
// steps, so every operation is one of q4_1x16's, and the sums are exact (|q qx| <= 128 *
// 32767, 16 or 32 of them < 2^31). Nibbles are q4_1's (the same int4 layout), i8_k's
// bytes q8_0's; q6_k's q - 32 are decoded to int8 per k pair (q6_pair), then as i8_k's, with
// no min step (its groups of 16 as i8_k's).

struct Act16 {
  std::vector<int16_t> q;  // [M, K] qx
  std::vector<float> d;    // [M, groups] dx
  int64_t group = 0, groups = 0;  // x's groups: the weight's (q4_1, q8_0) or 32 (K-quants)

  // dx of the group of row m that holds weight group g (of pb.group input channels)
  float dx(const Problem& pb, int64_t m, int64_t g) const {
    return d[m * groups + g * pb.group / group];
  }
};

// A group with a NaN or an infinity gets dx = NaN (and qx = 0), so that its outputs are NaN as
// the fp32 product's would be, and the step loop fails that row instead of sampling garbage.
inline void quantize_group16(const float* x, int64_t n, float& d_out, int16_t* q) {
  float amax = 0.f;
  bool bad = false;
  int64_t k = 0;
  if (n % 8 == 0) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (; k < n; k += 8) {
      const __m256 v = _mm256_loadu_ps(x + k);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    alignas(32) float t[8];
    _mm256_store_ps(t, m);
    for (int i = 0; i < 8; ++i) amax = std::max(amax, t[i]);
    bad = _mm256_movemask_ps(nan) != 0;
  } else {
    for (; k < n; ++k) {
      amax = std::max(amax, std::fabs(x[k]));
      bad = bad || std::isnan(x[k]);
    }
  }
  if (bad || !std::isfinite(amax)) {
    d_out = std::numeric_limits<float>::quiet_NaN();
    std::memset(q, 0, static_cast<size_t>(n) * sizeof(int16_t));
    return;
  }
  const float d = amax / 32767.f, id = amax > 0.f ? 1.f / d : 0.f;
  d_out = d;
  k = 0;
  if (n % 8 == 0) {  // _mm256_cvtps_epi32 rounds as lrintf does (MXCSR: half to even)
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
    for (; k < n; k += 8) {
      __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vid));
      v = _mm256_max_epi32(lo, _mm256_min_epi32(hi, v));
      const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), p);
    }
  }
  for (; k < n; ++k) {
    const long v = std::lrintf(x[k] * id);
    q[k] = static_cast<int16_t>(std::min(32767L, std::max(-32767L, v)));
  }
}

// x's groups of `group` input channels (dividing K, and a multiple of the weight's group or
// equal to it) quantized to int16.
inline void quantize_rows16(const Problem& pb, int64_t group, Act16& a, int num_threads) {
  const int64_t M = pb.M, K = pb.K, G = K / group;
  a.group = group;
  a.groups = G;
  a.q.resize(static_cast<size_t>(M * K));
  a.d.resize(static_cast<size_t>(M * G));
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M * K >= 32768)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g)
      quantize_group16(pb.x + m * pb.x_stride + g * group, group, a.d[m * G + g],
                       a.q.data() + m * K + g * group);
}

// Weights (k, k + 1) of one panel's 16 channels as int16 pairs, for _mm256_madd_epi16:
// lo holds channels 0-3 | 8-11, hi 4-7 | 12-15 (unpack works within 128-bit lanes).
template <int Fmt>
inline void pair_weights16(const Problem& pb, int64_t p, int64_t k, __m256i& lo, __m256i& hi) {
  __m256i a, b;
  if constexpr (is_4bit(Fmt)) {  // byte c of pair k / 2: q(c, k) low nibble, q(c, k + 1) high
    const uint8_t* w = static_cast<const uint8_t*>(pb.w) + at(p, pb.K / 2, k / 2);
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    a = _mm256_and_si256(v, _mm256_set1_epi16(15));
    b = _mm256_srli_epi16(v, 4);
  } else if constexpr (Fmt == kQ6K) {
    __m128i qa, qb;
    q6_pair(static_cast<const uint8_t*>(pb.w) + at(p, pb.K / 4 * kQ6Lines, k / 4 * kQ6Lines), 64,
            k, qa, qb);
    a = _mm256_cvtepi8_epi16(qa);
    b = _mm256_cvtepi8_epi16(qb);
  } else if constexpr (Fmt == kQ5K) {
    __m128i qa, qb;
    q5_pair(static_cast<const uint8_t*>(pb.w) + at(p, pb.K / 8 * kQ5Lines, k / 8 * kQ5Lines), 64,
            k, qa, qb);
    a = _mm256_cvtepi8_epi16(qa);
    b = _mm256_cvtepi8_epi16(qb);
  } else {
    const int8_t* w = static_cast<const int8_t*>(pb.w) + at(p, pb.K, k);
    a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 64)));
  }
  lo = _mm256_unpacklo_epi16(a, b);
  hi = _mm256_unpackhi_epi16(a, b);
}

// A one-row call (tile16 with C = 4; 2-3 rows: C = 2) prefetches the weight line this many
// bytes ahead of the k pair it reads: 32 k pairs for q4_1 (one 64-byte line each), 8 for
// q8_0 (two lines each), running on into the thread's next block. Such a call lasts tens of
// microseconds, too short for the hardware prefetcher to reach full stream depth. Measured
// on Zen 3 (AVX2, 2 threads, 30 layers' weights and the LM head streamed cold, alternating
// builds in one process): 120 layers at one row 5.24 -> 4.78 ms, LM head 1.72 -> 1.55 ms; a
// plain read of the same bytes over the same split, without prefetching, took 5.2 and
// 1.6-1.7 ms.
constexpr int64_t kGemvPrefetchBytes = 2048;

// Prefetches the weight line(s) of k pair k of the block holding panel p0 (one 64-byte line
// for q4_1, two for q8_0), kGemvPrefetchBytes ahead: the few-row layouts of tile16 and
// tile_vnni.
template <int Fmt>
inline void prefetch_ahead(const Problem& pb, int64_t p0, int64_t k) {
  if constexpr (is_4bit(Fmt)) {
    __builtin_prefetch(static_cast<const char*>(pb.w) + at(p0, pb.K / 2, k / 2) +
                       kGemvPrefetchBytes);
  } else if constexpr (Fmt == kQ6K) {  // a quad's three lines, once a quad
    if (k % 4 == 0) {
      const char* pw = static_cast<const char*>(pb.w) +
                       at(p0, pb.K / 4 * kQ6Lines, k / 4 * kQ6Lines) + kGemvPrefetchBytes;
      for (int i = 0; i < 3; ++i) __builtin_prefetch(pw + 64 * i);
    }
  } else if constexpr (Fmt == kQ5K) {  // an octet's five lines, once an octet
    if (k % 8 == 0) {
      const char* pw = static_cast<const char*>(pb.w) +
                       at(p0, pb.K / 8 * kQ5Lines, k / 8 * kQ5Lines) + kGemvPrefetchBytes;
      for (int i = 0; i < kQ5Lines; ++i) __builtin_prefetch(pw + 64 * i);
    }
  } else {
    const char* pw = static_cast<const char*>(pb.w) + at(p0, pb.K, k) + kGemvPrefetchBytes / 2;
    __builtin_prefetch(pw);
    __builtin_prefetch(pw + 64);
  }
}

// Group g's 16 scales of panel p as tile16's float steps take them: d (channels 0-7, 8-15)
// and, for the formats with a min, the min (q4_0: -8 d).
struct Scales16 {
  __m256 d0, d1, n0, n1;
};

template <int Fmt>
inline void panel_scales16(const Problem& pb, int64_t p, int64_t g, Scales16& sc) {
  sc.n0 = sc.n1 = _mm256_setzero_ps();
  if constexpr (has_supers(Fmt)) {  // d1, min1 formed exactly (group_scales), as halves
    V16 d, mn;
    group_scales<Fmt>(pb, p, g, d, mn);
    alignas(64) float dm[2][16];
    store(dm[0], d);
    store(dm[1], mn);
    sc.d0 = _mm256_load_ps(dm[0]);
    sc.d1 = _mm256_load_ps(dm[0] + 8);
    sc.n0 = _mm256_load_ps(dm[1]);
    sc.n1 = _mm256_load_ps(dm[1] + 8);
  } else {
    const int64_t off = at(p, pb.groups, g);
    const uint16_t* dw = static_cast<const uint16_t*>(pb.scale) + off;
    sc.d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw)));
    sc.d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dw + 8)));
    if constexpr (has_min(Fmt)) {
      if (pb.minv == nullptr) {  // q4_0: min = -8 d (exact)
        sc.n0 = _mm256_mul_ps(sc.d0, _mm256_set1_ps(-8.f));
        sc.n1 = _mm256_mul_ps(sc.d1, _mm256_set1_ps(-8.f));
      } else {
        const uint16_t* mn = static_cast<const uint16_t*>(pb.minv) + off;
        sc.n0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn)));
        sc.n1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + 8)));
      }
    }
  }
}

// The float step of row m's group g over one panel, every x16 kernel of AVX2 alike: i0, i1
// are the group's integer sums (channels 0-7, 8-15), t0, t1 the running outputs:
// t = fma(float(i), d * dx, t), then (formats with a min) t = fma(xsum, min, t).
template <int Fmt>
inline void group_step16(const Problem& pb, const Act16& a, int64_t m, int64_t g,
                         const Scales16& sc, __m256i i0, __m256i i1, __m256& t0, __m256& t1) {
  const __m256 vdx = _mm256_set1_ps(a.dx(pb, m, g));
  t0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(sc.d0, vdx), t0);
  t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(sc.d1, vdx), t1);
  if constexpr (has_min(Fmt)) {
    const __m256 vxs = _mm256_set1_ps(pb.xsum[m * pb.groups + g]);
    t0 = _mm256_fmadd_ps(vxs, sc.n0, t0);
    t1 = _mm256_fmadd_ps(vxs, sc.n1, t1);
  }
}

// Rows m0 .. m0+R-1 of panels p0 .. p0+C-1: every group's integer sums, the float steps,
// the bias. The weight pairs come from `strip` ([K / 2][2] vectors: channels 0-7 and 8-15,
// pair_weights16's lo and hi put in channel order; C = 1 only) when given.
template <int Fmt, int R, int C>
void tile16(const Problem& pb, const Act16& a, int64_t p0, int64_t m0, const __m256i* strip) {
  alignas(32) float tot[R][C][16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int j = 0; j < 16; ++j) tot[r][c][j] = 0.f;
  const int16_t* qx[R];
  for (int r = 0; r < R; ++r) qx[r] = a.q.data() + (m0 + r) * pb.K;
  for (int64_t g = 0; g < pb.groups; ++g) {
    __m256i s[R][C][2];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c][0] = s[r][c][1] = _mm256_setzero_si256();
    const int64_t k1 = (g + 1) * pb.group;
    for (int64_t k = g * pb.group; k < k1; k += 2) {
      if constexpr (C > 1)  // the few-row layouts (never a strip): see kGemvPrefetchBytes
        prefetch_ahead<Fmt>(pb, p0, k);
      for (int c = 0; c < C; ++c) {
        __m256i lo, hi;
        if (strip != nullptr) {
          lo = _mm256_load_si256(strip + k);
          hi = _mm256_load_si256(strip + k + 1);
        } else {
          pair_weights16<Fmt>(pb, p0 + c, k, lo, hi);
        }
        // each row's x pair broadcast where it is used (R = 6: 12 sums, 2 weight vectors
        // and one broadcast fill the 16 registers; hoisting six broadcasts would spill)
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, qx[r] + k, 4);
          const __m256i xp = _mm256_set1_epi32(pair);
          s[r][c][0] = _mm256_add_epi32(s[r][c][0], _mm256_madd_epi16(lo, xp));
          s[r][c][1] = _mm256_add_epi32(s[r][c][1], _mm256_madd_epi16(hi, xp));
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      Scales16 sc;
      panel_scales16<Fmt>(pb, p0 + c, g, sc);
      for (int r = 0; r < R; ++r) {
        __m256i i0 = s[r][c][0], i1 = s[r][c][1];  // a strip's sums: channels 0-7, 8-15
        if (strip == nullptr) {  // packed pairs' sums: channels 0-3 | 8-11 and 4-7 | 12-15
          i0 = _mm256_permute2x128_si256(s[r][c][0], s[r][c][1], 0x20);
          i1 = _mm256_permute2x128_si256(s[r][c][0], s[r][c][1], 0x31);
        }
        __m256 t0 = _mm256_load_ps(tot[r][c]), t1 = _mm256_load_ps(tot[r][c] + 8);
        group_step16<Fmt>(pb, a, m0 + r, g, sc, i0, i1, t0, t1);
        _mm256_store_ps(tot[r][c], t0);
        _mm256_store_ps(tot[r][c] + 8, t1);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t c0 = (p0 + c) * 16;
    const int64_t valid = std::min<int64_t>(16, pb.N - c0);
    if (valid <= 0) continue;
    for (int r = 0; r < R; ++r) {
      if (pb.bias != nullptr)
        for (int j = 0; j < 16; ++j) tot[r][c][j] += pb.bias[c0 + j];
      float* yr = pb.y + (m0 + r) * pb.y_stride + c0;
      if (valid == 16) {  // GCC makes the 64-byte memcpy a `rep movsq`: 5% of a 48-row call
        _mm256_storeu_ps(yr, _mm256_load_ps(tot[r][c]));
        _mm256_storeu_ps(yr + 8, _mm256_load_ps(tot[r][c] + 8));
      } else {
        std::memcpy(yr, tot[r][c], static_cast<size_t>(valid) * sizeof(float));
      }
    }
  }
}

// Groups ahead whose scale lines a one-row call prefetches (gemv16_block): a group of q4_k's
// 32 k is 16 weight lines of the block, so 4 groups are the weights' kGemvPrefetchBytes
// twice over.
constexpr int64_t kGemv16ScaleGroupsAhead = 4;

// Prefetches the lines of group g's scales (and mins, super-block scales) of the 64-channel
// block holding panel p0, when g is a group of the weight.
template <int Fmt>
inline void prefetch_scales16(const Problem& pb, int64_t p0, int64_t g) {
  if (g >= pb.groups) return;
  const int64_t off = at(p0, pb.groups, g);
  if constexpr (has_supers(Fmt)) {  // int8 / uint8 sc (and m): one line a group
    __builtin_prefetch(static_cast<const uint8_t*>(pb.scale) + off);
    if constexpr (has_min(Fmt)) __builtin_prefetch(static_cast<const uint8_t*>(pb.minv) + off);
    if ((g * pb.group) % pb.super_group == 0) {  // fp16 d (and dmin): two lines a super-block
      const int64_t soff = at(p0, pb.supers, g * pb.group / pb.super_group);
      __builtin_prefetch(pb.sup_scale + soff);
      __builtin_prefetch(pb.sup_scale + soff + 32);
      if constexpr (has_min(Fmt)) {
        __builtin_prefetch(pb.sup_min + soff);
        __builtin_prefetch(pb.sup_min + soff + 32);
      }
    }
  } else {  // fp16 d (and min): two lines a group
    const uint16_t* d = static_cast<const uint16_t*>(pb.scale) + off;
    __builtin_prefetch(d);
    __builtin_prefetch(d + 32);
    if (pb.minv != nullptr) {
      const uint16_t* mn = static_cast<const uint16_t*>(pb.minv) + off;
      __builtin_prefetch(mn);
      __builtin_prefetch(mn + 32);
    }
  }
}

// Row m's outputs of panels p0 .. p0 + C - 1 (tot: channels 0-7, 8-15 of each), the bias added,
// stored where the panel holds output channels.
template <int C = 4>
inline void store_row16(const Problem& pb, int64_t p0, int64_t m, const __m256 (&tot)[C][2]) {
  for (int c = 0; c < C; ++c) {
    const int64_t c0 = (p0 + c) * 16;
    const int64_t valid = std::min<int64_t>(16, pb.N - c0);
    if (valid <= 0) continue;
    alignas(32) float t[16];
    _mm256_store_ps(t, tot[c][0]);
    _mm256_store_ps(t + 8, tot[c][1]);
    if (pb.bias != nullptr)
      for (int j = 0; j < 16; ++j) t[j] += pb.bias[c0 + j];
    std::memcpy(pb.y + m * pb.y_stride + c0, t, static_cast<size_t>(valid) * sizeof(float));
  }
}

// The sums of two panels held as quarters (s0..s3: channels 0-3, 4-7, 8-11, 12-15 of panel
// p in lane 0 and of panel p + 1 in lane 1, as unpacking byte pairs with zero leaves them) put
// in channel order: lo[0], lo[1] panel p's channels 0-7, 8-15; hi the same of panel p + 1.
inline void quarters_to_panels(__m256i s0, __m256i s1, __m256i s2, __m256i s3, __m256i (&lo)[2],
                               __m256i (&hi)[2]) {
  lo[0] = _mm256_permute2x128_si256(s0, s1, 0x20);
  lo[1] = _mm256_permute2x128_si256(s2, s3, 0x20);
  hi[0] = _mm256_permute2x128_si256(s0, s1, 0x31);
  hi[1] = _mm256_permute2x128_si256(s2, s3, 0x31);
}

// Row 0's float steps of group g over the four panels of the block holding p0 (s: each
// panel's sums in channel order), the one-row block kernels alike.
template <int Fmt>
inline void block_step16(const Problem& pb, const Act16& a, int64_t p0, int64_t g,
                         const __m256i (&s)[4][2], __m256 (&tot)[4][2]) {
  for (int c = 0; c < 4; ++c) {
    Scales16 sc;
    panel_scales16<Fmt>(pb, p0 + c, g, sc);
    group_step16<Fmt>(pb, a, 0, g, sc, s[c][0], s[c][1], tot[c][0], tot[c][1]);
  }
}

// One row of a 4-bit x16 call on AVX2 (q4_1, q4_0, q4_k): a 64-channel block, tile16<Fmt, 1,
// 4>'s integer sums and float steps (group_step16), with the k pairs walked by one pointer
// (each pair of the block is one 64-byte line: the four panels' 16 bytes), each half block's
// four sums in registers (the other half's lines are still in L1), and the group's scale lines
// prefetched a few groups ahead. tile16's general indexing (at() per panel and pair) left GCC
// three of its eight sums on the stack and an address computation per panel. Measured on Zen 3
// (AVX2, 2 threads, a 1B Q4_K_M decode step's weights streamed, both builds in one process,
// taking turns over 20 rounds): the step's median 30.98 -> 26.17 ms.
template <int Fmt>
void gemv16_block(const Problem& pb, const Act16& a, int64_t b) {
  static_assert(is_4bit(Fmt), "gemv16_block: the nibble formats only");
  const int64_t p0 = 4 * b;
  const uint8_t* w = static_cast<const uint8_t*>(pb.w) + at(p0, pb.K / 2, 0);
  const int16_t* qx = a.q.data();
  const __m256i low4 = _mm256_set1_epi16(15);
  __m256 tot[4][2];
  for (int c = 0; c < 4; ++c) tot[c][0] = tot[c][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < pb.groups; ++g) {
    prefetch_scales16<Fmt>(pb, p0, g + kGemv16ScaleGroupsAhead);
    const int64_t k1 = (g + 1) * pb.group;
    __m256i s[4][2];
    const uint8_t* wg = w;
    for (int h = 0; h < 2; ++h) {  // the block's two halves in turn: four sums in registers
      __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
      const uint8_t* wk = wg + 32 * h;
      for (int64_t k = g * pb.group; k < k1; k += 2, wk += 64) {
        if (h == 0) __builtin_prefetch(wk + kGemvPrefetchBytes);
        int32_t pair;
        std::memcpy(&pair, qx + k, 4);
        const __m256i xp = _mm256_set1_epi32(pair);
        const __m256i v0 =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk)));
        const __m256i v1 =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wk + 16)));
        const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_srli_epi16(v0, 4);
        const __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_srli_epi16(v1, 4);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi16(lo0, hi0), xp));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi16(lo0, hi0), xp));
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi16(lo1, hi1), xp));
        s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi16(lo1, hi1), xp));
      }
      // pairs' sums (channels 0-3 | 8-11 and 4-7 | 12-15) in channel order
      s[2 * h][0] = _mm256_permute2x128_si256(s0, s1, 0x20);
      s[2 * h][1] = _mm256_permute2x128_si256(s0, s1, 0x31);
      s[2 * h + 1][0] = _mm256_permute2x128_si256(s2, s3, 0x20);
      s[2 * h + 1][1] = _mm256_permute2x128_si256(s2, s3, 0x31);
    }
    w += pb.group * 32;  // the group's pb.group / 2 lines
    block_step16<Fmt>(pb, a, p0, g, s, tot);
  }
  store_row16(pb, p0, 0, tot);
}

// A quad of q6_k's k for two panels (l: the quad's first line at the half block's 32 bytes)
// as vpmaddwd's word pairs: o[0..3] pairs (k, k + 1), o[4..7] pairs (k + 2, k + 3), each
// four registers of quarters (channels 0-3, 4-7, 8-11, 12-15; panel p in lane 0, p + 1 in
// lane 1). q6_quad's byte arithmetic on 256-bit registers, q in [0, 63] (no offset), byte
// pairs widened by unpacking with zero.
inline void q6_quad_pairs(const uint8_t* l, __m256i (&o)[8]) {
  const __m256i m0f = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i n0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l));
  const __m256i n1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 64));
  const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 128));
  const auto six = [&](__m256i low, __m256i high) {  // low & 15 | high & 0x30
    return _mm256_or_si256(_mm256_and_si256(low, m0f), _mm256_and_si256(high, m30));
  };
  const __m256i q0 = six(n0, _mm256_slli_epi16(hb, 4));
  const __m256i q1 = six(_mm256_srli_epi16(n0, 4), _mm256_slli_epi16(hb, 2));
  const __m256i q2 = six(n1, hb);
  const __m256i q3 = six(_mm256_srli_epi16(n1, 4), _mm256_srli_epi16(hb, 2));
  const __m256i p01[2] = {_mm256_unpacklo_epi8(q0, q1), _mm256_unpackhi_epi8(q0, q1)};
  const __m256i p23[2] = {_mm256_unpacklo_epi8(q2, q3), _mm256_unpackhi_epi8(q2, q3)};
  for (int i = 0; i < 2; ++i) {
    o[2 * i] = _mm256_unpacklo_epi8(p01[i], zero);
    o[2 * i + 1] = _mm256_unpackhi_epi8(p01[i], zero);
    o[4 + 2 * i] = _mm256_unpacklo_epi8(p23[i], zero);
    o[4 + 2 * i + 1] = _mm256_unpackhi_epi8(p23[i], zero);
  }
}

// The first `rows` rows' sums of qx over each weight group, [rows, groups] (q6_k's few-row
// kernels take the offset of 32 off their sums with them: exact).
inline std::vector<int32_t> group_sums16(const Problem& pb, const Act16& a, int64_t rows = 1) {
  std::vector<int32_t> gsum(static_cast<size_t>(rows * pb.groups), 0);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t g = 0; g < pb.groups; ++g)
      for (int64_t k = g * pb.group; k < (g + 1) * pb.group; ++k)
        gsum[static_cast<size_t>(m * pb.groups + g)] += a.q[m * pb.K + k];
  return gsum;
}

// One row of a q6_k x16 call on AVX2: a 64-channel block, tile16<kQ6K, 1, 4>'s integer sums
// and float steps (group_step16), formed a quad of k at a time for two panels at once (the
// quad's three lines, 32 bytes each: q6_quad's byte arithmetic on 256-bit registers). The
// values stay in [0, 63] (no byte subtraction) and their offset of 32 comes off the group's
// sums as 32 x the row's sum of qx over the group (gsum: exact, the same int32 sums). Byte
// pairs (k, k + 1) are widened to the word pairs of vpmaddwd by unpacking with zero. tile16
// formed each pair of each panel from 128-bit loads, about twice the instructions a weight.
// Measured on Zen 3 (AVX2, one thread, [1024 x 4096] in L3, one process): q6_k x16 took
// 1.9-2.1x q4_k x16's time before, 1.35-1.45x after.
void gemv16_q6k_block(const Problem& pb, const Act16& a, const int32_t* gsum, int64_t b) {
  const int64_t p0 = 4 * b, lines = pb.K / 4 * kQ6Lines;
  const uint8_t* w = static_cast<const uint8_t*>(pb.w) + at(p0, lines, 0);
  const int16_t* qx = a.q.data();
  __m256 tot[4][2];
  for (int c = 0; c < 4; ++c) tot[c][0] = tot[c][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < pb.groups; ++g) {
    prefetch_scales16<kQ6K>(pb, p0, g + kGemv16ScaleGroupsAhead);
    const __m256i off = _mm256_set1_epi32(32 * gsum[g]);
    __m256i s[4][2];  // panel c's sums: channels 0-7, 8-15
    for (int h = 0; h < 2; ++h) {  // panels 2h, 2h + 1: lanes 0 and 1 of each register
      __m256i q[4];  // quarters: channels 0-3, 4-7, 8-11, 12-15
      for (auto& v : q) v = _mm256_setzero_si256();
      const uint8_t* l = w + 32 * h;
      for (int64_t j = 0; j < kQ6GroupQuads; ++j, l += kQ6Lines * 64) {
        if (h == 0)
          for (int i = 0; i < kQ6Lines; ++i) __builtin_prefetch(l + kGemvPrefetchBytes + 64 * i);
        __m256i o[8];
        q6_quad_pairs(l, o);
        const int64_t k = g * pb.group + 4 * j;
        int32_t pair;
        std::memcpy(&pair, qx + k, 4);
        const __m256i x01 = _mm256_set1_epi32(pair);
        std::memcpy(&pair, qx + k + 2, 4);
        const __m256i x23 = _mm256_set1_epi32(pair);
        for (int i = 0; i < 4; ++i)
          q[i] = _mm256_add_epi32(q[i], _mm256_add_epi32(_mm256_madd_epi16(o[i], x01),
                                                         _mm256_madd_epi16(o[4 + i], x23)));
      }
      for (auto& v : q) v = _mm256_sub_epi32(v, off);
      quarters_to_panels(q[0], q[1], q[2], q[3], s[2 * h], s[2 * h + 1]);
    }
    w += kQ6GroupQuads * kQ6Lines * 64;
    block_step16<kQ6K>(pb, a, p0, g, s, tot);
  }
  store_row16(pb, p0, 0, tot);
}

// Two or three rows of a q6_k x16 call on AVX2: half a block (panels p0, p0 + 1), tile16<kQ6K,
// R, 2>'s integer sums and float steps (group_step16). Each group's word pairs are formed once
// (a quad of k for both panels at once, by q6_quad_pairs) into a buffer in L1
// that every row reads, where tile16 formed them from each panel's 128-bit loads (q6_pair).
// gsum: [M, groups], each row's sum of qx per weight group. Measured on Zen 3 (AVX2, 2
// threads, 8 [2048 x 8192] weights and a [49152 x 2048] LM head streamed, both builds in one
// process taking turns): 2 rows 20.30 -> 16.98 ms, 3 rows 25.78 -> 21.81 ms (medians of 12).
template <int R>
void rows16_q6k_half(const Problem& pb, const Act16& a, const int32_t* gsum, int64_t half) {
  const int64_t p0 = 2 * half, lines = pb.K / 4 * kQ6Lines;
  const uint8_t* l = static_cast<const uint8_t*>(pb.w) + at(p0, lines, 0);
  const __m256i zero = _mm256_setzero_si256();
  const int64_t quads = pb.group / 4;  // 4 for q6_k's groups of 16
  std::vector<__m256i> wp(static_cast<size_t>(quads * 8));  // [quad][8]: (k, k+1) x 4, (k+2, k+3) x 4
  __m256 tot[R][2][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) tot[r][c][0] = tot[r][c][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < pb.groups; ++g) {
    for (int64_t j = 0; j < quads; ++j, l += kQ6Lines * 64) {
      for (int i = 0; i < kQ6Lines; ++i) __builtin_prefetch(l + kGemvPrefetchBytes + 64 * i);
      q6_quad_pairs(l, *reinterpret_cast<__m256i(*)[8]>(wp.data() + 8 * j));
    }
    Scales16 sc[2];
    for (int c = 0; c < 2; ++c) panel_scales16<kQ6K>(pb, p0 + c, g, sc[c]);
    for (int r = 0; r < R; ++r) {
      const int16_t* qx = a.q.data() + r * pb.K + g * pb.group;
      __m256i s0 = zero, s1 = zero, s2 = zero, s3 = zero;  // channels 0-3, 4-7, 8-11, 12-15
      for (int64_t j = 0; j < quads; ++j) {
        const __m256i* o = wp.data() + 8 * j;
        int32_t pair;
        std::memcpy(&pair, qx + 4 * j, 4);
        const __m256i x01 = _mm256_set1_epi32(pair);
        std::memcpy(&pair, qx + 4 * j + 2, 4);
        const __m256i x23 = _mm256_set1_epi32(pair);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(o[0], x01));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(o[1], x01));
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(o[2], x01));
        s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(o[3], x01));
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(o[4], x23));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(o[5], x23));
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(o[6], x23));
        s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(o[7], x23));
      }
      const __m256i off = _mm256_set1_epi32(32 * gsum[r * pb.groups + g]);
      s0 = _mm256_sub_epi32(s0, off);
      s1 = _mm256_sub_epi32(s1, off);
      s2 = _mm256_sub_epi32(s2, off);
      s3 = _mm256_sub_epi32(s3, off);
      group_step16<kQ6K>(pb, a, r, g, sc[0], _mm256_permute2x128_si256(s0, s1, 0x20),
                         _mm256_permute2x128_si256(s2, s3, 0x20), tot[r][0][0], tot[r][0][1]);
      group_step16<kQ6K>(pb, a, r, g, sc[1], _mm256_permute2x128_si256(s0, s1, 0x31),
                         _mm256_permute2x128_si256(s2, s3, 0x31), tot[r][1][0], tot[r][1][1]);
    }
  }
  for (int r = 0; r < R; ++r) store_row16<2>(pb, p0, r, tot[r]);
}

// One row of a q5_k x16 call on AVX2: a 64-channel block, tile16<kQ5K, 1, 4>'s integer sums
// and float steps (group_step16), an octet of k at a time for two panels at once: its four
// nibble lines and its line of high bits, 32 bytes each, give q in [0, 31] as bytes (q5_pair's
// arithmetic on 256-bit registers, the high bit i moved to bit 4 by a shift and an and), and
// byte pairs (k, k + 1) are widened to the word pairs of vpmaddwd by unpacking with zero.
// tile16 formed each pair of each panel from 128-bit loads (q5_pair, then a sign extension).
// Measured on Zen 3 (AVX2, one thread, [1024 x 4096] in L3, one process): q5_k x16 took
// 2.4x q4_k x16's time before, about the same time after.
void gemv16_q5k_block(const Problem& pb, const Act16& a, int64_t b) {
  const int64_t p0 = 4 * b, lines = pb.K / 8 * kQ5Lines;
  const uint8_t* w = static_cast<const uint8_t*>(pb.w) + at(p0, lines, 0);
  const int16_t* qx = a.q.data();
  const __m256i m0f = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
  const __m256i zero = _mm256_setzero_si256();
  __m256 tot[4][2];
  for (int c = 0; c < 4; ++c) tot[c][0] = tot[c][1] = _mm256_setzero_ps();
  const int64_t octets = pb.group / 8;  // a group's octets: 5 lines each
  for (int64_t g = 0; g < pb.groups; ++g) {
    prefetch_scales16<kQ5K>(pb, p0, g + kGemv16ScaleGroupsAhead);
    __m256i s[4][2];  // panel c's sums: channels 0-7, 8-15
    for (int h = 0; h < 2; ++h) {  // panels 2h, 2h + 1: lanes 0 and 1 of each register
      __m256i s0 = zero, s1 = zero, s2 = zero, s3 = zero;  // channels 0-3, 4-7, 8-11, 12-15
      const uint8_t* l = w + 32 * h;
      for (int64_t j = 0; j < octets; ++j, l += kQ5Lines * 64) {
        if (h == 0)
          for (int i = 0; i < kQ5Lines; ++i) __builtin_prefetch(l + kGemvPrefetchBytes + 64 * i);
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 4 * 64));
        const int16_t* xk = qx + g * pb.group + 8 * j;
        // pair i: nibbles of line i; high bits 2i (k) and 2i + 1 (k + 1) moved to bit 4
        const auto pair = [&](int i, __m256i hk, __m256i hk1) {
          const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(l + 64 * i));
          const __m256i qa = _mm256_or_si256(_mm256_and_si256(n, m0f), _mm256_and_si256(hk, m10));
          const __m256i qb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(n, 4), m0f),
                                             _mm256_and_si256(hk1, m10));
          int32_t xv;
          std::memcpy(&xv, xk + 2 * i, 4);
          const __m256i xp = _mm256_set1_epi32(xv);
          const __m256i lo = _mm256_unpacklo_epi8(qa, qb), hi = _mm256_unpackhi_epi8(qa, qb);
          s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), xp));
          s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), xp));
          s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), xp));
          s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), xp));
        };
        // 16-bit shifts: the bits a shift carries across bytes are masked off (0x10)
        pair(0, _mm256_slli_epi16(hb, 4), _mm256_slli_epi16(hb, 3));
        pair(1, _mm256_slli_epi16(hb, 2), _mm256_slli_epi16(hb, 1));
        pair(2, hb, _mm256_srli_epi16(hb, 1));
        pair(3, _mm256_srli_epi16(hb, 2), _mm256_srli_epi16(hb, 3));
      }
      quarters_to_panels(s0, s1, s2, s3, s[2 * h], s[2 * h + 1]);
    }
    w += octets * kQ5Lines * 64;
    block_step16<kQ5K>(pb, a, p0, g, s, tot);
  }
  store_row16(pb, p0, 0, tot);
}

// Rows per block when M rows are cut into as few blocks of at most `most` rows as hold them,
// of equal size give or take one: with blocks of `most` rows, 64 rows were 48 + 16, and the
// thread given the first block took three times the other's work. Measured on Zen 4 (2
// threads, [8192 x 2048], against 48-row blocks in one process): q4_k x16 on the VNNI tiles
// 1.5x faster at 64 rows, 1.9x at 100 (48 + 48 + 4); q4_1 / q8_0 x16 on the AVX2 tiles 1.4x
// at 64 and 100.
inline int64_t even_block_rows(int64_t M, int64_t most) {
  const int64_t blocks = (M + most - 1) / most;
  return (M + blocks - 1) / blocks;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// ---- one row of q4_1 x int16 activations with AVX512-VNNI (the AVX-512 build only) -----
// The same integers and float steps as tile16<kQ41, 1, 4> (so the same bits), with about a
// third of its vector instructions: with its weights in cache, that kernel is bound by its
// instruction rate (unpacking nibbles to int16 for vpmaddwd). Each int16 qx is split into a
// signed high byte and an unsigned low byte, qx = 256 h + l with h = qx >> 8 in [-128, 127]
// and l = qx & 255, and vpdpbusd (unsigned bytes times signed bytes, four products summed
// into each int32 lane) takes the nibbles q in [0, 15] as they are, on either side:
//   sum q h = dpbusd(q as unsigned, h as signed),  sum q l = dpbusd(l as unsigned, q as signed)
//   isum = 256 sum q h + sum q l = sum q qx, exact (|isum| <= 15 * 32767 * 256 < 2^31).
// Four lines (k pairs j .. j + 3 of a block's 64 channels) are transposed in registers
// (unpack bytes, then 16-bit words: within 128-bit lanes) so that each int32 lane holds one
// channel's bytes of the four lines: low nibbles q(2j), q(2j+2), q(2j+4), q(2j+6), high
// nibbles the odd k; the activations are laid out to match (even k's bytes, odd k's bytes,
// per 8 k). The lanes' channel order (0-3 | 16-19 | 32-35 | 48-51 for the first vector) is
// put back once per group by a 4 x 4 transpose of 128-bit lanes.
// Measured on Zen 4 (2 threads, against tile16), weights in cache: [3072 x 576] 30.0 -> 20.6
// us, [576 x 1536] 21.6 -> 17.2 us; streamed from memory (a step's 120 one-row q4_1 calls, 66
// MB), the same time: 2.97 against 3.00 ms, 22 GB/s, when a plain x.sum() read 45+ GB/s.

// VNNI is not part of the build's flags (AVX-512 F/BW/VL/DQ): this kernel is compiled for it
// alone and run where the CPU has it.
inline bool cpu_has_avx512_vnni() {
#if defined(CONVEYOR_ISA_CAP_AVX512_CORE)
  return false;  // built to run as an AVX-512 CPU without VNNI (kernels/cpu_build.py: isa_cap)
#else
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return has;
#endif
}

// Row 0's qx as the vpdpbusd operands of each 8 k: words[4 t .. 4 t + 3] = the high bytes of
// k = 8t, 8t+2, 8t+4, 8t+6 | of the odd k | the low bytes of the even k | of the odd k.
inline void vnni_words(const int16_t* qx, int64_t K, int32_t* words) {
  for (int64_t t = 0; t < K / 8; ++t) {
    uint8_t b[4][4];
    for (int i = 0; i < 8; ++i) {
      const int16_t v = qx[8 * t + i];
      b[i & 1][i >> 1] = static_cast<uint8_t>(static_cast<uint16_t>(v) >> 8);  // v >> 8 as a byte
      b[2 + (i & 1)][i >> 1] = static_cast<uint8_t>(v & 255);
    }
    std::memcpy(words + 4 * t, b, sizeof(b));
  }
}

// q4_k takes it as it is (the same nibble lines; its float steps from group_scales). q5_k
// (the same nibble lines, a fifth line of high bits per octet: kQ5Lines) goes the same way
// with each transposed byte's fifth bit added before the products, so that its one-row calls
// are no longer bound by their instruction rate: the octet's high line is spread to the
// transposed order with one vpshufb per vector (each int32 lane gets its channel's high
// byte 4 times; lane L of u[i] holds channels 16 L + 4 i .. + 3, all within the 128-bit
// lane that holds their high bytes), and byte j of an int32 lane takes 16 where bit 2 j
// (even k) or 2 j + 1 (odd k) is set: two vptestmb and two masked vpaddb a vector. The sums
// and float steps are tile_vnni<Fmt, 1, 4>'s (group_scales), so its bits.

// q6_k (kQ6Lines per quad of k: two per octet of nibble lines, each with its line of high
// bits) takes its 6-bit values q in [0, 63] whole, before the transposition: the octet's
// eight k are formed as full bytes, (nibble & 15) | (high field << 4) (a shift, an and and
// one vpternlogd each), then transposed as the nibble lines are (the even k's bytes, then the
// odd k's). vpdpbusd takes q unsigned (as h's partner) and as a signed byte (l's partner,
// q <= 63), and the group's sum of q - 32 times qx, tile_vnni's integer, is sum q qx minus 32
// times the group's sum of qx (`gsum`, per group of 16, from the row's qx): exact
// (|sum q qx| <= 63 * 32767 * 16 < 2^31). No min step (q6_k has none), as tile_vnni.

// The octet's eight k as full q6_k bytes, f[j] for k = 8t + j (64 channels each), from its
// six lines at p (nibbles of k 0-1, of k 2-3, high fields of k 0-3, then the same for k 4-7).
__attribute__((target("avx512vnni"))) inline void q6_octet(const uint8_t* p, __m512i (&f)[8]) {
  const __m512i n0 = _mm512_loadu_si512(p), n1 = _mm512_loadu_si512(p + 64);
  const __m512i h0 = _mm512_loadu_si512(p + 128), n2 = _mm512_loadu_si512(p + 192);
  const __m512i n3 = _mm512_loadu_si512(p + 256), h1 = _mm512_loadu_si512(p + 320);
  const __m512i m0f = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const auto six = [&](__m512i low, __m512i high) {  // (low & 15) | (high & 0x30): 0xEC = (a & c) | b
    return _mm512_ternarylogic_epi32(low, _mm512_and_si512(high, m30), m0f, 0xEC);
  };
  // field i of a quad's high byte (bits 2 i, 2 i + 1) to bits 4-5 of its byte
  f[0] = six(n0, _mm512_slli_epi16(h0, 4));
  f[1] = six(_mm512_srli_epi16(n0, 4), _mm512_slli_epi16(h0, 2));
  f[2] = six(n1, h0);
  f[3] = six(_mm512_srli_epi16(n1, 4), _mm512_srli_epi16(h0, 2));
  f[4] = six(n2, _mm512_slli_epi16(h1, 4));
  f[5] = six(_mm512_srli_epi16(n2, 4), _mm512_slli_epi16(h1, 2));
  f[6] = six(n3, h1);
  f[7] = six(_mm512_srli_epi16(n3, 4), _mm512_srli_epi16(h1, 2));
}

// Four byte lines a, b, c, d (64 channels each) transposed so that int32 lane e of the 128-bit
// lane L of u[i] holds channel 16 L + 4 i + e's bytes (a, b, c, d) (unpacks work within 128-bit
// lanes).
__attribute__((target("avx512vnni"))) inline void transpose_lines(__m512i a, __m512i b, __m512i c,
                                                                 __m512i d, __m512i (&u)[4]) {
  const __m512i t01 = _mm512_unpacklo_epi8(a, b), t01h = _mm512_unpackhi_epi8(a, b);
  const __m512i t23 = _mm512_unpacklo_epi8(c, d), t23h = _mm512_unpackhi_epi8(c, d);
  u[0] = _mm512_unpacklo_epi16(t01, t23);
  u[1] = _mm512_unpackhi_epi16(t01, t23);
  u[2] = _mm512_unpacklo_epi16(t01h, t23h);
  u[3] = _mm512_unpackhi_epi16(t01h, t23h);
}

// Block b (channels 64 b .. 64 b + 63) of one row: every group's integer sums, the float
// steps, the bias. Needs K a multiple of 8 and the group a multiple of 8; q6_k needs `gsum`
// (the row's sum of qx per group), the others ignore it.
template <int Fmt>
__attribute__((target("avx512vnni"))) void gemv_vnni_block(const Problem& pb, const Act16& a,
                                                           const int32_t* words,
                                                           const int32_t* gsum, int64_t b) {
  static_assert(has_gemv_vnni(Fmt), "q4_1 (q4_0), q4_k, q5_k, q6_k lines only");
  // 64-byte lines per octet of k
  constexpr int64_t lines = Fmt == kQ5K ? kQ5Lines : Fmt == kQ6K ? 2 * kQ6Lines : 4;
  const uint8_t* wb = static_cast<const uint8_t*>(pb.w) + b * (pb.K / 8) * lines * 64;
  const __m512i mask = _mm512_set1_epi8(15);
  __m512i spread[4];  // vpshufb indices: int32 lane e of u[i] <- byte 4 i + e, 4 times
  for (int i = 0; i < 4; ++i)
    spread[i] = _mm512_broadcast_i32x4(_mm_setr_epi32(0x01010101 * (4 * i), 0x01010101 * (4 * i + 1),
                                                      0x01010101 * (4 * i + 2),
                                                      0x01010101 * (4 * i + 3)));
  const __m512i even_bits = _mm512_set1_epi32(0x40100401);  // byte j: bit 2 j
  const __m512i odd_bits = _mm512_set1_epi32(static_cast<int>(0x80200802u));  // bit 2 j + 1
  const __m512i sixteen = _mm512_set1_epi8(16);
  __m512 tot[4];
  for (int c = 0; c < 4; ++c) tot[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < pb.groups; ++g) {
    __m512i sh[4], sl[4];  // sum q h, sum q l in the transposed channel order
    for (int i = 0; i < 4; ++i) sh[i] = sl[i] = _mm512_setzero_si512();
    const int64_t t1 = (g + 1) * pb.group / 8;
    for (int64_t t = g * pb.group / 8; t < t1; ++t) {
      const uint8_t* p = wb + t * lines * 64;  // the octet's lines
      for (int i = 0; i < lines; ++i) __builtin_prefetch(p + kGemvPrefetchBytes + 64 * i);
      __m512i qe[4], qo[4];  // the even k's and the odd k's bytes, transposed
      if constexpr (Fmt == kQ6K) {
        __m512i f[8];
        q6_octet(p, f);
        transpose_lines(f[0], f[2], f[4], f[6], qe);
        transpose_lines(f[1], f[3], f[5], f[7], qo);
      } else {
        __m512i u[4];
        transpose_lines(_mm512_loadu_si512(p), _mm512_loadu_si512(p + 64),
                        _mm512_loadu_si512(p + 128), _mm512_loadu_si512(p + 192), u);
        for (int i = 0; i < 4; ++i) {
          qe[i] = _mm512_and_si512(u[i], mask);
          qo[i] = _mm512_and_si512(_mm512_srli_epi16(u[i], 4), mask);
          if constexpr (Fmt == kQ5K) {
            const __m512i h = _mm512_shuffle_epi8(_mm512_loadu_si512(p + 256), spread[i]);
            qe[i] = _mm512_mask_add_epi8(qe[i], _mm512_test_epi8_mask(h, even_bits), qe[i], sixteen);
            qo[i] = _mm512_mask_add_epi8(qo[i], _mm512_test_epi8_mask(h, odd_bits), qo[i], sixteen);
          }
        }
      }
      const __m512i he = _mm512_set1_epi32(words[4 * t]), ho = _mm512_set1_epi32(words[4 * t + 1]);
      const __m512i le = _mm512_set1_epi32(words[4 * t + 2]), lo = _mm512_set1_epi32(words[4 * t + 3]);
      for (int i = 0; i < 4; ++i) {
        sh[i] = _mm512_dpbusd_epi32(sh[i], qe[i], he);
        sh[i] = _mm512_dpbusd_epi32(sh[i], qo[i], ho);
        sl[i] = _mm512_dpbusd_epi32(sl[i], le, qe[i]);
        sl[i] = _mm512_dpbusd_epi32(sl[i], lo, qo[i]);
      }
    }
    __m512i s[4];
    for (int i = 0; i < 4; ++i) s[i] = _mm512_add_epi32(_mm512_slli_epi32(sh[i], 8), sl[i]);
    // s[i] lane L holds channels 16 L + 4 i .. 16 L + 4 i + 3: transpose the 4 x 4 lanes
    const __m512i a01 = _mm512_shuffle_i32x4(s[0], s[1], 0x44), b01 = _mm512_shuffle_i32x4(s[2], s[3], 0x44);
    const __m512i a23 = _mm512_shuffle_i32x4(s[0], s[1], 0xEE), b23 = _mm512_shuffle_i32x4(s[2], s[3], 0xEE);
    __m512i isum[4] = {_mm512_shuffle_i32x4(a01, b01, 0x88), _mm512_shuffle_i32x4(a01, b01, 0xDD),
                       _mm512_shuffle_i32x4(a23, b23, 0x88), _mm512_shuffle_i32x4(a23, b23, 0xDD)};
    if constexpr (Fmt == kQ6K) {  // sum (q - 32) qx
      const __m512i off = _mm512_set1_epi32(32 * gsum[g]);
      for (int c = 0; c < 4; ++c) isum[c] = _mm512_sub_epi32(isum[c], off);
    }
    const __m512 vdx = _mm512_set1_ps(a.dx(pb, 0, g));
    for (int c = 0; c < 4; ++c) {  // tile16's float steps, lane for lane
      V16 d, mn;
      group_scales<Fmt>(pb, 4 * b + c, g, d, mn);  // q4_0: mn = -8 d
      tot[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c]), _mm512_mul_ps(d.v, vdx), tot[c]);
      if constexpr (has_min(Fmt)) tot[c] = _mm512_fmadd_ps(_mm512_set1_ps(pb.xsum[g]), mn.v, tot[c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    const int64_t c0 = b * 64 + 16 * c;
    const int64_t valid = std::min<int64_t>(16, pb.N - c0);
    if (valid <= 0) continue;
    __m512 v = tot[c];
    if (pb.bias != nullptr) {
      const __mmask16 k = static_cast<__mmask16>((1u << valid) - 1u);
      v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, pb.bias + c0));
    }
    _mm512_mask_storeu_ps(pb.y + c0, static_cast<__mmask16>((1u << valid) - 1u), v);
  }
}

// Whether a call of a has_gemv_vnni format takes gemv_vnni_block: one row, groups of a
// multiple of 8, VNNI.
inline bool use_gemv_vnni(const Problem& pb) {
  return pb.M == 1 && pb.group % 8 == 0 && cpu_has_avx512_vnni();
}

// ---- q4_1 / q8_0 x int16 activations, any row count, with AVX512-VNNI (AVX-512 build) -----
// tile16's integers and float steps (so its bits) with vpdpwssd: one instruction multiplies
// 16 channels' int16 weight pairs (k, k + 1) by a row's broadcast int16 pair of qx and adds
// both products to each channel's int32 sum (exact, as vpmaddwd then vpaddd), where tile16
// needs four 256-bit instructions for the same work; a weight pair vector is unpacked once
// per k pair and tile and shared by the tile's R rows. Lanes hold channels in order, so the
// float steps need no permute. A tile is R rows x C panels (R x C sums, C weight vectors
// and a broadcast of the 32 zmm registers); tile16's totals stay in memory, updated once a
// group.

// Panel p's 16 channels at k pair (k, k + 1) as vpdpwssd's int16 pairs (channel order).
template <int Fmt>
__attribute__((target("avx512vnni"))) inline __m512i pair_weights_vnni(const Problem& pb,
                                                                       int64_t p, int64_t k) {
  if constexpr (is_4bit(Fmt)) {  // byte c: q(c, k) low nibble, q(c, k + 1) high
    const uint8_t* w = static_cast<const uint8_t*>(pb.w) + at(p, pb.K / 2, k / 2);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    // bits 0-3: q(c, k), bits 16-19: q(c, k + 1)
    return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)),
                            _mm512_set1_epi32(0x000F000F));
  } else if constexpr (Fmt == kQ6K) {
    __m128i a, b;
    q6_pair(static_cast<const uint8_t*>(pb.w) + at(p, pb.K / 4 * kQ6Lines, k / 4 * kQ6Lines), 64,
            k, a, b);
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
  } else if constexpr (Fmt == kQ5K) {  // q4's nibble pairs, bits 4 and 20 set from the high line
    const uint8_t* l = static_cast<const uint8_t*>(pb.w) + at(p, pb.K / 8 * kQ5Lines, k / 8 * kQ5Lines);
    const int i = static_cast<int>(k % 8) / 2;
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l + 64 * i)));
    const __m512i h =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(l + 4 * 64)));
    const __m512i q = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)),
                                       _mm512_set1_epi32(0x000F000F));
    const __mmask16 ml = _mm512_test_epi32_mask(h, _mm512_set1_epi32(1 << (2 * i)));
    const __mmask16 mh = _mm512_test_epi32_mask(h, _mm512_set1_epi32(2 << (2 * i)));
    const __m512i ql = _mm512_mask_or_epi32(q, ml, q, _mm512_set1_epi32(0x10));
    return _mm512_mask_or_epi32(ql, mh, ql, _mm512_set1_epi32(0x100000));
  } else {  // rows k and k + 1 of the block, 64 bytes apart: interleave, then widen
    const int8_t* w = static_cast<const int8_t*>(pb.w) + at(p, pb.K, k);
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 64));
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
  }
}

// Rows m0 .. m0 + R - 1 of panels p0 .. p0 + C - 1 (C = 4: a whole block, whose weight line
// is prefetched kGemvPrefetchBytes ahead as tile16's few-row layouts do).
// The weight pairs come from `strip` ([K / 2][C] vectors, pair_weights_vnni's, unpacked once
// for every tile of a work item: rows_vnni) when given, else from the packed bytes.
template <int Fmt, int R, int C>
__attribute__((target("avx512vnni"))) void tile_vnni(const Problem& pb, const Act16& a,
                                                     int64_t p0, int64_t m0,
                                                     const __m512i* strip = nullptr) {
  alignas(64) float tot[R][C][16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_store_ps(tot[r][c], _mm512_setzero_ps());
  const int16_t* qx[R];
  for (int r = 0; r < R; ++r) qx[r] = a.q.data() + (m0 + r) * pb.K;
  for (int64_t g = 0; g < pb.groups; ++g) {
    __m512i s[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_si512();
    const int64_t k1 = (g + 1) * pb.group;
    for (int64_t k = g * pb.group; k < k1; k += 2) {
      __m512i w[C];
      if (strip != nullptr) {
        for (int c = 0; c < C; ++c) w[c] = _mm512_loadu_si512(strip + k / 2 * C + c);
      } else {
        if constexpr (C == 4) prefetch_ahead<Fmt>(pb, p0, k);
        for (int c = 0; c < C; ++c) w[c] = pair_weights_vnni<Fmt>(pb, p0 + c, k);
      }
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, qx[r] + k, 4);
        const __m512i xp = _mm512_set1_epi32(pair);
        for (int c = 0; c < C; ++c) s[r][c] = _mm512_dpwssd_epi32(s[r][c], w[c], xp);
      }
    }
    for (int c = 0; c < C; ++c) {  // tile16's float steps, lane for lane
      V16 d, mn = zero();
      group_scales<Fmt>(pb, p0 + c, g, d, mn);  // q4_k, i8_k: d1 and min1, exact
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const __m512 vdx = _mm512_set1_ps(a.dx(pb, m, g));
        __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][c]), _mm512_mul_ps(d.v, vdx),
                                   _mm512_load_ps(tot[r][c]));
        if constexpr (has_min(Fmt))
          t = _mm512_fmadd_ps(_mm512_set1_ps(pb.xsum[m * pb.groups + g]), mn.v, t);
        _mm512_store_ps(tot[r][c], t);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t c0 = (p0 + c) * 16;
    const int64_t valid = std::min<int64_t>(16, pb.N - c0);
    if (valid <= 0) continue;
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_load_ps(tot[r][c]);
      if (pb.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, pb.bias + c0));
      _mm512_mask_storeu_ps(pb.y + (m0 + r) * pb.y_stride + c0, keep, v);
    }
  }
}

// The last tile of rows_vnni: `left` (below R) rows from m, as one tile of that many.
template <int Fmt, int R, int C>
__attribute__((target("avx512vnni"))) void rows_vnni_tail(const Problem& pb, const Act16& a,
                                                          int64_t p, int64_t m, int64_t left,
                                                          const __m512i* strip) {
  if constexpr (R > 0) {
    if (left == R) {
      tile_vnni<Fmt, R, C>(pb, a, p, m, strip);
      return;
    }
    rows_vnni_tail<Fmt, R - 1, C>(pb, a, p, m, left, strip);
  }
}

// From this many rows in a work item on, a q5_k or q6_k item's C panels' weight pairs are
// unpacked once into a strip that each of its tiles reads (K x 64 bytes for C = 2: 128 KB at
// K = 2048, 896 KB at 14336, within Zen 4's 1 MB L2), rather than again by every tile of 6
// rows: their unpacking (about 10 vector instructions a pair vector, against a tile's 12
// vpdpwssd a pair) then counts once a work item. Measured on Zen 4 (2 threads, [8192 x 2048],
// in one process against the per-tile unpacking, two rounds): q5_k 1.35x faster at 64 and 512
// rows (197 -> 265 G multiply-adds x 2 a second at 512), q6_k 1.31x. The nibble formats
// (4 instructions a pair vector) and the int8 ones gain nothing, and q8_0 lost up to 8%
// (its strip reads twice its packed bytes): they keep unpacking per tile.
constexpr int64_t kVnniStripRows = 12;

constexpr bool vnni_strip(int fmt) { return fmt == kQ5K || fmt == kQ6K; }

// A many-row work item (2 panels) of a K-quant of up to this many rows is one tile (8 x 2: 16
// sums), so that its weights are unpacked once: as 6 + 2 rows (a decode step of 8 sequences)
// they were unpacked twice. Measured on Zen 4 (2 threads, [8192 x 2048] in cache, 8 rows,
// against 6 + 2, the builds taking turns): q5_k 1.72-1.81 -> 1.21-1.48 ms, q6_k 1.63-1.82 ->
// 1.32-1.41, q4_k 1.03-1.16 -> 0.97-1.01. q8_0 was 1.2x slower that way (0.85-0.87 -> 1.04-1.10
// ms) and q4_1 1.05x: they keep 6 + 2.
constexpr int kVnniOneTileRows = 8;

constexpr bool vnni_one_tile(int fmt) { return fmt == kQ4K || fmt == kQ5K || fmt == kQ6K; }

// Rows m0 .. m1 - 1 of panels p0 .. p1 - 1: for each group of C panels, tiles of R rows (the
// last one fewer); a q5_k / q6_k item of kVnniStripRows rows or more unpacks its weights once
// into `buf`.
template <int Fmt, int R, int C>
__attribute__((target("avx512vnni"))) void rows_vnni(const Problem& pb, const Act16& a,
                                                     int64_t p0, int64_t p1, int64_t m0,
                                                     int64_t m1, std::vector<__m512i>& buf) {
  for (int64_t p = p0; p < p1; p += C) {
    const __m512i* strip = nullptr;
    if (vnni_strip(Fmt) && m1 - m0 >= kVnniStripRows) {
      buf.resize(static_cast<size_t>(pb.K / 2 * C));
      for (int64_t k = 0; k < pb.K; k += 2)
        for (int c = 0; c < C; ++c)
          _mm512_storeu_si512(buf.data() + k / 2 * C + c, pair_weights_vnni<Fmt>(pb, p + c, k));
      strip = buf.data();
    }
    if constexpr (C == 2 && vnni_one_tile(Fmt)) {  // not the few-row items: 8 x 4 sums spill
      if (m1 - m0 > R && m1 - m0 <= kVnniOneTileRows) {
        rows_vnni_tail<Fmt, kVnniOneTileRows, C>(pb, a, p, m0, m1 - m0, strip);
        continue;
      }
    }
    int64_t m = m0;
    for (; m + R <= m1; m += R) tile_vnni<Fmt, R, C>(pb, a, p, m, strip);
    if (m < m1) rows_vnni_tail<Fmt, R - 1, C>(pb, a, p, m, m1 - m, strip);
  }
}

// Tile shapes of the VNNI path. Below kVnniFewRows rows a tile is a whole block (4 panels:
// one 64-byte weight line per k pair for q4_1, prefetched) of up to 4 rows: 16 sums, 4
// weight vectors. From kVnniFewRows rows on, 2 panels of up to 6 rows: 12 sums and 2 weight
// vectors, each unpacked weight vector serving 6 rows (R = 6 with 4 panels spilled its 24
// sums: about 1.5x slower; 8 x 2, 12 x 1 and 3 x 4 measured within a few percent of these).
// Measured on Zen 4 (2 threads, a step's 120 q4_1 layers streamed from memory, then the
// [49152 x 576] q8_0 LM head; this build against tile16's in one process, alternating;
// docs/perf/2026-12-05/vnni-tiles): layers 1.19x faster at 2 rows, 1.39x at 4,
// 1.37-1.39x at 8 and 10, 1.27x at 16, 1.22x at 64; the LM head 1.24-1.67x at 2 to 64
// rows. On that core a zmm vpdpwssd retires about one a cycle (3.66 G/s on one core: 117 G
// int16 multiply-adds/s; docs/perf/2026-12-05/busd-tiles), and these tiles reach about
// two thirds of that (one thread: 66% on [3072 x 576] at 512 rows, 68% on [576 x 1536] at
// 64): the group's float steps (four multiply-pipe instructions a row per 16 vpdpwssd) and
// the unpacking take the rest. A vpdpbusd tile that unpacks far less (that folder's patch)
// measured 1.05-1.26x on [3072 x 576] and 0.91-1.10x on [576 x 1536] (2-512 rows, two
// threads, in cache): not taken.
constexpr int64_t kVnniFewRows = 8;

// Rows per work item of the VNNI path: a work item is a block (below kVnniFewRows rows) or
// half a block (from there: 30 items rather than 15 for a [960 x 576] weight, so the two
// threads' shares differ by none rather than one; 1.01-1.03x at 8-64 rows, Zen 4) for a
// block of rows.
constexpr int64_t kVnniRows = 48;

// The whole call on the VNNI tiles: items row-block-major (a thread's consecutive items share
// their rows' activations), every span of the weight once per block of rows.
template <int Fmt>
void run_vnni(const Problem& pb, const Act16& a, int num_threads) {
  const bool few = pb.M < kVnniFewRows;
  const int64_t width = few ? 4 : 2;  // panels per item: a block, or half of one
  const int64_t spans = pb.Np / 16 / width, block_rows = even_block_rows(pb.M, kVnniRows);
  const int64_t items = spans * ((pb.M + block_rows - 1) / block_rows);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<__m512i> buf;  // this thread's strip
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t p0 = i % spans * width, m0 = i / spans * block_rows;
      const int64_t m1 = std::min(pb.M, m0 + block_rows);
      if (few)
        rows_vnni<Fmt, 4, 4>(pb, a, p0, p0 + 4, m0, m1, buf);
      else
        rows_vnni<Fmt, 6, 2>(pb, a, p0, p0 + 2, m0, m1, buf);
    }
  }
}

#if defined(CONVEYOR_AMX)
// ---- int16 activations on AMX tiles (the amx and amxemu builds: -DCONVEYOR_AMX) ----------
// tile_vnni's integers and float steps (so its bits, and every other x16 path's) with
// AMX-INT8's tile dot products: each int16 qx is split as the one-row VNNI kernel splits it,
// qx = 256 h + l (h = qx >> 8 signed, l = qx & 255 unsigned), and every weight value of the
// x16 formats fits a signed byte (q4 nibbles 0..15, q5_k 0..31, q6_k's q - 32, q8_0 / i8_k
// bytes), so a group's exact integer sum is
//   isum = 256 tdpbssd(h, w) + tdpbusd(l, w)     (exact in int32: amx_chunk)
// over 16 rows x 16 channels a tile, a group of up to 64 k a tile product (larger ones 64 k
// at a time into the same sums), then
// tile_vnni's float steps per row, panel and group in order. The tiles (Intel SDM vol. 2,
// TILELOADD / TDPBSSD / TDPBUSD; palette 1): t0 h and t1 l of 16 rows x one group's k (A),
// t2 and t3 the weights of two panels (B: group / 4 rows of 16 channels x 4 k), t4-t7 the
// sums (C: h and l of each panel). A work item is two panels (32 channels) for a block of
// rows; its weights are laid out as B once per item (pair_weights_vnni's pairs, two of
// them to a row of four k) and read by every 16-row tile of the item.
// The amxemu build runs the same code on a scalar model of those instructions (any
// AVX512-VNNI CPU: the tests check its bits against the other builds'); the amx build uses the
// instructions, after the kernel grants the process the tile state (arch_prctl
// ARCH_REQ_XCOMP_PERM) and a self-check on this CPU passes (conveyor_amx_init).

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte operand
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

#if defined(CONVEYOR_AMX_EMULATE)
constexpr const char* kAmxIsa = "amxemu";
// A scalar model of the tile instructions used, with the SDM's operand checks (a violation
// would raise #UD on the hardware: here a trap).
struct EmuTiles {
  TileConfig cfg;
  alignas(64) uint8_t t[8][16][64];
};
thread_local EmuTiles emu_tiles;

inline void amx_config(const TileConfig* c) {
  emu_tiles.cfg = *c;
  std::memset(emu_tiles.t, 0, sizeof(emu_tiles.t));
}
inline void amx_release() { std::memset(&emu_tiles, 0, sizeof(emu_tiles)); }
inline void amx_load(int t, const void* base, int64_t stride) {
  const TileConfig& c = emu_tiles.cfg;
  if (c.rows[t] == 0 || c.rows[t] > 16 || c.colsb[t] == 0 || c.colsb[t] > 64) __builtin_trap();
  std::memset(emu_tiles.t[t], 0, sizeof(emu_tiles.t[t]));
  for (int r = 0; r < c.rows[t]; ++r)
    std::memcpy(emu_tiles.t[t][r], static_cast<const uint8_t*>(base) + r * stride, c.colsb[t]);
}
inline void amx_store(int t, void* base, int64_t stride) {
  const TileConfig& c = emu_tiles.cfg;
  for (int r = 0; r < c.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, emu_tiles.t[t][r], c.colsb[t]);
}
inline void amx_zero(int t) { std::memset(emu_tiles.t[t], 0, sizeof(emu_tiles.t[t])); }
// C[m][n] += sum over k < colsb(A) / 4 and i < 4 of A[m][4k + i] * B[k][4n + i] (int32, wrapping),
// A's bytes signed (tdpbssd) or unsigned (tdpbusd), B's signed.
template <bool ASigned>
inline void amx_dp(int tc, int ta, int tb) {
  const TileConfig& c = emu_tiles.cfg;
  if (c.rows[tc] != c.rows[ta] || c.colsb[tc] != c.colsb[tb] || c.rows[tb] * 4 != c.colsb[ta] ||
      c.colsb[tc] % 4 != 0)
    __builtin_trap();
  for (int m = 0; m < c.rows[tc]; ++m)
    for (int n = 0; n < c.colsb[tc] / 4; ++n) {
      uint32_t acc;
      std::memcpy(&acc, emu_tiles.t[tc][m] + 4 * n, 4);
      for (int k = 0; k < c.rows[tb]; ++k)
        for (int i = 0; i < 4; ++i) {
          const uint8_t a = emu_tiles.t[ta][m][4 * k + i];
          const int32_t av = ASigned ? static_cast<int8_t>(a) : static_cast<int32_t>(a);
          acc += static_cast<uint32_t>(av * static_cast<int8_t>(emu_tiles.t[tb][k][4 * n + i]));
        }
      std::memcpy(emu_tiles.t[tc][m] + 4 * n, &acc, 4);
    }
}
#define AMX_LOAD(t, p, s) amx_load(t, p, s)
#define AMX_STORE(t, p, s) amx_store(t, p, s)
#define AMX_ZERO(t) amx_zero(t)
#define AMX_DP_SS(c, a, b) amx_dp<true>(c, a, b)
#define AMX_DP_US(c, a, b) amx_dp<false>(c, a, b)
#define AMX_CONFIG(p) amx_config(p)
#define AMX_RELEASE() amx_release()
#else
constexpr const char* kAmxIsa = "amx";
#define AMX_LOAD(t, p, s) _tile_loadd(t, p, s)
#define AMX_STORE(t, p, s) _tile_stored(t, p, s)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_DP_SS(c, a, b) _tile_dpbssd(c, a, b)
#define AMX_DP_US(c, a, b) _tile_dpbusd(c, a, b)
#define AMX_CONFIG(p) _tile_loadconfig(p)
#define AMX_RELEASE() _tile_release()
#endif

// Set by conveyor_amx_init once the tile state is granted and the self-check passed.
std::atomic<bool> amx_ready{false};

// From this many rows an int16-activation call runs on the tiles (a tile is 16 rows).
constexpr int64_t kAmxMinRows = 16;
// Rows of a work item: a block of rows for two panels (the items of one panel pair are
// consecutive, so a thread lays out the pair's weights once for all of its blocks).
constexpr int64_t kAmxRows = 128;

// The k of one tile product: a whole group of up to 64 (16 or 32 for the GGUF formats), else
// 64 at a time (groups of up to 256: |256 sum h w| <= 256 * 128 * 128 * 256 = 2^30); 0 where
// the tiles cannot take the group (not a multiple of 4, or above 64 and not of 64).
inline int64_t amx_chunk(int64_t group) {
  if (group % 4 != 0) return 0;
  if (group <= 64) return group;
  return group % 64 == 0 ? 64 : 0;
}

// qx split into h (signed) and l (unsigned) bytes, [Mp, K] each, rows past M zero.
struct AmxAct {
  std::vector<int8_t> h;
  std::vector<uint8_t> l;
  int64_t Mp = 0;
};

inline void amx_split(const Problem& pb, const Act16& a, AmxAct& s, int num_threads) {
  const int64_t K = pb.K;
  s.Mp = (pb.M + 15) / 16 * 16;
  s.h.assign(static_cast<size_t>(s.Mp * K), 0);
  s.l.assign(static_cast<size_t>(s.Mp * K), 0);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (pb.M * K >= 32768)
  for (int64_t m = 0; m < pb.M; ++m) {
    const int16_t* q = a.q.data() + m * K;
    int8_t* h = s.h.data() + m * K;
    uint8_t* l = s.l.data() + m * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512i v = _mm512_loadu_si512(q + k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + k),
                          _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(l + k),
                          _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(255))));
    }
    for (; k < K; ++k) {
      h[k] = static_cast<int8_t>(q[k] >> 8);
      l[k] = static_cast<uint8_t>(q[k] & 255);
    }
  }
}

// Panels p0, p0 + 1 laid out as B tiles: buf[c][j] (64 bytes) = channel n's weights at
// k = 4j .. 4j + 3 in bytes 4n .. 4n + 3, for panel p0 + c.
template <int Fmt>
__attribute__((target("avx512vnni"))) void amx_weights(const Problem& pb, int64_t p0,
                                                         uint8_t* buf) {
  // words of the two k pairs' vectors interleaved: word 2n = pair (k, k + 1) of channel n,
  // word 2n + 1 = pair (k + 2, k + 3)
  alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21,
                                                 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27,
                                                 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(order);
  for (int c = 0; c < 2; ++c)
    for (int64_t k = 0; k < pb.K; k += 4) {
      const __m256i a = _mm512_cvtepi16_epi8(pair_weights_vnni<Fmt>(pb, p0 + c, k));
      const __m256i b = _mm512_cvtepi16_epi8(pair_weights_vnni<Fmt>(pb, p0 + c, k + 2));
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
      _mm512_store_si512(buf + (c * pb.K / 4 + k / 4) * 64, _mm512_permutexvar_epi16(idx, ab));
    }
}

// Rows m0 .. m0 + 15 (those below M) of panels p0, p0 + 1 from the laid-out weights `wb`;
// the tile configuration for the problem's group is loaded.
template <int Fmt>
__attribute__((target("avx512vnni"))) void amx_tile(const Problem& pb, const Act16& a,
                                                      const AmxAct& s, const uint8_t* wb,
                                                      int64_t p0, int64_t m0) {
#if defined(CONVEYOR_AMX_EMULATE)
  if (m0 % 16 != 0 || m0 + 16 > s.Mp) __builtin_trap();  // a tile load past h and l
#endif
  const int rows = static_cast<int>(std::min<int64_t>(16, pb.M - m0));
  alignas(64) float tot[16][2][16];
  alignas(64) int32_t sums[4][16][16];  // h, l of panel 0, then of panel 1
  std::memset(tot, 0, sizeof(tot));
  const int64_t G = pb.group, chunk = amx_chunk(G);
  for (int64_t g = 0; g < pb.groups; ++g) {
    AMX_ZERO(4);
    AMX_ZERO(5);
    AMX_ZERO(6);
    AMX_ZERO(7);
    for (int64_t k0 = g * G; k0 < (g + 1) * G; k0 += chunk) {  // a group's sums, exact
      AMX_LOAD(0, s.h.data() + m0 * pb.K + k0, pb.K);
      AMX_LOAD(1, s.l.data() + m0 * pb.K + k0, pb.K);
      AMX_LOAD(2, wb + k0 / 4 * 64, 64);
      AMX_LOAD(3, wb + (pb.K / 4 + k0 / 4) * 64, 64);
      AMX_DP_SS(4, 0, 2);
      AMX_DP_US(5, 1, 2);
      AMX_DP_SS(6, 0, 3);
      AMX_DP_US(7, 1, 3);
    }
    AMX_STORE(4, sums[0], 64);
    AMX_STORE(5, sums[1], 64);
    AMX_STORE(6, sums[2], 64);
    AMX_STORE(7, sums[3], 64);
    for (int c = 0; c < 2; ++c) {  // tile_vnni's float steps, lane for lane
      V16 d, mn = zero();
      group_scales<Fmt>(pb, p0 + c, g, d, mn);
      for (int r = 0; r < rows; ++r) {
        const int64_t m = m0 + r;
        const __m512i isum =
            _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums[2 * c][r]), 8),
                             _mm512_load_si512(sums[2 * c + 1][r]));
        const __m512 vdx = _mm512_set1_ps(a.dx(pb, m, g));
        __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d.v, vdx),
                                   _mm512_load_ps(tot[r][c]));
        if constexpr (has_min(Fmt))
          t = _mm512_fmadd_ps(_mm512_set1_ps(pb.xsum[m * pb.groups + g]), mn.v, t);
        _mm512_store_ps(tot[r][c], t);
      }
    }
  }
  for (int c = 0; c < 2; ++c) {
    const int64_t c0 = (p0 + c) * 16;
    const int64_t valid = std::min<int64_t>(16, pb.N - c0);
    if (valid <= 0) continue;
    const __mmask16 keep = static_cast<__mmask16>((1u << valid) - 1u);
    for (int r = 0; r < rows; ++r) {
      __m512 v = _mm512_load_ps(tot[r][c]);
      if (pb.bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, pb.bias + c0));
      _mm512_mask_storeu_ps(pb.y + (m0 + r) * pb.y_stride + c0, keep, v);
    }
  }
}

// The whole call on the tiles (pb.M >= 1, amx_chunk(pb.group) > 0).
template <int Fmt>
__attribute__((target("avx512vnni"))) void run_amx(const Problem& pb, const Act16& a,
                                                     int num_threads) {
  AmxAct s;
  amx_split(pb, a, s, num_threads);
  TileConfig cfg;
  const int G = static_cast<int>(amx_chunk(pb.group));
  for (int t = 0; t < 2; ++t) {  // A: 16 rows x one chunk's bytes
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(G);
  }
  for (int t = 2; t < 4; ++t) {  // B: a chunk's k / 4 rows x 16 channels' 4 bytes
    cfg.rows[t] = static_cast<uint8_t>(G / 4);
    cfg.colsb[t] = 64;
  }
  for (int t = 4; t < 8; ++t) {  // C: 16 rows x 16 int32
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // blocks of whole tiles: every tile's 16 rows lie within the Mp rows of h and l
  const int64_t pairs = pb.Np / 32;
  const int64_t block_rows = (even_block_rows(s.Mp, kAmxRows) + 15) / 16 * 16;
  const int64_t blocks = (s.Mp + block_rows - 1) / block_rows, items = pairs * blocks;
#pragma omp parallel num_threads(num_threads)
  {
    AMX_CONFIG(&cfg);
    // this thread's laid-out pair (64-byte rows: tile loads and aligned stores)
    uint8_t* wb = static_cast<uint8_t*>(std::aligned_alloc(64, static_cast<size_t>(pb.K * 32)));
    int64_t have = -1;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t pair = i / blocks, m0 = i % blocks * block_rows;
      if (pair != have) {
        amx_weights<Fmt>(pb, 2 * pair, wb);
        have = pair;
      }
      const int64_t m1 = std::min(pb.M, m0 + block_rows);
      for (int64_t m = m0; m < m1; m += 16) amx_tile<Fmt>(pb, a, s, wb, 2 * pair, m);
    }
    std::free(wb);
    AMX_RELEASE();
  }
}
#endif  // CONVEYOR_AMX
#endif

// From this many rows in a work item on, its panel's weight pairs are unpacked once into a
// strip that every tile reads (fewer than that: each tile unpacks them from the packed bytes).
constexpr int64_t kAct16StripRows = 12;

// q5_k's and q6_k's pairs cost about 10 vector instructions each to unpack (the nibble
// formats 4): from this many rows on (two tiles) theirs are unpacked once into the strip.
// Measured on Zen 3 (AVX2, 2 threads, in one process against per-tile unpacking, every
// output equal): [8192 x 2048] in cache, q6_k 0.75-0.78x the time at 7-11 rows, q5_k
// 0.67-0.73x; [2048 x 8192] 0.85-0.89x and 0.65-0.76x at 8 and 11; [4096 x 14336] (an 8B
// ffn_down, a 448 KB strip) 0.81-0.83x and 0.67-0.68x at 7 and 8. q4_k gained 2-6% and q8_0
// lost 11-14% (its strip reads twice its packed bytes): they keep kAct16StripRows.
constexpr int64_t kAct16EarlyStripRows = 7;

constexpr bool act16_strip_early(int fmt) { return fmt == kQ5K || fmt == kQ6K; }

template <int Fmt>
void rows16(const Problem& pb, const Act16& a, int64_t p, int64_t m0, int64_t m1,
            std::vector<__m256i>& buf) {
  const __m256i* strip = nullptr;
  if (m1 - m0 >= (act16_strip_early(Fmt) ? kAct16EarlyStripRows : kAct16StripRows)) {
    buf.resize(static_cast<size_t>(pb.K));
    for (int64_t k = 0; k < pb.K; k += 2) {  // in channel order: no permute per row and group
      __m256i lo, hi;
      pair_weights16<Fmt>(pb, p, k, lo, hi);
      buf[k] = _mm256_permute2x128_si256(lo, hi, 0x20);      // channels 0-7
      buf[k + 1] = _mm256_permute2x128_si256(lo, hi, 0x31);  // 8-15
    }
    strip = buf.data();
  }
  int64_t m = m0;
  for (; m + 6 <= m1; m += 6) tile16<Fmt, 6, 1>(pb, a, p, m, strip);
  switch (m1 - m) {
    case 5: tile16<Fmt, 5, 1>(pb, a, p, m, strip); break;
    case 4: tile16<Fmt, 4, 1>(pb, a, p, m, strip); break;
    case 3: tile16<Fmt, 3, 1>(pb, a, p, m, strip); break;
    case 2: tile16<Fmt, 2, 1>(pb, a, p, m, strip); break;
    case 1: tile16<Fmt, 1, 1>(pb, a, p, m, strip); break;
    default: break;
  }
}

// Rows per work item (a block of rows, one panel; items row-block-major, so that a thread's
// consecutive items share their rows' activations, and a panel's weights stay in L1 across
// its tiles).
constexpr int64_t kAct16Rows = 48;

// Below this many rows a work item is a whole 64-channel block (4 panels: every k pair of
// its weights is one 64-byte cache line for q4_1, two for q8_0) and each of its rows is a
// tile of 1 x 4 panels. A one-panel item would use a quarter of each line it fetches and
// leave the rest to the next three items: the memory traffic comes in bursts, with compute
// and memory taking turns instead of overlapping.
constexpr int64_t kAct16GemvRows = 2;

// From kAct16GemvRows rows up to below this many, a work item is half a block (2 panels, the
// same half of each line; a thread's consecutive items are the two halves of one block, so
// the other half is still in cache) with all rows in one tile (R x 2: 12 int32 sums at 3
// rows). The one-panel items of more rows used a quarter of each line per item. Measured on
// Zen 3 (AVX2, 2 threads, 30 layers' weights and the LM head cold, alternating builds in one
// process): 2 rows 9.66 + 2.36 -> 7.17 + 1.95 ms, 3 rows 10.73 + 2.78 -> 8.78 + 2.21 ms.
constexpr int64_t kAct16HalfBlockRows = 4;

template <int Fmt>
void run_act16(const Problem& pb, int num_threads) {
  Act16 a;
  quantize_rows16(pb, has_supers(Fmt) ? kAct16KGroup : pb.group, a, num_threads);
#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(CONVEYOR_AMX)
  if (pb.M >= kAmxMinRows && amx_chunk(pb.group) > 0 &&
      amx_ready.load(std::memory_order_acquire)) {
    run_amx<Fmt>(pb, a, num_threads);
    return;
  }
#endif
  if constexpr (has_gemv_vnni(Fmt)) {
    if (use_gemv_vnni(pb)) {
      std::vector<int32_t> words(static_cast<size_t>(pb.K / 2)), gsum;
      vnni_words(a.q.data(), pb.K, words.data());
      if constexpr (Fmt == kQ6K) gsum = group_sums16(pb, a);
      const int64_t blocks = pb.Np / 64;
#pragma omp parallel for num_threads(num_threads) schedule(static)
      for (int64_t b = 0; b < blocks; ++b)
        gemv_vnni_block<Fmt>(pb, a, words.data(), gsum.data(), b);
      return;
    }
  }
  if (cpu_has_avx512_vnni()) {  // every other act16 call: the VNNI tiles
    run_vnni<Fmt>(pb, a, num_threads);
    return;
  }
#endif
  if (pb.M < kAct16GemvRows) {
    const int64_t blocks = pb.Np / 64;
    std::vector<int32_t> gsum;
    if constexpr (Fmt == kQ6K) gsum = group_sums16(pb, a);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; ++b)
      if constexpr (is_4bit(Fmt)) {
        gemv16_block<Fmt>(pb, a, b);
      } else if constexpr (Fmt == kQ6K) {
        gemv16_q6k_block(pb, a, gsum.data(), b);
      } else if constexpr (Fmt == kQ5K) {
        gemv16_q5k_block(pb, a, b);
      } else {
        tile16<Fmt, 1, 4>(pb, a, 4 * b, 0, nullptr);
      }
    return;
  }
  if (pb.M < kAct16HalfBlockRows) {  // 2 or 3 rows: one tile of every row per half block
    const int64_t halves = pb.Np / 32;
    if constexpr (Fmt == kQ6K) {
      const std::vector<int32_t> gsum = group_sums16(pb, a, pb.M);
#pragma omp parallel for num_threads(num_threads) schedule(static)
      for (int64_t h = 0; h < halves; ++h) {
        if (pb.M == 2)
          rows16_q6k_half<2>(pb, a, gsum.data(), h);
        else
          rows16_q6k_half<3>(pb, a, gsum.data(), h);
      }
      return;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t h = 0; h < halves; ++h) {
      if (pb.M == 2)
        tile16<Fmt, 2, 2>(pb, a, 2 * h, 0, nullptr);
      else
        tile16<Fmt, 3, 2>(pb, a, 2 * h, 0, nullptr);
    }
    return;
  }
  const int64_t panels = (pb.N + 15) / 16, block_rows = even_block_rows(pb.M, kAct16Rows);
  const int64_t items = panels * ((pb.M + block_rows - 1) / block_rows);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<__m256i> buf;  // this thread's strip
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      const int64_t p = i % panels, m0 = i / panels * block_rows;
      rows16<Fmt>(pb, a, p, m0, std::min(pb.M, m0 + block_rows), buf);
    }
  }
}

}  // namespace

extern "C" {

const char* conveyor_qlinear_isa() {
#if defined(CONVEYOR_AMX)
  return kAmxIsa;
#else
  return kIsa;
#endif
}

// Whether the K-quant arguments are valid: group 32 (q4_k) or 16 (i8_k), super_group 256 (or
// 32 for i8_k) dividing K, d and dmin given. True for every other format (which ignores them).
inline bool kquant_args_ok(int fmt, int64_t K, int64_t group, const void* sup_scale,
                           const void* sup_min, int64_t super_group) {
  if (fmt == kQ6K)  // no min: sup_min ignored
    return group == 16 && super_group == 256 && K % 256 == 0 && sup_scale != nullptr;
  if (!is_kquant(fmt)) return true;
  const bool sizes = fmt == kQ4K || fmt == kQ5K ? group == 32 && super_group == 256
                                 : group == 16 && (super_group == 256 || super_group == 32);
  return sizes && K % super_group == 0 && sup_scale != nullptr && sup_min != nullptr;
}

// y = x @ W^T (+ bias) for a packed W (layouts above). Returns 0, or 1 (nothing written) for
// an unknown format, a non-positive size, Np not a multiple of 64 or below N, an odd or
// non-positive int4 group, x / y rows closer than K / N elements, or K-quant arguments
// outside kquant_args_ok.
// fmt: 0 fp32, 1 int8, 2 int4, 3 q4_1, 4 q8_0 (scale / minv then point at fp16 data);
// 5 q4_1 and 6 q8_0 weights with int8 activations, 7 q4_1 and 8 q8_0 with int16 ones (above:
// the same packed weights; K a multiple of the group, at most 256 for int16, else code 1);
// 9 q4_k, 10 i8_k (scale / minv point at sc / m; sup_scale / sup_min at d / dmin, fp16, one
// per super_group input channels); 11 q4_k and 12 i8_k weights with int16 activations (per
// group of 32); 13 q6_k (scale: sc, sup_scale: d, super_group 256, group 16), 14 q6_k with
// int16 activations; 15 q5_k (as q4_k: sc, m, d, dmin; group 32, super_group 256), 16 q5_k with
// int16 activations. Other formats ignore sup_scale, sup_min, super_group.
int conveyor_qlinear_ex(int fmt, const float* x, int64_t x_stride, int64_t M, int64_t K,
                        int64_t N, int64_t Np, const void* w, const float* scale,
                        const float* minv, int64_t group, const void* sup_scale,
                        const void* sup_min, int64_t super_group, const float* bias, float* y,
                        int64_t y_stride, int num_threads) {
  const bool act8 = fmt == kQ41 + kAct8Offset || fmt == kQ80 + kAct8Offset;
  const bool act16_q6 = fmt == kQ6KAct16, act16_q5 = fmt == kQ5KAct16;
  const bool act16_k =
      fmt == kQ4K + kAct16KOffset || fmt == kI8K + kAct16KOffset || act16_q6 || act16_q5;
  const bool act16 = fmt == kQ41 + kAct16Offset || fmt == kQ80 + kAct16Offset || act16_k;
  if (act16_k) {
    fmt = act16_q6 ? kQ6K : act16_q5 ? kQ5K : fmt - kAct16KOffset;  // K: a multiple of super_group
  } else if (act8 || act16) {
    fmt -= act8 ? kAct8Offset : kAct16Offset;
    if (group <= 0 || group % 2 != 0 || K % group != 0 || (act16 && group > 256)) return 1;
  }
  if (!is_format(fmt) || M < 0 || K <= 0 || N <= 0 || Np < N || Np % 64 != 0 ||
      x_stride < K || y_stride < N || num_threads <= 0 ||
      (is_grouped(fmt) && group <= 0) || (is_4bit(fmt) && group % 2 != 0) ||
      !kquant_args_ok(fmt, K, group, sup_scale, sup_min, super_group))
    return 1;
  if (M == 0) return 0;
  const int64_t groups = is_grouped(fmt) ? (K + group - 1) / group : 0;
  const int64_t sums = has_min(fmt) ? groups : 0;  // xsum only where a min is applied
  std::vector<float> xsum(static_cast<size_t>(M * sums));
  for (int64_t m = 0; m < M; ++m)  // sequential adds: the same bits for a row in any call
    for (int64_t g = 0; g < sums; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k) s += x[m * x_stride + k];
      xsum[m * groups + g] = s;
    }
  const int64_t supers = has_supers(fmt) ? K / super_group : 0;
  const Problem pb{x, x_stride, M, K, N, Np, w, scale, minv, group, groups, xsum.data(), bias,
                   y, y_stride, static_cast<const uint16_t*>(sup_scale),
                   static_cast<const uint16_t*>(sup_min), super_group, supers};
  if (act16) {
    switch (fmt) {
      case kQ41: run_act16<kQ41>(pb, num_threads); break;
      case kQ4K: run_act16<kQ4K>(pb, num_threads); break;
      case kI8K: run_act16<kI8K>(pb, num_threads); break;
      case kQ6K: run_act16<kQ6K>(pb, num_threads); break;
      case kQ5K: run_act16<kQ5K>(pb, num_threads); break;
      default: run_act16<kQ80>(pb, num_threads); break;
    }
    return 0;
  }
  if (act8) {
    if (fmt == kQ41)
      run_act8<kQ41>(pb, num_threads);
    else
      run_act8<kQ80>(pb, num_threads);
    return 0;
  }
  switch (fmt) {
    case kF32: run<kF32>(pb, num_threads); break;
    case kI8: run<kI8>(pb, num_threads); break;
    case kI4: run<kI4>(pb, num_threads); break;
    case kQ41: run<kQ41>(pb, num_threads); break;
    case kQ4K: run<kQ4K>(pb, num_threads); break;
    case kI8K: run<kI8K>(pb, num_threads); break;
    case kQ6K: run<kQ6K>(pb, num_threads); break;
    case kQ5K: run<kQ5K>(pb, num_threads); break;
    default: run<kQ80>(pb, num_threads); break;
  }
  return 0;
}

// conveyor_qlinear_ex for the formats without super-block scales (0-8; 9 to 13 give 1).
int conveyor_qlinear(int fmt, const float* x, int64_t x_stride, int64_t M, int64_t K, int64_t N,
                     int64_t Np, const void* w, const float* scale, const float* minv,
                     int64_t group, const float* bias, float* y, int64_t y_stride,
                     int num_threads) {
  return conveyor_qlinear_ex(fmt, x, x_stride, M, K, N, Np, w, scale, minv, group, nullptr,
                             nullptr, 0, bias, y, y_stride, num_threads);
}

// out [N, K] row-major float = the weight the kernel multiplies by (int8: q * scale, rounded
// once; int4, q4_1: fma(q, d, min); q8_0: q * d, exact; q4_k, i8_k: fma(q, d1, min1) with the
// group's d1, min1 of group_scales). Returns 0, or 1 for the argument errors of
// conveyor_qlinear_ex.
int conveyor_qdequant_ex(int fmt, const void* w, const float* scale, const float* minv,
                         int64_t group, const void* sup_scale, const void* sup_min,
                         int64_t super_group, int64_t K, int64_t N, int64_t Np, float* out,
                         int num_threads) {
  if (fmt == kQ41 + kAct8Offset || fmt == kQ80 + kAct8Offset) fmt -= kAct8Offset;  // same weights
  if (fmt == kQ41 + kAct16Offset || fmt == kQ80 + kAct16Offset) fmt -= kAct16Offset;
  if (fmt == kQ4K + kAct16KOffset || fmt == kI8K + kAct16KOffset) fmt -= kAct16KOffset;
  if (fmt == kQ6KAct16) fmt = kQ6K;
  if (fmt == kQ5KAct16) fmt = kQ5K;
  if (!is_format(fmt) || K <= 0 || N <= 0 || Np < N || Np % 64 != 0 ||
      num_threads <= 0 || (is_grouped(fmt) && group <= 0) || (is_4bit(fmt) && group % 2 != 0) ||
      !kquant_args_ok(fmt, K, group, sup_scale, sup_min, super_group))
    return 1;
  const int64_t panels = (N + 15) / 16, groups = is_grouped(fmt) ? (K + group - 1) / group : 0;
  Problem pb{};  // for group_scales: the K-quants' scale tensors
  pb.scale = scale;
  pb.minv = minv;
  pb.group = group;
  pb.groups = groups;
  pb.sup_scale = static_cast<const uint16_t*>(sup_scale);
  pb.sup_min = static_cast<const uint16_t*>(sup_min);
  pb.super_group = super_group;
  pb.supers = has_supers(fmt) ? K / super_group : 0;
  const int64_t pairs = (K + 1) / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int valid = static_cast<int>(std::min<int64_t>(16, N - p * 16));
    alignas(64) float lo_t[16], hi_t[16];
    const bool two = is_4bit(fmt) || fmt == kQ6K || fmt == kQ5K;  // values come in k pairs
    for (int64_t k = 0; k < K; k += (two ? 2 : 1)) {
      V16 lo, hi = zero();
      if (fmt == kF32) {
        lo = load(static_cast<const float*>(w) + at(p, K, k));
      } else if (fmt == kI8) {
        lo = mul(load_i8(static_cast<const int8_t*>(w) + at(p, K, k)), load(scale + p * 16));
      } else if (fmt == kQ80) {
        const V16 d = load_scale<kQ80>(scale, at(p, groups, k / group));
        lo = mul(load_i8(static_cast<const int8_t*>(w) + at(p, K, k)), d);
      } else if (fmt == kI8K) {
        V16 d, m;
        group_scales<kI8K>(pb, p, k / group, d, m);
        lo = fma(load_i8(static_cast<const int8_t*>(w) + at(p, K, k)), d, m);
      } else if (fmt == kQ6K) {
        V16 d, m;
        group_scales<kQ6K>(pb, p, k / group, d, m);
        const uint8_t* wq = static_cast<const uint8_t*>(w);
        __m128i q[4];
        q6_quad(wq + at(p, K / 4 * kQ6Lines, k / 4 * kQ6Lines), 64, q);
        lo = i8_to_f(q[k % 4]);
        hi = i8_to_f(q[k % 4 + 1]);
        lo = mul(lo, d);  // (d sc) (q - 32): exact
        hi = mul(hi, d);
      } else if (fmt == kQ5K) {  // fma(q, d1, min1), as q4_k
        V16 d, m;
        group_scales<kQ5K>(pb, p, k / group, d, m);
        __m128i a, b;
        q5_pair(static_cast<const uint8_t*>(w) + at(p, K / 8 * kQ5Lines, k / 8 * kQ5Lines), 64, k,
                a, b);
        lo = fma(i8_to_f(a), d, m);
        hi = fma(i8_to_f(b), d, m);
      } else if (fmt == kQ4K) {
        V16 d, m;
        group_scales<kQ4K>(pb, p, k / group, d, m);
        load_u4x2(static_cast<const uint8_t*>(w) + at(p, pairs, k / 2), lo, hi);
        lo = fma(lo, d, m);
        hi = fma(hi, d, m);
      } else {
        const int64_t g = k / group;
        const V16 d = fmt == kQ41 ? load_scale<kQ41>(scale, at(p, groups, g))
                                  : load(scale + at(p, groups, g));
        const V16 m = fmt != kQ41    ? load(minv + at(p, groups, g))
                      : minv != nullptr ? load_scale<kQ41>(minv, at(p, groups, g))
                                        : mul(d, bcast(-8.f));  // q4_0: min = -8 d
        load_u4x2(static_cast<const uint8_t*>(w) + at(p, pairs, k / 2), lo, hi);
        lo = fma(lo, d, m);
        hi = fma(hi, d, m);
      }
      store(lo_t, lo);
      store(hi_t, hi);
      for (int c = 0; c < valid; ++c) {
        float* row = out + (p * 16 + c) * K;
        row[k] = lo_t[c];
        if (two && k + 1 < K) row[k + 1] = hi_t[c];
      }
    }
  }
  return 0;
}

// conveyor_qdequant_ex for the formats without super-block scales.
int conveyor_qdequant(int fmt, const void* w, const float* scale, const float* minv,
                      int64_t group, int64_t K, int64_t N, int64_t Np, float* out,
                      int num_threads) {
  return conveyor_qdequant_ex(fmt, w, scale, minv, group, nullptr, nullptr, 0, K, N, Np, out,
                              num_threads);
}

#if defined(CONVEYOR_AMX)
// Grants this process the AMX tile state (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA; the amxemu build needs none) and checks the tiles on this CPU: q4_1
// and q8_0 calls of 40 rows (two full tiles and a partial one, two panel pairs) must give
// the VNNI tiles' bits. Returns 0 (the tiles then serve int16-activation calls from
// kAmxMinRows rows), 1 (no tile state: the OS refused it), 2 (no AVX512-VNNI to check
// against) or 3 (the tiles' outputs differ: never used).
int conveyor_amx_init() {
#if !defined(CONVEYOR_AMX_EMULATE)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return 1;
#endif
  if (!cpu_has_avx512_vnni()) return 2;
  constexpr int64_t M = 40, K = 256, N = 64, Np = 64, group = 32, groups = K / group;
  uint32_t state = 12345u;
  auto next = [&state] {  // a fixed LCG: the same problem every time
    state = state * 1664525u + 1013904223u;
    return state >> 8;
  };
  std::vector<float> x(M * K), xsum(M * groups), y_amx(M * N), y_vnni(M * N), bias(Np);
  for (float& v : x) v = static_cast<float>(next() % 2001) / 1000.f - 1.f;
  for (float& v : bias) v = static_cast<float>(next() % 101) / 100.f;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += x[m * K + k];
      xsum[m * groups + g] = s;
    }
  std::vector<uint8_t> w(Np / 64 * K * 64);
  for (uint8_t& b : w) b = static_cast<uint8_t>(next());
  for (uint8_t& b : w) b = b == 0x80 ? 0x81 : b;  // q8_0 bytes in [-127, 127]
  std::vector<uint16_t> d(Np / 64 * groups * 64), mn(d.size());
  for (uint16_t& h : d) h = static_cast<uint16_t>(0x2C00 + next() % 0x0C00);  // fp16 in [2^-4, 1)
  for (uint16_t& h : mn) h = static_cast<uint16_t>(0xAC00 + next() % 0x0C00);  // negative
  for (int fmt : {kQ41, kQ80}) {
    const Problem pb{x.data(), K, M, K, N, Np, w.data(), d.data(),
                     fmt == kQ41 ? mn.data() : nullptr, group, groups,
                     xsum.data(), bias.data(), nullptr, N, nullptr, nullptr, 0, 0};
    Act16 a;
    quantize_rows16(pb, group, a, 1);
    Problem p1 = pb;
    p1.y = y_amx.data();
    Problem p2 = pb;
    p2.y = y_vnni.data();
    if (fmt == kQ41) {
      run_amx<kQ41>(p1, a, 2);
      run_vnni<kQ41>(p2, a, 2);
    } else {
      run_amx<kQ80>(p1, a, 2);
      run_vnni<kQ80>(p2, a, 2);
    }
    if (std::memcmp(y_amx.data(), y_vnni.data(), y_amx.size() * sizeof(float)) != 0) return 3;
  }
  amx_ready.store(true, std::memory_order_release);
  return 0;
}
#endif
}  // extern "C"
