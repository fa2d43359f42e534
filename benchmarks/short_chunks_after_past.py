"""Prefill chunks of few queries after a long past, on the CPU: the paged prefill operator against the same rows
attended as decodes.

    .venv/bin/python benchmarks/short_chunks_after_past.py [--cases 64,16,384 8,4,2000 8,16,2000 4,64,2000]

Each case is SEGMENTS,QUERIES,PAST: that many chunks of QUERIES queries, each after PAST keys of its own, at
SmolLM2-135M's heads (9 query heads sharing 3 KV heads of 64 dims), float32, a paged cache of 16-token blocks in
random order. "paged": tokenloom::paged_prefill_attention, what the engine runs for a chunk with a past (a prefix
hit's remainder, a chunked prompt's later chunks), which packs every key block of each chunk's context before the
chunk's queries read it. "as decodes": tokenloom::paged_decode_attention with every query a row of its own reading
its context up to itself (what a request verifying drafts runs). Milliseconds for one layer, the best of 7 rounds of
5 calls, the two alternated; both outputs checked equal first. A benchmark, not a test: CI never runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
import torch
from int8_linear_breakdown import milliseconds

from tokenloom.model import cpu_kernel
from tokenloom.model.step_inputs import shared_key_blocks

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def case_row(segments: int, queries: int, past: int) -> str:
    g = torch.Generator().manual_seed(0)
    ctx = past + queries
    blocks_each = -(-ctx // BLOCK)
    cache_k, cache_v = (torch.randn(segments * blocks_each * BLOCK, KV_HEADS * HEAD_DIM, generator=g) for _ in "kv")
    tables = torch.randperm(segments * blocks_each, generator=g).view(segments, blocks_each).numpy()
    ends = np.arange(1, segments + 1) * queries
    spans = np.stack([ends - queries, np.full(segments, queries), np.full(segments, ctx)], axis=1).astype(np.int64)
    units, sources = shared_key_blocks(spans, tables, BLOCK)
    q = torch.randn(segments * queries, HEADS, HEAD_DIM, generator=g)
    paged_out, decode_out = torch.empty_like(q), torch.empty_like(q)
    paged_args = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in (spans, tables, units, sources)]
    row_tables = torch.from_numpy(np.repeat(tables, queries, axis=0).astype(np.int64))
    row_contexts = torch.from_numpy(np.tile(np.arange(past + 1, ctx + 1), segments).astype(np.int64))
    scale = HEAD_DIM**-0.5

    def paged() -> None:
        torch.ops.tokenloom.paged_prefill_attention(q, cache_k, cache_v, *paged_args, BLOCK, scale, paged_out)

    def as_decodes() -> None:
        cpu_kernel.paged_decode_attention(q, cache_k, cache_v, row_tables, row_contexts, BLOCK, scale, decode_out, 0)

    paged()
    as_decodes()
    torch.testing.assert_close(paged_out, decode_out, atol=1e-4, rtol=1e-4)
    paged_ms, decode_ms = float("inf"), float("inf")
    for _ in range(2):
        paged_ms = min(paged_ms, milliseconds(paged, repeats=5, rounds=7))
        decode_ms = min(decode_ms, milliseconds(as_decodes, repeats=5, rounds=7))
    flop = 4 * segments * queries * HEADS * ctx * HEAD_DIM
    return (f"| {segments} x {queries} after {past} | {paged_ms:.2f} ({flop / paged_ms / 1e6:.0f} GFLOP/s) | "
            f"{decode_ms:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["64,16,384", "8,4,2000", "8,16,2000", "4,64,2000", "2,200,2000"])
    args = parser.parse_args()
    if not (cpu_kernel.load_kernel() and cpu_kernel.has_prefill_op(torch.float32)):
        raise SystemExit("the float32 prefill operator is not built here (it needs AVX-512)")
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads: {torch.get_num_threads()}")
    print("| chunks x queries after past | paged ms (GFLOP/s) | as decodes ms |")
    print("|---|---:|---:|")
    for case in args.cases:
        print(case_row(*(int(part) for part in case.split(","))), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
