"""8-bit weights (--quantization int8): per-channel codes, per-token activations, oneDNN's int8 matmul; the engine's
tokens stay those of the same model alone whatever the batch; a method the device cannot run is refused at start."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import needs_operator
from torch import nn

from tokenloom import LLM, SamplingParams
from tokenloom.model import quantization
from tokenloom.model.llama import REFINED_TOP_K
from tokenloom.model.loader import load_model
from tokenloom.model.parallel import TensorParallelGroup
from tokenloom.model.prepack import PackedLinear, can_prepack
from tokenloom.model.quantization import (
    Int8Linear,
    hadamard_matrix,
    int8_available,
    int8_kernel_isa,
    per_channel,
    quantize_linears,
    rotate,
    rotation_signs,
)


@pytest.fixture(autouse=True)
def int8_matmul():
    needs_operator()
    if not int8_available():
        pytest.skip("this torch build has no oneDNN int8 matmul")


def per_token_codes(x: torch.Tensor) -> torch.Tensor:
    """What tokenloom::quantize_rows_int8 makes of each row, in its float32 arithmetic (scale = amax x (1 / 127),
    code = x x (1 / scale)), scaled back, in float64."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    codes = (x * torch.reciprocal(scale)).round().clamp(-127, 127)
    return codes.double() * scale.double()


def test_the_rotation_is_orthonormal_and_its_signs_fixed():
    h = hadamard_matrix(64)
    torch.testing.assert_close(h @ h.T, torch.eye(64))
    signs = rotation_signs(576)
    assert signs is not None and torch.equal(signs, rotation_signs(576)) and set(signs.tolist()) == {-1.0, 1.0}
    assert rotation_signs(48) is None  # not a multiple of 64: that linear is not rotated
    x, w = torch.randn(5, 576, dtype=torch.float64), torch.randn(32, 576, dtype=torch.float64)
    torch.testing.assert_close(rotate(x, signs) @ rotate(w, signs).T, x @ w.T)  # (x R)(W R)^T = x W^T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_the_operator_rotates_then_quantizes_each_row(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    x[:, 7] = 30.0  # an outlier channel
    signs = rotation_signs(576)
    codes, scales = torch.ops.tokenloom.quantize_rows_int8(x, signs)
    rotated = rotate(x.double(), signs.double())  # the reference in float64; the operator's transform is float32
    torch.testing.assert_close(scales[:, 0].double(), rotated.abs().amax(1) / 127, rtol=1e-5, atol=0)
    want = (rotated / scales.double()).round()
    off = (codes.double() - want).abs()
    assert off.max() <= 1 and (off > 0).float().mean() < 1e-3  # only float32 ties may round the other way
    plain_codes, plain_scales = torch.ops.tokenloom.quantize_rows_int8(x)
    torch.testing.assert_close(plain_codes.double() * plain_scales.double(), per_token_codes(x))
    # With a group, one scale per 64 rotated inputs: the outlier's group has a coarse one, the others stay fine.
    grouped, group_scales = torch.ops.tokenloom.quantize_rows_int8(x, signs, 64)
    assert group_scales.shape == (rows, 9)
    blocks = rotated.unflatten(1, (9, 64))
    torch.testing.assert_close(group_scales.double(), blocks.abs().amax(2) / 127, rtol=1e-5, atol=0)
    off = (grouped.double().unflatten(1, (9, 64)) - blocks / group_scales.double()[:, :, None]).abs()
    assert off.max() <= 0.5 + 1e-3
    assert (group_scales.min(1).values < scales[:, 0] / 2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "rotated", "group"), [(576, True, 0), (576, True, 64), (40, False, 0)])
def test_shifted_codes_are_the_codes_plus_128_and_the_kernel_sums_them_alike(dtype, in_features, rotated, group):
    """quantize_rows_int8(..., shifted=True) stores each code + 128 as an unsigned byte (the VNNI kernel's operand,
    so it skips its own shifting pass): the same codes and scales, and int8_linear gives the same bits from either
    (40 inputs: the quantizer's scalar tail after two vectors of 16)."""
    g = torch.Generator().manual_seed(in_features + group)
    x = (torch.randn(33, in_features, generator=g) * 3).to(dtype)
    signs = rotation_signs(in_features) if rotated else None
    codes, scales = torch.ops.tokenloom.quantize_rows_int8(x, signs, group)
    shifted, shifted_scales = torch.ops.tokenloom.quantize_rows_int8(x, signs, group, True)
    assert codes.dtype == torch.int8 and shifted.dtype == torch.uint8
    assert torch.equal(shifted.int(), codes.int() + 128) and torch.equal(scales, shifted_scales)
    if not quantization.small_step_kernel_available():
        return  # the kernel below is the VNNI one
    weight = torch.randint(-127, 128, (48, in_features), dtype=torch.int8, generator=g)
    packed, sums = torch.ops.tokenloom.int8_pack_weight(weight)
    code_sums = quantization.group_code_sums(weight, group) if group else sums
    weight_scale = torch.rand(48, generator=g) * 0.01
    outputs = [
        torch.ops.tokenloom.int8_linear(c, scales, packed, code_sums, weight_scale, None, dtype, False)
        for c in (codes, shifted)
    ]
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("gated", [False, True])
def test_the_int8_kernel_rounds_a_bf16_output_as_torch_does(gated):
    """A bf16 output is the kernel's float32 output rounded to nearest even, bit for bit (on CPUs without AVX-512
    BF16 the kernel rounds by integer arithmetic), ties and values near bf16's largest included."""
    if int8_kernel_isa() is None or (gated and not quantization.small_step_kernel_available()):
        pytest.skip("no int8 kernel for this CPU, or (gated) no VNNI kernel: the AVX2 one has no gated epilogue")
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(-127, 128, (37, 256), dtype=torch.int8, generator=g)
    scales = torch.rand(37, 1, generator=g) * 10
    weight = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=g)
    packed, code_sums = torch.ops.tokenloom.int8_pack_weight(weight)
    weight_scale = torch.rand(64, generator=g) * 0.01
    weight_scale[:4] = torch.tensor([1e30, 1.0 + 2**-8, 2**-140, 3e-3])  # near bf16's top, a tie, a denormal
    outputs = [
        torch.ops.tokenloom.int8_linear(codes, scales, packed, code_sums, weight_scale, None, dtype, gated)
        for dtype in (torch.float32, torch.bfloat16)
    ]
    assert outputs[1].dtype == torch.bfloat16 and torch.equal(outputs[1], outputs[0].to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize(("rotated", "group", "gated"), [(True, 64, False), (True, 0, True), (False, 0, False)])
def test_int8_linear_rows_is_the_quantizer_then_the_kernel_in_one_call(rows, rotated, group, gated):
    """int8_linear_rows (what Int8Linear calls where our VNNI kernel runs) quantizes its bf16 rows as
    quantize_rows_int8 does and multiplies them as int8_linear does: the same bits as the two operators."""
    if not quantization.small_step_kernel_available():
        pytest.skip("int8_linear_rows is the VNNI kernel's")
    g = torch.Generator().manual_seed(rows * 10 + group)
    x = (torch.randn(rows, 128, generator=g) * 3).to(torch.bfloat16)
    signs = rotation_signs(128) if rotated else None
    weight = torch.randint(-127, 128, (64, 128), dtype=torch.int8, generator=g)
    packed, sums = torch.ops.tokenloom.int8_pack_weight(weight)
    code_sums = quantization.group_code_sums(weight, group) if group else sums
    weight_scale, bias = torch.rand(64, generator=g) * 0.01, torch.randn(64, generator=g)
    codes, scales = torch.ops.tokenloom.quantize_rows_int8(x, signs, group, True)
    apart = torch.ops.tokenloom.int8_linear(codes, scales, packed, code_sums, weight_scale, bias, torch.bfloat16, gated)
    fused = torch.ops.tokenloom.int8_linear_rows(
        x, signs, group, packed, code_sums, weight_scale, bias, torch.bfloat16, gated
    )
    assert fused.shape == (rows, 32 if gated else 64) and torch.equal(fused, apart)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_code", [32767, 11008, 300])
def test_16_bit_codes_are_rotated_and_rounded_as_the_8_bit_ones(dtype, max_code):
    """quantize_rows_int16 (the AVX2 kernel's activations): scale = largest |x R| / max_code, codes x R / scale."""
    g = torch.Generator().manual_seed(max_code)
    x = torch.randn(37, 576, generator=g).to(dtype)
    x[:, 7] = 30.0
    signs = rotation_signs(576)
    codes, scales = torch.ops.tokenloom.quantize_rows_int16(x, signs, max_code)
    assert codes.dtype == torch.int16 and codes.abs().max() == max_code
    rotated = rotate(x.double(), signs.double())
    torch.testing.assert_close(scales[:, 0].double(), rotated.abs().amax(1) / max_code, rtol=1e-5, atol=0)
    off = (codes.double() - rotated / scales.double()).abs()
    assert off.max() <= 0.5 + 1e-3 * max_code / 127  # rounded to nearest, but for the float32 transform's error
    plain, _ = torch.ops.tokenloom.quantize_rows_int16(x, None, max_code)
    assert plain.abs().max() == max_code


def test_16_bit_codes_bound_their_sums_to_int32():
    from tokenloom.model.quantization import int16_activation_max_code

    for k in (64, 576, 1536, 14336):
        code = int16_activation_max_code(k)
        assert 0 < code <= 32767 and 127 * k * (code + 1) < 2**31
    assert int16_activation_max_code(576) == 29355 and int16_activation_max_code(1536) == 11007


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# On AVX2: up to 5 rows run block tiles of 2 rows (3: and one of 1), 6 or more widened blocks (7, 9, 301: an odd row).
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 9, 64, 301])
# 128 x 48: two groups of 64 inputs (where the VNNI kernel scales them apart) over three blocks of 16 features, so
# its tiles of 2 and 4 blocks end in a remainder.
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"), [(576, 1536, False), (64, 48, True), (128, 48, True), (48, 32, False)]
)
@pytest.mark.parametrize("activation_bits", [8, 16])
def test_int8_linear_equals_the_product_of_its_codes(dtype, rows, in_features, out_features, bias, activation_bits):
    g = torch.Generator().manual_seed(rows)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g))
    x = torch.randn(rows, in_features, generator=g)
    x[0, 3] = 40.0  # an outlier in one token: only its own row's scale grows
    quantized = Int8Linear(
        linear.weight.to(dtype), None if linear.bias is None else linear.bias.to(dtype), activation_bits=activation_bits
    )
    assert (quantized.activation_max_code > 127) == (activation_bits == 16 or int8_kernel_isa() == "avx2")
    ours = quantized(x.to(dtype)).float()
    # What the codes mean, in float64: per-token activations times per-channel weights, both rotated where the
    # inputs split into 64-blocks (the activations' codes as the operator made them: tested above).
    signs = rotation_signs(in_features)
    weight = linear.weight.detach().to(dtype)
    if signs is not None:
        weight = rotate(weight.float(), signs)
    codes, scales = quantized.activation_codes(x.to(dtype))  # int8 or int16, as the layer takes them: tested above
    # one scale a row, or one per 64 inputs where the layer groups them (the VNNI kernel without AMX)
    assert scales.shape == (rows, in_features // quantized.activation_group if quantized.activation_group else 1)
    activations = codes.double() * scales.double().repeat_interleave(in_features // scales.shape[1], dim=1)
    scaled, scale = per_channel(weight, 127.0)  # the weight's codes, in float32
    w = scaled.round().clamp(-127, 127).double() * scale.double()[:, None]
    reference = activations @ w.T
    if bias:
        reference += linear.bias.detach().to(dtype).double()
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
    torch.testing.assert_close(ours.double(), reference, rtol=tolerance, atol=tolerance)
    # And close to the float product itself (int8's error, relative to the output's size), but for the outlier's
    # own row, whose scale it coarsened.
    exact = x.double() @ linear.weight.detach().double().T + (linear.bias.detach().double() if bias else 0)
    if rows > 1:
        assert ((ours[1:].double() - exact[1:]).norm() / exact[1:].norm()) < 0.02


def test_the_rotation_shrinks_the_error_an_outlier_channel_makes():
    """A channel far larger than the rest in every token (what real models' activations have) sets each token's
    scale; rotated, its size is shared by 64 channels and the other channels keep their precision."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 576, generator=g) * 0.05
    x = torch.randn(64, 576, generator=g)
    x[:, 100] = 60.0
    exact = x.double() @ weight.double().T
    layer = Int8Linear(weight, None)
    assert layer.signs is not None
    plain = Int8Linear(weight[:, :-16], None)  # 560 inputs: not a multiple of 64, so not rotated
    assert plain.signs is None
    layer.activation_max_code = plain.activation_max_code = 127  # 8-bit activations, as on VNNI, also on AVX2
    rotated = layer(x).double()
    plain_error = (plain(x[:, :-16]).double() - x[:, :-16].double() @ weight[:, :-16].double().T).norm()
    rotated_error = (rotated - exact).norm()
    assert rotated_error < plain_error / 3


def test_a_rows_output_does_not_depend_on_the_other_rows():
    linear = nn.Linear(128, 64, bias=False)
    x = torch.randn(5, 128)
    quantized = Int8Linear(linear.weight.detach(), None)
    alone = quantized(x[2:3])
    crowd = torch.cat([x, 100 * torch.randn(3, 128)])  # large rows beside it
    assert torch.equal(quantized(crowd)[2:3], alone)


def test_every_decoder_linear_is_quantized(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", quantization="int8")
    model = llm.engine.core.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 4 * len(model.layers)  # qkv, o, gate_up, down
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules())
    assert quantize_linears(nn.Sequential(), "int8") == 0
    # The C++ operators' step calls the quantized linears, not those it gathered before (GPTQ's recording forward).
    assert llm.engine.core.runner.attention_backend == "cpu"
    for layer, operators in zip(model.layers, model.operator_layers(), strict=True):
        assert operators.qkv_proj.__self__ is layer.self_attn.qkv_proj
        assert operators.down_proj.__self__ is layer.mlp.down_proj


@pytest.mark.parametrize("method", ["int8", "int8_w8a16"])
def test_an_int8_models_logits_are_its_int8_heads_but_where_they_decide_the_token(tiny_llama, method):
    """The full logits come from the head's int8 copy; each row's best candidates are refined in float32 from the
    plain weight, so the token the head decides is float32's."""
    if int8_kernel_isa() is None:
        pytest.skip("no int8 kernel of ours on this CPU: the head stays as it is")
    model = LLM(str(tiny_llama), dtype="bfloat16", quantization=method).engine.core.runner.model
    head = model._int8_head
    assert isinstance(head, Int8Linear)
    if int8_kernel_isa() == "avx512_vnni":  # 8-bit codes for both methods where the CPU multiplies bytes
        assert head.activation_max_code == 127
    assert LLM(str(tiny_llama), dtype="bfloat16").engine.core.runner.model._int8_head is None
    stream = 3 * torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = model.compute_logits(stream)
    normed = F.rms_norm(stream, (stream.shape[-1],), model.norm.weight.float(), model.norm.eps)
    exact = normed @ model.head_weight().float().T
    top = logits.topk(REFINED_TOP_K).indices
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top))
    rest = torch.ones_like(logits, dtype=torch.bool).scatter_(1, top, False)
    int8_logits = head.rows_forward(normed.to(torch.bfloat16), out_dtype=torch.float32)
    assert torch.equal(logits[rest], int8_logits[rest])
    assert not torch.equal(int8_logits[rest], exact[rest])  # not the plain head's: its own codes


def test_a_float32_models_linears_are_packed_on_the_cpu_and_give_the_plain_matmuls_outputs(tiny_llama):
    """oneDNN's float32 layout takes every linear on every CPU it runs on: the same outputs as F.linear over the
    plain weights, and the same logits as the head's plain matmul, within float32's rounding, for one row and many."""
    if not can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN")
    engine_model = LLM(str(tiny_llama), dtype="float32").engine.core.runner.model
    assert isinstance(engine_model.lm_head, PackedLinear) and not engine_model.lm_head.own
    packed = [m for m in engine_model.layers.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * len(engine_model.layers) and not any(m.own or m.gated for m in packed)
    int8_model = LLM(str(tiny_llama), dtype="float32", quantization="int8").engine.core.runner.model
    assert not isinstance(int8_model.lm_head, PackedLinear)  # its logits come from its int8 head

    model = load_model(str(tiny_llama), 64, torch.float32, torch.device("cpu")).model
    plain = {name: m.weight.detach().clone() for name, m in model.layers.named_modules() if isinstance(m, nn.Linear)}
    head = model.head_weight().detach().clone()
    model.prepack_weights()
    g = torch.Generator().manual_seed(0)
    for rows in (1, 5, 70):
        for name, layer in model.layers.named_modules():
            if isinstance(layer, PackedLinear):
                x = torch.randn(rows, layer.in_features, generator=g)
                torch.testing.assert_close(layer(x), F.linear(x, plain[name]))
        stream = 3 * torch.randn(rows, model.config.hidden_size, generator=g)
        normed = F.rms_norm(stream, (stream.shape[-1],), model.norm.weight, model.norm.eps)
        torch.testing.assert_close(model.compute_logits(stream), normed @ head.T)


@pytest.mark.parametrize("method", [None, "int8"])
def test_only_the_rank_that_computes_logits_copies_the_head(tiny_llama, method):
    """Rank 0 alone computes logits under tensor parallelism: another rank makes neither the packed bf16 copy of
    the head nor its int8 copy (a tied head's copy is the embedding's size again, ~1 GB for a Llama-3-8B)."""
    if method and int8_kernel_isa() is None:
        pytest.skip("no int8 kernel of ours on this CPU: no int8 head")
    if not method and not can_prepack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU packs no bf16 weight (the engine then keeps them plain): no packed head")
    for rank, copies in ((0, True), (1, False)):
        model = load_model(str(tiny_llama), 64, torch.bfloat16, torch.device("cpu"), TensorParallelGroup(rank, 2)).model
        if method:
            model.quantize_weights(method)
        model.prepack_weights(layers=method is None)
        head = model._int8_head if method else model.lm_head
        assert isinstance(head, Int8Linear if method else PackedLinear) == copies
        assert model.head_weight() is not None  # the plain weight stays: the embedding, or the head as loaded


def alone(tiny_llama, method: str) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", quantization=method, max_num_seqs=1)
    return [greedy_one(llm, p) for p in PROMPTS]


PROMPTS = [[*range(20, 52), 5], list(range(60, 130)), [3] * 17, [7, 8]]


def greedy_one(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("method", ["int8", "int8_w8a16"])
def test_batches_chunks_and_preemption_keep_each_requests_tokens(tiny_llama, method):
    llm = LLM(str(tiny_llama), dtype="float32", quantization=method, max_num_batched_tokens=24, block_size=8,
              num_kv_blocks=14, max_num_seqs=4)  # fmt: skip
    wide = [m.activation_max_code > 127 for m in llm.engine.core.runner.model.layers.modules()
            if isinstance(m, Int8Linear)]  # fmt: skip
    assert wide and all(wide) == (method == "int8_w8a16" or int8_kernel_isa() == "avx2") and len(set(wide)) == 1
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == alone(tiny_llama, method)
    assert llm.stats().num_preemptions > 0


def test_int8_weights_and_an_int8_cache_together(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="bfloat16", quantization="int8", kv_cache_dtype="int8")
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_a_method_the_device_cannot_run_is_refused_at_start(tiny_llama):
    with pytest.raises(ValueError, match=r"fp8 runs torch\._scaled_mm on a CUDA GPU"):
        LLM(str(tiny_llama), dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tiny_llama), quantization="int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("in_features", "out_features", "bias"), [(576, 1728, False), (1536, 576, False), (576, 960, True), (64, 48, True)]
)
@pytest.mark.parametrize("gated", [False, True])
def test_every_kernel_gets_oneDNNs_bits(dtype, in_features, out_features, bias, gated):
    """Steps of a few rows run our VNNI kernel (csrc/int8_linear.cpp), larger ones our AMX kernel where the CPU has
    AMX-INT8 and the shape fits its tiles (csrc/amx_int8_linear.cpp), else oneDNN's matmul; every one equals oneDNN's
    bits, so a request's tokens do not depend on how many rows its step had; gated (a [gate; up] projection giving
    silu(gate) * up) as well."""
    from tokenloom.model import quantization

    if not quantization.small_step_kernel_available():
        pytest.skip("the VNNI kernel is built only where the compiler targets AVX-512 VNNI")
    g = torch.Generator().manual_seed(in_features)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
    bias_values = (torch.randn(out_features, generator=g)).to(dtype) if bias else None
    layer = Int8Linear(weight, bias_values, gated=gated)
    assert layer.gated == (gated and out_features % 32 == 0)
    assert layer.out_features == (out_features // 2 if layer.gated else out_features)
    fits_tiles = out_features % 32 == 0 and in_features % 64 == 0
    amx_cpu = quantization.amx_kernel_available()
    assert layer.own is not None and layer.amx == (fits_tiles and amx_cpu)
    # oneDNN's packing is kept only where a step can reach it: on an AMX CPU, for what does not fit the tiles
    assert (layer.packed is None) == (layer.amx or not amx_cpu)
    if layer.activation_group:
        # Scales per 64 inputs: only our VNNI kernel reads them, and it runs every step (no AMX here), so a row's
        # output is what it is alone, whatever the step's rows and tiles.
        assert layer.small_rows == sys.maxsize and layer.packed is None
        x = torch.randn(129, in_features, generator=g).to(dtype)
        crowd = layer(x)
        for rows in (1, 2, 3, 7, 8, 13, 33, 129):
            assert torch.equal(layer(x[:rows]), crowd[:rows]), rows
        for row in (0, 5, 100, 128):
            assert torch.equal(layer(x[row : row + 1]), crowd[row : row + 1]), row
        return
    reference = through_onednn_alone(layer)
    # 129: past one chunk of 128 rows (the VNNI kernel's L2 chunk) by a lone row; a larger step adds no path, only
    # minutes where oneDNN's int8 matmul is its reference implementation (CPUs without AMX).
    for rows in (1, 3, quantization.AMX_FROM_ROWS, quantization.SMALL_STEP_ROWS, 13, 32, 33, 100, 129):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        assert torch.equal(layer(x), reference(x)), rows


def through_onednn_alone(layer: Int8Linear) -> Int8Linear:
    """A copy of the layer whose every step runs oneDNN's int8 matmul on the same codes."""
    codes = layer.rounded_codes()
    assert codes is not None
    n, k = codes.shape
    reference = copy.copy(layer)
    reference.own, reference.amx, reference.small_rows = None, False, 0
    reference.packed = torch.ops.onednn.qlinear_prepack(codes, [64, k])
    reference.weight_zero_point = torch.zeros(n, dtype=torch.long)
    return reference


@pytest.mark.parametrize("activation_bits", [8, 16])
def test_a_gated_layer_gives_silu_of_gate_times_up(activation_bits):
    from tokenloom.model import quantization

    if not quantization.small_step_kernel_available():
        pytest.skip("the gated epilogue is in our AVX-512 kernels")
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(2 * 96, 128, generator=g) * 0.1, torch.randn(2 * 96, generator=g)
    plain = Int8Linear(weight, bias, activation_bits=activation_bits)
    gated = Int8Linear(weight, bias, gated=True, activation_bits=activation_bits)
    assert gated.gated and gated.out_features == 96
    for rows in (2, 40, 300):
        x = torch.randn(rows, 128, generator=g)
        gate, up = plain(x).chunk(2, dim=-1)
        torch.testing.assert_close(gated(x), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
