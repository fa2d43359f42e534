"""LoRA adapters for tests: PEFT's files with random A and B, and the oracle they are checked against, transformers
with each adapter merged into the base weights."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import hf_oracle
from safetensors.torch import load_file, save_file

from tokenloom.model.config import ModelConfig
from tokenloom.model.lora import projection_shapes

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_LINEARS = (*ATTENTION, "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, base: Path, seed: int, targets=ALL_LINEARS, rank=8, alpha=16.0, **config) -> Path:
    """A PEFT adapter of random A and B (PEFT starts B at zero; random B makes the adapter change the outputs)."""
    config_of_base = ModelConfig.from_hf(json.loads((base / "config.json").read_text()))
    shapes = projection_shapes(config_of_base)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config_of_base.num_layers):
        for projection in targets:
            block = "self_attn" if projection in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{projection}"
            out_features, in_features = shapes[projection]
            tensors[f"{prefix}.lora_A.weight"] = 0.3 * torch.randn(rank, in_features, generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.3 * torch.randn(out_features, rank, generator=generator)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}
    (directory / "adapter_config.json").write_text(json.dumps(settings | config))
    return directory


def merged_oracle(base: Path, adapter: Path | None):
    """transformers' float32 model with the adapter's deltas merged into its weights."""
    model = hf_oracle(base)
    if adapter is None:
        return model
    settings = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." in key:
                b = tensors[key.replace(".lora_A.", ".lora_B.")]
                name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                rank = a.shape[0]
                scale = settings["lora_alpha"] / (rank**0.5 if settings.get("use_rslora") else rank)
                weights[name] += scale * (b @ a)
    return model


def greedy_reference(model, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]
