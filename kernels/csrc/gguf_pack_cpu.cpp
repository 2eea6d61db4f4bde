// A GGUF tensor's raw block rows -> the packed tensors of kernels/quant_pack.py, in one pass.
//
// The same transform as kernels/gguf_pack.py's numpy path (its reference, and the tests'):
// each block is decoded into the form
//
//     W[k] = (d * sc[g]) * q[k] - dmin * m[g]        (g: group of 16; d, dmin fp16 bits)
//
// and the form is written in the output format's panels. Nothing is computed in floating
// point: fp16 fields are copied as bits (Q4_1's min m becomes dmin = -m by its sign bit), so
// the result is the numpy path's bit for bit. The one float step (Q4_0 as q4_1: the min
// -8 d in fp16) is exact or refused, as the reference does (F16C conversions).
//
// Layout of every output (kernels/quant_pack.py, PackedWeight): rows padded to Np (a
// multiple of 64), panels [Np/64, C, 64] with the 64 rows of a panel innermost; row n's
// column c of an output lives at ((n / 64) * C + c) * 64 + n % 64. So a panel's rows are
// decoded one block at a time and written column by column, each column's 64 lanes
// contiguous.
//
// Block layouts are ggml's (ggml-common.h), as kernels/gguf_pack.py documents them.
// Parallel over output panels (OpenMP: torch's pool). 0.7-2.0 GB/s of file on one thread
// ([4096 x 14336] Q4_K, Q6_K, Q8_0; Q4_0 0.46), where the numpy path ran at 0.02-0.03 GB/s
// (8B-shaped Q4_K_M layers); Zen 4, 2026-12-06, host loaded by other processes.

#include <immintrin.h>

#include <cstdint>

namespace {

enum Type { Q4_0 = 0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K };
enum Format { F_Q4_K = 0, F_Q6_K, F_I8_K, F_Q8_0, F_Q4_1, F_Q5_K, F_Q4_0 };

constexpr int kBlockWeights[] = {32, 32, 32, 32, 32, 256, 256, 256, 256, 256};
constexpr int kBlockBytes[] = {18, 20, 22, 24, 34, 84, 110, 144, 176, 210};

// One block in the form: up to 256 weights, 16 groups of 16.
struct Form {
  int16_t q[256];
  int16_t sc[16];
  int16_t m[16];
  uint16_t d;
  uint16_t dmin;
};

inline uint16_t half_at(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// ggml's get_scale_min_k4 over the 12 scale bytes of a Q4_K / Q5_K block.
inline void k4_scales(const uint8_t* s, int16_t* sc, int16_t* m) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    m[j] = s[4 + j] & 63;
    sc[4 + j] = (s[8 + j] & 15) | ((s[j] >> 6) << 4);
    m[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4);
  }
}

void decode(int type, const uint8_t* b, Form& f) {
  switch (type) {
    case Q4_K:
    case Q5_K: {
      f.d = half_at(b);
      f.dmin = half_at(b + 2);
      int16_t sc8[8], m8[8];
      k4_scales(b + 4, sc8, m8);
      for (int g = 0; g < 16; ++g) { f.sc[g] = sc8[g / 2]; f.m[g] = m8[g / 2]; }
      const uint8_t* ql = b + (type == Q4_K ? 16 : 48);  // the last 128 bytes
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 32; ++i) {
          f.q[64 * j + i] = ql[32 * j + i] & 15;
          f.q[64 * j + 32 + i] = ql[32 * j + i] >> 4;
        }
      if (type == Q5_K) {
        const uint8_t* qh = b + 16;  // bit t of qh[i]: weight 32 t + i
        for (int t = 0; t < 8; ++t)
          for (int i = 0; i < 32; ++i) f.q[32 * t + i] |= ((qh[i] >> t) & 1) << 4;
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;        // weight 128 h + 64 t + i: (ql[64 h + i] >> 4 t) & 15
      const uint8_t* qh = b + 128;  // weight 128 h + 32 s + i: (qh[32 h + i] >> 2 s) & 3
      for (int h = 0; h < 2; ++h) {
        for (int t = 0; t < 2; ++t)
          for (int i = 0; i < 64; ++i) f.q[128 * h + 64 * t + i] = (ql[64 * h + i] >> (4 * t)) & 15;
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i)
            f.q[128 * h + 32 * s + i] |= ((qh[32 * h + i] >> (2 * s)) & 3) << 4;
      }
      for (int k = 0; k < 256; ++k) f.q[k] -= 32;
      for (int g = 0; g < 16; ++g) { f.sc[g] = int8_t(b[192 + g]); f.m[g] = 0; }
      f.d = half_at(b + 208);
      f.dmin = 0;
      return;
    }
    case Q2_K: {
      for (int g = 0; g < 16; ++g) { f.sc[g] = b[g] & 15; f.m[g] = b[g] >> 4; }
      const uint8_t* qs = b + 16;  // weight 128 h + 32 s + i: (qs[32 h + i] >> 2 s) & 3
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i) f.q[128 * h + 32 * s + i] = (qs[32 * h + i] >> (2 * s)) & 3;
      f.d = half_at(b + 80);
      f.dmin = half_at(b + 82);
      return;
    }
    case Q3_K: {
      const uint8_t* hm = b;       // bit t of hmask[i]: weight 32 t + i
      const uint8_t* qs = b + 32;  // as Q2_K's
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int i = 0; i < 32; ++i) {
            int k = 128 * h + 32 * s + i;
            int hi = (hm[k % 32] >> (k / 32)) & 1;
            f.q[k] = int16_t(((qs[32 * h + i] >> (2 * s)) & 3) - 4 * (1 - hi));
          }
      const uint8_t* s = b + 96;  // scale 8 t + i: (s[i] >> 4 t) & 15, high bits of 4 t + i
      for (int g = 0; g < 16; ++g) {
        int low = (s[g % 8] >> (4 * (g / 8))) & 15;
        int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        f.sc[g] = int16_t((low | (high << 4)) - 32);
        f.m[g] = 0;
      }
      f.d = half_at(b + 108);
      f.dmin = 0;
      return;
    }
    default: {  // legacy, 32 weights: d [, m] [, qh], then 16 nibble bytes or 32 int8
      f.d = half_at(b);
      f.dmin = 0;
      f.sc[0] = f.sc[1] = 1;
      f.m[0] = f.m[1] = 0;
      if (type == Q8_0) {
        for (int i = 0; i < 32; ++i) f.q[i] = int8_t(b[2 + i]);
        return;
      }
      const uint8_t* qs = b + kBlockBytes[type] - 16;  // weight i low nibble, 16 + i high
      for (int i = 0; i < 16; ++i) { f.q[i] = qs[i] & 15; f.q[16 + i] = qs[i] >> 4; }
      if (type == Q5_0 || type == Q5_1) {  // bit i of the little-endian uint32 qh
        const uint8_t* qh = b + (type == Q5_0 ? 2 : 4);
        for (int i = 0; i < 32; ++i) f.q[i] |= ((qh[i / 8] >> (i % 8)) & 1) << 4;
      }
      if (type == Q4_1 || type == Q5_1) {  // d q + m = d q - (-m) * 1
        f.dmin = half_at(b + 2) ^ 0x8000;
        f.m[0] = f.m[1] = 1;
      } else {
        for (int i = 0; i < 32; ++i) f.q[i] -= (type == Q4_0 ? 8 : 16);
      }
      return;
    }
  }
}

// Lane 0 of column c in panel p of a panel output with `cols` columns (row n of the
// panel's 64 is at lane n % 64).
template <typename T>
inline T* column(T* base, int64_t p, int64_t cols, int64_t c) {
  return base + (p * cols + c) * 64;
}

struct Out {
  int fmt;
  int64_t k;           // input features
  int64_t super_group;  // d / dmin per this many weights (q4_k, q5_k, q6_k: 256; i8_k 256 or 32)
  uint8_t* data;
  uint8_t* scale;       // q4_k / q5_k uint8, q6_k / i8_k int8, q8_0 / q4_1 fp16
  uint8_t* minv;        // q4_k / q5_k uint8, i8_k int8, q4_1 fp16; else null
  uint16_t* super_scale;
  uint16_t* super_min;
};

// q4_k's and q5_k's scales of block `blk` for lanes l0 .. l1 of panel p: sc, m per 32 (the
// form's per-16 values come in equal pairs), d, dmin per 256.
void emit_k4_scales(const Out& o, int64_t p, int l0, int l1, int64_t blk, int size,
                    const Form* f) {
  const int64_t k0 = blk * size;
  for (int g = 0; g < size / 32; ++g) {
    uint8_t* sc = column(o.scale, p, o.k / 32, k0 / 32 + g);
    uint8_t* mn = column(o.minv, p, o.k / 32, k0 / 32 + g);
    for (int l = l0; l < l1; ++l) { sc[l] = uint8_t(f[l].sc[2 * g]); mn[l] = uint8_t(f[l].m[2 * g]); }
  }
  uint16_t* d = column(o.super_scale, p, o.k / 256, blk);
  uint16_t* dm = column(o.super_min, p, o.k / 256, blk);
  for (int l = l0; l < l1; ++l) { d[l] = f[l].d; dm[l] = f[l].dmin; }
}

// Write block `blk` (weights blk * size .. + size) of lanes l0 .. l1 of panel p from their
// forms f[lane]: column by column, each column's lanes contiguous (64 bytes of a q4_k
// column are one cache line). False where a value is not servable (Q4_0's -8 d beyond fp16).
bool emit(const Out& o, int type, int64_t p, int l0, int l1, int64_t blk, int size,
          const Form* f) {
  const int64_t k0 = blk * size;
  switch (o.fmt) {
    case F_Q4_K: {  // nibbles (k = 2j low, 2j + 1 high); sc, m per 32; d, dmin per 256
      for (int j = 0; j < size / 2; ++j) {
        uint8_t* c = column(o.data, p, o.k / 2, k0 / 2 + j);
        for (int l = l0; l < l1; ++l) c[l] = uint8_t(f[l].q[2 * j] | (f[l].q[2 * j + 1] << 4));
      }
      emit_k4_scales(o, p, l0, l1, blk, size, f);
      return true;
    }
    case F_Q5_K: {  // per 8 weights: nibbles of (k, k + 1) .. (k + 6, k + 7), the 8 high bits;
                    // q4_k's scales
      const int64_t cols = 5 * o.k / 8;
      for (int j = 0; j < size / 8; ++j) {
        const int64_t c = 5 * (k0 / 8 + j);
        for (int i = 0; i < 4; ++i) {
          uint8_t* n = column(o.data, p, cols, c + i);
          for (int l = l0; l < l1; ++l) {
            const int16_t* q = f[l].q + 8 * j + 2 * i;
            n[l] = uint8_t((q[0] & 15) | ((q[1] & 15) << 4));
          }
        }
        uint8_t* h = column(o.data, p, cols, c + 4);
        for (int l = l0; l < l1; ++l) {
          int bits = 0;
          for (int i = 0; i < 8; ++i) bits |= ((f[l].q[8 * j + i] >> 4) & 1) << i;
          h[l] = uint8_t(bits);
        }
      }
      emit_k4_scales(o, p, l0, l1, blk, size, f);
      return true;
    }
    case F_Q6_K: {  // per 4 weights: nibbles of k, k + 1, of k + 2, k + 3, the 4 high fields
      const int64_t cols = 3 * o.k / 4;
      for (int j = 0; j < size / 4; ++j) {
        const int64_t c = 3 * (k0 / 4 + j);
        uint8_t* a = column(o.data, p, cols, c);
        uint8_t* b = column(o.data, p, cols, c + 1);
        uint8_t* h = column(o.data, p, cols, c + 2);
        for (int l = l0; l < l1; ++l) {
          const int16_t* q = f[l].q + 4 * j;  // q - 32: back to 0 .. 63
          const int u0 = q[0] + 32, u1 = q[1] + 32, u2 = q[2] + 32, u3 = q[3] + 32;
          a[l] = uint8_t((u0 & 15) | ((u1 & 15) << 4));
          b[l] = uint8_t((u2 & 15) | ((u3 & 15) << 4));
          h[l] = uint8_t((u0 >> 4) | ((u1 >> 4) << 2) | ((u2 >> 4) << 4) | ((u3 >> 4) << 6));
        }
      }
      for (int g = 0; g < size / 16; ++g) {
        uint8_t* sc = column(o.scale, p, o.k / 16, k0 / 16 + g);
        for (int l = l0; l < l1; ++l) sc[l] = uint8_t(int8_t(f[l].sc[g]));
      }
      uint16_t* d = column(o.super_scale, p, o.k / 256, blk);
      for (int l = l0; l < l1; ++l) d[l] = f[l].d;
      return true;
    }
    case F_I8_K: {  // int8 q; sc, m per 16; d, dmin per super_group (repeated when smaller)
      for (int i = 0; i < size; ++i) {
        uint8_t* c = column(o.data, p, o.k, k0 + i);
        for (int l = l0; l < l1; ++l) c[l] = uint8_t(int8_t(f[l].q[i]));
      }
      for (int g = 0; g < size / 16; ++g) {
        uint8_t* sc = column(o.scale, p, o.k / 16, k0 / 16 + g);
        uint8_t* mn = column(o.minv, p, o.k / 16, k0 / 16 + g);
        for (int l = l0; l < l1; ++l) {
          sc[l] = uint8_t(int8_t(f[l].sc[g]));
          mn[l] = uint8_t(int8_t(f[l].m[g]));
        }
      }
      const int64_t sg = o.super_group, cols = o.k / sg;
      for (int64_t s = k0 / sg; s < (k0 + size) / sg; ++s) {
        uint16_t* d = column(o.super_scale, p, cols, s);
        uint16_t* dm = column(o.super_min, p, cols, s);
        for (int l = l0; l < l1; ++l) { d[l] = f[l].d; dm[l] = f[l].dmin; }
      }
      return true;
    }
    case F_Q4_0: {  // the file's nibbles (q - 8 + 8) and fp16 d per 32; no min
      for (int j = 0; j < 16; ++j) {
        uint8_t* c = column(o.data, p, o.k / 2, k0 / 2 + j);
        for (int l = l0; l < l1; ++l)
          c[l] = uint8_t((f[l].q[2 * j] + 8) | ((f[l].q[2 * j + 1] + 8) << 4));
      }
      uint16_t* d = column(reinterpret_cast<uint16_t*>(o.scale), p, o.k / 32, blk);
      for (int l = l0; l < l1; ++l) d[l] = f[l].d;
      return true;
    }
    case F_Q8_0: {  // int8 q, fp16 d per 32
      for (int i = 0; i < 32; ++i) {
        uint8_t* c = column(o.data, p, o.k, k0 + i);
        for (int l = l0; l < l1; ++l) c[l] = uint8_t(int8_t(f[l].q[i]));
      }
      uint16_t* d = column(reinterpret_cast<uint16_t*>(o.scale), p, o.k / 32, blk);
      for (int l = l0; l < l1; ++l) d[l] = f[l].d;
      return true;
    }
    default: {  // F_Q4_1: q (+ 8 for Q4_0) as nibbles, fp16 d and min per 32
      const int add = type == Q4_0 ? 8 : 0;
      for (int j = 0; j < 16; ++j) {
        uint8_t* c = column(o.data, p, o.k / 2, k0 / 2 + j);
        for (int l = l0; l < l1; ++l)
          c[l] = uint8_t((f[l].q[2 * j] + add) | ((f[l].q[2 * j + 1] + add) << 4));
      }
      uint16_t* d = column(reinterpret_cast<uint16_t*>(o.scale), p, o.k / 32, blk);
      uint16_t* mn = column(reinterpret_cast<uint16_t*>(o.minv), p, o.k / 32, blk);
      bool ok = true;
      for (int l = l0; l < l1; ++l) {
        d[l] = f[l].d;
        uint16_t m = uint16_t(f[l].dmin ^ 0x8000);  // Q4_1: -dmin, the file's m
        if (type == Q4_0) {  // d (q - 8) = d q + (-8 d): exact in fp16 unless it overflows
          const float v = -8.0f * _cvtsh_ss(f[l].d);
          m = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
          ok &= _cvtsh_ss(m) == v;
        }
        mn[l] = m;
      }
      return ok;
    }
  }
}

}  // namespace

extern "C" {

// Pack `rows` rows of one part (GGUF type `type`, Type's order) into output rows row0 ..
// row0 + rows of format `fmt` (Format's order). raw: [rows, row_bytes] uint8, each row K
// weights of whole blocks. The output tensors are PackedWeight's, padded to a multiple of 64
// rows; pass null for those the format has none of. Returns 0, or -1 for a type / format /
// shape the caller should have refused (nothing is written then), -2 for a Q4_0 block whose
// -8 d is beyond fp16 (not servable as q4_1; the output is then incomplete).
int conveyor_pack_gguf(const uint8_t* raw, int64_t rows, int64_t row_bytes, int type,
                       int64_t row0, int fmt, int64_t k, int64_t super_group, uint8_t* data,
                       uint8_t* scale, uint8_t* minv, uint16_t* super_scale,
                       uint16_t* super_min) {
  if (type < Q4_0 || type > Q6_K || fmt < F_Q4_K || fmt > F_Q4_0 || rows < 1 || row0 < 0)
    return -1;
  const int size = kBlockWeights[type];
  if (k % size || row_bytes != k / size * kBlockBytes[type]) return -1;
  if (fmt == F_I8_K && (super_group < 1 || size % super_group)) return -1;
  if ((fmt == F_Q4_K && type != Q4_K) || (fmt == F_Q6_K && type != Q6_K) ||
      (fmt == F_Q5_K && type != Q5_K) || (fmt == F_Q4_0 && type != Q4_0) ||
      (fmt == F_Q8_0 && type != Q8_0 && type != Q5_0) ||
      (fmt == F_Q4_1 && type != Q4_0 && type != Q4_1))
    return -1;
  const Out o{fmt, k, fmt == F_I8_K ? super_group : 256, data, scale, minv, super_scale,
              super_min};
  const int64_t blocks = k / size;
  const int64_t first = row0 >> 6, last = (row0 + rows - 1) >> 6;
  int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
  for (int64_t p = first; p <= last; ++p) {  // one output panel (64 rows) a task
    Form f[64];  // the panel's rows' forms of one block
    const int64_t lo = p * 64 > row0 ? p * 64 : row0;
    const int64_t hi = (p + 1) * 64 < row0 + rows ? (p + 1) * 64 : row0 + rows;
    const int l0 = int(lo - p * 64), l1 = int(hi - p * 64);
    for (int64_t b = 0; b < blocks; ++b) {
      for (int l = l0; l < l1; ++l)
        decode(type, raw + (p * 64 + l - row0) * row_bytes + b * kBlockBytes[type], f[l]);
      bad |= !emit(o, type, p, l0, l1, b, size, f);
    }
  }
  return bad ? -2 : 0;
}

}  // extern "C"
