// fp16 K/V elements (IEEE binary16) for the CPU attention kernels and the fused forward's
// K/V store: the cache of --kv-cache-dtype float16, half the bytes of fp32.
//
// Widening and narrowing use F16C (vcvtph2ps / vcvtps2ph, on every AVX2 CPU) where the build
// has it, else the compiler's _Float16. Narrowing rounds to nearest even, as torch's
// `.to(torch.float16)` does, so a K/V row stored here has the bits the torch path stores.
#pragma once

#include <cstdint>
#include <cstring>
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

}  // namespace conveyor
