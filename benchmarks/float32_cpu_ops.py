"""The two float32 hot spots of a CPU without AVX-512 BF16 (where dtype auto is float32), each part alone.

    .venv/bin/python benchmarks/float32_cpu_ops.py [--attention 64x400,16x4000] [--kv-pages small,huge]
                                                  [--rows 1,8,32,64,512,2048] [--step-rows 1,2,4,8,12,16,32,64]

Decode attention: tokenloom::paged_decode_attention over a float32 paged cache of SmolLM2-135M's shape (9 query
heads, 3 KV heads of 64 dims, blocks of 16 tokens, scattered), 30 layers of it so that the cache is read from
memory as in a step, for S sequences of C tokens each: milliseconds for the 30 layers, the cache bytes read per
second, and nanoseconds per key and KV head (best of 5); `--kv-cache-dtype auto,int8` repeats each case over an
8-bit cache of the same tokens (kv_quant.py's entries: 64 codes and a scale per token and KV head), and
`--kv-pages small,huge` on 4 KiB pages and on 2 MiB ones (the engine's, huge_pages.py; the default). Linears:
F.linear against the same weight in oneDNN's packed float32 layout (what the engine uses on the CPU, prepack.py),
and where this CPU has an int8 kernel the same weight as --quantization int8 runs it (quantization.Int8Linear: the
activations' codes made per call, then our int8 kernel), at SmolLM2's shapes (fused qkv, o, fused gate/up, down,
LM head), microseconds per call (best of 5 repeats). A step's linears: the 120 decoder linears of 30 layers of
distinct weights (425 MB, so read from memory as in a decode step, where one weight repeated would sit in the cache),
oneDNN's packed layout against tokenloom::f32_linear over the same weights in its blocks (what the engine runs
every float32 step on where the operators are built), rounds alternated, best of 4: milliseconds and the weights'
GB/s; where tokenloom::gguf_linear is built (AVX-512), the same 120 weights in GGUF's Q4_1 blocks through it
(--quantization gguf; every path then multiplies the dequantized Q4_1 weights). Prints markdown tables. CPU only; a
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from int8_linear_breakdown import milliseconds

from tokenloom.model import cpu_kernel, kv_quant
from tokenloom.model.gguf_linear import GGUFLinear, gguf_groups
from tokenloom.model.huge_pages import zeros_on_huge_pages
from tokenloom.model.prepack import DECODE_ROWS_HINT, f32_pack_weight
from tokenloom.model.quantization import Int8Linear, gguf_linear_available, int8_available

LAYERS, BLOCK, KV_HEADS, HEADS, HEAD_DIM = 30, 16, 3, 9, 64
Q4_1 = gguf.GGMLQuantizationType.Q4_1
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # [out, in]: qkv, o, gate_up, down, head


def attention_row(seqs: int, ctx: int, kv_dtype: str, pages: str = "huge") -> str:
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-ctx // BLOCK)
    num_blocks = seqs * blocks_per_seq
    fmt = kv_quant.kv_format(kv_dtype)
    kind = 0 if fmt is None else fmt.kind

    def cache() -> torch.Tensor:
        values = torch.randn(num_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g)
        rows = values.flatten(1) if fmt is None else kv_quant.encode(values, fmt).flatten(1)
        if pages == "small":
            return rows
        return zeros_on_huge_pages(rows.shape[0], rows.shape[1], rows.dtype, rows.device).copy_(rows)

    caches = [(cache(), cache()) for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks, generator=g).view(seqs, blocks_per_seq).contiguous()
    lens = torch.full((seqs,), ctx, dtype=torch.long)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=g)
    out = torch.empty_like(q)

    def step() -> None:
        for k, v in caches:
            cpu_kernel.paged_decode_attention(q, k, v, tables, lens, BLOCK, HEAD_DIM**-0.5, out, kind)

    seconds = milliseconds(step, repeats=1, rounds=5) / 1e3
    cache_bytes = LAYERS * seqs * ctx * caches[0][0].shape[1] * caches[0][0].element_size() * 2
    per_key = seconds / (LAYERS * seqs * ctx * KV_HEADS) * 1e9
    rate = cache_bytes / seconds / 1e9
    return f"| {seqs} x {ctx} | {kv_dtype} | {pages} | {seconds * 1e3:.1f} | {rate:.1f} | {per_key:.1f} |"


def linear_rows(rows: list[int]) -> list[str]:
    lines = []
    g = torch.Generator().manual_seed(0)
    for out_features, in_features in SHAPES:
        weight = 0.05 * torch.randn(out_features, in_features, generator=g)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, DECODE_ROWS_HINT)
        int8 = Int8Linear(weight, None) if int8_available() else None
        for m in rows:
            if out_features * m > 49152 * 512:
                continue  # the head is only ever given the rows that sample
            x = torch.randn(m, in_features, generator=g)
            repeats = max(2, int(1e8 / (m * out_features * in_features)))
            plain = milliseconds(lambda: F.linear(x, weight), repeats, rounds=5)  # noqa: B023 (called at once)
            onednn = milliseconds(
                lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),  # noqa: B023
                repeats,
                rounds=5,
            )
            shape = f"{out_features} x {in_features}"
            line = f"| {shape} | {m} | {plain * 1e3:.0f} | {onednn * 1e3:.0f} | {plain / onednn:.2f}x |"
            if int8 is not None:
                quantized = milliseconds(lambda: int8.rows_forward(x), repeats, rounds=5)  # noqa: B023
                line += f" {quantized * 1e3:.0f} | {onednn / quantized:.2f}x |"
            lines.append(line)
    return lines


def q4_1_weights(count: int) -> list[GGUFLinear]:
    """`count` passes over SMOLLM's four decoder shapes, random weights in GGUF's Q4_1 blocks."""
    rng = np.random.default_rng(0)
    layers = []
    for _ in range(count):
        for o, i in SHAPES[:4]:
            raw = gguf.quants.quantize(0.05 * rng.standard_normal((o, i), dtype=np.float32), Q4_1)
            layers.append(GGUFLinear(gguf_groups(raw, "Q4_1", (o, i)), None))
    return layers


def step_linear_rows(rows: list[int]) -> list[str]:
    g = torch.Generator().manual_seed(0)
    q4 = q4_1_weights(LAYERS) if gguf_linear_available(torch.device("cpu")) else []
    # With gguf_linear: every path multiplies the same (dequantized Q4_1) weights.
    plain = [layer.dequantized() for layer in q4] or [
        0.05 * torch.randn(o, i, generator=g) for _ in range(LAYERS) for o, i in SHAPES[:4]
    ]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, DECODE_ROWS_HINT) for w in plain]
    ours_packed = [f32_pack_weight(w) for w in plain]
    weight_bytes = sum(w.numel() * w.element_size() for w in plain)
    lines = []
    for m in rows:
        inputs = {i: torch.randn(m, i, generator=g) for _, i in SHAPES[:4]}

        def onednn() -> None:
            for w, p in zip(plain, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")  # noqa: B023

        def ours() -> None:
            for w, p in zip(plain, ours_packed, strict=True):
                torch.ops.tokenloom.f32_linear(inputs[w.shape[1]], p, None)  # noqa: B023

        def four_bit() -> None:
            for layer in q4:
                layer.rows_forward(inputs[layer.in_features])  # noqa: B023

        runs = [("onednn", onednn), ("ours", ours)] + [("q4", four_bit)] * bool(q4)
        best = dict.fromkeys([name for name, _ in runs], float("inf"))
        for _ in range(4):
            for name, run in runs:
                best[name] = min(best[name], milliseconds(run, 1, rounds=1))
        a, b = best["onednn"], best["ours"]
        rate = weight_bytes / 1e6
        line = f"| {m} | {a:.1f} ({rate / a:.1f}) | {b:.1f} ({rate / b:.1f}) | {a / b:.2f}x |"
        if q4:
            line += f" {best['q4']:.1f} | {b / best['q4']:.2f}x |"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", default="64x400,16x4000", help="sequences x context, comma-separated ('': none)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="comma-separated: auto (float32), int8, fp8_e4m3, ...")
    parser.add_argument(
        "--kv-pages", default="huge", help="small, huge or both (small,huge): the cache on 4 KiB or 2 MiB pages"
    )
    parser.add_argument("--rows", default="1,8,32,64,512,2048", help="rows of one linear ('': none)")
    parser.add_argument(
        "--step-rows", default="1,2,4,8,12,16,32,64", help="rows of a step's 120 decoder linears ('': none)"
    )
    args = parser.parse_args()
    if not cpu_kernel.load_kernel():
        raise SystemExit("the CPU operators could not be built here")
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads: {torch.get_num_threads()}")
    print("| sequences x context | KV cache | pages | ms per 30 layers | cache GB/s | ns per key and KV head |")
    print("|---|---|---|---:|---:|---:|")
    for case in filter(None, args.attention.split(",")):
        seqs, ctx = (int(part) for part in case.split("x"))
        for kv_dtype in args.kv_cache_dtype.split(","):
            for pages in args.kv_pages.split(","):
                print(attention_row(seqs, ctx, kv_dtype, pages))
    if args.rows:
        int8 = " int8 us | packed / int8 |" if int8_available() else ""
        print(f"\n| weight [out x in] | rows | F.linear us | oneDNN packed us | F.linear / packed |{int8}")
        print("|---|---:|---:|---:|---:|" + "---:|---:|" * bool(int8))
        for line in linear_rows([int(r) for r in args.rows.split(",")]):
            print(line)
    if args.step_rows and cpu_kernel.has_operator("f32_linear"):
        q4 = " gguf_linear (Q4_1) ms | f32_linear / Q4_1 |" if gguf_linear_available(torch.device("cpu")) else ""
        print(f"\n| step rows | 120 decoder linears, oneDNN packed: ms (GB/s) | f32_linear | packed / ours |{q4}")
        print("|---:|---:|---:|---:|" + "---:|---:|" * bool(q4))
        for line in step_linear_rows([int(r) for r in args.step_rows.split(",")]):
            print(line)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
