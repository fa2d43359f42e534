"""Prefill attention per layer (SmolLM2-135M's heads: 9 query, 3 KV, head size 64, bf16): our C++ operator
(csrc/prefill_attention.cpp: on AMX tiles where the CPU has them and grants them, else AVX-512 BF16) against torch's
fused scaled_dot_product_attention (which uses AMX tiles where the CPU has them), for prompt chunks with and without a
cached past; a past is given to torch's path as the engine gives it (attended apart where that pays, else masked).

    .venv/bin/python benchmarks/prefill_attention_amx.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from tokenloom.model import cpu_kernel
from tokenloom.model.attention import PrefillSegment, _prefill_attention, attends_apart

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = [(64, 0), (256, 0), (512, 0), (256, 256), (2048, 0), (2048, 2048), (16, 300)]  # (queries, cached past)


def ms_per_call(f: Callable[[], object], n: int) -> float:
    f()
    started = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - started) / n * 1e3


def compare(q_len: int, past: int) -> tuple[float, float]:
    ctx = q_len + past
    q = torch.randn(q_len, HEADS, HEAD_DIM).bfloat16()
    k = torch.randn(ctx, KV_HEADS * HEAD_DIM).bfloat16()
    v = torch.randn(ctx, KV_HEADS * HEAD_DIM).bfloat16()
    out = torch.empty(q_len, HEADS, HEAD_DIM).bfloat16()
    # As the engine's steps give it: a past attended apart from the chunk where that pays, else a mask.
    apart = attends_apart(q_len, ctx, torch.bfloat16, torch.device("cpu"))
    mask = torch.from_numpy(np.arange(ctx)[None, :] <= np.arange(past, ctx)[:, None]) if past and not apart else None
    seg = PrefillSegment(0, q_len, ctx, None, mask)
    n = 3 if q_len >= 2048 else 30
    ours = ms_per_call(lambda: torch.ops.tokenloom.prefill_attention(q, k, v, 0.125, out), n)
    fused = ms_per_call(lambda: _prefill_attention(q, k, v, seg, 0.125), n)
    return ours, fused


def main() -> None:
    assert cpu_kernel.has_prefill_op(torch.bfloat16), "the bf16 prefill operator is built only with AVX-512 BF16"
    print("operator on AMX tiles:", cpu_kernel.prefill_op_uses_amx())
    for q_len, past in SHAPES:
        ours, fused = compare(q_len, past)
        print(f"q={q_len} past={past}: ours {ours:.2f} ms, torch sdpa {fused:.2f} ms, ratio {ours / fused:.2f}")


if __name__ == "__main__":
    main()
