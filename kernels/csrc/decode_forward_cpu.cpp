// A whole Llama-family forward on the CPU, fp32 activations, in one native call: the
// fused decode path (kernels/decode_forward_cpu.py).
//
// A one-sequence decode step is mostly per-op dispatch from Python: about 15 torch or
// ctypes calls a layer, tens of microseconds each, for almost no arithmetic in everything
// but the linear layers. Here every layer runs without returning to Python:
//
//   layer 0:  h = embed[ids];  residual = h;  x = rmsnorm(h, ln1)
//   layer i:  residual += h;   x = rmsnorm(residual, ln1)              (i > 0)
//             qkv = x W_qkv^T;  rotate q, k (rotate-half, cos/sin at each row's position)
//             K/V of each row stored at its slot;  a = attention(q)     (paged, GQA)
//             h = a W_o^T;  residual += h;  x = rmsnorm(residual, ln2)
//             h = (silu(x W_gate^T) * x W_up^T) W_down^T
//   end:      y = rmsnorm(h + residual, norm) at the sampling rows;  logits = y W_lm^T
//
// The linear layers and the attention are not compiled here: the caller passes function
// pointers to the builds it chose (conveyor_qlinear_ex of kernels/csrc/quant_linear_cpu.cpp,
// built for AVX-512 or AVX2, any of its weight formats; conveyor_decode_attention of
// kernels/csrc/decode_attention_cpu.cpp, given the caches' dtype as kv_kind), so
// one step runs exactly the kernels the unfused path would run for those layers, and a new
// weight format needs nothing here. A 16-bit cache (fp16 or bf16) gets each row's K/V rounded
// to nearest even on store (half.h), the bits torch's `.to(dtype)` gives the unfused path.
//
// Every row is computed on its own (the small ops loop over rows, the linear kernels are
// row-invariant, the attention is per row): a row's result never depends on the other rows
// of the call. Attention rows are described by the caller: a decode row attends to its
// sequence's first seq_len tokens; in the batch-invariant mode a prefill row is a "decode"
// over its own causal prefix, so a step of prefill chunks runs here too (all K/V of the
// layer are stored before any row attends).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "half.h"

extern "C" {
typedef int (*qlinear_fn)(int fmt, const float* x, int64_t x_stride, int64_t M, int64_t K,
                          int64_t N, int64_t Np, const void* w, const void* scale,
                          const void* minv, int64_t group, const void* sup_scale,
                          const void* sup_min, int64_t super_group, const float* bias, float* y,
                          int64_t y_stride, int num_threads);
typedef int (*attention_fn)(int kv_dtype, const float* q, int64_t q_row_stride,
                            const void* k_cache, const void* v_cache, const int64_t* tables,
                            int64_t table_stride, int64_t table_width, const int64_t* seq_lens,
                            const int64_t* rows, float* out, int64_t num_rows,
                            int64_t num_blocks, int n, int Hq, int Hkv, int head_dim,
                            int block_size, float scale, int num_threads);

// One linear layer y [M, N] = x [M, K] W^T (+ bias): conveyor_qlinear_ex's arguments
// (sup_scale, sup_min, super_group: the K-quant formats' super-block scales; null, 0 else).
// next: null, or the next part of a split weight (kernels/packed_parts.py): the parts' outputs
// are consecutive column ranges of one row of y, out_features of each in turn.
struct ConveyorLinear {
  qlinear_fn fn;
  int64_t fmt, in_features, out_features, padded_out, group;
  const void* w;
  const void* scale;
  const void* minv;
  const float* bias;
  const void* sup_scale;
  const void* sup_min;
  int64_t super_group;
  const ConveyorLinear* next;
};

struct ConveyorLayer {
  ConveyorLinear qkv, o, gate_up, down;
  const float* ln1;  // [H]
  const float* ln2;  // [H]
  void* kv;          // [2, num_blocks, block_size, Hkv, D] of ConveyorModel::kv_kind
};

struct ConveyorModel {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
  int64_t max_position, num_blocks, block_size;
  float eps, scale;
  int64_t kv_kind;              // the caches' elements: 0 fp32, 1 fp16, 2 bf16 (half.h)
  const ConveyorLayer* layers;  // [num_layers]
  const float* embed;           // [vocab, hidden]
  const float* norm;            // [hidden]
  const float* cos;             // [max_position, D / 2]
  const float* sin;             // [max_position, D / 2]
  ConveyorLinear lm_head;
  attention_fn attention;  // conveyor_decode_attention (given kv_kind as its kv_dtype)
};

// One step of M rows. tables [M, table_stride] (table_width valid columns), seq_lens [M]:
// the context each row attends to (its own token included). logits [S, vocab] for the S
// rows in logits_rows. embedded: the rows' embeddings [M, hidden], looked up by the caller
// (a model whose embedding is a GGUF file's blocks), or null: rows of the model's embed.
struct ConveyorStep {
  int64_t rows;
  const int64_t* ids;        // [M]
  const int64_t* positions;  // [M]
  const int64_t* slots;      // [M]
  const int64_t* tables;
  int64_t table_stride, table_width;
  const int64_t* seq_lens;     // [M]
  const int64_t* logits_rows;  // [S]
  int64_t num_logits;
  float* logits;  // [S, vocab]
  int num_threads;
  const float* embedded;  // [M, hidden] or null
};
}

namespace {

// y = x / rms(x) * w over one row of n floats (mean of squares in float, as torch.rms_norm).
inline void rms_norm_row(const float* x, const float* w, float eps, int64_t n, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// residual += h, then y = rmsnorm(residual) * w (one row of n floats).
inline void add_norm_row(float* residual, const float* h, const float* w, float eps, int64_t n,
                         float* y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) residual[i] += h[i];
  rms_norm_row(residual, w, eps, n, y);
}

// Rotate-half rotary embedding in place on `heads` heads of D: (x1 c - x2 s, x2 c + x1 s).
inline void rotate_row(float* v, int64_t heads, int64_t D, const float* c, const float* s) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = v + h * D;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * c[i] - b * s[i];
      x2[i] = b * c[i] + a * s[i];
    }
  }
}

// out [I] = silu(gu[:I]) * gu[I:]. Built with all of -ffast-math, so that std::exp is glibc's
// vector exp (libmvec); under finite-math an overflowing exp is not a clean inf (g = -200 gave
// NaN), and libmvec takes its fast path only while every lane's |x| < 87.34 (one lane outside:
// the whole vector through scalar expf, 10x slower on gates of +-100,
// kernels/csrc/softmax_exp.h). So exp's argument is clamped to [-87, 87]: for g > 87,
// 1 + exp(-87) rounds to 1 as 1 + exp(-g) did (the same bits as before the clamp); for g < -87
// silu(g) is g / 6.1e37 instead of about 0 (-87 e^-87 = -1.4e-36): below 1e-34 in magnitude
// for g > -6e3, vanishing beside any normal term of the down projection's sums. A NaN g stays
// NaN (it is the numerator).
inline void silu_mul_row(const float* gu, int64_t I, float* out) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float g = gu[i];
    out[i] = g / (1.f + std::exp(std::fmax(std::fmin(-g, 87.f), -87.f))) * gu[I + i];
  }
}

// y [M, N] with rows N apart; a split weight calls its parts in turn, each writing its columns.
inline int linear(const ConveyorLinear& l, const float* x, int64_t x_stride, int64_t M, float* y,
                  int threads) {
  int64_t n = 0;
  for (const ConveyorLinear* p = &l; p != nullptr; p = p->next) n += p->out_features;
  for (const ConveyorLinear* p = &l; p != nullptr; p = p->next) {
    const int rc = p->fn(static_cast<int>(p->fmt), x, x_stride, M, p->in_features,
                         p->out_features, p->padded_out, p->w, p->scale, p->minv, p->group,
                         p->sup_scale, p->sup_min, p->super_group, p->bias, y, n, threads);
    if (rc != 0) return rc;
    y += p->out_features;
  }
  return 0;
}

// Runs body(m) for every row, over the threads when there are enough rows to pay for it.
template <class F>
inline void for_rows(int64_t M, int threads, F&& body) {
  if (M >= 8 && threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < M; ++m) body(m);
  } else {
    for (int64_t m = 0; m < M; ++m) body(m);
  }
}

}  // namespace

extern "C" {

// Returns 0 on success; nothing is written to the cache on 1-3:
//   1  a non-positive size, an odd head dim, or Hq not a multiple of Hkv
//   2  a token id outside [0, vocab) or a position outside [0, max_position)
//   3  a slot outside the cache, or a logits row outside [0, M)
//   10 + k: the attention kernel returned k (1..4: see decode_attention_cpu.cpp)
//   20 + k: a linear kernel returned k
int conveyor_decode_forward(const ConveyorModel* model, const ConveyorStep* step) {
  const ConveyorModel& md = *model;
  const ConveyorStep& st = *step;
  const int64_t M = st.rows, H = md.hidden, Hq = md.num_heads, Hkv = md.num_kv_heads;
  const int64_t D = md.head_dim, I = md.intermediate, half = D / 2;
  const int threads = st.num_threads;
  if (M <= 0 || H <= 0 || Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || D % 2 != 0 || I <= 0 ||
      threads <= 0 || md.num_layers <= 0 || md.block_size <= 0 || st.num_logits < 0 ||
      md.kv_kind < 0 || md.kv_kind > 2)
    return 1;
  for (int64_t m = 0; m < M; ++m) {
    if (st.ids[m] < 0 || st.ids[m] >= md.vocab) return 2;
    if (st.positions[m] < 0 || st.positions[m] >= md.max_position) return 2;
    if (st.slots[m] < 0 || st.slots[m] >= md.num_blocks * md.block_size) return 3;
  }
  for (int64_t i = 0; i < st.num_logits; ++i)
    if (st.logits_rows[i] < 0 || st.logits_rows[i] >= M) return 3;

  const int64_t qkv_n = (Hq + 2 * Hkv) * D, kv_width = Hkv * D;
  // Scratch, reused across calls of this thread (the step loop's worker thread).
  thread_local std::vector<float> buf;
  thread_local std::vector<int64_t> rows;
  const size_t need = static_cast<size_t>(M) * (3 * H + qkv_n + Hq * D + 3 * I);
  if (buf.size() < need) buf.resize(need);
  float* h = buf.data();            // [M, H] a layer's output
  float* residual = h + M * H;      // [M, H]
  float* x = residual + M * H;      // [M, H] normed input of a linear
  float* qkv = x + M * H;           // [M, qkv_n]
  float* attn = qkv + M * qkv_n;    // [M, Hq, D]
  float* gu = attn + M * Hq * D;    // [M, 2 I]
  float* act = gu + M * 2 * I;      // [M, I]
  rows.resize(static_cast<size_t>(M));
  for (int64_t m = 0; m < M; ++m) rows[m] = m;
  const int64_t block_elems = md.num_blocks * md.block_size * kv_width;

  for_rows(M, threads, [&](int64_t m) {
    const float* e = st.embedded != nullptr ? st.embedded + m * H : md.embed + st.ids[m] * H;
    std::memcpy(residual + m * H, e, sizeof(float) * H);
    rms_norm_row(residual + m * H, md.layers[0].ln1, md.eps, H, x + m * H);
  });
  int rc = 0;
  for (int64_t li = 0; li < md.num_layers; ++li) {
    const ConveyorLayer& L = md.layers[li];
    if (li > 0)
      for_rows(M, threads, [&](int64_t m) {
        add_norm_row(residual + m * H, h + m * H, L.ln1, md.eps, H, x + m * H);
      });
    if ((rc = linear(L.qkv, x, H, M, qkv, threads)) != 0) return 20 + rc;
    const int64_t elem = md.kv_kind == 0 ? sizeof(float) : sizeof(uint16_t);
    char* k_cache = static_cast<char*>(L.kv);
    char* v_cache = k_cache + block_elems * elem;
    for_rows(M, threads, [&](int64_t m) {
      float* row = qkv + m * qkv_n;
      const float* c = md.cos + st.positions[m] * half;
      const float* s = md.sin + st.positions[m] * half;
      rotate_row(row, Hq + Hkv, D, c, s);  // q heads then k heads, side by side
      char* k_dst = k_cache + st.slots[m] * kv_width * elem;
      char* v_dst = v_cache + st.slots[m] * kv_width * elem;
      if (md.kv_kind == 1) {
        conveyor::store_half(reinterpret_cast<conveyor::Half*>(k_dst), row + Hq * D, kv_width);
        conveyor::store_half(reinterpret_cast<conveyor::Half*>(v_dst), row + (Hq + Hkv) * D,
                             kv_width);
      } else if (md.kv_kind == 2) {
        conveyor::store_bf16(reinterpret_cast<conveyor::BF16*>(k_dst), row + Hq * D, kv_width);
        conveyor::store_bf16(reinterpret_cast<conveyor::BF16*>(v_dst), row + (Hq + Hkv) * D,
                             kv_width);
      } else {
        std::memcpy(k_dst, row + Hq * D, sizeof(float) * kv_width);
        std::memcpy(v_dst, row + (Hq + Hkv) * D, sizeof(float) * kv_width);
      }
    });
    rc = md.attention(static_cast<int>(md.kv_kind), qkv, qkv_n, k_cache, v_cache, st.tables,
                      st.table_stride, st.table_width, st.seq_lens, rows.data(), attn, M,
                      md.num_blocks, static_cast<int>(M), static_cast<int>(Hq),
                      static_cast<int>(Hkv), static_cast<int>(D),
                      static_cast<int>(md.block_size), md.scale, threads);
    if (rc != 0) return 10 + rc;
    if ((rc = linear(L.o, attn, Hq * D, M, h, threads)) != 0) return 20 + rc;
    for_rows(M, threads, [&](int64_t m) {
      add_norm_row(residual + m * H, h + m * H, L.ln2, md.eps, H, x + m * H);
    });
    if ((rc = linear(L.gate_up, x, H, M, gu, threads)) != 0) return 20 + rc;
    for_rows(M, threads, [&](int64_t m) { silu_mul_row(gu + m * 2 * I, I, act + m * I); });
    if ((rc = linear(L.down, act, I, M, h, threads)) != 0) return 20 + rc;
  }
  // The sampling rows: final norm of h + residual, gathered into x, then the LM head.
  const int64_t S = st.num_logits;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t m = st.logits_rows[i];
    add_norm_row(residual + m * H, h + m * H, md.norm, md.eps, H, x + i * H);
  }
  if (S > 0 && (rc = linear(md.lm_head, x, H, S, st.logits, threads)) != 0) return 20 + rc;
  return 0;
}

// ---- The same row functions for the unfused forward (kernels/rowwise_cpu.py) -------------
// Prefill and mixed steps run their linear layers and attention one call at a time from
// Python; their small ops run here, over M rows on the threads, rather than as torch's
// eager ops (a 512-row prefill step's RMSNorm, rotary and SiLU x mul took about 60 ms of
// its 600 as torch calls). Rows are `*_stride` floats apart, elements contiguous. Each
// returns 0, or 1 for a negative row count, a row width below 1, an odd head dim, a row
// stride below its row's width or a thread count below 1.

// y[m] = rmsnorm(x[m]) * w  (n floats a row).
int conveyor_rms_norm_rows(const float* x, int64_t x_stride, const float* w, float eps,
                           int64_t M, int64_t n, float* y, int64_t y_stride, int threads) {
  if (M < 0 || n < 1 || x_stride < n || y_stride < n || threads < 1) return 1;
  for_rows(M, threads,
           [&](int64_t m) { rms_norm_row(x + m * x_stride, w, eps, n, y + m * y_stride); });
  return 0;
}

// x[m] += residual[m], then y[m] = rmsnorm(x[m]) * w  (x: a fresh layer output, overwritten
// with the new residual).
int conveyor_add_rms_norm_rows(float* x, int64_t x_stride, const float* residual,
                               int64_t r_stride, const float* w, float eps, int64_t M,
                               int64_t n, float* y, int64_t y_stride, int threads) {
  if (M < 0 || n < 1 || x_stride < n || r_stride < n || y_stride < n || threads < 1) return 1;
  for_rows(M, threads, [&](int64_t m) {
    add_norm_row(x + m * x_stride, residual + m * r_stride, w, eps, n, y + m * y_stride);
  });
  return 0;
}

// Rotates the first `heads` heads of D floats of each row in place (rotate-half, as the
// fused forward: q heads then k heads of a fused projection), row m by cos[m], sin[m]
// ([M, D / 2] contiguous: the tables gathered at the rows' positions).
int conveyor_rotate_rows(float* v, int64_t stride, int64_t heads, int64_t D, const float* cos,
                         const float* sin, int64_t M, int threads) {
  if (M < 0 || heads < 0 || D < 2 || D % 2 || stride < heads * D || threads < 1) return 1;
  const int64_t half = D / 2;
  for_rows(M, threads, [&](int64_t m) {
    rotate_row(v + m * stride, heads, D, cos + m * half, sin + m * half);
  });
  return 0;
}

// out[m] = silu(gu[m, :I]) * gu[m, I:]  (gu rows of 2 I floats).
int conveyor_silu_mul_rows(const float* gu, int64_t gu_stride, int64_t M, int64_t I, float* out,
                           int64_t out_stride, int threads) {
  if (M < 0 || I < 1 || gu_stride < 2 * I || out_stride < I || threads < 1) return 1;
  for_rows(M, threads,
           [&](int64_t m) { silu_mul_row(gu + m * gu_stride, I, out + m * out_stride); });
  return 0;
}

// dst[0 .. n) = src[0 .. n) narrowed as the fused forward stores K/V in a cache of `kind`
// (ConveyorModel::kv_kind: 1 fp16, 2 bf16; half.h), so tests can hold that rounding to
// torch's `.to(dtype)` bit for bit. Returns 1 for another kind or a negative n.
int conveyor_narrow_kv(const float* src, void* dst, int64_t n, int64_t kind) {
  if (n < 0 || (kind != 1 && kind != 2)) return 1;
  if (kind == 1)
    conveyor::store_half(static_cast<conveyor::Half*>(dst), src, n);
  else
    conveyor::store_bf16(static_cast<conveyor::BF16*>(dst), src, n);
  return 0;
}

}  // extern "C"
