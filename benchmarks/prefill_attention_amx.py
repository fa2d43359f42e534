"""Prefill attention per layer (SmolLM2-135M's heads: 9 query, 3 KV, head size 64, bf16): our C++ operator
(csrc/prefill_attention.cpp, AVX-512 BF16) against torch's fused scaled_dot_product_attention (which uses AMX tiles
where the CPU has them), for prompt chunks with and without a cached past.

    .venv/bin/python benchmarks/prefill_attention_amx.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tokenloom.model import cpu_kernel
from tokenloom.model.attention import PrefillSegment, _prefill_attention


H, KV, d = 9, 3, 64


def bench(f, n: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


cpu_kernel.load_kernel()
for q_len, past in [(64, 0), (256, 0), (512, 0), (256, 256), (2048, 0), (2048, 2048), (16, 300)]:
    ctx = q_len + past
    q = torch.randn(q_len, H, d).bfloat16()
    k = torch.randn(ctx, KV * d).bfloat16()
    v = torch.randn(ctx, KV * d).bfloat16()
    out = torch.empty(q_len, H, d).bfloat16()
    mask = None
    if past:
        mask = torch.from_numpy(np.arange(ctx)[None, :] <= np.arange(past, ctx)[:, None])
    seg = PrefillSegment(0, q_len, ctx, None, mask)
    n = 3 if q_len >= 2048 else 30
    t_op = bench(lambda: torch.ops.tokenloom.prefill_attention(q, k, v, 0.125, out), n)
    t_sd = bench(lambda: _prefill_attention(q, k, v, seg, 0.125), n)
    print(f"q={q_len} past={past}: op {t_op:.2f} ms  sdpa {t_sd:.2f} ms  ratio {t_op / t_sd:.2f}")
