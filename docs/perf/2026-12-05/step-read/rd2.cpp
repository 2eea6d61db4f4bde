#include <immintrin.h>
#include <cstdint>
#include <omp.h>
static inline int64_t rd1(const uint8_t* q, int64_t n) {
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 256) {
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(q + i));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(q + i + 64));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(q + i + 128));
    acc = _mm512_xor_si512(acc, _mm512_loadu_si512(q + i + 192));
  }
  return _mm512_reduce_add_epi64(acc);
}
// one call: thread t reads (p[t], n[t])
extern "C" int64_t rd_call(const uint8_t** p, const int64_t* n) {
  int64_t out = 0;
#pragma omp parallel num_threads(2) reduction(^:out)
  { int t = omp_get_thread_num(); out ^= rd1(p[t], n[t]); }
  return out;
}
// all calls in one region with barriers: p[2*c+t], n[2*c+t]
extern "C" int64_t rd_region(const uint8_t** p, const int64_t* n, int calls) {
  int64_t out = 0;
#pragma omp parallel num_threads(2) reduction(^:out)
  { int t = omp_get_thread_num();
    for (int c = 0; c < calls; ++c) { out ^= rd1(p[2*c+t], n[2*c+t]);
#pragma omp barrier
    } }
  return out;
}
extern "C" int64_t rd_calls_cpp(const uint8_t** p, const int64_t* n, int calls) {
  int64_t out = 0;
  for (int c = 0; c < calls; ++c) out ^= rd_call(p + 2 * c, n + 2 * c);
  return out;
}
