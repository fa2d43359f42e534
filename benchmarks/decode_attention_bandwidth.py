"""Decode attention over a cold bf16 cache: ms a layer and the cache's bytes read a second, by batch shape.

    .venv/bin/python benchmarks/decode_attention_bandwidth.py [--rounds 5] [--dtype bfloat16]
    PYTHONPATH=/work/wtbase/src .venv/bin/python benchmarks/decode_attention_bandwidth.py   # an earlier checkout's

The CPU decode operator (tokenloom::paged_decode_attention) on SmolLM2-135M's heads (9 query heads, 3 KV heads of
64), blocks of 16 tokens taken in a random order, each "layer" its own cache so that 8 layers are read from memory
rather than the caches (16 x 4,096 tokens x 8 layers is 400 MB, near this VM's 480 MB L3: the figures are memory's).
Median over the rounds of 8 layers each, after one warm-up pass. GB/s counts the K and V bytes of every context once,
what attention must read; a plain sum over 384 MiB of float32 reads at 23-26 GB/s on the 2-core Xeon of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from tokenloom.model import cpu_kernel

SHAPES = [(16, 4096), (32, 2048), (64, 512), (64, 256)]  # (sequences, tokens of context each)
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 8


def measure(sequences: int, context: int, dtype: torch.dtype, rounds: int) -> tuple[float, float]:
    """Median seconds a layer, and GB/s of K and V."""
    g = torch.Generator().manual_seed(sequences * context)
    slots = sequences * context
    caches = [
        tuple(torch.randn(slots, KV_HEADS * HEAD_DIM, generator=g).to(dtype) for _ in range(2)) for _ in range(LAYERS)
    ]
    tables = torch.randperm(slots // BLOCK, generator=g).view(sequences, -1).contiguous()
    lens = torch.full((sequences,), context, dtype=torch.long)
    q = torch.randn(sequences, HEADS, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(q)

    def one_pass() -> None:
        for k, v in caches:
            cpu_kernel.paged_decode_attention(q, k, v, tables, lens, BLOCK, HEAD_DIM**-0.5, out)

    one_pass()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        one_pass()
        times.append((time.perf_counter() - start) / LAYERS)
    seconds = statistics.median(times)
    return seconds, 2 * slots * KV_HEADS * HEAD_DIM * dtype.itemsize / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    assert cpu_kernel.load_kernel(), "the CPU operators did not build"
    dtype = getattr(torch, args.dtype)
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads, {args.dtype} cache")
    print("| sequences x context | ms a layer | GB/s |\n|---|---:|---:|")
    for sequences, context in SHAPES:
        seconds, rate = measure(sequences, context, dtype, args.rounds)
        print(f"| {sequences} x {context} | {seconds * 1e3:.2f} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
