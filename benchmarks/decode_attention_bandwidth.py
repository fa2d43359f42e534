"""Decode attention over a cold bf16 cache: ms a layer and the cache's bytes read a second, by batch shape.

    .venv/bin/python benchmarks/decode_attention_bandwidth.py [--rounds 5] [--dtype bfloat16]
        [--kv-cache-dtype auto|int8|fp8_e4m3|fp8_e5m2]
    PYTHONPATH=/work/wtbase/src .venv/bin/python benchmarks/decode_attention_bandwidth.py   # an earlier checkout's

The CPU decode operator (tokenloom::paged_decode_attention) on SmolLM2-135M's heads (9 query heads, 3 KV heads of
64), blocks of 16 tokens taken in a random order, each "layer" its own cache so that 8 layers are read from memory
rather than the caches (16 x 4,096 tokens x 8 layers is 400 MB, near this VM's 480 MB L3: the figures are memory's).
Median over the rounds of 8 layers each, after one warm-up pass. GB/s counts the K and V bytes of every context
once, what attention must read (an 8-bit cache's codes and scales, where --kv-cache-dtype names one); a plain sum
over 384 MiB of float32 reads at 23-26 GB/s on the 2-core Xeon of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from tokenloom.model import cpu_kernel, kv_quant

SHAPES = [(16, 4096), (32, 2048), (64, 512), (64, 256)]  # (sequences, tokens of context each)
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 8


def cache(slots: int, dtype: torch.dtype, fmt: kv_quant.KVFormat | None, g: torch.Generator) -> torch.Tensor:
    values = torch.randn(slots, KV_HEADS * HEAD_DIM, generator=g).to(dtype)
    if fmt is None:
        return values
    entries = torch.empty(slots, KV_HEADS * (HEAD_DIM + kv_quant.SCALE_BYTES), dtype=torch.uint8)
    kv_quant.write(entries, values, torch.arange(slots), fmt, HEAD_DIM, BLOCK)
    return entries


def measure(
    sequences: int, context: int, dtype: torch.dtype, fmt: kv_quant.KVFormat | None, rounds: int
) -> tuple[float, float]:
    """Median seconds a layer, and GB/s of K and V."""
    g = torch.Generator().manual_seed(sequences * context)
    slots = sequences * context
    caches = [(cache(slots, dtype, fmt, g), cache(slots, dtype, fmt, g)) for _ in range(LAYERS)]
    tables = torch.randperm(slots // BLOCK, generator=g).view(sequences, -1).contiguous()
    lens = torch.full((sequences,), context, dtype=torch.long)
    q = torch.randn(sequences, HEADS, HEAD_DIM, generator=g).to(dtype)
    out = torch.empty_like(q)
    kv_kind = 0 if fmt is None else fmt.kind

    def one_pass() -> None:
        for k, v in caches:
            cpu_kernel.paged_decode_attention(q, k, v, tables, lens, BLOCK, HEAD_DIM**-0.5, out, kv_kind)

    one_pass()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        one_pass()
        times.append((time.perf_counter() - start) / LAYERS)
    seconds = statistics.median(times)
    return seconds, 2 * caches[0][0].nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
    args = parser.parse_args()
    fmt = kv_quant.kv_format(args.kv_cache_dtype)
    assert cpu_kernel.load_kernel(), "the CPU operators did not build"
    dtype = getattr(torch, args.dtype)
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads, {args.dtype} queries, "
          f"--kv-cache-dtype {args.kv_cache_dtype}")  # fmt: skip
    print("| sequences x context | ms a layer | GB/s |\n|---|---:|---:|")
    for sequences, context in SHAPES:
        seconds, rate = measure(sequences, context, dtype, fmt, args.rounds)
        print(f"| {sequences} x {context} | {seconds * 1e3:.2f} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
