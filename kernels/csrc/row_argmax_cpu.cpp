// Greedy sampling's argmax over logits rows on the CPU, fp32 (kernels/row_argmax_cpu.py).
//
// torch's max / argmax along the last dim of a [B, 49152] fp32 tensor ran at about 2.6 ns an
// element on the 2-core Zen 3 (AVX2) reference machine (0.08-0.13 ms a row, 1 ms for 16
// rows), where the vectorised amax takes a sixth of that; this is amax's speed with the
// index. Per row: one vector pass for the maximum (and whether a NaN is present), one for
// the first index holding it. Built without -ffast-math, so comparisons keep IEEE NaN rules.
#include <cstdint>
#include <cmath>
#include <cstring>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8x __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The index of row x's first maximum, or -1 when its maximum is not finite (a NaN anywhere,
// +inf, or every value -inf): the row cannot be sampled greedily. Four independent vector
// maxima (one would wait on its compare-and-blend latency every 8 values), then a scan for
// the first equal value 32 at a time.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
  bool nan = false;
  if (n >= 32) {
    v8 mv[4];
    i8x bad[4];
    for (int a = 0; a < 4; ++a) {
      mv[a] = load8(x + 8 * a);
      bad[a] = mv[a] != mv[a];
    }
    for (i = 32; i + 32 <= n; i += 32)
      for (int a = 0; a < 4; ++a) {
        const v8 v = load8(x + i + 8 * a);
        bad[a] |= v != v;
        mv[a] = v > mv[a] ? v : mv[a];
      }
    for (int a = 0; a < 4; ++a)
      for (int l = 0; l < 8; ++l) {
        m = mv[a][l] > m ? mv[a][l] : m;
        nan = nan || bad[a][l] != 0;
      }
  }
  for (; i < n; ++i) {
    nan = nan || std::isnan(x[i]);
    m = x[i] > m ? x[i] : m;
  }
  if (nan || !std::isfinite(m)) return -1;
  int64_t j = 0;
  const v8 mm = {m, m, m, m, m, m, m, m};
  for (; j + 32 <= n; j += 32) {
    i8x hit = load8(x + j) == mm;
    for (int a = 1; a < 4; ++a) hit |= load8(x + j + 8 * a) == mm;
    bool any = false;
    for (int l = 0; l < 8; ++l) any = any || hit[l] != 0;
    if (any) break;
  }
  for (; j < n; ++j)
    if (x[j] == m) return j;
  return -1;  // not reached: m is one of the values
}

}  // namespace

extern "C" {

// out[r] = the first index of row r's maximum (rows `stride` floats apart, n values each;
// rows may overlap, e.g. stride 0 for a broadcast row: they are only read), or -1 where that
// maximum is not finite. Returns 0, or 1 for a non-positive size or a negative stride
// (nothing written).
int conveyor_row_argmax_f32(const float* x, int64_t rows, int64_t n, int64_t stride,
                            int64_t* out, int num_threads) {
  if (rows < 0 || n <= 0 || stride < 0 || num_threads <= 0) return 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 4)
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * stride, n);
  return 0;
}

}  // extern "C"
