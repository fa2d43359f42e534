"""A Q4_K_M file's decoder linears served from their blocks, against the same weights dequantized.

    .venv/bin/python benchmarks/gguf_k_quants.py [--rows 1,2,4,8,16,64,256] [--layers 28] [--formats Q4_K,Q6_K]

(`--formats BASE,MORE`: the other _M layouts, e.g. Q3_K,Q5_K for Q3_K_M, Q2_K,Q3_K for Q2_K's.)

llama.cpp's Q4_K_M keeps most linears in Q4_K and the value projection and the MLP's down projection in Q6_K in a
third of the layers and the first and last eighth (its use_more_bits). Random blocks in that layout, at Qwen3-0.6B's
shapes (hidden 1,024, 16 query heads and 8 KV heads of 128, MLP 3,072; every input count a multiple of 256, as the
K-quants need): one decode step's linears (fused qkv, o, fused gate/up, down of every layer: distinct weights, read
from memory as in a step), milliseconds, best of 4 rounds alternated, for
- `dequantized`: tokenloom::f32_linear over every dequantized weight (`--quantization none`);
- `Q4 only`: gguf_linear where every part of a linear is Q4_K, f32_linear for the rest, as the engine served such a
  file before the Q5/Q6 formats (a Q6_K value made its whole fused qkv fall back);
- `all formats`: gguf_linear for every linear (gguf_linear.in_one_form: a mixed qkv in 8-bit codes, groups of 16).
Outputs of both gguf columns are checked bit for bit against f32_linear's first. CPU with the operators; a benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import gguf
import numpy as np
import torch

from tokenloom.bench.provenance import cpu_flags
from tokenloom.model import cpu_kernel
from tokenloom.model.gguf_linear import GGUFLinear, gguf_groups, in_one_form
from tokenloom.model.prepack import f32_pack_weight

HIDDEN, Q, KV, MLP = 1024, 2048, 1024, 3072
# Each linear's parts: (output features, input features, "v" or "down" where Q4_K_M may give it more bits).
LINEARS = {"qkv": [(Q, HIDDEN, ""), (KV, HIDDEN, ""), (KV, HIDDEN, "v")], "o": [(HIDDEN, Q, "")],
           "gate_up": [(MLP, HIDDEN, ""), (MLP, HIDDEN, "")], "down": [(HIDDEN, MLP, "down")]}  # fmt: skip


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get Q6_K in Q4_K_M."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


# Where each K-quant's fp16 scale (and min scale) sit in its block of 256 inputs.
HALVES = {"Q2_K": slice(80, 84), "Q3_K": slice(108, 110), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4),
          "Q6_K": slice(208, 210)}  # fmt: skip


def random_blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, k] in a K-quant's blocks: random codes and sub-block scales under small positive fp16 scales."""
    qtype = gguf.GGMLQuantizationType[fmt]
    inputs, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n * k // inputs, size), dtype=np.uint8)
    where = HALVES[fmt]
    halves = (rng.random((len(blocks), (where.stop - where.start) // 2)) * 1e-3 + 1e-4).astype(np.float16)
    blocks[:, where] = halves.view(np.uint8)
    return blocks.reshape(n, -1)


def q4_k_m_layers(layers: int, base: str = "Q4_K", more: str = "Q6_K") -> list[tuple[GGUFLinear, bool]]:
    """Every linear of `layers` decoder layers (`base`, `more` where Q4_K_M gives more bits), and whether all its
    parts are Q4_K."""
    rng = np.random.default_rng(0)
    out = []
    for layer in range(layers):
        for parts in LINEARS.values():
            formats = [more if role and use_more_bits(layer, layers) else base for _, _, role in parts]
            groups = [
                gguf_groups(random_blocks(f, n, k, rng), f, (n, k)) for f, (n, k, _) in zip(formats, parts, strict=True)
            ]
            out.append((GGUFLinear(in_one_form(groups), None), set(formats) == {"Q4_K"}))
    return out


MODES = ("plain", "q4", "all")


def step(linears: list[tuple[GGUFLinear, bool]], packed: list[torch.Tensor], x: dict[int, torch.Tensor], mode: str
         ) -> list[torch.Tensor]:  # fmt: skip
    """A step's linears: every one by f32_linear ('plain'), by gguf_linear where all its parts are Q4_K ('q4'), or
    every one by gguf_linear ('all')."""
    out = []
    for (layer, all_q4), weight in zip(linears, packed, strict=True):
        rows = x[layer.in_features]
        blocks = mode == "all" or (mode == "q4" and all_q4)
        out.append(layer.rows_forward(rows) if blocks else torch.ops.tokenloom.f32_linear(rows, weight, None))
    return out


def best_ms(run: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--formats", default="Q4_K,Q6_K", help="the base format and the one with more bits")
    args = parser.parse_args()
    base, more = args.formats.split(",")
    if not (cpu_kernel.load_kernel() and cpu_kernel.has_operator("gguf_linear")):
        sys.exit("tokenloom::gguf_linear is not built on this CPU")
    print(f"load average before: {os.getloadavg()[0]:.2f}; CPU flags: {cpu_flags()}")
    linears = q4_k_m_layers(args.layers, base, more)
    packed = [f32_pack_weight(layer.dequantized()) for layer, _ in linears]
    print(
        f"{len(linears)} linears, {sum(all_q4 for _, all_q4 in linears)} all Q4_K; weights: "
        f"{sum(p.numel() * 4 for p in packed) / 1e6:.0f} MB dequantized, "
        f"{sum(sum(t.nbytes for t in (g.codes, g.scales, g.offsets)) for g, _ in linears) / 1e6:.0f} MB in blocks"
    )
    print("\n| rows | dequantized ms | Q4 only ms | all formats ms | dequantized / Q4 only | dequantized / all |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = {k: torch.randn(rows, k) for k in (HIDDEN, Q, MLP)}
        runs = {mode: functools.partial(step, linears, packed, x, mode) for mode in MODES}
        expected = runs["plain"]()
        for mode in MODES[1:]:
            assert all(map(torch.equal, runs[mode](), expected)), f"{mode}: not f32_linear's outputs"
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(4):
            for name in runs if round_ % 2 == 0 else list(runs)[::-1]:
                times[name].append(best_ms(runs[name]))
        b = {name: min(t) for name, t in times.items()}
        print(f"| {rows} | {b['plain']:.1f} | {b['q4']:.1f} | {b['all']:.1f} | {b['plain'] / b['q4']:.2f}x | "
              f"{b['plain'] / b['all']:.2f}x |", flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
