"""Where an int8 linear's time goes on a large step, against the bf16 linear (issue 24).

    .venv/bin/python benchmarks/int8_linear_breakdown.py [--rows 64,512,2048]

For SmolLM2-135M's linear shapes (K x N: 576 x 1536 gate/up, 1536 x 576 down, 576 x 576 q/o) and steps of M rows
above the small-step kernel's: torch's bf16 linear and the engine's packed one (prepack.PackedLinear) against
`Int8Linear` (what --quantization int8 runs), and its
parts timed alone: the per-token quantization with the Hadamard rotation (our C++ operator); our AMX kernel (int32
sums in tiles, both scales applied as they leave, bf16 out), where the CPU has AMX-INT8; and the path without it,
oneDNN's int8 GEMM (float32 out) followed by the per-row rescale to bf16 (our operator), where the layer keeps
oneDNN's packing (not where our VNNI kernel runs every step: a CPU with VNNI and no AMX). Random weights of those
shapes; milliseconds per call, the best of 7 rounds of 10 calls after 3 warm-up calls.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from tokenloom.model import cpu_kernel, prepack, quantization
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


def onednn_layer(weight: torch.Tensor) -> Int8Linear:
    """The same layer as the engine would build on a CPU without AMX: oneDNN's packing for every large step."""
    has_amx = quantization.amx_kernel_available
    quantization.amx_kernel_available = lambda: False  # type: ignore[assignment]
    try:
        return Int8Linear(weight, None)
    finally:
        quantization.amx_kernel_available = has_amx  # type: ignore[assignment]


def onednn_gemm(linear: Int8Linear, codes: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_pointwise(
        codes, 1.0, 0, linear.packed, linear.weight_scale, linear.weight_zero_point, None, 1.0, 0, torch.float32,
        "none", [], "",
    )  # fmt: skip


def measured_row(weight: torch.Tensor, m: int) -> str:
    linear, plain, weight_bf16 = Int8Linear(weight, None), onednn_layer(weight), weight.bfloat16()
    x = torch.randn(m, linear.in_features).bfloat16()
    bf16 = milliseconds(lambda: torch.nn.functional.linear(x, weight_bf16))
    packed_bf16 = "-"
    if prepack.can_prepack(x.device, x.dtype):  # the engine's bf16 linear: our kernel's packing, or oneDNN's
        packed_linear = prepack.PackedLinear(weight_bf16, None)
        packed_bf16 = f"{milliseconds(lambda: packed_linear(x)):.2f}"
    int8 = milliseconds(lambda: linear(x))
    quantize = milliseconds(lambda: linear.activation_codes(x))  # as the layer makes them (grouped without AMX)
    codes, row_scales = torch.ops.tokenloom.quantize_rows_int8(x, linear.signs)  # one scale a row: AMX's, oneDNN's
    amx = "-"
    if linear.amx:
        assert linear.own is not None
        packed, scale = linear.own[0], linear.weight_scale
        amx = f"{milliseconds(lambda: torch.ops.tokenloom.int8_amx_linear(codes, row_scales, packed, scale, None, x.dtype)):.2f}"  # noqa: E501
    matmul = rescale = "-"
    if plain.packed is not None:  # without AMX, where our VNNI kernel runs every step, no oneDNN packing is made
        matmul = f"{milliseconds(lambda: onednn_gemm(plain, codes)):.2f}"
        sums = onednn_gemm(plain, codes)
        rescale = f"{milliseconds(lambda: torch.ops.tokenloom.scale_rows(sums, row_scales, None, x.dtype)):.2f}"
    shape = f"{linear.in_features} x {linear.out_features}"
    return (f"| {shape} | {m} | {bf16:.2f} | {packed_bf16} | {int8:.2f} | {bf16 / int8:.2f}x | {quantize:.2f} | {amx} "
            f"| {matmul} | {rescale} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,512,2048")
    args = parser.parse_args()
    assert cpu_kernel.load_kernel(), "the C++ operators did not build"
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.2f}, {torch.get_num_threads()} threads")
    print("| K x N | M | bf16 ms (F.linear) | bf16 ms (packed, the engine's) | int8 ms | int8 / F.linear speed "
          "| quantize + rotate | AMX kernel | oneDNN int8 GEMM | rescale |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, n in SHAPES:
        weight = torch.randn(n, k) * 0.05
        for m in (int(r) for r in args.rows.split(",")):
            print(measured_row(weight, m), flush=True)


if __name__ == "__main__":
    main()
