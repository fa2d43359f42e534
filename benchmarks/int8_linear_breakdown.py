"""Where an int8 linear's time goes on a large step, against the bf16 linear (issue 24).

    .venv/bin/python benchmarks/int8_linear_breakdown.py [--rows 64,512,2048]

For SmolLM2-135M's linear shapes (K x N: 576 x 1536 gate/up, 1536 x 576 down, 576 x 576 q/o) and steps of M rows
above the small-step kernel's 12: torch's bf16 linear against `Int8Linear` (what --quantization int8 runs), and
Int8Linear's three parts timed alone: the per-token quantization with the Hadamard rotation (our C++ operator),
oneDNN's int8 GEMM (int32 sums scaled per channel, float32 out), and the per-row rescale to bf16 (our operator).
Random weights of those shapes; milliseconds per call, the best of 7 rounds of 10 calls after 3 warm-up calls.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from tokenloom.model import cpu_kernel
from tokenloom.model.quantization import Int8Linear

SHAPES = ((576, 1536), (1536, 576), (576, 576))


def milliseconds(call: Callable[[], object], repeats: int = 10, rounds: int = 7) -> float:
    """The best round's mean: this machine's speed drifts by 2-3x within seconds, and the best round is the one
    least disturbed."""
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - started) / repeats * 1e3)
    return best


def gemm(linear: Int8Linear, codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(
        codes, 1.0, 0, linear.packed, linear.weight_scale, linear.weight_zero_point, None, 1.0, 0, torch.float32,
        "none", [], "",
    )  # fmt: skip


def measured_row(linear: Int8Linear, weight_bf16: torch.Tensor, m: int) -> str:
    x = torch.randn(m, linear.in_features).bfloat16()
    bf16 = milliseconds(lambda: torch.nn.functional.linear(x, weight_bf16))
    int8 = milliseconds(lambda: linear(x))
    quantize = milliseconds(lambda: torch.ops.tokenloom.quantize_rows_int8(x, linear.signs))
    codes, row_scales = torch.ops.tokenloom.quantize_rows_int8(x, linear.signs)
    matmul = milliseconds(lambda: gemm(linear, codes))
    sums = gemm(linear, codes)
    rescale = milliseconds(lambda: torch.ops.tokenloom.scale_rows(sums, row_scales, None, x.dtype))
    shape = f"{linear.in_features} x {linear.out_features}"
    return (f"| {shape} | {m} | {bf16:.2f} | {int8:.2f} | {bf16 / int8:.2f}x | {quantize:.2f} | {matmul:.2f} "
            f"| {rescale:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,512,2048")
    args = parser.parse_args()
    assert cpu_kernel.load_kernel(), "the C++ operators did not build"
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads")
    print("| K x N | M | bf16 ms | int8 ms | int8 / bf16 speed | quantize + rotate | int8 GEMM | rescale |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for k, n in SHAPES:
        weight = torch.randn(n, k) * 0.05
        linear, weight_bf16 = Int8Linear(weight, None), weight.bfloat16()
        for m in (int(r) for r in args.rows.split(",")):
            print(measured_row(linear, weight_bf16, m), flush=True)


if __name__ == "__main__":
    main()
