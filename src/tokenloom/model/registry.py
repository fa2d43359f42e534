"""The model families tokenloom runs, one entry each. The config reader, the loader, the planner's parameter count,
tensor-parallel sharding and the GGUF converter all read an entry, so a new family is a model file and one entry.

A model file defines an ``nn.Module`` built as ``Model(config, max_len, tp)`` (the whole model's ``ModelConfig``,
the rotary tables' length, this rank's ``TensorParallelGroup``) with ``load_hf_weights(named tensors)``, the
forward ``model(input_ids, positions, kv_caches, meta)`` and ``compute_logits(hidden)`` (``llama.py`` is the one
there is). A Llama-family variant that differs only in biases, norms or a sliding window is an entry that points
at ``llama.py`` with its own ``features``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallelLayout:
    """How a rank's shard is cut from the checkpoint, by the module names of its Hugging Face tensors."""

    column_parallel: tuple[str, ...]  # split by output rows: whole heads, 1/N of the MLP width
    row_parallel: tuple[str, ...]  # split by input columns: partial sums, all-reduced


LLAMA_TENSOR_PARALLEL = TensorParallelLayout(
    column_parallel=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), row_parallel=("o_proj", "down_proj")
)


@dataclass(frozen=True)
class GGUFLayout:
    """What a GGUF file of the family says, and what converting it back to a Hugging Face checkpoint needs."""

    name: str  # the file's general.architecture
    model_type: str  # config.json's model_type
    permuted_qk: bool  # llama.cpp permuted the Q and K rows into its rotary layout


@dataclass(frozen=True)
class ModelFamily:
    architecture: str  # as Hugging Face's config.json names it in "architectures"
    model: str  # "module:Class" of the model file's module, imported when a model is built
    # The config fields of ModelConfig that differ between families (qkv_bias, o_bias, mlp_bias, qk_norm,
    # sliding_window), read from a Hugging Face config.json.
    features: Callable[[dict[str, Any]], dict[str, Any]]
    tensor_parallel: TensorParallelLayout = LLAMA_TENSOR_PARALLEL
    gguf: GGUFLayout | None = None

    def model_class(self) -> Any:
        """The model file's class (imported here, so reading a config never imports torch models)."""
        module, name = self.model.split(":")
        return getattr(importlib.import_module(module), name)


def _llama_features(hf: dict[str, Any]) -> dict[str, Any]:
    attention_bias = bool(hf.get("attention_bias", False))
    return {
        "qkv_bias": attention_bias,
        "o_bias": attention_bias,
        "mlp_bias": bool(hf.get("mlp_bias", False)),
        "qk_norm": False,
        "sliding_window": hf.get("sliding_window") if hf.get("use_sliding_window", False) else None,
    }


def _mistral_features(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's, with a sliding window unless the config turns it off."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
    return {**_llama_features(hf), "sliding_window": window}


def _qwen2_features(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's, with biases on Q, K and V (always) and none on the output projection."""
    return {**_llama_features(hf), "qkv_bias": True, "o_bias": False}


def _qwen3_features(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's, with an RMSNorm over each head's queries and keys before the rotary embedding."""
    return {**_llama_features(hf), "qk_norm": True}


LLAMA_MODEL = "tokenloom.model.llama:CausalLM"

FAMILIES: dict[str, ModelFamily] = {
    family.architecture: family
    for family in (
        ModelFamily("LlamaForCausalLM", LLAMA_MODEL, _llama_features, gguf=GGUFLayout("llama", "llama", True)),
        ModelFamily("MistralForCausalLM", LLAMA_MODEL, _mistral_features),
        ModelFamily("Qwen2ForCausalLM", LLAMA_MODEL, _qwen2_features, gguf=GGUFLayout("qwen2", "qwen2", False)),
        ModelFamily("Qwen3ForCausalLM", LLAMA_MODEL, _qwen3_features, gguf=GGUFLayout("qwen3", "qwen3", False)),
    )
}


class UnsupportedModelError(ValueError):
    pass


def gguf_family(name: str) -> ModelFamily | None:
    """The family whose GGUF files name their architecture so (general.architecture), if tokenloom reads it."""
    return next((f for f in FAMILIES.values() if f.gguf is not None and f.gguf.name == name), None)


def gguf_names() -> list[str]:
    return [f.gguf.name for f in FAMILIES.values() if f.gguf is not None]


CLASSIFIER_SUFFIX = "ForSequenceClassification"  # a family's model with a classification head (score.weight)


def family_of(architectures: list[str], model_type: str | None = None) -> ModelFamily:
    """The first of a config's architectures that tokenloom runs (a family's *ForSequenceClassification among them:
    its model with a classification head); UnsupportedModelError naming those it does."""
    for architecture in architectures:
        causal = causal_architecture(architecture)
        if causal in FAMILIES:
            return FAMILIES[causal]
    raise UnsupportedModelError(
        f"unsupported architecture {architectures or model_type!r}; tokenloom runs {', '.join(FAMILIES)} (and "
        f"each one's *{CLASSIFIER_SUFFIX})"
    )


def causal_architecture(architecture: str) -> str:
    """A classifier's family's causal LM ("Qwen3ForSequenceClassification" -> "Qwen3ForCausalLM"), else itself."""
    if architecture.endswith(CLASSIFIER_SUFFIX):
        return architecture.removesuffix(CLASSIFIER_SUFFIX) + "ForCausalLM"
    return architecture


def is_classifier(architectures: list[str]) -> bool:
    """Whether the first architecture tokenloom runs is a *ForSequenceClassification (its own classification head)."""
    known = [a for a in architectures if causal_architecture(a) in FAMILIES]
    return bool(known) and known[0].endswith(CLASSIFIER_SUFFIX)
