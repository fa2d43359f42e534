"""Weights packed once at load time, for bfloat16 linears on CPU.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout inside every call.
Packing once at load time is what inductor's freezing does. Where the C++ operators are built, the weights are
packed for our own kernels: without AMX ``tokenloom::bf16_linear`` (csrc/bf16_linear.cpp, AVX-512 BF16), which on
our machines is as fast as oneDNN on prefill-sized inputs and much faster on decode-sized ones, because it does not
wait for a sleeping OpenMP thread to wake; with AMX the same layout serves both that kernel, for steps of up to 7
rows, and ``tokenloom::bf16_amx_linear`` (csrc/amx_bf16_linear.cpp) for larger ones, which ran the decoder's layer
shapes 1.2-1.5x faster than oneDNN's packed linear at 64-2,048 rows (benchmarks/RESULTS.md). The LM head stays with
oneDNN under AMX (its 49,152-wide weight streamed faster there at 13-64 rows), with our layout beside it for steps
of a few rows. float32 weights on a CPU with AVX2 are packed in blocks of 16 features for ``tokenloom::f32_linear``
(csrc/f32_linear.cpp), which ran a step's linears 1.1-1.4x faster than oneDNN's packed float32 linear at 1-2,048 rows
on a Zen 3, and with AVX-512 1.2-1.8x at decode sizes (1-64 rows), 0.92-0.95x at prefill sizes, on a Xeon; on other CPUs
float32 weights go to oneDNN's layout. On other devices, or
without either, the model keeps its plain ``nn.Linear`` layers.

The compiled step (compiled.py) cannot take a oneDNN tensor as a graph input, and inductor's own prepacking
(freezing) makes its graphs uncacheable; so in a compiled graph a packed layer is the opaque operator
``tokenloom::packed_linear``, which finds its weight by a number, as vLLM's oneDNN handles do.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from tokenloom.model import cpu_kernel
from tokenloom.model.platform import cpu_can_reorder_bf16, cpu_has_amx

DECODE_ROWS_HINT = 64  # the batch size oneDNN picks its blocked layout for: a full decode step
PACK_BLOCK = 16  # output features per block of bf16_pack_weight's layout (kBlock in csrc/bf16_linear.cpp)
# With AMX, oneDNN's tiles waste most of their rows on a step of a few: up to this many rows our kernel ran a
# SmolLM2-135M step in half the time (benchmarks/RESULTS.md, "small-batch linears"), so layers keep both layouts.
SMALL_BATCH_ROWS = 12
SMALL_BATCH_COPY_LIMIT = 2 << 30  # the second layout costs the weights' bytes again: only for models this small


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the engine packs its linears' weights once (CausalLM.prepack_weights): bf16 into our layout or oneDNN's,
    where the CPU has either; float32 into oneDNN's on every CPU oneDNN runs on (its float32 reorder needs no
    AVX-512). On an AVX2 CPU packed float32 matmuls ran 1.1-2.4x faster than F.linear at decode sizes (8-64 rows),
    the LM head 1.3-3x at 1-512 rows, ~10% slower at 512-2,048 rows for some shapes; mixed-64 as a whole ~1.2x faster
    than with only the head packed (benchmarks/RESULTS.md)."""
    if device.type != "cpu":
        return False
    if dtype == torch.float32:
        return _onednn_reorder_exists()
    return dtype == torch.bfloat16 and (_onednn_available() or _own_linear_available())


def _onednn_reorder_exists() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _onednn_available() -> bool:
    """oneDNN packs bf16 weights here: its reorder exists and the CPU has what its bf16 path needs."""
    return _onednn_reorder_exists() and cpu_can_reorder_bf16()


AMX_FROM_ROWS = 8  # from this many rows our AMX kernel, below it our AVX-512 BF16 one (both read one layout)
AMX_BLOCK = 32  # the AMX kernel's inputs per tile row and features per block: K and N multiples of it


def _own_linear_available() -> bool:
    return not cpu_has_amx() and cpu_kernel.load_kernel() and cpu_kernel.has_operator("bf16_linear")


def amx_linear_available() -> bool:
    """Our AMX-BF16 kernel (csrc/amx_bf16_linear.cpp) beside the AVX-512 one: built, and the tiles granted."""
    return (
        cpu_has_amx()
        and cpu_kernel.load_kernel()
        and cpu_kernel.has_operator("bf16_amx_linear")
        and cpu_kernel.has_operator("bf16_linear")
        and bool(torch.ops.tokenloom.bf16_amx_available())
    )


def _fits_own_layout(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    out_features, in_features = weight.shape
    return bias is None and out_features % PACK_BLOCK == 0 and in_features % 2 == 0


def _fits_own_linear(weight: torch.Tensor, bias: torch.Tensor | None, amx_kernel: bool = True) -> bool:
    if not _fits_own_layout(weight, bias):
        return False
    if cpu_has_amx():  # only where our AMX kernel takes the large steps: else oneDNN's tiles do
        fits = weight.shape[0] % AMX_BLOCK == 0 and weight.shape[1] % AMX_BLOCK == 0
        return amx_kernel and fits and amx_linear_available()
    return _own_linear_available()


def _takes_f32_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a float32 weight is packed for our f32_linear: whole blocks of 16 output features, and the operator
    built (a CPU with AVX2 and FMA; with AVX-512 its wider tiles)."""
    return takes_f32_layout(weight.dtype, weight.shape[0]) and (bias is None or bias.dtype == torch.float32)


def takes_f32_layout(dtype: torch.dtype, out_features: int) -> bool:
    """Whether a weight of this dtype and output count takes f32_linear's layout (f32_pack_weight). That layout gives
    the weight's rows back, so an LM head packed in it is held once, no plain copy beside it (CausalLM.hold_head_once,
    head_rows.py)."""
    return (
        dtype == torch.float32
        and out_features % PACK_BLOCK == 0
        and cpu_kernel.load_kernel()
        and cpu_kernel.has_operator("f32_linear")
    )


def f32_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N / 16, K * 16]: each block's 16 features side by side for every input, as f32_linear reads them
    (one block's weights for an input are two vectors)."""
    out_features, in_features = weight.shape
    blocks = weight.reshape(out_features // PACK_BLOCK, PACK_BLOCK, in_features).transpose(1, 2)
    return blocks.contiguous().view(out_features // PACK_BLOCK, in_features * PACK_BLOCK)


def small_batch_copies_pay(weight_bytes: int) -> bool:
    """Whether linears also keep our layout for steps of few rows: with AMX (where oneDNN is the main path), our
    operator built, and the weights small enough to hold twice."""
    return (
        weight_bytes <= SMALL_BATCH_COPY_LIMIT
        and cpu_has_amx()
        and cpu_kernel.load_kernel()
        and cpu_kernel.has_operator("bf16_linear")
    )


_packed_weights: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("tokenloom::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, handle: int, bias: torch.Tensor | None, out_features: int, amx: bool = False
) -> torch.Tensor:
    packed = _packed_weights[handle]
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return _own_linear(x, packed, out_features, amx, bias)


def unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    """x as 2-D rows [-1, last dim] of unit stride, the form the linear kernels take (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _own_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, amx: bool, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x times a weight in one of our layouts ([N / 16, K * 16]): bf16_pack_weight's, where a gated [gate; up]
    weight is the one whose out_features are half its N and gives silu(gate) * up, and amx sends steps of
    AMX_FROM_ROWS rows and more to our AMX kernel (the same layout); or, float32, f32_pack_weight's, with its bias."""
    return _own_linear_rows(unit_stride_rows(x), packed, out_features, amx, bias).view(*x.shape[:-1], out_features)


def _own_linear_rows(
    rows: torch.Tensor, packed: torch.Tensor, out_features: int, amx: bool, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """_own_linear for 2-D rows of unit stride."""
    if packed.dtype == torch.float32:
        return torch.ops.tokenloom.f32_linear(rows, packed, bias)
    assert bias is None, "our bf16 layouts are only made for linears without a bias (_fits_own_layout)"
    out = rows.new_empty(rows.shape[0], out_features)
    gated = 2 * out_features == packed.shape[0] * PACK_BLOCK
    if amx and rows.shape[0] >= AMX_FROM_ROWS:
        torch.ops.tokenloom.bf16_amx_linear(rows, packed, out, gated)
    elif gated:
        torch.ops.tokenloom.bf16_linear_silu_and_mul(rows, packed, out)
    else:
        torch.ops.tokenloom.bf16_linear(rows, packed, out)
    return out


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: int, bias: torch.Tensor | None, out_features: int, amx: bool = False):
    return x.new_empty(*x.shape[:-1], out_features)


def gate_and_up_interleaved(weight: torch.Tensor) -> torch.Tensor:
    """[gate; up] (a weight's rows, or a bias) -> blocks of 16 alternating gate, up: the order the gated kernels
    (bf16_linear_silu_and_mul, the int8 linears) read them in."""
    gate, up = (half.reshape(-1, PACK_BLOCK, *weight.shape[1:]) for half in weight.chunk(2, dim=0))
    return torch.stack([gate, up], dim=1).reshape(weight.shape)


class PackedLinear(nn.Module):
    """A linear layer whose weight lives only in a packed layout: ours (bf16_linear, or f32_linear in float32) or
    oneDNN's blocked one.

    A gated one (``gated=True``, only on our path) holds a fused [gate; up] weight and returns silu(gate) * up,
    computed from the float32 sums before anything is rounded or written: half the output, one pass."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gated: bool = False,
        small_batch: bool = False,
        amx_kernel: bool = True,
    ) -> None:
        """small_batch: beside oneDNN's layout, keep ours for steps of up to SMALL_BATCH_ROWS rows. amx_kernel: with
        AMX, our kernel may take this layer (False for the LM head: at 13-64 rows oneDNN streamed its 49,152 x 576
        weight 10-35% faster; benchmarks/RESULTS.md)."""
        super().__init__()
        plain = weight.detach().contiguous()
        bf16 = plain.dtype == torch.bfloat16  # bf16: our bf16 layout or oneDNN's; float32: f32_linear's or oneDNN's
        self.own = bf16 and _fits_own_linear(plain, bias, amx_kernel)
        self.own_f32 = not bf16 and _takes_f32_linear(plain, bias)
        self.gated = gated and self.own and plain.shape[0] % (2 * PACK_BLOCK) == 0
        self.in_features = plain.shape[1]
        self.out_features = plain.shape[0] // 2 if self.gated else plain.shape[0]
        if self.gated:
            self.packed = torch.ops.tokenloom.bf16_pack_weight(gate_and_up_interleaved(plain))
        elif self.own:
            self.packed = torch.ops.tokenloom.bf16_pack_weight(plain)
        elif self.own_f32:
            self.packed = f32_pack_weight(plain)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(plain, DECODE_ROWS_HINT)
        self.small: torch.Tensor | None = None
        if small_batch and bf16 and not self.own and _fits_own_layout(plain, bias):
            self.small = torch.ops.tokenloom.bf16_pack_weight(plain)
        self.amx = self.own and cpu_has_amx()  # own with AMX: only where our AMX kernel fits (_fits_own_linear)
        self.handle = next(_handles)  # numbered in build order: the same in every start, so compiled graphs cache
        _packed_weights[self.handle] = self.packed
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.bias, self.out_features, self.amx)
        return self.rows_forward(unit_stride_rows(x)).view(*x.shape[:-1], self.out_features)

    @property
    def gives_weight_rows(self) -> bool:
        """Whether weight_rows can read the weight's rows back (f32_linear's layout: the values, only moved)."""
        return self.own_f32

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of the weight as given, [len, K] float32, from f32_pack_weight's layout: where nothing else
        keeps the plain weight, an LM head's exact token logits and a tied embedding's lookups read it here."""
        assert self.own_f32, "only f32_linear's layout is the weight's values in another order"
        by_input = self.packed.view(self.packed.shape[0], self.in_features, PACK_BLOCK)
        return by_input[rows // PACK_BLOCK, :, rows % PACK_BLOCK]

    def rows_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """forward for 2-D rows of unit stride (what forward passes, and the C++ operators' step: llama.OperatorLayer,
        whose rows are already so)."""
        if self.own or self.own_f32:
            return _own_linear_rows(rows, self.packed, self.out_features, self.amx, self.bias)
        if self.small is not None and rows.shape[0] <= SMALL_BATCH_ROWS:
            return _own_linear_rows(rows, self.small, self.out_features, amx=False)
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module, gated: frozenset[str] = frozenset(), small_batch: bool = False) -> int:
    """Replaces every nn.Linear under `model` by a PackedLinear; those named in `gated` (a fused [gate; up]
    projection) return silu(gate) * up where our operator can (see PackedLinear.gated); small_batch as in
    PackedLinear. Returns how many were packed."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                layer = PackedLinear(child.weight, child.bias, gated=name in gated, small_batch=small_batch)
                setattr(parent, name, layer)
                packed += 1
    return packed


def linear_weight_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
