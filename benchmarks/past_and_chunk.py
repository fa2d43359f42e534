"""A prefill chunk after a past on the CPU: one masked call of torch's attention against the past and the chunk
attended apart and merged (attention._past_and_chunk, what the engine runs from APART_FROM_PAIRS query-key pairs:
2^19 in float32, 2^21 in 16-bit dtypes).

    .venv/bin/python benchmarks/past_and_chunk.py [--rounds 3] [--dtypes float32 bfloat16]
        [--cases 2048+2048,1500+40,4000+512,512+512]

Each case is PAST+CHUNK: a chunk of CHUNK queries over a context whose first PAST keys are its past, at
SmolLM2-135M's heads (9 query heads sharing 3 KV heads of 64 dims). "masked": F.scaled_dot_product_attention with
the boolean causal mask of the chunk's rows over its context, as the engine called it before (the fused CPU kernel
multiplies every block, masked or not); "apart": _past_and_chunk. Milliseconds a call for one layer, the best of
the rounds (the two alternate in each round), and the ratio. A benchmark, not a test: CI never runs it.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F

from tokenloom.bench.provenance import cpu_flags
from tokenloom.model.attention import _past_and_chunk

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def timed_ms(fn, repeats: int = 3) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def case_row(past: int, chunk: int, dtype: torch.dtype, rounds: int) -> str:
    g = torch.Generator().manual_seed(past + chunk)
    ctx = past + chunk
    query = torch.randn(1, HEADS, chunk, HEAD_DIM, generator=g).to(dtype)
    keys, values = (torch.randn(1, KV_HEADS, ctx, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    visible = torch.arange(ctx)[None, :] <= torch.arange(past, ctx)[:, None]
    scale = HEAD_DIM**-0.5

    def masked() -> torch.Tensor:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)

    def apart() -> torch.Tensor:
        return _past_and_chunk(query, keys, values, past, scale)

    difference = (masked().float() - apart().float()).abs().max().item()
    best = {"masked": float("inf"), "apart": float("inf")}
    for r in range(rounds):
        for name, fn in (("masked", masked), ("apart", apart))[:: 1 if r % 2 == 0 else -1]:
            best[name] = min(best[name], timed_ms(fn))
    masked_ms, apart_ms = best["masked"], best["apart"]
    name = str(dtype).removeprefix("torch.")
    return (f"| {past} + {chunk} | {name} | {masked_ms:.1f} | {apart_ms:.1f} | {masked_ms / apart_ms:.2f}x "
            f"| {difference:.1e} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cases", default="2048+2048,1500+40,4000+512,512+512")
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads: {torch.get_num_threads()}; "
          f"CPU flags: {cpu_flags()}")  # fmt: skip
    print("| past + chunk | dtype | masked ms | apart ms | masked / apart | largest difference |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in args.dtypes:
        for case in args.cases.split(","):
            past, chunk = (int(part) for part in case.split("+"))
            print(case_row(past, chunk, getattr(torch, dtype), args.rounds))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
