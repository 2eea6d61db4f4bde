// 16-bit K/V elements for the CPU attention kernels and the fused forward's K/V store: the
// caches of --kv-cache-dtype float16 (IEEE binary16) and bfloat16, half the bytes of fp32.
//
// fp16: widening and narrowing use F16C (vcvtph2ps / vcvtps2ph, on every AVX2 CPU) where the
// build has it, else the compiler's _Float16. Narrowing rounds to nearest even, as torch's
// `.to(torch.float16)` does, so a K/V row stored here has the bits the torch path stores.
// bf16: an fp32's top 16 bits, so widening is a shift (exact); narrowing rounds to nearest
// even by c10::BFloat16's rule (add 0x7FFF plus the kept part's lowest bit, keep the top
// half), as torch's `.to(torch.bfloat16)` does for every finite value; a NaN stays a NaN
// (0x7FC0, c10's scalar choice; torch's vector loops may give other NaN bits).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace conveyor {

struct Half {
  uint16_t bits;
};

typedef float f8 __attribute__((vector_size(32)));  // the kernels' v8

// 8 fp16 -> 8 fp32.
inline f8 load8(const Half* p) {
  f8 v;
#if defined(__F16C__)
  const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &w, sizeof(v));
#else
  for (int i = 0; i < 8; ++i) {
    _Float16 h;
    std::memcpy(&h, &p[i].bits, sizeof(h));
    v[i] = static_cast<float>(h);
  }
#endif
  return v;
}

// dst[0 .. n) = fp16(src[0 .. n)), round to nearest even.
inline void store_half(Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i].bits = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
#else
  for (; i < n; ++i) {
    const _Float16 h = static_cast<_Float16>(src[i]);
    std::memcpy(&dst[i].bits, &h, sizeof(h));
  }
#endif
}

struct BF16 {
  uint16_t bits;
};

// 8 bf16 -> 8 fp32 (exact).
inline f8 load8(const BF16* p) {
  f8 v;
#if defined(__AVX2__)
  const __m256i w = _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  std::memcpy(&v, &w, sizeof(v));
#else
  for (int i = 0; i < 8; ++i) {
    const uint32_t u = static_cast<uint32_t>(p[i].bits) << 16;
    std::memcpy(&v[i], &u, sizeof(u));
  }
#endif
  return v;
}

inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// dst[0 .. n) = bf16(src[0 .. n)), round to nearest even (bf16_bits).
inline void store_bf16(BF16* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1),
                nan = _mm256_set1_epi32(0x7FC0), abs_mask = _mm256_set1_epi32(0x7FFFFFFF),
                inf = _mm256_set1_epi32(0x7F800000);
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    r = _mm256_blendv_epi8(r, nan, is_nan);
    // 8 int32 in [0, 0xFFFF] -> 8 uint16: packus per 128-bit lane, then the lanes in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
  }
#endif
  for (; i < n; ++i) dst[i].bits = bf16_bits(src[i]);
}

// The caches' element type as the kernels' entry points take it (kernels/cpu_attention_io.py:
// KV_DTYPE_CODES; the fused forward's ConveyorModel::kv_kind): 0 fp32, 1 fp16, 2 bf16.
enum KvDtype : int { kKvF32 = 0, kKvF16 = 1, kKvBF16 = 2 };

// f(tag) with tag a null `const KV*` of the element type `kv_dtype` names (float, Half or
// BF16), returning what f returns; `unknown` for a code outside KvDtype. One entry point per
// kernel then serves every cache dtype through its templates:
//   return with_kv_dtype(kv_dtype, 1, [&](auto tag) {
//     using KV = kv_type<decltype(tag)>; ...; });
template <class F>
inline int with_kv_dtype(int kv_dtype, int unknown, F&& f) {
  switch (kv_dtype) {
    case kKvF32:
      return f(static_cast<const float*>(nullptr));
    case kKvF16:
      return f(static_cast<const Half*>(nullptr));
    case kKvBF16:
      return f(static_cast<const BF16*>(nullptr));
    default:
      return unknown;
  }
}

// The element type of with_kv_dtype's tag.
template <class Tag>
using kv_type = std::remove_const_t<std::remove_pointer_t<Tag>>;

}  // namespace conveyor
