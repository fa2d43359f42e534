"""Float32 prefill attention per layer (SmolLM2-135M's heads: 9 query, 3 KV, head size 64): our C++ operator
(csrc/prefill_attention.cpp, AVX-512) against what the engine runs without it, torch's fused CPU kernel (one causal
call; with a past, the past and the chunk apart and merged, or one masked call below attention.APART_FROM_PAIRS).
Alternated call by call, median of the rounds; GFLOP/s counts the causal (query, key) pairs only.

    .venv/bin/python benchmarks/prefill_attention_f32.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from tokenloom.model import cpu_kernel
from tokenloom.model.attention import PrefillSegment, _prefill_attention, attends_apart

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
# (queries, cached past): prompts whole, chunks of 512 / 2,048 after a past, a short turn after a long history.
SHAPES = [(16, 0), (64, 0), (256, 0), (512, 0), (2048, 0), (16, 300), (64, 1000), (512, 512), (256, 1024),
          (512, 1536), (2048, 2048)]  # fmt: skip


def seconds(f, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - started) / calls


def compare(q_len: int, past: int, rounds: int) -> tuple[float, float]:
    ctx = q_len + past
    g = torch.Generator().manual_seed(ctx)
    q = torch.randn(q_len, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(ctx, KV_HEADS * HEAD_DIM, generator=g)
    v = torch.randn(ctx, KV_HEADS * HEAD_DIM, generator=g)
    out = torch.empty(q_len, HEADS, HEAD_DIM)
    apart = past == 0 or attends_apart(q_len, ctx, torch.float32, q.device)
    mask = None if apart else torch.from_numpy(np.arange(ctx)[None, :] <= np.arange(past, ctx)[:, None])
    seg = PrefillSegment(0, q_len, ctx, None, mask)
    scale = HEAD_DIM**-0.5
    ours = lambda: torch.ops.tokenloom.prefill_attention(q, k, v, scale, out)  # noqa: E731
    torch_fused = lambda: _prefill_attention(q, k, v, seg, scale)  # noqa: E731
    calls = max(1, int(2e7 // (q_len * ctx)))
    ours(), torch_fused()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        times[0].append(seconds(ours, calls))
        times[1].append(seconds(torch_fused, calls))
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    assert cpu_kernel.has_prefill_op(torch.float32), "the float32 prefill operator needs a CPU with AVX-512"
    print("| queries | past | ours ms | torch ms | torch / ours | ours GFLOP/s | torch GFLOP/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for q_len, past in SHAPES:
        ours, fused = compare(q_len, past, args.rounds)
        flops = 4 * HEAD_DIM * HEADS * (q_len * past + q_len * (q_len + 1) / 2)
        print(f"| {q_len} | {past} | {ours * 1e3:.3f} | {fused * 1e3:.3f} | {fused / ours:.2f}x | "
              f"{flops / ours / 1e9:.0f} | {flops / fused / 1e9:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
