"""The architecture of a checkpoint, read from its Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tokenloom.model.registry import family_of, is_classifier

SCALE_BYTES = 4  # an 8-bit KV cache's float32 scale per (token, KV head): kv_quant.py


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    # A *ForSequenceClassification checkpoint's classification head (score.weight): its labels' names, in order
    # (config.json's id2label); empty for a causal LM.
    labels: tuple[str, ...] = ()
    # Its labels are independent (problem_type multi_label_classification): a sigmoid each, not a softmax over them.
    multi_label: bool = False

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def kv_bytes_per_token(self, element_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """K and V of one token across all layers: layers x 2 x KV heads x head dim x element size, or for an
        8-bit cache (kv_cache_dtype other than 'auto') x (head dim + 4): a byte per value and a float32 scale per head.

        The engine sizes its KV pool with this, and so does `tokenloom plan`.
        """
        if kv_cache_dtype != "auto":
            return self.num_layers * 2 * self.num_kv_heads * (self.head_dim + SCALE_BYTES)
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element_bytes

    def shard(self, world_size: int) -> ModelConfig:
        """What one rank of a tensor-parallel group holds: 1/world_size of the heads, KV heads and MLP width.

        ValueError when a count does not divide (vLLM refuses the same; KV heads could be replicated instead,
        which tokenloom does not do yet).
        """
        if world_size == 1:
            return self
        for name, count in (
            ("attention heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            ("intermediate size", self.intermediate_size),
        ):
            if count % world_size:
                raise ValueError(f"the model's {name} ({count}) are not divisible by tensor_parallel_size={world_size}")
        return replace(
            self,
            num_heads=self.num_heads // world_size,
            num_kv_heads=self.num_kv_heads // world_size,
            intermediate_size=self.intermediate_size // world_size,
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        family = family_of(hf.get("architectures") or [], hf.get("model_type"))
        num_heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        rope_scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=family.architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            labels=_labels(hf) if is_classifier(hf.get("architectures") or []) else (),
            multi_label=hf.get("problem_type") == "multi_label_classification",
            **family.features(hf),
        )


def _labels(hf: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels as transformers reads them: id2label's names by id, else num_labels (2 by default) of
    LABEL_i."""
    id2label = {int(i): str(name) for i, name in (hf.get("id2label") or {}).items()}
    count = len(id2label) or int(hf.get("num_labels") or 2)
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(count))
