"""Checkpoints in the compressed-tensors format (llm-compressor's: W4A16, W8A16, W8A8, FP8), made here with that
library from a tiny random Llama: the engine dequantizes their weights at load and its greedy output in float32 is
transformers' (which decompresses them with the library) token for token; the packing reads as the library packs
it; a quantization method or format not read is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams

from tokenloom import LLM, SamplingParams
from tokenloom.model.compressed_tensors import unpack_int32
from tokenloom.model.loader import checkpoint_tensors

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
INT8_TOKEN = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
SCHEMES = {
    "w4a16-group": ("pack-quantized", QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=32), None),
    "w4a16-asymmetric": (
        "pack-quantized", QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
        None),
    "w8a16-channel": ("pack-quantized", QuantizationArgs(num_bits=8, type="int", strategy="channel"), None),
    "w8a8-channel": ("int-quantized", QuantizationArgs(num_bits=8, type="int", strategy="channel"), INT8_TOKEN),
    "w8a16-asymmetric": ("int-quantized", QuantizationArgs(num_bits=8, type="int", symmetric=False,
                                                           strategy="channel"), None),
    "fp8-channel": ("float-quantized", QuantizationArgs(num_bits=8, type="float", strategy="channel"), None),
    "fp8-tensor": ("float-quantized", QuantizationArgs(num_bits=8, type="float", strategy="tensor"), None),
    "fp8-static-input": ("float-quantized", QuantizationArgs(num_bits=8, type="float", strategy="tensor"),
                         QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)),
}  # fmt: skip


def quantized_checkpoint(directory, fmt: str, weights: QuantizationArgs, activations: QuantizationArgs | None):
    """A tiny random Llama, every linear but the LM head quantized by the library (scales from each weight's range,
    as llm-compressor's default observer sets them) and saved compressed."""
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.25,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is not None:
            _set_weight_qparams(module, args)
        if hasattr(module, "input_scale"):  # a static input scale, as calibration would leave it
            module.input_scale.data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return directory


def _set_weight_qparams(module: torch.nn.Module, args: QuantizationArgs) -> None:
    weight = module.weight.data
    if args.strategy == "group":
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        low, high = grouped.amin(-1), grouped.amax(-1)
    elif args.strategy == "channel":
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    else:
        low, high = weight.amin().reshape(1), weight.amax().reshape(1)
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))


def transformers_greedy(model: transformers.PreTrainedModel, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", list(SCHEMES))
def test_a_compressed_checkpoint_generates_what_transformers_does(tmp_path, name):
    directory = quantized_checkpoint(tmp_path / name, *SCHEMES[name])
    assert json.loads((directory / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "compressed-tensors"
    )
    config = transformers.CompressedTensorsConfig(dequantize=True)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=config)
    # Each linear's weight as the library decompresses it, and the LM head (left plain) as it was.
    ours = dict(checkpoint_tensors(directory))
    decompressed = dict(oracle.named_parameters())
    assert sorted(ours) == sorted(decompressed)
    for key, weight in decompressed.items():
        torch.testing.assert_close(ours[key], weight.data, rtol=0, atol=1e-7)
    expected = transformers_greedy(oracle, PROMPT, GREEDY.max_tokens)
    got = LLM(str(directory), dtype="float32").generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_unpack_as_the_library_packs_them(bits):
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(low, high + 1, (6, 100), dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_int32(pack_to_int32(codes, bits), bits, 100), codes)


def test_a_quantization_not_read_is_refused_by_name(tmp_path):
    directory = quantized_checkpoint(tmp_path / "w4", *SCHEMES["w4a16-group"])
    config = json.loads((directory / "config.json").read_text())
    awq = tmp_path / "awq"
    shutil.copytree(directory, awq)
    (awq / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quantized with 'awq', which is not read"):
        LLM(str(awq))
    nvfp4 = json.loads(json.dumps(config["quantization_config"])) | {"format": "nvfp4-pack-quantized"}
    nvfp4["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    (awq / "config.json").write_text(json.dumps({**config, "quantization_config": nvfp4}))
    with pytest.raises(ValueError, match=r"format 'nvfp4-pack-quantized' .* is not read"):
        LLM(str(awq))
    grouped = json.loads(json.dumps(config["quantization_config"]))
    grouped["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (awq / "config.json").write_text(json.dumps({**config, "quantization_config": grouped}))
    with pytest.raises(ValueError, match="actorder 'group'"):
        LLM(str(awq))
