"""8-bit weights (``--quantization int8 | fp8``): every linear of the decoder layers, quantized at load time.

Weights are symmetric per output channel (one float32 scale per row of the weight, its largest |w| over the largest
code), made from whatever the checkpoint held (GGUF dequantized, or safetensors) after tensor-parallel sharding, so
each rank quantizes its own slice; where the runner has calibration inputs, each code is rounded by GPTQ against
them (gptq.py) instead of to the nearest. Activations are quantized per token on the fly (per 64 inputs of a token
on CPUs with VNNI and no AMX: below), so one request's outlier token never coarsens another's rows: a request's
output does not depend on the batch it ran in. The product of the codes is summed exactly in int32, then scaled back
by the row's and the column's scales:

    y[m, n] = x_scale[m] * w_scale[n] * sum_k xq[m, k] * wq[n, k]   (+ bias[n])

(grouped: sum over the groups g of x_scale[m, g] * sum_{k in g} xq[m, k] * wq[n, k], times w_scale[n]).

int8 (the CPU): three kernels, one result. Where the CPU has AMX-INT8, steps of a few rows run our VNNI kernel
(csrc/int8_linear.cpp: at decode sizes oneDNN's int8 matmul was slower than the whole bf16 linear) and larger ones
our AMX kernel (csrc/amx_int8_linear.cpp), which applies both scales and the bias as the sums leave its tiles;
shapes that fit neither run oneDNN's int8 matmul through torch (``onednn::qlinear_pointwise`` on a weight packed
once at load time), with the activation scale left at 1 inside it and applied per row after
(``tokenloom::scale_rows``), since oneDNN takes one activation scale per tensor. All three scale the sums in one
order (csrc/int8_epilogue.h), so their outputs are the same bits. The fused [gate; up] projection returns
silu(gate) * up from that same epilogue, before anything is rounded, so the MLP's activation is not a pass of its
own. Without AMX our kernel runs every step: with VNNI, the VNNI kernel (oneDNN ran its reference loops on the AMD
CPU measured); with AVX2 alone, our AVX2 kernel (csrc/int8_linear_avx2.cpp: oneDNN's int8 matmul saturates 16-bit
pair sums there), the SiLU as its own operator.

Activation codes: int8 where the kernel multiplies bytes (VNNI's vpdpbusd, AMX), 16-bit where it multiplies words
(``tokenloom::quantize_rows_int16``, as large as exact int32 sums allow): always on the AVX2 kernel, where it costs
nothing, and on every CPU with ``--quantization int8_w8a16`` (VNNI's vpdpwssd: half the byte rate, and no AMX).
Where our VNNI kernel runs every step (no AMX), a token's int8 codes carry one scale per 64 inputs, the rotation's
block, instead of one a row (``activation_group``): the kernel scales each group's exact sum as it goes, which costs
it ~1.1-1.2x on large steps; AMX's tiles and oneDNN take one scale a row, so CPUs with AMX keep those.
On SmolLM2-135M against float32 (RESULTS.md): int8 weights agreed on 96.0-97.3% of top-1 tokens with 8-bit
activations scaled per row (Zen 5 and Zen 4, bf16 engine), 97.6% with a scale per 64 inputs (Zen 4, bf16), 98.0%
(bf16 engine) and 98.6% (float32) with 16-bit ones.
fp8 (CUDA): e4m3 codes and ``torch._scaled_mm`` with row-wise scales (Hopper and later).

Before either is quantized, each linear's inputs are rotated (QuaRot, Ashkboos et al. 2024): every 64 inputs times
fixed random signs, then through the orthonormal 64-point Walsh-Hadamard transform R, and the weight's rows through
the same R at load time, so y = (x R)(W R)^T = x W^T in exact arithmetic. A rotation spreads an outlier channel over
its 64 neighbours, so a token's largest |x| no longer sets a scale most of its channels cannot use: on SmolLM2-135M
teacher-forced against float32 (benchmarks/RESULTS.md), per-token W8A8 agreed on 88.9% of top-1 tokens plain,
94.9% with SmoothQuant's per-channel smoothing (alpha 0.5), 98.2% rotated. On the CPU the rotation is fused into
the activations' quantization (a fast transform in registers, ``tokenloom::quantize_rows_int8``).

The embeddings stay in the model's dtype (a lookup, not a matmul), and so does the LM head's weight, which the
logits' refinement reads; but with int8 weights the head's full logits come from an int8 copy of it (``int8_head``:
at one row it streams half the bytes, at 64 rows it multiplies bytes), and compute_logits (llama.py) recomputes each
row's best candidates in float32 from the plain weight, as it does for bf16 logits. So the tokens the head decides
(greedy's argmax, the top logprobs) are exact whatever its codes are; only the tail of the distribution is int8's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenloom.model import cpu_kernel
from tokenloom.model.gptq import calibration_ids, gptq_codes
from tokenloom.model.prepack import PACK_BLOCK, gate_and_up_interleaved, unit_stride_rows

QUANTIZATIONS = ("int8", "int8_w8a16", "fp8", "gguf")
INT8_METHODS = ("int8", "int8_w8a16")  # int8 weights; int8_w8a16 with 16-bit activation codes on every CPU
ROWS_HINT = 64  # the batch size oneDNN packs the weight for: a full decode step
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def calibration_for(quantization: str | None, tokenizer: Any, vocab_size: int) -> list[list[int]] | None:
    """What a runner calibrates with: gptq.py's sequences for int8 weights (GPTQ rounds their codes), else None."""
    return calibration_ids(tokenizer, vocab_size) if quantization in INT8_METHODS else None


def int8_available() -> bool:
    """Our int8 kernel was built for this CPU (VNNI or AVX2), and torch has oneDNN's int8 matmul beside it."""
    onednn = hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")
    return onednn and int8_kernel_isa() is not None


def int8_kernel_isa() -> str | None:
    """Which of our int8 kernels this CPU's build holds: "avx512_vnni" (int8_linear.cpp), "avx2"
    (int8_linear_avx2.cpp), or None."""
    if not (cpu_kernel.load_kernel() and cpu_kernel.has_operator("int8_linear_isa")):
        return None
    return str(torch.ops.tokenloom.int8_linear_isa())


def fits_own_kernels(out_features: int, in_features: int) -> bool:
    """Whether our int8 kernels (VNNI, AVX2, AMX's layout) take an [N, K] weight: 16-feature blocks of 4-byte
    groups."""
    return out_features % 16 == 0 and in_features % 4 == 0


@dataclass(frozen=True)
class Int8Kernels:
    """The kernels that hold and run an int8 [N, K] weight on this CPU: Int8Linear builds these forms, and the planner
    (advisor/weights.py) counts their bytes from the same choice."""

    own: bool  # packed for our kernels (VNNI or AVX2; AMX reads the same layout), with code sums
    amx: bool  # our AMX kernel takes the larger steps
    every_step: bool  # our VNNI or AVX2 kernel runs every step (no AMX)
    activation_group: int  # inputs per activation scale and per code sum where our VNNI kernel runs every step; else 0

    @property
    def onednn(self) -> bool:
        """oneDNN's packing, only where a step can reach it: no kernel of ours for this shape, or AMX's misfits."""
        return not (self.amx or self.every_step)


def int8_kernels(out_features: int, in_features: int, wide: bool) -> Int8Kernels:
    """Which kernels take an [N, K] int8 weight here; wide: 16-bit activation codes (int8_w8a16, and the AVX2
    kernel)."""
    own = fits_own_kernels(out_features, in_features) and int8_kernel_isa() is not None
    amx_cpu = not wide and amx_kernel_available()
    # Without AMX our kernel runs every step: oneDNN's int8 matmul saturates without VNNI (int8_linear_avx2.cpp) and,
    # on the AMD CPU with VNNI measured (Zen 5), ran its reference loops (2.5 s for one 300-row linear).
    every_step = own and not amx_cpu
    # One activation scale per 64 inputs (a rotation block) where our VNNI kernel runs every step: no other kernel
    # reads such codes (see the module's docstring for what it buys).
    rotated = in_features % ROTATION_BLOCK == 0  # rotation_signs
    return Int8Kernels(
        own=own,
        amx=amx_cpu and own and out_features % 32 == 0 and in_features % 64 == 0,
        every_step=every_step,
        activation_group=ROTATION_BLOCK if every_step and not wide and rotated else 0,
    )


def int8_head(weight: torch.Tensor, method: str) -> Int8Linear | None:
    """An int8 copy of the LM head's weight for the approximate logits of an int8 model (module docstring), or None
    where our kernels cannot run it (no kernel for this CPU, or a shape they do not fit): oneDNN's int8 matmul, its
    fallback, ran its reference loops on the AMD CPUs measured."""
    if method not in INT8_METHODS or weight.device.type != "cpu" or int8_kernel_isa() is None:
        return None
    if not fits_own_kernels(*weight.shape):
        return None
    # 8-bit activation codes where the CPU multiplies bytes, for both methods: the refinement makes the best
    # candidates exact, and 16-bit codes multiply at half the rate (slower than the bf16 head from ~64 rows).
    return Int8Linear(weight.detach(), None, activation_bits=8)


def gguf_linear_available(device: torch.device) -> bool:
    """Whether --quantization gguf can run here: tokenloom::gguf_linear, built for CPUs with AVX2 and FMA."""
    return device.type == "cpu" and cpu_kernel.load_kernel() and cpu_kernel.has_operator("gguf_linear")


def check_quantization(name: str | None, device: torch.device) -> None:
    """ValueError at start for a method this device cannot run: never a silent fallback to the unquantized model."""
    if name is None:
        return
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; the methods: {', '.join(QUANTIZATIONS)}")
    if name in INT8_METHODS and (device.type != "cpu" or not int8_available()):
        raise ValueError(
            f"--quantization {name} runs our int8 kernels (AVX-512 VNNI or AVX2) and oneDNN's on a CPU; "
            f"here the device is {device.type}" + ("" if device.type != "cpu" else " and they are not available")
        )
    if name == "gguf" and not gguf_linear_available(device):
        raise ValueError(
            "--quantization gguf runs tokenloom::gguf_linear, built for CPUs with AVX2 and FMA; here "
            + (f"the device is {device.type}" if device.type != "cpu" else "the operator is not available")
        )
    if name == "fp8" and (device.type != "cuda" or not hasattr(torch, "_scaled_mm")):
        raise ValueError(
            f"--quantization fp8 runs torch._scaled_mm on a CUDA GPU (Hopper or later); here: {device.type}"
        )


ROTATION_BLOCK = 64  # inputs per Walsh-Hadamard block (kRotationBlock in csrc/fused.cpp)
ROTATION_SEED = 0  # the signs are the same in every load and on every tensor-parallel rank


def rotation_signs(in_features: int) -> torch.Tensor | None:
    """The fixed +-1 signs of a linear with this many inputs, or None where they do not split into 64-blocks."""
    if in_features % ROTATION_BLOCK:
        return None
    g = torch.Generator().manual_seed(ROTATION_SEED)
    return torch.randint(0, 2, (in_features,), generator=g).float() * 2 - 1


def hadamard_matrix(n: int) -> torch.Tensor:
    """Sylvester's n x n Walsh-Hadamard matrix over sqrt(n): orthonormal and symmetric."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == n, "n must be a power of two"
    return h / n**0.5


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x R in x's dtype (float32 math, float64 for float64): each 64 inputs times their signs, then
    times H / 8."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    blocks = x.to(work).unflatten(-1, (-1, ROTATION_BLOCK)) * signs.to(x.device, work).view(-1, ROTATION_BLOCK)
    return (blocks @ hadamard_matrix(ROTATION_BLOCK).to(x.device, work)).flatten(-2).to(x.dtype)


def rotated_hessian(hessian: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """X^T X -> (X R)^T (X R) = R^T X^T X R: the Hessian of the rotated inputs (float64)."""
    return rotate(rotate(hessian.double(), signs).T.contiguous(), signs)


def per_channel(weight: torch.Tensor, max_code: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> codes (as float32, rounded for int8) and scales [N], each row's largest |w| over max_code."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / max_code
    return w / scale[:, None], scale


def int16_activation_max_code(in_features: int) -> int:
    """The largest 16-bit activation code for which a sum of in_features products with int8 weights (|w| <= 127)
    cannot overflow int32, one code of headroom for the rounding of x / scale."""
    return min(32767, (2**31 - 1) // (127 * in_features) - 1)


SMALL_STEP_ROWS = 12  # up to this many rows, our VNNI kernel (csrc/int8_linear.cpp) instead of oneDNN's matmul
AMX_FROM_ROWS = 8  # from this many rows, the AMX kernel where the CPU has one (it streams the weight in tiles)


def small_step_kernel_available() -> bool:
    """The VNNI kernel, for steps of a few rows (the AVX2 kernel runs them all)."""
    return int8_kernel_isa() == "avx512_vnni"


def amx_kernel_available() -> bool:
    return (
        small_step_kernel_available()
        and cpu_kernel.has_operator("int8_amx_linear")
        and bool(torch.ops.tokenloom.int8_amx_available())
    )


def weight_codes(
    weight: torch.Tensor, hessian: torch.Tensor | None, codes: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A (rotated) weight [N, K] -> its int8 codes, contiguous, and per-channel scales [N]: rounded by GPTQ against
    the hessian, or to the nearest, unless given (an earlier load's, gptq_cache.py)."""
    scaled, scale = per_channel(weight, 127.0)
    if codes is None:
        rounded = scaled.round().clamp(-127, 127) if hessian is None else gptq_codes(weight, hessian, scale)
        codes = rounded.to(torch.int8)
    assert codes.dtype == torch.int8 and codes.shape == weight.shape
    return codes.contiguous(), scale  # oneDNN's prepack reads GPTQ's transposed codes as if contiguous


def group_code_sums(codes: torch.Tensor, group: int) -> torch.Tensor:
    """int8 codes [N, K] -> [N / 16, K / group, 16] int32: each feature's code sum over each group of inputs, a
    16-feature block's groups side by side (int8_linear's grouped steps take back the activations' unsigned shift
    group by group, reading a block's sums as they read its codes)."""
    n, k = codes.shape
    sums = codes.view(n // PACK_BLOCK, PACK_BLOCK, k // group, group).sum(-1, dtype=torch.int32)
    return sums.transpose(1, 2).contiguous()


def unpacked_codes(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int8_pack_weight's [N / 16, K * 16] back to the codes [N, K] (csrc/int8_packing.h has the layout)."""
    n, k = packed.shape[0] * 16, in_features
    return packed.view(n // 16, k // 4, 16, 4).permute(0, 2, 1, 3).reshape(n, k).contiguous()


class Int8Linear(nn.Module):
    """Three kernels, one result (the module's docstring says which runs where): our VNNI or AVX2 kernel, our AMX
    kernel for larger steps where the CPU has AMX-INT8, oneDNN's int8 matmul for shapes neither fits. All sum the same
    codes exactly and scale in one order."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gated: bool = False,
        hessian: torch.Tensor | None = None,
        activation_bits: int = 8,
        codes: torch.Tensor | None = None,
    ) -> None:
        """gated: the weight is a fused [gate; up] projection and the layer returns silu(gate) * up, computed from the
        float32 outputs as they leave the kernel (on every kernel alike: csrc/int8_epilogue.h). hessian: X^T X of
        calibration inputs ([K, K], before the rotation): the codes are rounded by GPTQ against it (gptq.py), else
        to the nearest. activation_bits 16: 16-bit activation codes on every CPU (``int8_w8a16``); 8 takes them
        where the CPU multiplies bytes (VNNI, AMX) and 16-bit ones where it multiplies words anyway (AVX2). codes:
        this weight's int8 codes as rounded_codes() gave them on an earlier load (gptq_cache.py), not rounded again."""
        super().__init__()
        assert activation_bits in (8, 16)
        self.in_features = weight.shape[1]
        isa = int8_kernel_isa()
        wide = activation_bits == 16 or isa == "avx2"
        if wide and not fits_own_kernels(*weight.shape):
            raise ValueError(
                f"--quantization int8 with 16-bit activations (on this CPU: {isa}) needs linears of a multiple of 16"
                f" outputs and of 4 inputs; this one is {weight.shape[0]} x {self.in_features}"
            )
        self.gated = gated and weight.shape[0] % (2 * PACK_BLOCK) == 0 and isa == "avx512_vnni"  # VNNI's epilogue
        self.out_features = weight.shape[0] // 2 if self.gated else weight.shape[0]
        if self.gated:
            weight, bias = gate_and_up_interleaved(weight), None if bias is None else gate_and_up_interleaved(bias)
        self.signs = rotation_signs(self.in_features)
        if self.signs is not None:
            weight = rotate(weight.detach().float(), self.signs)
            hessian = None if hessian is None else rotated_hessian(hessian, self.signs)
        codes, self.weight_scale = weight_codes(weight, hessian, codes)
        kernels = int8_kernels(codes.shape[0], codes.shape[1], wide)
        # The codes packed for our kernels (VNNI and AMX read one layout, with the VNNI kernel's code sums: per
        # feature, or per feature and group of inputs with an activation group), which scale the sums exactly as
        # oneDNN.
        self.own: tuple[torch.Tensor, torch.Tensor] | None = None
        if kernels.own:
            self.own = torch.ops.tokenloom.int8_pack_weight(codes)
        self.amx = kernels.amx
        self.small_rows = sys.maxsize if kernels.every_step else AMX_FROM_ROWS - 1 if self.amx else SMALL_STEP_ROWS
        self.activation_group = kernels.activation_group
        if self.activation_group and self.own is not None:  # the kernel then reads the code sums group by group
            self.own = (self.own[0], group_code_sums(codes, ROTATION_BLOCK))
        # 16-bit codes as large as int32 sums allow: the kernels multiply 16-bit words (vpmaddwd, vpdpwssd).
        self.activation_max_code = int16_activation_max_code(self.in_features) if wide else 127
        self.shifted_codes = isa == "avx512_vnni" and not wide  # our VNNI kernel's int8 codes + 128: vpdpbusd's bytes
        onednn = kernels.onednn
        self.packed = torch.ops.onednn.qlinear_prepack(codes, [ROWS_HINT, self.in_features]) if onednn else None
        self.weight_zero_point = torch.zeros(codes.shape[0], dtype=torch.long, device=weight.device) if onednn else None
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def rounded_codes(self) -> torch.Tensor | None:
        """The weight's int8 codes [N, K] (rotated, gate and up interleaved where gated), read back from our kernels'
        packing; None where only oneDNN's opaque packing holds them."""
        return None if self.own is None else unpacked_codes(self.own[0], self.in_features)

    def activation_codes(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's codes (rotated where the weight is) and its scales: int8, or int16 up to activation_max_code;
        [M, 1], or [M, K / 64] with an activation group. (Where our VNNI kernel runs, int8_linear_rows makes them
        itself, + 128.)"""
        if self.activation_max_code == 127:
            return torch.ops.tokenloom.quantize_rows_int8(rows, self.signs, self.activation_group)
        return torch.ops.tokenloom.quantize_rows_int16(rows, self.signs, self.activation_max_code)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows_forward(unit_stride_rows(x)).view(*x.shape[:-1], self.out_features)

    def rows_forward(self, rows: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """forward for 2-D rows of unit stride (the C++ operators' step calls this: llama.OperatorLayer); the output
        in out_dtype (float32 for the LM head's logits), by default the rows' dtype."""
        own = self.own if self.own is not None and rows.shape[0] <= self.small_rows else None
        dtype = out_dtype or rows.dtype
        if own is not None and self.shifted_codes:  # our VNNI kernel: the rows quantized in the same call
            return torch.ops.tokenloom.int8_linear_rows(
                rows, self.signs, self.activation_group, *own, self.weight_scale, self.bias, dtype, self.gated
            )
        codes, row_scales = self.activation_codes(rows)
        if own is not None:
            packed, code_sums = own
            return torch.ops.tokenloom.int8_linear(
                codes, row_scales, packed, code_sums, self.weight_scale, self.bias, dtype, self.gated
            )
        if self.amx:
            assert self.own is not None
            return torch.ops.tokenloom.int8_amx_linear(
                codes, row_scales, self.own[0], self.weight_scale, self.bias, dtype, self.gated
            )
        sums = torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, 0, self.packed, self.weight_scale, self.weight_zero_point, None, 1.0, 0, torch.float32,
            "none", [], "",
        )  # fmt: skip
        return torch.ops.tokenloom.scale_rows(sums, row_scales, self.bias, dtype, self.gated)


class Fp8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.signs = rotation_signs(self.in_features)
        if self.signs is not None:
            self.signs = self.signs.to(weight.device)
            weight = rotate(weight.detach().float(), self.signs)
        scaled, scale = per_channel(weight, FP8_MAX)
        self.codes = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [N, K]; _scaled_mm takes its transpose
        self.weight_scale = scale[None, :].contiguous()
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.signs is not None:
            rows = rotate(rows, self.signs)
        row_scales = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        codes = (rows / row_scales).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(
            codes, self.codes.t(), scale_a=row_scales, scale_b=self.weight_scale, bias=self.bias, out_dtype=x.dtype
        )
        return out.view(*x.shape[:-1], self.out_features)


def quantize_linears(
    model: nn.Module,
    method: str,
    gated: frozenset[str] = frozenset(),
    hessians: dict[str, torch.Tensor] | None = None,
    codes: dict[str, torch.Tensor] | None = None,
) -> int:
    """Replaces every nn.Linear under `model` (the decoder layers) by its 8-bit form; returns how many. Those named in
    `gated` (a fused [gate; up] projection) return silu(gate) * up where the int8 kernels can (Int8Linear). hessians:
    by a linear's name under `model`, its calibration inputs' X^T X, for GPTQ's rounding of its int8 codes; codes:
    by name, the int8 codes an earlier load rounded (gptq_cache.py)."""
    count = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if method in INT8_METHODS:
                    full = f"{prefix}.{name}" if prefix else name
                    hessian = None if hessians is None else hessians[full]
                    layer: nn.Module = Int8Linear(
                        child.weight, child.bias, name in gated, hessian, 16 if method == "int8_w8a16" else 8,
                        None if codes is None else codes[full],
                    )  # fmt: skip
                else:
                    layer = Fp8Linear(child.weight, child.bias)
                setattr(parent, name, layer)
                count += 1
    return count
