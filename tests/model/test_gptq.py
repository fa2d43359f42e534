"""GPTQ's rounding of int8 weights (model/gptq.py): it cuts a linear's output error on inputs like its calibration's,
equals round-to-nearest where inputs are uncorrelated, and the engine calibrates every decoder linear at start."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom import LLM, SamplingParams
from tokenloom.model import quantization
from tokenloom.model.gptq import calibration_ids, gptq_codes, recording_input_hessians
from tokenloom.model.loader import load_tokenizer
from tokenloom.model.quantization import per_channel, rotate, rotated_hessian, rotation_signs


def correlated_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Inputs on a few directions plus a little noise, as a linear's inputs in a model are."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(12, k, generator=torch.Generator().manual_seed(99))
    return torch.randn(rows, 12, generator=g) @ basis + 0.05 * torch.randn(rows, k, generator=g)


def output_error(weight: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> float:
    return float(((weight - codes * scale[:, None]) @ x.T).pow(2).sum())


def test_gptq_cuts_the_output_error_on_inputs_like_its_calibration():
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    _, scale = per_channel(weight, 127.0)
    calibration, held_out = correlated_inputs(600, 128, 1), correlated_inputs(300, 128, 2)
    codes = gptq_codes(weight, calibration.double().T @ calibration.double(), scale)
    nearest = (weight / scale[:, None]).round().clamp(-127, 127)
    assert torch.equal(codes, codes.round()) and codes.abs().max() <= 127
    assert not torch.equal(codes, nearest)
    # GPTQ moves each code by at most a few steps: the same weight, rounded differently
    assert (codes - weight / scale[:, None]).abs().max() < 8
    for x in (calibration, held_out):
        assert output_error(weight, codes, scale, x) < 0.5 * output_error(weight, nearest, scale, x)


def test_uncorrelated_inputs_give_round_to_nearest_and_a_dead_input_zero():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    _, scale = per_channel(weight, 127.0)
    diagonal = torch.rand(64, generator=torch.Generator().manual_seed(4)).double() + 0.5
    diagonal[5] = 0.0  # an input that is always zero
    codes = gptq_codes(weight, torch.diag(diagonal), scale)
    nearest = (weight / scale[:, None]).round().clamp(-127, 127)
    assert torch.equal(codes[:, 5], torch.zeros(16))
    keep = torch.arange(64) != 5
    assert torch.equal(codes[:, keep], nearest[:, keep])


def test_the_recorder_sums_each_linears_inputs_and_lets_go():
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    x = torch.randn(10, 8)
    with recording_input_hessians(model) as recorders:
        model(x[:4])
        model(x[4:])
    hidden = torch.relu(model[0](x)).detach().double()
    torch.testing.assert_close(recorders["0"].sum, x.double().T @ x.double())
    torch.testing.assert_close(recorders["2"].sum, hidden.T @ hidden, rtol=1e-5, atol=1e-6)
    assert recorders["0"].rows == 10 and not model[0]._forward_hooks and not model[2]._forward_hooks


def test_the_rotated_hessian_is_that_of_the_rotated_inputs():
    signs = rotation_signs(128)
    assert signs is not None
    x = torch.randn(50, 128, dtype=torch.float64)
    rotated = rotate(x, signs)
    torch.testing.assert_close(rotated_hessian(x.T @ x, signs), rotated.T @ rotated)


def test_calibration_is_text_where_the_checkpoint_has_a_tokenizer(tiny_chat_model):
    sequences = calibration_ids(load_tokenizer(str(tiny_chat_model)), 49152)
    assert len(sequences) >= 8 and sum(map(len, sequences)) > 600
    assert sequences == calibration_ids(load_tokenizer(str(tiny_chat_model)), 49152)  # the same on every load
    assert all(0 <= t < 49152 for s in sequences for t in s)
    seeded = calibration_ids(None, 100)
    assert seeded == calibration_ids(None, 100) and all(0 <= t < 100 for s in seeded for t in s)


@pytest.mark.parametrize("model_fixture", ["tiny_chat_model", "tiny_llama"])
def test_the_engine_rounds_every_decoder_linear_by_gptq(request, monkeypatch, model_fixture):
    """Each decoder linear gets the Hessian of its own inputs: [K, K], the calibration's rows, positive definite
    enough to invert; and the engine still serves."""
    from helpers import needs_operator

    needs_operator()
    if not quantization.int8_available():
        pytest.skip("this torch build has no oneDNN int8 matmul")
    seen: list[tuple[int, int, torch.Tensor]] = []
    real = quantization.gptq_codes

    def spy(weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        seen.append((weight.shape[0], weight.shape[1], hessian))
        return real(weight, hessian, scale)

    monkeypatch.setattr(quantization, "gptq_codes", spy)
    path = request.getfixturevalue(model_fixture)
    llm = LLM(str(path), dtype="float32", quantization="int8")
    layers = llm.engine.core.runner.model.layers
    assert len(seen) == 4 * len(layers)
    for _, k, hessian in seen:
        assert hessian.shape == (k, k) and torch.allclose(hessian, hessian.T)
        assert torch.linalg.eigvalsh(hessian).min() > -1e-6 * torch.diagonal(hessian).max()
        assert torch.diagonal(hessian).sum() > 0
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("out_features", [64, 40])  # 40: not our kernels' 16-feature blocks, oneDNN's matmul alone
def test_gptq_codes_serve_the_same_product_on_every_path(out_features):
    """GPTQ's codes leave it transposed; every kernel must read them as the codes they are, at any row count."""
    from helpers import needs_operator

    needs_operator()
    if not quantization.int8_available():
        pytest.skip("no int8 kernels on this CPU")
    weight = torch.randn(out_features, 128, generator=torch.Generator().manual_seed(5))
    calibration = correlated_inputs(400, 128, 6)
    try:
        layer = quantization.Int8Linear(weight, None, hessian=calibration.double().T @ calibration.double())
    except ValueError:
        pytest.skip("this CPU's int8 kernel takes only 16-feature blocks")
    x = correlated_inputs(40, 128, 7)
    exact = x @ weight.T
    out = layer(x)
    assert (out - exact).norm() < 0.02 * exact.norm()
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(40)]), out)


@pytest.fixture
def codes_cache(tmp_path, monkeypatch):
    from tokenloom.model import gptq_cache

    monkeypatch.setenv("TOKENLOOM_GPTQ_CACHE", "1")
    monkeypatch.setattr(gptq_cache, "cache_dir", lambda: tmp_path)
    return tmp_path


def test_a_second_load_takes_the_codes_from_the_cache(tiny_llama, codes_cache, monkeypatch):
    from helpers import needs_operator

    needs_operator()
    if not quantization.int8_available():
        pytest.skip("no int8 kernels on this CPU")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = LLM(str(tiny_llama), dtype="float32", quantization="int8")
    assert len(list(codes_cache.glob("*.pt"))) == 1
    tokens = first.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids

    def no_gptq(*args: object) -> torch.Tensor:
        raise AssertionError("GPTQ ran although its codes were cached")

    monkeypatch.setattr(quantization, "gptq_codes", no_gptq)
    second = LLM(str(tiny_llama), dtype="float32", quantization="int8")
    layers = [first.engine.core.runner.model.layers, second.engine.core.runner.model.layers]
    pairs = zip(*([m for m in ls.modules() if isinstance(m, quantization.Int8Linear)] for ls in layers), strict=True)
    assert all(torch.equal(a.rounded_codes(), b.rounded_codes()) for a, b in pairs)
    assert second.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_the_key_changes_with_any_weight_or_the_calibration():
    from tokenloom.model.gptq_cache import codes_key

    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    calibration = [[1, 2, 3]]
    key = codes_key(model, calibration, "avx2")
    assert key == codes_key(model, [[1, 2, 3]], "avx2")
    assert key != codes_key(model, [[1, 2, 4]], "avx2") and key != codes_key(model, calibration, "avx512_vnni")
    with torch.no_grad():
        model[1].weight[3, 5] += 1e-3
    assert key != codes_key(model, calibration, "avx2")


def test_a_file_that_does_not_load_is_recomputed_not_fatal(codes_cache):
    from tokenloom.model.gptq_cache import load_codes, save_codes

    save_codes("k", {"0": torch.ones(2, 2, dtype=torch.int8)})
    assert torch.equal(load_codes("k")["0"], torch.ones(2, 2, dtype=torch.int8))
    (codes_cache / "k.pt").write_bytes(b"not a torch file")
    assert load_codes("k") is None and load_codes("absent") is None
