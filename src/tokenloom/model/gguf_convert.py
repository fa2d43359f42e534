"""Turns a GGUF file into a Hugging Face checkpoint directory (float32 safetensors, config.json, tokenizer).

Dequantizing SmolLM2's Q4_1/Q8_0 tensors takes tens of seconds, so the result is kept in the local cache and a
second start reads plain safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenloom.model.registry import UnsupportedModelError, gguf_family, gguf_names

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def cache_root() -> Path:
    return Path(os.environ.get("TOKENLOOM_CACHE", Path.home() / ".cache" / "tokenloom"))


def converted_dir_for(gguf_path: Path) -> Path:
    """The cache directory for one GGUF file, keyed by its name, size and modification time."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{key}"


def ensure_converted(gguf_path: Path) -> Path:
    target = converted_dir_for(gguf_path)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        convert_gguf(gguf_path, staging)
        try:
            staging.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    family = gguf_family(arch)
    if family is None or family.gguf is None:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; tokenloom reads {', '.join(gguf_names())}"
        )
    hf_arch, model_type = family.architecture, family.gguf.model_type
    tensors: dict[str, np.ndarray] = {}
    for name, tensor, heads in hf_tensors(reader):
        array = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])
        tensors[name] = array if heads is None else unpermute_rows(array, heads)
    tokenizer = _convert_tokenizer(gguf_path)
    config = _hf_config(reader, arch, hf_arch, model_type, tensors, tokenizer)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out_dir))


def _hf_config(reader, arch: str, hf_arch: str, model_type: str, tensors, tokenizer) -> dict[str, Any]:
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32",
    }


def _convert_tokenizer(gguf_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _hf_tensor_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{_TENSOR_NAMES[base]}.{suffix}"
    return f"{_TENSOR_NAMES[parts[0]]}.{parts[1]}"


def hf_tensors(reader) -> Iterator[tuple[str, Any, int | None]]:
    """Each tensor of a GGUF file (a gguf.GGUFReader's) with its Hugging Face name and, for Q and K weights that
    llama.cpp permuted, the heads to unpermute its rows by (unpermute_rows); None for every other tensor."""
    arch = _field(reader, "general.architecture")
    family = gguf_family(arch)
    permuted = family is not None and family.gguf is not None and family.gguf.permuted_qk
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        heads = None
        if permuted and name.endswith("q_proj.weight"):
            heads = num_heads
        elif permuted and name.endswith("k_proj.weight"):
            heads = num_kv_heads
        yield name, tensor, heads


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation (interleaved rotary pairs) back to HF's rotate-half layout; a row may
    be values or a quantized row's blocks."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF file lacks the metadata field {key!r}")
        return default
    return field.contents()
