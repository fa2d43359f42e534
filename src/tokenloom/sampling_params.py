"""Per-request generation settings, validated on construction (no torch here)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal

from tokenloom.pooling_params import PoolingParams

# What torch.Generator.manual_seed takes: any signed or unsigned 64-bit integer.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# What a token's logprobs are (the engine's logprobs_mode, vLLM's --logprobs-mode; model/sampler.py).
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's names): exactly one of a JSON schema, any JSON object, a regular
    expression, a choice of strings, or an EBNF grammar (GBNF, as llama.cpp writes them)."""

    json: str | dict | None = None  # a JSON schema, as text or parsed
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # A reasoning model's end of thought (the token ids of `</think>`): the grammar holds only once the output ends
    # with them, so the model thinks freely first (vLLM's structured output with a reasoning parser).
    starts_after: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.starts_after is not None:
            object.__setattr__(self, "starts_after", tuple(self.starts_after))
            if not self.starts_after:
                raise ValueError("StructuredOutputsParams: starts_after needs at least one token id")
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None]
        if sum(given) + (self.grammar is not None) != 1:
            raise ValueError("StructuredOutputsParams: give exactly one of json, json_object, regex, choice, grammar")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutputsParams: choice must be a non-empty list of non-empty strings")


class RequestOutputKind(enum.Enum):
    """Which outputs a request's caller is given, as vLLM names them: one after every step that brought it tokens,
    each with all of its text and tokens so far (CUMULATIVE: streaming, per-token metrics) or only what the step
    added (DELTA: text, token ids and logprobs since the output before; prompt logprobs with the first), or only the
    last one (FINAL_ONLY: ``LLM.generate``, which then builds no output for the steps between)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops; names and defaults follow vLLM and the OpenAI API."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text ends after the stop string instead of before it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per generated token
    prompt_logprobs: int | None = None  # the same for each prompt token after the first (computes the whole prompt)
    min_tokens: int = 0  # until the output has this many tokens, its stop tokens cannot be sampled
    logit_bias: dict[int, float] | None = None  # added to these tokens' logits before sampling (OpenAI's)
    allowed_token_ids: list[int] | None = None  # only these can be sampled (vLLM's)
    # vLLM's: no word of these is completed in the output (its last token is banned where the output ends with the
    # tokens before it). Tokenized by the engine into bad_words_token_ids: each word alone, and after a space.
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    skip_special_tokens: bool = True  # special tokens' text left out of the output's
    structured_outputs: StructuredOutputsParams | None = None  # decode under a grammar (engine/structured_output.py)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # An embedding request (LLM.embed, /v1/embeddings): one greedy token is sampled, to end the request through the
    # path every request takes, and dropped; its output is the prompt's pooled hidden state (model/prompt_outputs.py).
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens must be an integer >= 1"),
            (
                self.seed is None or (isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX),
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}]",
            ),
            (math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature must be finite and >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0 (or -1 to disable)"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
                "repetition_penalty must be finite and > 0",
            ),
            # The most a request may ask for is the engine's (--max-logprobs): EngineClient.prepare_request.
            # -1: the whole vocabulary, as vLLM's (EngineClient.with_logprobs_resolved says how many that is).
            (self.logprobs is None or self.logprobs >= -1, "logprobs must be >= 0, or -1 for the vocabulary"),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= -1,
                "prompt_logprobs must be >= 0, or -1 for the vocabulary",
            ),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (_valid_logit_bias(self.logit_bias), "logit_bias must map token ids (integers) to finite numbers"),
            (
                self.allowed_token_ids is None
                or (bool(self.allowed_token_ids) and all(type(t) is int for t in self.allowed_token_ids)),
                "allowed_token_ids must be a non-empty list of token ids",
            ),
            (all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words must be words, not blanks"),
            (_valid_token_sequences(self.bad_words_token_ids), "bad_words_token_ids must be non-empty id lists"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"SamplingParams: {message}")

    @classmethod
    def for_embedding(cls, pooling: PoolingParams) -> SamplingParams:
        """An embedding request's params: its one token greedy, and dropped."""
        return cls(max_tokens=1, temperature=0.0, pooling=pooling)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def bad_words_read_the_output(self) -> bool:
        """A bad word of several tokens: its last is banned only after the others, so sampling reads the output."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids or [])

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _valid_token_sequences(sequences: list[list[int]] | None) -> bool:
    return sequences is None or all(isinstance(s, list) and s and all(type(t) is int for t in s) for s in sequences)


def _valid_logit_bias(bias: dict[int, float] | None) -> bool:
    return all(type(t) is int and isinstance(b, int | float) and math.isfinite(b) for t, b in (bias or {}).items())
