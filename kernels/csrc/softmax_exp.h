// exp of a softmax's shifted scores (x - max <= 0) for the CPU attention kernels, at one cost
// whatever the scores' range.
//
// The kernels are built with -ffast-math so that GCC vectorises their exp loops as calls to
// glibc's libmvec (_ZGVeN16v_expf, _ZGVdN8v_expf). Those take a fast path only while every
// lane's |x| is within their domain (about 87.34: exp(x) a normal float); a vector with one
// lane outside calls the scalar expf lane by lane. A softmax's shifted scores fall below
// -87.34 wherever one key's score beats another's by that much (sharp heads, large
// activations) and always for the masked keys (kMasked): measured on a Zen 4, a 512-token
// chunk of the prefill kernel at a context of 3,072 (32 query / 8 KV heads of 64) took 47 ms
// on scores of unit range and 279 ms with scores of +-240, and a random-weight
// Llama-3.2-1B-shaped model's prefill ran its attention about 3x slower than the same kernel
// on unit scores.
//
// exp_shifted clamps its argument to kExpLowest, inside that domain, and returns 0 below it:
// libmvec's own value wherever x >= kExpLowest (the same bits as before), and 0 where the
// true value is below exp(-87) = 1.6e-38, which no fp32 sum with a max's term 1 can see
// (bf16 products flush such values to 0 already: vcvtneps2bf16 treats denormals as 0).
#pragma once

#include <cmath>

namespace conveyor {

constexpr float kExpLowest = -87.0f;  // exp(-87) = 1.65e-38 > FLT_MIN: a normal float

// exp(x) for x <= 0, or 0 where x < kExpLowest. Vectorises (in an `omp simd` loop of a
// -ffast-math build) to libmvec's exp on a clamped argument and a blend, no lane on its
// scalar path.
inline float exp_shifted(float x) {
  const float e = std::exp(x < kExpLowest ? kExpLowest : x);
  return x < kExpLowest ? 0.f : e;
}

}  // namespace conveyor
