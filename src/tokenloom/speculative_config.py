"""What ``--speculative-config`` holds (vLLM's JSON keys for its model-free methods), parsed and validated: the one
engine option that is a structure of its own (config.py holds it as ``speculative_config``)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_args

SpeculativeMethod = Literal["ngram", "suffix"]
T = TypeVar("T")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What ``--speculative-config`` holds: vLLM's JSON keys for its model-free methods, and tokenloom's ``dynamic``."""

    method: SpeculativeMethod = "ngram"
    """'ngram': prompt lookup, the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from prompt_lookup_max down to prompt_lookup_min); 'suffix': SuffixDecoding, the most frequent continuation of
    the longest matching suffix in the request's own tokens and in recent requests' outputs."""
    num_speculative_tokens: int | None = None
    """The most draft tokens a request verifies per step; required for ngram (as in vLLM), for suffix the tree
    depth by default."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest suffix that may match (vLLM: both default to 5 when neither is given)."""
    prompt_lookup_max: int | None = None
    """ngram: the longest suffix tried."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest suffix matched, and the longest continuation proposed."""
    suffix_decoding_max_cached_requests: int = 10000
    """suffix: how many finished requests' outputs the global index keeps (0: none, only the request's own tokens)."""
    suffix_decoding_max_spec_factor: float = 1.0
    """suffix: a match of m tokens proposes at most m * factor tokens (and at most num_speculative_tokens)."""
    suffix_decoding_min_token_prob: float = 0.1
    """suffix: a continuation stops where its estimated probability (its count over the match's) drops below this."""
    dynamic: bool = True
    """Speculate only where it pays: a request's drafts are verified only while its measured acceptance rate is above
    the share of a step's time that its tokens cost (fitted to the steps run so far); False: always."""

    def __post_init__(self) -> None:
        methods = get_args(SpeculativeMethod)
        require(self.method in methods, f"speculative_config: method must be one of {', '.join(methods)}")
        if self.method == "ngram":
            require(
                self.num_speculative_tokens is not None,
                "speculative_config: num_speculative_tokens must be given for method 'ngram'",
            )
        elif self.num_speculative_tokens is None:
            object.__setattr__(self, "num_speculative_tokens", self.suffix_decoding_max_tree_depth)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        object.__setattr__(self, "prompt_lookup_min", low or high or 5)
        object.__setattr__(self, "prompt_lookup_max", high or low or 5)
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_min",
            "prompt_lookup_max",
            "suffix_decoding_max_tree_depth",
        ):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"speculative_config: {name} must be a positive integer")
        require(
            self.num_lookup[0] <= self.num_lookup[1],
            "speculative_config: prompt_lookup_min must be <= prompt_lookup_max",
        )
        require(self.suffix_decoding_max_cached_requests >= 0, "speculative_config: max_cached_requests must be >= 0")
        require(self.suffix_decoding_max_spec_factor > 0, "speculative_config: max_spec_factor must be positive")
        require(0 <= self.suffix_decoding_min_token_prob <= 1, "speculative_config: min_token_prob must be in [0, 1]")

    @property
    def num_lookup(self) -> tuple[int, int]:
        assert self.prompt_lookup_min is not None and self.prompt_lookup_max is not None
        return self.prompt_lookup_min, self.prompt_lookup_max

    @property
    def num_tokens(self) -> int:
        assert self.num_speculative_tokens is not None
        return self.num_speculative_tokens

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From what a caller gives: a SpeculativeConfig, a dict (``LLM(speculative_config={...})``) or its JSON."""
        return parse_json_option(cls, value, "speculative_config")


def parse_json_option(cls: type[T], value: T | dict[str, Any] | str | None, name: str, what: str = "") -> T | None:
    """An engine option that is a structure of its own (a frozen dataclass), from what a caller gives: the structure,
    a dict or its JSON; a key that is not one of its fields is refused by name (``what`` says what the keys are for)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"EngineConfig: {name} is not valid JSON: {error}") from None
    require(isinstance(value, dict), f"{name} must be a JSON object")
    assert isinstance(value, dict)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    require(not unknown, f"{name}: unknown key(s) {unknown}; the keys are: {', '.join(sorted(known))}{what}")
    return cls(**value)


def require(ok: bool, message: str) -> None:
    """An EngineConfig check (the speculative config is part of it; config.py's checks call this one too)."""
    if not ok:
        raise ValueError(f"EngineConfig: {message}")
