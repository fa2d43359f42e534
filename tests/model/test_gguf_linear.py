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
from helpers import needs_operator

from tokenloom import LLM, EngineConfig, SamplingParams
from tokenloom.model import cpu_kernel, gguf_linear
from tokenloom.model.gguf_linear import GGUFLinear, gguf_groups
from tokenloom.model.prepack import f32_pack_weight
from tokenloom.model.quantization import check_quantization


def raw_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """A weight [n, k] in a GGUF format's blocks ([n, bytes per row] uint8), as gguf-py quantizes it (Q4_0, Q4_1,
    Q8_0) or, for Q4_K (which gguf-py does not quantize), blocks of random codes, scales and mins."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[fmt]
    if fmt != "Q4_K":
        weight = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        weight[:, 3] += 0.4  # an outlier input, as real weights have
        return gguf.quants.quantize(weight, qtype)
    blocks = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
    halves = (rng.random((n * k // 256, 2)) * 0.01 + 1e-3).astype(np.float16)  # d and dmin: finite, positive
    blocks[:, 0:4] = halves.view(np.uint8)
    return blocks.reshape(n, -1)


def dequantized(raw: np.ndarray, fmt: str, n: int, k: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(n, k)


def needs_gguf_operator() -> None:
    needs_operator()
    if not gguf_linear.gguf_linear_available():
        pytest.skip("tokenloom::gguf_linear is built for CPUs with AVX2 and FMA")


@pytest.mark.parametrize("fmt", gguf_linear.FORMATS)
def test_codes_scales_and_offsets_are_ggufs_values_bit_for_bit(fmt):
    n, k = 48, 512
    raw = raw_blocks(fmt, n, k)
    codes, scales, offsets = gguf_groups(raw, fmt, (n, k))
    assert codes.shape == (n, k) and scales.shape == offsets.shape == (n, k // 32)
    assert codes.dtype == np.int8 if fmt == "Q8_0" else codes.max() <= 15
    values = (
        codes.reshape(n, k // 32, 32) * scales[..., None] + offsets[..., None]
    )  # one rounding: the product is exact
    assert torch.equal(torch.from_numpy(values.reshape(n, k).astype(np.float32)), dequantized(raw, fmt, n, k))
    # The packed layout gives the same weight back.
    assert torch.equal(GGUFLinear((codes, scales, offsets), None).dequantized(), dequantized(raw, fmt, n, k))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 12, 13, 97, 200])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_linear_is_f32_linear_over_the_dequantized_weight_bit_for_bit(fmt, rows):
    needs_gguf_operator()
    n, k = 80, 576  # 5 blocks: tiles of two blocks and one of one
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


def test_the_embedded_gguf_serves_its_own_blocks_with_the_dequantized_models_tokens():
    needs_gguf_operator()
    prompts = [{"prompt_token_ids": [1, 504, 3458, 282, 4914, 314]}, {"prompt_token_ids": [1, 2683, 418, 346, 47]}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    served = LLM(None, dtype="float32", quantization="gguf")
    model = served.engine.core.runner.model
    linears = [m for m in model.layers.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 4 * len(model.layers) and {m.bits for m in linears} == {4}  # every layer's, all Q4_1
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.bits == 8  # the tied embedding's Q8_0
    ours = served.generate(prompts, params, use_tqdm=False)
    del served, model, linears
    plain = LLM(None, dtype="float32").generate(prompts, params, use_tqdm=False)
    for a, b in zip(ours, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the same logits, bit for bit


def test_a_ggufs_groups_are_read_once_then_from_the_cache(tmp_path, monkeypatch):
    from tokenloom.model.gguf_convert import converted_dir_for
    from tokenloom.model.loader import default_gguf_path

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
    if gguf_linear.gguf_linear_available():
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
