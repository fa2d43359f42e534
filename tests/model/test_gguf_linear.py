"""--quantization gguf: a GGUF's 4-bit linears kept as stored, each weight widened to float32 as gguf dequantizes it,
so that the served model is the dequantized one bit for bit where that one runs f32_linear."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_blocks import raw_blocks
from helpers import needs_operator

from tokenloom import LLM, EngineConfig, SamplingParams
from tokenloom.model import cpu_kernel, gguf_linear
from tokenloom.model.footprint import held_weight_bytes
from tokenloom.model.gguf_linear import GGUFLinear, gguf_groups
from tokenloom.model.loader import default_gguf_path
from tokenloom.model.prepack import f32_pack_weight
from tokenloom.model.quantization import check_quantization, gguf_linear_available


def dequantized(raw: np.ndarray, fmt: str, n: int, k: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(n, k)


def needs_gguf_operator() -> None:
    needs_operator()
    if not gguf_linear_available(torch.device("cpu")):
        pytest.skip("tokenloom::gguf_linear is built for CPUs with AVX2 and FMA")


def width(fmt: str) -> int:
    """Inputs in a test weight of this format: whole blocks of 256 for the K-quants, an odd number of 32s else."""
    return 768 if fmt in gguf_linear.IN_SUPER_BLOCKS else 576


@pytest.mark.parametrize("fmt", gguf_linear.FORMATS)
def test_codes_scales_and_offsets_are_ggufs_values_bit_for_bit(fmt):
    n, k, group = 48, 512, 16 if fmt in gguf_linear.BY_SIXTEEN else 32
    raw = raw_blocks(fmt, n, k)
    codes, scales, offsets = gguf_groups(raw, fmt, (n, k))
    assert codes.shape == (n, k) and scales.shape == offsets.shape == (n, k // group)
    assert codes.dtype == np.int8 if fmt not in gguf_linear.FOUR_BIT else codes.max() <= 15
    assert len(np.unique(codes)) == {"Q2_K": 4, "Q3_K": 8, "IQ4_NL": 16, "IQ4_XS": 16}.get(fmt, len(np.unique(codes)))
    values = (
        codes.reshape(n, k // group, group) * scales[..., None] + offsets[..., None]
    )  # one rounding: the product is exact
    assert torch.equal(torch.from_numpy(values.reshape(n, k).astype(np.float32)), dequantized(raw, fmt, n, k))
    # The packed layout gives the same weight back.
    assert torch.equal(GGUFLinear((codes, scales, offsets), None).dequantized(), dequantized(raw, fmt, n, k))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 97, 200])
@pytest.mark.parametrize("fmt", ["Q3_K", "Q4_0", "Q4_1", "Q5_1", "Q6_K", "Q8_0", "IQ4_XS"])
def test_gguf_linear_is_f32_linear_over_the_dequantized_weight_bit_for_bit(fmt, rows):
    needs_gguf_operator()
    n, k = 80, width(fmt)  # 5 blocks: tiles of two blocks and one of one
    raw = raw_blocks(fmt, n, k, seed=rows)
    weight = dequantized(raw, fmt, n, k)
    bias = torch.randn(n) if rows % 2 else None
    layer = GGUFLinear(gguf_groups(raw, fmt, (n, k)), bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    out = layer.rows_forward(x)
    assert torch.equal(out, torch.ops.tokenloom.f32_linear(x, f32_pack_weight(weight), bias))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    # Rows of another dtype run in float32 and come back in theirs; leading dimensions are kept.
    halved = layer(x.to(torch.bfloat16).view(1, rows, k))
    assert halved.dtype == torch.bfloat16 and halved.shape == (1, rows, n)
    torch.testing.assert_close(halved.float().view(rows, n), F.linear(x.to(torch.bfloat16).float(), weight, bias),
                               rtol=2e-2, atol=2e-2)  # fmt: skip


@pytest.mark.parametrize("rows", [1, 13])
def test_a_fused_projection_of_mixed_formats_is_one_8_bit_weight(rows):
    """A Q4_K_M file's query and key in Q4_K, its value in Q6_K: one weight, 8-bit codes in groups of 16."""
    needs_gguf_operator()
    k, members = 512, [("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)]
    raws = [raw_blocks(fmt, n, k, seed=i) for i, (fmt, n) in enumerate(members)]
    parts = [gguf_groups(raw, fmt, (n, k)) for raw, (fmt, n) in zip(raws, members, strict=True)]
    fused = gguf_linear.in_one_form(parts)
    layer = GGUFLinear(fused, None)
    assert (layer.bits, layer.group) == (8, 16)
    weight = torch.cat([dequantized(raw, fmt, n, k) for raw, (fmt, n) in zip(raws, members, strict=True)])
    assert torch.equal(layer.dequantized(), weight)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(layer.rows_forward(x), torch.ops.tokenloom.f32_linear(x, f32_pack_weight(weight), None))
    same = gguf_linear.in_one_form([gguf_groups(raws[0], "Q4_K", (64, k))] * 2)  # one format: kept as it is
    assert same[0].dtype == np.uint8 and gguf_linear.group_size(same) == 32


PROMPTS = [{"prompt_token_ids": [1, 504, 3458, 282, 4914, 314]}, {"prompt_token_ids": [1, 2683, 418, 346, 47]}]


def assert_the_dequantized_models_outputs(served: LLM, model: str | None, max_tokens: int) -> None:
    """`served`'s greedy tokens and logprobs are, bit for bit, those of `model` dequantized (--quantization none)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    ours = served.generate(PROMPTS, params, use_tqdm=False)
    dequantized = LLM(model, dtype="float32", quantization="none")
    assert dequantized.engine.quantization is None
    assert not any(isinstance(m, GGUFLinear) for m in dequantized.engine.core.runner.model.modules())
    plain = dequantized.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(ours, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the same logits, bit for bit


def test_the_embedded_gguf_serves_its_own_blocks_with_the_dequantized_models_tokens():
    """In float32 by default (quantization None), as with --quantization gguf; 'none' dequantizes."""
    needs_gguf_operator()
    served = LLM(None, dtype="float32")
    assert served.engine.quantization == "gguf"
    model = served.engine.core.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 4 * len(model.layers) and {m.bits for m in linears} == {4}  # every layer's, all Q4_1
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.bits == 8  # the tied embedding's Q8_0
    assert gguf_linear.served_weight_bytes(default_gguf_path()) == held_weight_bytes(model)
    assert_the_dequantized_models_outputs(served, None, 24)


Tensor = tuple[str, np.ndarray, gguf.GGMLQuantizationType]  # a name, its data (a quantized one's blocks), its type


def write_gguf(
    target: Path, fields: list, tensors: list[Tensor], arch: str = "llama", numbers: dict[str, int] | None = None
) -> None:
    """A GGUF file of `fields` (a reader's: its metadata, less the architecture the writer adds), `numbers` (uint32
    fields) and `tensors`."""
    writer = gguf.GGUFWriter(str(target), arch)
    for key, value in (numbers or {}).items():
        writer.add_uint32(key, value)
    for field in fields:
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    for name, data, qtype in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()


def metadata(reader: gguf.GGUFReader, prefix: str = "") -> list:
    """A reader's fields whose names start with `prefix`, less the ones a writer adds itself."""
    own = (gguf.Keys.General.ARCHITECTURE, "GGUF.")
    return [f for f in reader.fields.values() if f.name.startswith(prefix) and not f.name.startswith(own)]


def requantized_gguf(source: Path, target: Path, formats: dict[str, str]) -> None:
    """`source` written to `target` with every tensor whose name ends in a key of `formats` dequantized and quantized
    again in that format by gguf-py; its metadata and other tensors as they were."""
    reader = gguf.GGUFReader(str(source))
    tensors = []
    for tensor in reader.tensors:
        fmt = next((f for suffix, f in formats.items() if tensor.name.endswith(suffix)), None)
        data, qtype = tensor.data, tensor.tensor_type
        if fmt is not None:
            qtype = gguf.GGMLQuantizationType[fmt]
            data = gguf.quants.quantize(gguf.quants.dequantize(tensor.data, tensor.tensor_type), qtype)
        tensors.append((tensor.name, data, qtype))
    write_gguf(target, metadata(reader), tensors, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())


def q4_k_m_gguf(
    target: Path, tokenizer_from: Path, base: str = "Q4_K", more_bits: str = "Q6_K", head: str | None = None
) -> None:
    """A 2-layer Llama in Q4_K_M's layout: Q4_K linears, layer 0's value and down projections in Q6_K (so its qkv mixes
    formats), the tied embedding in Q8_0; random blocks (every input count a multiple of 256), the tokenizer of
    `tokenizer_from`. Other K-quants in the two places (`base`, `more_bits`) make the other _M layouts; `head`, an
    output tensor of its own in that format (untied)."""
    hidden, heads, kv_heads, head_dim, mlp, layers = 256, 4, 2, 64, 512, 2
    vocab = len(gguf.GGUFReader(str(tokenizer_from)).fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    tensors: list[Tensor] = [
        ("token_embd.weight", gguf.quants.quantize(rng.standard_normal((vocab, hidden), np.float32) * 0.05, q8), q8),
        ("output_norm.weight", np.ones(hidden, np.float32), gguf.GGMLQuantizationType.F32),
    ]
    if head is not None:
        tensors.append(
            ("output.weight", raw_blocks(head, vocab, hidden, seed=99, unit=1e-3), gguf.GGMLQuantizationType[head])
        )
    for i in range(layers):
        more = more_bits if i == 0 else base
        shapes = {
            "attn_q": (base, heads * head_dim, hidden),
            "attn_k": (base, kv_heads * head_dim, hidden),
            "attn_v": (more, kv_heads * head_dim, hidden),
            "attn_output": (base, hidden, heads * head_dim),
            "ffn_gate": (base, mlp, hidden),
            "ffn_up": (base, mlp, hidden),
            "ffn_down": (more, hidden, mlp),
        }
        for j, (name, (fmt, n, k)) in enumerate(shapes.items()):
            blocks = raw_blocks(fmt, n, k, seed=10 * i + j, unit=1e-4)
            tensors.append((f"blk.{i}.{name}.weight", blocks, gguf.GGMLQuantizationType[fmt]))
        for norm in ("attn_norm", "ffn_norm"):
            tensors.append((f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32), gguf.GGMLQuantizationType.F32))
    numbers = {"llama.block_count": layers, "llama.context_length": 512, "llama.embedding_length": hidden,
               "llama.feed_forward_length": mlp, "llama.attention.head_count": heads,
               "llama.attention.head_count_kv": kv_heads}  # fmt: skip
    write_gguf(target, metadata(gguf.GGUFReader(str(tokenizer_from)), "tokenizer."), tensors, numbers=numbers)


def test_a_gguf_of_5_bit_and_mixed_formats_serves_the_dequantized_models_tokens(tmp_path, monkeypatch):
    """The embedded model with its value projections in Q5_1 (each layer's fused qkv then mixes them with Q4_1's
    query and key) and its down projections in Q5_0, through the converter, the loader and gguf_linear."""
    needs_gguf_operator()
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))  # its conversion, not the user's cache
    path = tmp_path / "smollm2-q5.gguf"
    requantized_gguf(default_gguf_path(), path, {"attn_v.weight": "Q5_1", "ffn_down.weight": "Q5_0"})
    served = LLM(str(path), dtype="float32")
    assert served.engine.quantization == "gguf"
    assert all(isinstance(layer.self_attn.qkv_proj, GGUFLinear) and layer.self_attn.qkv_proj.bits == 8
               and layer.mlp.down_proj.bits == 8 and layer.mlp.gate_up_proj.bits == 4
               for layer in served.engine.core.runner.model.layers)  # fmt: skip
    assert gguf_linear.served_weight_bytes(path) == held_weight_bytes(served.engine.core.runner.model)
    assert_the_dequantized_models_outputs(served, str(path), 16)


def test_a_q4_k_m_gguf_serves_every_linear_from_its_blocks_with_the_dequantized_models_tokens(tmp_path, monkeypatch):
    """Every linear and the head of a file in Q4_K_M's layout from their blocks, through converter and loader."""
    needs_gguf_operator()
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-q4_k_m.gguf"
    q4_k_m_gguf(path, default_gguf_path())
    served = LLM(str(path), dtype="float32")
    model = served.engine.core.runner.model
    first, second = model.layers
    assert (first.self_attn.qkv_proj.bits, first.self_attn.qkv_proj.group) == (8, 16)  # Q4_K and Q6_K in one
    assert (first.mlp.down_proj.bits, first.mlp.down_proj.group) == (8, 16)
    assert (second.self_attn.qkv_proj.bits, second.self_attn.qkv_proj.group) == (4, 32)  # all Q4_K
    assert isinstance(first.mlp.gate_up_proj, GGUFLinear) and isinstance(model.lm_head, GGUFLinear)
    assert gguf_linear.served_weight_bytes(path) == held_weight_bytes(model)
    assert_the_dequantized_models_outputs(served, str(path), 12)


@pytest.mark.parametrize(("base", "more_bits", "forms"), [("Q2_K", "Q3_K", {(8, 16)}),
                                                           ("IQ4_XS", "IQ4_NL", {(8, 32)})])  # fmt: skip
def test_a_2_3_bit_or_iq4_gguf_serves_every_linear_from_its_blocks_with_the_dequantized_models_tokens(
    tmp_path, monkeypatch, base, more_bits, forms
):
    """The 2- and 3-bit K-quants (a byte a code, a scale and offset per 16 inputs: 12 bits a weight against float32's
    32) and the non-linear IQ4_XS and IQ4_NL (the value a code picks, in a byte, a scale per 32) from their blocks:
    `base` linears, layer 0's value and down projections in `more_bits`."""
    needs_gguf_operator()
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{base}.gguf"
    q4_k_m_gguf(path, default_gguf_path(), base=base, more_bits=more_bits)
    served = LLM(str(path), dtype="float32")
    model = served.engine.core.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 8 and {(m.bits, m.group) for m in linears} == forms
    assert gguf_linear.served_weight_bytes(path) == held_weight_bytes(model)
    assert_the_dequantized_models_outputs(served, str(path), 12)


def test_a_gguf_is_served_from_its_blocks_by_default_only_where_that_is_exact(monkeypatch):
    from tokenloom.engine.core_setup import served_quantization

    needs_gguf_operator()
    gguf, cpu = Path("model.gguf"), torch.device("cpu")

    def served(gguf_file: Path | None = gguf, dtype: torch.dtype = torch.float32, **options) -> str | None:
        return served_quantization(EngineConfig.from_kwargs(**options), gguf_file, dtype, cpu)

    assert served() == "gguf"
    assert served(quantization="none") is None and served(quantization="int8") == "int8"
    assert served(gguf_file=None) is None  # a checkpoint directory: its weights as stored
    assert served(dtype=torch.bfloat16) is None  # the blocks run in float32: not the bf16 model's outputs
    assert served(tensor_parallel_size=2) is None  # the blocks are not sharded
    assert served(enable_lora=True) is None and served(enforce_eager=False) is None  # adapters, torch.compile
    assert served_quantization(EngineConfig(), gguf, torch.float32, torch.device("meta")) is None
    monkeypatch.setattr(cpu_kernel, "has_operator", lambda name: False)
    assert served() is None


def test_a_ggufs_groups_are_read_once_then_from_the_cache(tmp_path, monkeypatch):
    from tokenloom.model.gguf_convert import converted_dir_for

    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path))
    path = default_gguf_path()
    read = gguf_linear.cached_weight_groups(path)
    assert (converted_dir_for(path) / gguf_linear.GROUPS_FILE).exists()
    monkeypatch.setattr(gguf_linear, "gguf_weight_groups", lambda path: pytest.fail("read the GGUF again"))
    cached = gguf_linear.cached_weight_groups(path)
    assert read.keys() == cached.keys() and "layers.0.self_attn.qkv_proj" in cached and "embed_tokens" in cached
    for key, groups in read.items():
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(groups, cached[key], strict=True))


def test_gguf_quantization_is_refused_where_it_cannot_run(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig.from_kwargs(quantization="gguf", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="device is meta"):
        check_quantization("gguf", torch.device("meta"))
    monkeypatch.setattr(cpu_kernel, "has_operator", lambda name: False)
    with pytest.raises(ValueError, match="AVX2 and FMA"):
        check_quantization("gguf", torch.device("cpu"))
    monkeypatch.undo()
    if gguf_linear_available(torch.device("cpu")):
        with pytest.raises(ValueError, match="not a GGUF"):
            LLM(str(tiny_llama), dtype="float32", quantization="gguf")


def test_the_avx2_build_gives_f32_linears_outputs_too(tmp_path):
    """Where this CPU has AVX-512, the engine's build never runs gguf_linear's AVX2 path: build it apart."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if os.uname().machine != "x86_64" or " avx2" not in flags or " fma" not in flags:
        pytest.skip("runs x86 code for AVX2 and FMA")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    script = Path(__file__).with_name("f32_linear_avx2_build.py")
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-2000:]
