"""A GGUF checkpoint's quantized linears served as they are stored (``--quantization gguf``, and by default in
float32: engine/core_setup.py), as vLLM and llama.cpp serve a GGUF.

Without it a GGUF is dequantized at load (gguf_convert.py) and every linear streams float32 (or bf16) weights: at
batch 1 a decode step reads 5.3x the bytes of a 4-bit linear here (24 per 32 weights: 16 of codes, a float32 scale
and offset; the checkpoint's Q4_1 holds 20, its scale and offset in fp16). With it every decoder linear whose GGUF
tensors are all in FORMATS (Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, IQ4_NL, IQ4_XS), and the LM
head where it is one of those (the embedding's, when tied), keep their codes with a float32 scale and offset per 32
inputs (16 for Q2_K, Q3_K and Q6_K): every one of these formats is code * scale + offset per group, codes 0-15 of
the 4-bit formats kept 4 bits wide, the 2-, 3-, 5- and 6-bit ones and Q8_0's in a byte, and IQ4's as the value each
picks from its 16 (in a byte, no offset). ``tokenloom::gguf_linear`` (csrc/f32_linear.cpp) widens each weight to
float32 by one FMA as it multiplies, rounding as gguf's dequantization does: the outputs are the dequantized model's,
bit for bit, where that model runs f32_linear (float32, where the operators are built). The embedding's lookups
read its rows from the same blocks (GGUFLinear.weight_rows: a tied head's, or its own; head_rows.py), so no float32
table is kept. Other tensors (other formats) are dequantized as before. CPUs with AVX2 and FMA (where f32_linear is
built), one rank; other activations' dtypes are run in float32 and returned in theirs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from tokenloom.model.prepack import unit_stride_rows

if TYPE_CHECKING:
    from tokenloom.model.llama import CausalLM

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per scale and offset (gguf_linear's Group in csrc/f32_linear.cpp; K_GROUP below)
K_GROUP = 16  # Q2_K's, Q3_K's and Q6_K's: 8-bit codes only
BLOCK = 16  # output features per packed block
FORMATS = ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS")
BY_SIXTEEN = ("Q2_K", "Q3_K", "Q6_K")  # a scale (and offset) per 16 inputs
IN_SUPER_BLOCKS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")  # blocks of SUPER_BLOCK inputs, not of GROUP
# IQ4_NL's and IQ4_XS's 16 values, which a 4-bit code picks (gguf's IQ4_NL.kvalues)
NON_LINEAR_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # codes kept 4 bits wide; the other FORMATS' in a byte
SUPER_BLOCK = 256  # inputs per block of the K-quants and IQ4_XS
FLOAT32 = 4  # bytes: scales, offsets and every tensor held dequantized
# A linear's codes [N, K] (uint8 0-15, or int8), scales and offsets [N, K / group] float32 (group_size).
Groups = tuple[np.ndarray, np.ndarray, np.ndarray]
Form = tuple[int, int]  # (bits a code, inputs a group) a weight is served in


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] values with bit i of it as bit 4 of element i."""
    bits = qh.copy().view("<u4") >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are elements 0-15, the high ones 16-31 (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def gguf_groups(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> Groups:
    """A GGUF tensor's raw blocks ([N, bytes per row] uint8) in one of FORMATS -> its codes, scales and offsets, so
    that codes * scale + offset (one rounding) is gguf.quants.dequantize's value: gguf computes scale * code (+ or -
    offset), whose product is exact in float32 for every format here (at most 24 significant bits: an fp16 scale's
    11, a K-quant's sub-block scale's 6-7, a code's 4-6), so the one FMA rounds where gguf's sum or product does."""
    n, k = shape
    if fmt in ("Q4_0", "Q5_0"):  # d, (Q5: 32 fifth bits), 16 bytes of nibbles; value = d * (code - 8 or 16)
        blocks = raw.reshape(n, k // GROUP, -1)
        scale = _half(blocks[..., 0:2])
        if fmt == "Q4_0":
            return _nibbles(blocks[..., 2:]).reshape(n, k), scale, -8 * scale
        codes = (_nibbles(blocks[..., 6:]) | _fifth_bits(blocks[..., 2:6])).astype(np.int8) - 16
        return codes.reshape(n, k), scale, np.zeros_like(scale)
    if fmt in ("Q4_1", "Q5_1"):  # d, m, (Q5: 32 fifth bits), 16 bytes of nibbles; value = d * code + m
        blocks = raw.reshape(n, k // GROUP, -1)
        scale, offset = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
        if fmt == "Q4_1":
            return _nibbles(blocks[..., 4:]).reshape(n, k), scale, offset
        codes = (_nibbles(blocks[..., 8:]) | _fifth_bits(blocks[..., 4:8])).astype(np.int8)
        return codes.reshape(n, k), scale, offset
    if fmt in ("Q2_K", "Q3_K"):
        return _two_and_three_bit_groups(raw, fmt, n, k)
    if fmt in ("IQ4_NL", "IQ4_XS"):
        return _non_linear_groups(raw, fmt, n, k)
    if fmt in ("Q4_K", "Q5_K"):  # per 256: d, dmin, 12 bytes of 6-bit scales and mins, (Q5: 32 bytes of fifth bits)
        import gguf  # and 128 bytes of nibbles; value = d * scale * code - dmin * min, scale and min per 32

        supers = raw.reshape(n * k // SUPER_BLOCK, -1)
        d, dmin = _half(supers[:, 0:2]), _half(supers[:, 2:4])
        sc, mins = gguf.quants.Q4_K.get_scale_min(supers[:, 4:16])
        nibbles = supers[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (nibbles & 0x0F).reshape(-1, 8, 32)
        if fmt == "Q5_K":  # bit g of byte i of the 32: element i of group g
            high = supers[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = (codes | ((high & 1) << 4)).astype(np.int8)
        scale = (d[:, None] * sc.astype(np.float32)).reshape(n, k // GROUP)
        return codes.reshape(n, k), scale, -(dmin[:, None] * mins.astype(np.float32)).reshape(n, k // GROUP)
    if fmt == "Q6_K":  # per 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16), d;
        supers = raw.reshape(n * k // SUPER_BLOCK, 210)  # value = d * scale * (code - 32)
        low = supers[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        high = supers[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        codes = ((low & 0x0F).reshape(-1, 8, 32) | ((high & 3).reshape(-1, 8, 32) << 4)).astype(np.int8) - 32
        scale = _half(supers[:, 208:210])[:, None] * supers[:, 192:208].view(np.int8).astype(np.float32)
        return codes.reshape(n, k), scale.reshape(n, k // K_GROUP), np.zeros((n, k // K_GROUP), np.float32)
    if fmt == "Q8_0":  # 34 bytes: d, 32 int8 codes; value = d * code
        blocks = raw.reshape(n, k // GROUP, 34)
        scale = _half(blocks[..., 0:2])
        return blocks[..., 2:].copy().view(np.int8).reshape(n, k), scale, np.zeros_like(scale)
    raise ValueError(f"{fmt} is not a format gguf_linear reads ({', '.join(FORMATS)})")


def _two_and_three_bit_groups(raw: np.ndarray, fmt: str, n: int, k: int) -> Groups:
    """Q2_K and Q3_K, kept in a byte a code with a scale (and offset) per 16 inputs, as Q6_K's. Per 256 inputs, Q2_K:
    16 bytes of a 4-bit scale and a 4-bit min per 16, 64 bytes of 2-bit codes, d, dmin; value = d * scale * code -
    dmin * min. Q3_K: 32 bytes of high bits, 64 of 2-bit low codes, 12 of 6-bit scales, d; value = d * (scale - 32) *
    (code - 4, the high bit clear), as gguf dequantizes them."""
    pairs = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    if fmt == "Q2_K":
        supers = raw.reshape(n * k // SUPER_BLOCK, 84)
        sc, d, dmin = supers[:, :16], _half(supers[:, 80:82]), _half(supers[:, 82:84])
        codes = ((supers[:, 16:80].reshape(-1, 2, 1, 32) >> pairs) & 3).astype(np.int8)
        scale = d[:, None] * (sc & 0x0F).astype(np.float32)
        offset = -(dmin[:, None] * (sc >> 4).astype(np.float32))
        return codes.reshape(n, k), scale.reshape(n, k // K_GROUP), offset.reshape(n, k // K_GROUP)
    supers = raw.reshape(n * k // SUPER_BLOCK, 110)
    hmask, packed, d = supers[:, :32], supers[:, 96:108], _half(supers[:, 108:110])
    low = (packed[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    high = (packed[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    sc = ((low & 0x0F) | ((high & 3) << 4)).astype(np.int8) - 32
    codes = ((supers[:, 32:96].reshape(-1, 2, 1, 32) >> pairs) & 3).astype(np.int8).reshape(-1, SUPER_BLOCK)
    high_bits = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    codes -= ((high_bits.reshape(-1, SUPER_BLOCK) ^ 1) << 2).astype(np.int8)
    scale = d[:, None] * sc.astype(np.float32)
    return codes.reshape(n, k), scale.reshape(n, k // K_GROUP), np.zeros((n, k // K_GROUP), np.float32)


def _non_linear_groups(raw: np.ndarray, fmt: str, n: int, k: int) -> Groups:
    """IQ4_NL and IQ4_XS: each 4-bit code picks one of 16 values (NON_LINEAR_VALUES), kept as that value in a byte,
    times a scale per 32 inputs, no offset. IQ4_NL per 32: d, 16 bytes of nibbles; value = d * value[code]. IQ4_XS per
    256: d, 2 bytes of the 6-bit scales' high bit pairs, 4 of their low nibbles, 128 of nibbles; value = d * (scale -
    32) * value[code] (at most 24 significant bits: exact in float32, as gguf's product)."""
    if fmt == "IQ4_NL":
        blocks = raw.reshape(n, k // GROUP, 18)
        codes = NON_LINEAR_VALUES[_nibbles(blocks[..., 2:])].reshape(n, k)
        return codes, _half(blocks[..., 0:2]), np.zeros((n, k // GROUP), np.float32)
    supers = raw.reshape(n * k // SUPER_BLOCK, 136)
    d, high = _half(supers[:, 0:2]), supers[:, 2:4].copy().view(np.uint16)
    low = (supers[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(-1, 8) & 0x0F
    high = ((high.reshape(-1, 1) >> (2 * np.arange(8, dtype=np.uint16)).reshape(1, 8)) & 3).astype(np.uint8)
    scale = d[:, None] * ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32)
    nibbles = (supers[:, 8:].reshape(-1, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    codes = NON_LINEAR_VALUES[nibbles.reshape(n, k)]
    return codes, scale.reshape(n, k // GROUP), np.zeros((n, k // GROUP), np.float32)


def code_form(fmt: str, k: int) -> Form | None:
    """The form a weight of this format with k inputs is served in; None: it is dequantized."""
    if fmt not in FORMATS or k % (SUPER_BLOCK if fmt in IN_SUPER_BLOCKS else GROUP):
        return None
    return 4 if fmt in FOUR_BIT else 8, K_GROUP if fmt in BY_SIXTEEN else GROUP


def group_size(groups: Groups) -> int:
    """Inputs per scale and offset: 32, or Q6_K's 16."""
    codes, scales, _ = groups
    return codes.shape[1] // scales.shape[1]


def gguf_pack_weight(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[N, K] codes (uint8 0-15: 4 bits; int8: 8), [N, K / G] scales and offsets (G = 32, or 16 for 8-bit codes) ->
    gguf_linear's layout: codes [N / 16, K / G, G, 16 x bits / 8] uint8 (per block and group, input by input, each
    input's 16 features side by side; 4-bit codes two inputs a byte, input 2p in the low nibble: the last two
    dimensions are then a view of [G / 2, 16] bytes), so that the shape says the group and the code width; scales
    and offsets [N / 16, K / G, 16]."""
    n, k = codes.shape
    g = k // scales.shape[1]
    assert n % BLOCK == 0 and (g == GROUP or (g == K_GROUP and codes.dtype == torch.int8)) and k % g == 0, (
        "gguf_linear takes N a multiple of 16 and groups of 32 inputs (16 with 8-bit codes)"
    )
    by_input = codes.view(n // BLOCK, BLOCK, k // g, g).permute(0, 2, 3, 1)  # [blocks, groups, g, 16]
    if codes.dtype == torch.int8:
        packed = by_input.contiguous().view(torch.uint8)
    else:
        pairs = by_input.reshape(n // BLOCK, k // g, g // 2, 2, BLOCK)
        packed = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(n // BLOCK, k // g, g, BLOCK // 2)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // BLOCK, BLOCK, k // g).transpose(1, 2).contiguous()

    return packed.contiguous(), per_block(scales), per_block(offsets)


class GGUFLinear(nn.Module):
    """A linear over a GGUF weight's codes (see the module's docstring): gguf_linear, in float32."""

    def __init__(self, groups: Groups, bias: torch.Tensor | None) -> None:
        super().__init__()
        codes, scales, offsets = (torch.from_numpy(np.ascontiguousarray(a)) for a in groups)
        self.out_features, self.in_features = codes.shape
        self.codes, self.scales, self.offsets = gguf_pack_weight(codes, scales, offsets)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def group(self) -> int:
        """Inputs per scale and offset."""
        return self.codes.shape[2]

    @property
    def bits(self) -> int:
        """Bits per code: 4, or 8."""
        return self.codes.shape[3] * 8 // BLOCK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows_forward(unit_stride_rows(x)).view(*x.shape[:-1], self.out_features)

    def rows_forward(self, rows: torch.Tensor) -> torch.Tensor:
        out = torch.ops.tokenloom.gguf_linear(rows.float(), self.codes, self.scales, self.offsets, self.bias)
        return out if rows.dtype == torch.float32 else out.to(rows.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] in float32, as gguf's dequantization gives it."""
        blocks, groups, g = self.out_features // BLOCK, self.in_features // self.group, self.group
        if self.bits == 8:
            codes = self.codes.view(torch.int8)
        else:
            codes = _split_nibbles(self.codes.view(blocks, groups, g // 2, BLOCK), dim=2)
        values = _values(codes, self.scales[:, :, None, :], self.offsets[:, :, None, :])  # [blocks, groups, g, 16]
        return values.permute(0, 3, 1, 2).reshape(self.out_features, self.in_features)

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (output features: token ids, of an embedding or LM head) of dequantized(), [len, K] float32 and
        bit for bit, without making the whole weight: an embedding held as its blocks looks its tokens up here."""
        blocks, lanes = rows // BLOCK, rows % BLOCK
        if self.bits == 8:
            codes = self.codes.view(torch.int8)[blocks, :, :, lanes]  # [len, groups, g]
        else:
            pairs = self.codes.view(*self.codes.shape[:2], self.group // 2, BLOCK)[blocks, :, :, lanes]
            codes = _split_nibbles(pairs, dim=2)
        values = _values(codes, self.scales[blocks, :, lanes, None], self.offsets[blocks, :, lanes, None])
        return values.view(len(rows), self.in_features)


def _split_nibbles(pairs: torch.Tensor, dim: int) -> torch.Tensor:
    """Bytes of two 4-bit codes along `dim` (input 2p in the low nibble, 2p + 1 in the high) -> the codes, twice as
    many along it."""
    return torch.stack([pairs & 0x0F, pairs >> 4], dim=dim + 1).flatten(dim, dim + 1)


def _values(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """code x scale + offset in float32, rounded after each (gguf's dequantization in numpy; never one FMA)."""
    return codes.float().mul_(scales).add_(offsets)


def one_form(forms: list[Form]) -> Form:
    """The form a fused projection of members in `forms` is served in: theirs where they agree, else 8-bit codes at
    the smallest group (a Q4_K_M file's Q4_K query and key with its Q6_K value)."""
    return forms[0] if len(set(forms)) == 1 else (8, min(group for _, group in forms))


def _form_of(groups: Groups) -> Form:
    return 4 if groups[0].dtype == np.uint8 else 8, group_size(groups)


def in_one_form(parts: list[Groups]) -> Groups:
    """A fused projection's members' groups concatenated (rows of the first, then the next...), each in one_form's
    form: a member regrouped has 8-bit codes and its scales and offsets repeated (the same values, the same single
    rounding)."""
    bits, group = one_form([_form_of(p) for p in parts])
    parts = [p if _form_of(p) == (bits, group) else _regrouped(p, group) for p in parts]
    codes, scales, offsets = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
    return codes, scales, offsets


def _regrouped(groups: Groups, g: int) -> Groups:
    """The same weight with 8-bit codes and a scale and offset per g inputs (g divides its group)."""
    codes, scales, offsets = groups
    repeat = group_size(groups) // g
    return codes.astype(np.int8), np.repeat(scales, repeat, axis=1), np.repeat(offsets, repeat, axis=1)


Member = tuple[Any, int | None]  # a gguf-py tensor and, for a permuted Q or K, the heads to unpermute its rows by


def _linear_members(reader: Any) -> dict[str, list[Member | None]]:
    """A GGUF's 2-D weights by the model's name for their linear (``layers.0.self_attn.qkv_proj``, ``lm_head``,
    ``embed_tokens``): a fused projection's members in the order the model fuses them, None for one the file lacks."""
    from tokenloom.model.gguf_convert import hf_tensors
    from tokenloom.model.llama import fused_target

    found: dict[str, dict[str, Member]] = {}
    members_of: dict[str, tuple[str, ...]] = {}
    for name, tensor, heads in hf_tensors(reader):
        if name.endswith(".weight") and len(tensor.shape) == 2:
            module = name.removeprefix("model.").removesuffix(".weight")
            target, part, members = fused_target(module)
            found.setdefault(target or module, {})[part] = (tensor, heads)
            members_of[target or module] = members or ("",)
    return {key: [parts.get(member) for member in members_of[key]] for key, parts in found.items()}


def _shape_and_form(member: Member) -> tuple[int, int, Form | None]:
    tensor = member[0]
    n, k = (int(d) for d in reversed(tensor.shape))
    return n, k, code_form(tensor.tensor_type.name, k)


def gguf_weight_groups(path: Path) -> dict[str, Groups]:
    """The 2-D weights of a GGUF file in one of FORMATS, by the model's name for them (_linear_members): a fused
    projection's members, each in one of FORMATS, concatenated in the order the model fuses them (in_one_form)."""
    import gguf

    weights: dict[str, Groups] = {}
    for key, members in _linear_members(gguf.GGUFReader(str(path))).items():
        present = [m for m in members if m is not None]
        if len(present) == len(members) and all(_shape_and_form(m)[2] is not None for m in present):
            weights[key] = in_one_form([_groups_of(m) for m in present])
    return weights


def _groups_of(member: Member) -> Groups:
    """A tensor's codes, scales and offsets (gguf_groups), Q and K rows unpermuted as gguf_convert unpermutes them."""
    from tokenloom.model.gguf_convert import unpermute_rows

    tensor, heads = member
    n, k, _ = _shape_and_form(member)
    raw = np.asarray(tensor.data).reshape(n, -1)
    return gguf_groups(raw if heads is None else unpermute_rows(raw, heads), tensor.tensor_type.name, (n, k))


def served_weight_bytes(path: Path) -> int:
    """What a GGUF's weights take served from its blocks (serve_gguf), from the file's tensor list alone (no weight
    is read, so a planner can ask of any file): a decoder linear or LM head whose every member gguf_linear reads (16
    output features a block) holds its codes in one_form's form and a float32 scale and offset per group, and so does
    an embedding in one of FORMATS (its lookups, and a tied head's logits, read those blocks: head_rows.py); every
    other tensor is held dequantized in float32, once (a tied head's packed copy is its embedding's table)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    linears = _linear_members(reader)
    held = FLOAT32 * sum(int(t.n_elements) for t in reader.tensors if len(t.shape) != 2)  # norms, biases
    for members in linears.values():
        shapes = [_shape_and_form(m) for m in members if m is not None]
        rows, k = sum(n for n, _, _ in shapes), shapes[0][1]
        forms = [form for _, _, form in shapes if form is not None]
        blocks = _blocks_bytes(rows, k, one_form(forms)) if len(forms) == len(members) and rows % BLOCK == 0 else None
        held += FLOAT32 * rows * k if blocks is None else blocks
    return held


def _blocks_bytes(rows: int, k: int, form: Form) -> int:
    """A linear's codes in `form` with a float32 scale and offset per group, as gguf_pack_weight lays them out."""
    bits, group = form
    return rows * k * bits // 8 + 2 * FLOAT32 * rows * (k // group)


def checked_layer(
    groups: Groups | None, bias: torch.Tensor | None, plain: torch.Tensor, what: str
) -> GGUFLinear | None:
    """A GGUFLinear of `groups` where they fit gguf_linear and `plain`'s shape (else None), its weight checked, bit
    for bit, against `plain`: the one loaded from the dequantized checkpoint (rounded to the model's dtype)."""
    if groups is None or groups[0].shape != tuple(plain.shape) or groups[0].shape[0] % BLOCK:
        return None
    layer = GGUFLinear(groups, bias)
    if not torch.equal(layer.dequantized().to(plain.dtype), plain.detach()):
        raise ValueError(f"{what}: the GGUF's weight is not the one the dequantized checkpoint loaded")
    return layer


def serve_gguf_linears(layers: nn.Module, weights: dict[str, Groups]) -> tuple[int, int]:
    """Every nn.Linear of the decoder `layers` (a model's ``layers`` list) whose GGUF weight is in `weights`
    (gguf_weight_groups) becomes a GGUFLinear of it; returns how many did and how many kept their dequantized
    weight."""
    replaced = kept = 0
    for prefix, parent in list(layers.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            what = f"layers.{prefix}.{name}"
            layer = checked_layer(weights.get(what), child.bias, child.weight, what)
            if layer is None:
                kept += 1
                continue
            setattr(parent, name, layer)
            replaced += 1
    return replaced, kept


def gguf_head(weights: dict[str, Groups], plain: torch.Tensor) -> GGUFLinear | None:
    """The LM head over its GGUF weight (the output's, or the tied embedding's), where gguf_linear reads it; `plain`
    is the head's weight as loaded."""
    return checked_layer(weights.get("lm_head", weights.get("embed_tokens")), None, plain, "the LM head")


# In a directory of the GGUF's cache directory (gguf_convert.converted_dir_for), where the loader, which reads its
# *.safetensors, does not look; "2" since the Q5 and Q6 formats and fused projections of mixed formats (a file of
# the first version lacks them).
GROUPS_FILE = Path("blocks") / "groups2.safetensors"
PARTS = ("codes", "scales", "offsets")  # a Groups' arrays, as the cache file names them


def cached_weight_groups(path: Path) -> dict[str, Groups]:
    """gguf_weight_groups, kept in the GGUF's cache directory after the first start: reading a GGUF's metadata (the
    tokenizer's 49,152 strings for the embedded model) takes gguf-py ~2.5 s, the cached groups a fraction of that."""
    from safetensors.numpy import load_file, save_file

    from tokenloom.model.gguf_convert import converted_dir_for

    cached = converted_dir_for(path) / GROUPS_FILE
    if cached.exists():
        arrays = load_file(str(cached))
        keys = {name.rsplit(".", 1)[0] for name in arrays}
        return {key: tuple(arrays[f"{key}.{part}"] for part in PARTS) for key in keys}  # type: ignore[misc]
    weights = gguf_weight_groups(path)
    arrays = {f"{key}.{part}": a for key, groups in weights.items() for part, a in zip(PARTS, groups, strict=True)}
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = cached.with_name(f".{cached.name}.{os.getpid()}")
    save_file(arrays, str(staging))
    staging.replace(cached)  # whole or not at all, whichever process writes it
    return weights


def serve_gguf(model: CausalLM) -> None:
    """A model's decoder linears and LM head over its GGUF's own blocks, where gguf_linear reads them."""
    if model.gguf_file is None:
        raise ValueError("--quantization gguf serves a GGUF checkpoint's own blocks; this model is not a GGUF")
    weights = cached_weight_groups(model.gguf_file)
    replaced, kept = serve_gguf_linears(model.layers, weights)
    model.operator_layers_changed()
    head = gguf_head(weights, model.head_weight()) if model.computes_logits else None
    if head is not None:
        model.serve_head(head)  # in float32 a tied embedding then looks its rows up in the head's blocks
    if not model.head_is_embedding:  # its own table, which no head keeps: its lookups from its blocks instead
        table = model.embedding_table()
        embedding = checked_layer(weights.get("embed_tokens"), None, table, "the embedding")
        if embedding is not None:
            model.embed_from(embedding)
    logger.info("served from the GGUF's blocks: %d decoder linears (%d dequantized: not %s), the LM head: %s",
                replaced, kept, ", ".join(FORMATS), "yes" if head is not None else "no")  # fmt: skip
