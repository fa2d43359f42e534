"""GGUF weights in their formats' raw blocks, for test_gguf_linear.py and the AVX2 build it runs apart."""

from __future__ import annotations

import gguf
import numpy as np

# Where each K-quant's fp16 scale (and min scale) sit in its block of 256 inputs.
K_QUANT_HALVES = {"Q2_K": slice(80, 84), "Q3_K": slice(108, 110), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4),
                  "Q6_K": slice(208, 210), "IQ4_NL": slice(0, 2), "IQ4_XS": slice(0, 2)}  # fmt: skip
# A smaller fp16 scale where codes or sub-block scales reach far, keeping |w| below ~1.
UNITS = {"Q6_K": 1e-4, "IQ4_NL": 1e-4, "IQ4_XS": 3e-6}


def raw_blocks(fmt: str, n: int, k: int, seed: int = 0, unit: float | None = None) -> np.ndarray:
    """A weight [n, k] in a GGUF format's blocks ([n, bytes per row] uint8), as gguf-py quantizes it (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0) or, for the K-quants and IQ4's (which gguf-py does not quantize), blocks of random codes and
    sub-block scales under small, positive fp16 scales (from `unit` to 11 x `unit`)."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt not in K_QUANT_HALVES:
        weight = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        weight[:, 3] += 0.4  # an outlier input, as real weights have
        return gguf.quants.quantize(weight, qtype)
    block_inputs, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // block_inputs, block_bytes), dtype=np.uint8)
    where = K_QUANT_HALVES[fmt]
    unit = unit or UNITS.get(fmt, 1e-3)
    halves = (rng.random((len(blocks), (where.stop - where.start) // 2)) * 10 * unit + unit).astype(np.float16)
    blocks[:, where] = halves.view(np.uint8)
    return blocks.reshape(n, -1)
