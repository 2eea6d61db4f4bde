"""Random GGML blocks whose dequantized values are finite and of a chosen size.

Every byte of a block is random except its fp16 scale fields (``d``, and ``m`` / ``dmin``
where the type has them), which are set so that the dequantized weights have about the
standard deviation asked for and about zero mean: a forward over them stays finite. The
layouts (``ggml-common.h``; bytes per block of 32 or 256 values):

    Q4_0  18: d, qs[16]                  w = d (q - 8)
    Q4_1  20: d, m, qs[16]               w = d q + m
    Q5_0  22: d, qh[4], qs[16]           w = d (q - 16)
    Q5_1  24: d, m, qh[4], qs[16]        w = d q + m
    Q8_0  34: d, qs[32] (int8)           w = d q
    Q4_K 144: d, dmin, scales[12], qs[128]            w = d sc q - dmin m  (sc, m: 6 bits)
    Q5_K 176: d, dmin, scales[12], qh[32], qs[128]    the same, q of 5 bits
    Q6_K 210: ql[128], qh[64], scales[16] (int8), d   w = d sc (q - 32)

Each type's ``_STD`` is the standard deviation of the dequantized value per unit ``d``
over uniformly random bytes (e.g. Q4_0: sqrt(E[(q - 8)^2]) over q in 0..15 = 4.64).

Where ``d`` is the only fp16 field (Q4_0, Q5_0, Q8_0, Q6_K), uniform bytes do not average 0
(Q4_0: q - 8 over q in 0..15 averages -0.5 d, a tenth of its standard deviation), so each
block's ``d`` gets a random sign. With one sign everywhere, every row of every layer shared
that mean: a common all-ones direction that grew through the residual stream layer by layer
(a Llama-3.2-1B-shaped Q4_0 file's attention scores reached +-190; about +-3 now).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

# E.g. Q4_K: sc, m uniform in 0..63 and q in 0..15; with dmin = 7.5 d the mean is 0 and
# var(sc q - 7.5 m) = 1333.5 * 77.5 - 236.25^2 + 7.5^2 * 330.75 = 66,138 (std 257).
_STD = {T.Q4_0: 4.64, T.Q4_1: 4.61, T.Q5_0: 9.25, T.Q5_1: 9.23, T.Q8_0: 73.9,
        T.Q4_K: 257.0, T.Q5_K: 524.5, T.Q6_K: 1366.0}
# fp16 fields: (byte offset in the block, value as a multiple of d); d itself is 1.0
_SCALES = {
    T.Q4_0: [(0, 1.0)], T.Q5_0: [(0, 1.0)], T.Q8_0: [(0, 1.0)],
    T.Q4_1: [(0, 1.0), (2, -7.5)], T.Q5_1: [(0, 1.0), (2, -15.5)],
    T.Q4_K: [(0, 1.0), (2, 7.5)], T.Q5_K: [(0, 1.0), (2, 15.5)],
    T.Q6_K: [(208, 1.0)],
}
QUANTIZED = frozenset(_STD)
_SIGNED_D = frozenset({T.Q4_0, T.Q5_0, T.Q8_0, T.Q6_K})
"""Types whose blocks get a random sign on d (the module docstring)."""


def row_bytes(t: T, ncols: int) -> int:
    """Bytes of one row of `ncols` values of type t."""
    block, size = GGML_QUANT_SIZES[t]
    assert ncols % block == 0, f"{t.name}: {ncols} columns are not whole blocks of {block}"
    return ncols // block * size


def random_blocks(rng: np.random.Generator, t: T, rows: int, ncols: int,
                  std: float) -> np.ndarray:
    """[rows, row_bytes] uint8: random blocks of type t whose values have about `std`
    standard deviation and zero mean."""
    block, size = GGML_QUANT_SIZES[t]
    nblocks = rows * ncols // block
    data = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)
    d = std / _STD[t]
    for offset, mult in _SCALES[t]:
        data[:, offset:offset + 2] = np.array([d * mult], dtype="<f2").view(np.uint8)
    if t in _SIGNED_D:  # the fp16 sign bit: the high byte's top bit (little-endian)
        offset = _SCALES[t][0][0] + 1
        data[:, offset] |= rng.integers(0, 2, size=nblocks, dtype=np.uint8) << 7
    return data.reshape(rows, -1)


def random_dense(rng: np.random.Generator, t: T, rows: int, ncols: int,
                 std: float) -> np.ndarray:
    """[rows, ncols] F16 or F32 values, normal with `std`."""
    x = rng.standard_normal((rows, ncols), dtype=np.float32) * np.float32(std)
    return x.astype(np.float16) if t == T.F16 else x
