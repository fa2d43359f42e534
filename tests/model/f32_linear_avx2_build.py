"""Run by test_gguf_linear.py in a process of its own: builds csrc/f32_linear.cpp alone for AVX2 without AVX-512
(-march=haswell) into the directory given, and checks that gguf_linear there is that build's f32_linear over the
dequantized weight, bit for bit. A process of its own, as its operators have the names of the engine's."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from gguf_blocks import raw_blocks
from torch.utils.cpp_extension import load

from tokenloom.model.cpu_kernel import SOURCES
from tokenloom.model.gguf_linear import GGUFLinear, gguf_groups
from tokenloom.model.prepack import f32_pack_weight


def main(build_dir: str) -> int:
    csrc = SOURCES[0].parent
    load(name="f32_linear_avx2", sources=[str(csrc / "f32_linear.cpp")], extra_include_paths=[str(csrc)],
         extra_cflags=["-O2", "-march=haswell", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"],
         build_directory=build_dir, is_python_module=False)  # fmt: skip
    failures = []
    for fmt in ("Q4_1", "Q8_0", "Q6_K"):  # (bits, group): (4, 32), (8, 32), (8, 16)
        n, k = 48, 768
        layer = GGUFLinear(gguf_groups(raw_blocks(fmt, n, k), fmt, (n, k)), None)
        weight = layer.dequantized()
        for rows in (1, 2, 3, 4, 13):
            x, bias = torch.randn(rows, k), torch.randn(n) if rows % 2 else None
            ours = torch.ops.tokenloom.gguf_linear(x, layer.codes, layer.scales, layer.offsets, bias)
            if not torch.equal(ours, torch.ops.tokenloom.f32_linear(x, f32_pack_weight(weight), bias)):
                failures.append(f"{fmt}, {rows} rows: not f32_linear's outputs")
            if not torch.allclose(ours, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4):
                failures.append(f"{fmt}, {rows} rows: not the product")
    print("\n".join(failures) or "ok")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
