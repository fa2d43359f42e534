"""The embedded SmolLM2-135M-Instruct quantized into a compressed-tensors checkpoint, as llm-compressor saves one
without calibration (scales from each weight's range, round to nearest; the LM head left plain), for serving
such a checkpoint on both engines (vs_vllm.py --model DIR).

    .venv/bin/python benchmarks/compressed_checkpoint.py --scheme w8a8|w4a16 --out DIR

w8a8: int8 weights per output channel, int8 activations per token at run time (int-quantized); w4a16: int4 weights
in groups of 64 (pack-quantized; SmolLM2's width, 576, is not a multiple of 128). Needs the compressed-tensors
library (in the test extras).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import transformers
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams

from tokenloom.model.loader import resolve_checkpoint_dir

SCHEMES = {
    "w8a8": ("int-quantized", QuantizationArgs(num_bits=8, type="int", strategy="channel"),
             QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True)),
    "w4a16": ("pack-quantized", QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=64), None),
}  # fmt: skip


def set_weight_qparams(module: torch.nn.Module, args: QuantizationArgs) -> None:
    weight = module.weight.data.float()
    if args.strategy == "group":
        grouped = weight.reshape(weight.shape[0], -1, args.group_size)
        low, high = grouped.amin(-1), grouped.amax(-1)
    else:
        low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    scale, _ = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="w8a8")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    source = resolve_checkpoint_dir(None)[1]
    fmt, weights, activations = SCHEMES[args.scheme]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        quantized = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if quantized is not None:
            set_weight_qparams(module, quantized)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(args.out)
    compressor.update_config(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, args.out / name)
    print(f"{args.scheme} checkpoint of {source.name} in {args.out}")


if __name__ == "__main__":
    main()
