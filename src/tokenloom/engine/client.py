"""What callers (the offline LLM, the async engine, the server) hold of an engine, wherever its core runs.

``EngineClient`` does the API-side work once for both engines: tokenization and the limits check of a new
request (on any thread), and the output processor's state. ``LLMEngine`` runs the core in this process;
``CoreProcessEngine`` talks to it in another.
"""

from __future__ import annotations

import dataclasses
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.request import Request, RequestLimits
from tokenloom.engine.core_outputs import EngineStats, QueueState
from tokenloom.engine.output_processor import OutputProcessor, RequestState
from tokenloom.engine.structured_output import GrammarCompiler
from tokenloom.hf_overrides import HFOverrides
from tokenloom.lora import LoRARequest
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import Tokenizer
from tokenloom.model.lora import read_adapter_config
from tokenloom.model.platform import dtype_name
from tokenloom.model.token_bias import bad_word_sequences
from tokenloom.outputs import RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class InvalidField(ValueError):
    """A request that can never be served because of one of its fields, named so a server can say which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class KVCacheInfo:
    """The KV pool as /version, /metrics, the start-up log and `tokenloom diagnose` describe it."""

    dtype: str  # what each value is stored as: the model's dtype, or an 8-bit format (--kv-cache-dtype)
    num_blocks: int
    num_tokens: int
    bytes_per_token: int  # every layer's K and V, scales included
    tokens_with_8_bit: int  # what the same memory would hold with --kv-cache-dtype int8


def kv_cache_info(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, num_blocks: int) -> KVCacheInfo:
    kv = config.cache.kv_cache_dtype
    element = torch.empty((), dtype=dtype).element_size()
    per_token = model_config.kv_bytes_per_token(element, kv)
    tokens = num_blocks * config.cache.block_size
    return KVCacheInfo(
        dtype=dtype_name(dtype) if kv == "auto" else kv,
        num_blocks=num_blocks,
        num_tokens=tokens,
        bytes_per_token=per_token,
        tokens_with_8_bit=tokens * per_token // model_config.kv_bytes_per_token(1, "int8"),
    )


@dataclass
class PreparedRequest:
    """A request tokenized and validated, ready to be queued by the engine thread."""

    request: Request
    state: RequestState


def classifier_pooling(
    overrides: HFOverrides | None, tokenizer: Tokenizer | None, model: ModelConfig
) -> PoolingParams | None:
    """The pooling that classifies a prompt: a classifier checkpoint's own head (*ForSequenceClassification), or the
    reranker --hf-overrides makes of a causal LM from its classifier tokens' ids, each a token of the vocabulary
    (ValueError naming one that is not); None for a causal LM without overrides."""
    if model.num_labels:
        if overrides is not None:
            raise ValueError("hf_overrides: this checkpoint has its own classification head; classifier_from_token "
                             "makes one from a causal LM's")  # fmt: skip
        return PoolingParams(classifier_labels=model.num_labels, independent_labels=model.multi_label)
    if overrides is None:
        return None
    vocab = model.vocab_size
    if tokenizer is None:
        raise ValueError("hf_overrides: classifier_from_token names tokens, and this checkpoint has no tokenizer")
    ids = []
    for token in overrides.classifier_from_token:
        token_id = tokenizer.convert_tokens_to_ids(token)
        unknown = token_id is None or (token_id == tokenizer.unk_token_id and token != tokenizer.unk_token)
        if unknown or not 0 <= token_id < vocab:
            raise ValueError(f"hf_overrides: classifier_from_token {token!r} is not a token of this model's vocabulary")
        ids.append(token_id)
    return PoolingParams(classifier_token_ids=tuple(ids))


class EngineClient(ABC):
    config: EngineConfig
    model_name: str
    model_path: Path  # the checkpoint's directory
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    quantization: str | None  # the form the weights are served in (core_setup.served_quantization)
    weight_bytes: int  # what the served weights hold in memory (model/footprint.py), one rank's

    @property
    def max_logprobs(self) -> int:
        """The most alternatives per token a request may ask for (--max-logprobs, -1 the vocabulary)."""
        most = self.config.model.max_logprobs
        return self.model_config.vocab_size if most == -1 else most

    def kv_cache(self) -> KVCacheInfo:
        return kv_cache_info(self.config, self.model_config, self.dtype, self.stats().kv_blocks_total)

    def _init_client(
        self, tokenizer: Tokenizer | None, limits: RequestLimits, grammars: GrammarCompiler | None = None
    ) -> None:
        self.tokenizer = tokenizer
        eos = self.model_config.eos_token_ids
        self._grammars = grammars or GrammarCompiler(
            tokenizer, self.model_config.vocab_size, eos, self.config.structured_outputs
        )
        self.processor = OutputProcessor(tokenizer)
        self._limits = limits
        self._ids = itertools.count()
        self._adapters_checked: set[tuple[str, str]] = set()  # (name, path) of LoRA adapters whose config was read
        # The classifier (a checkpoint's head, or --hf-overrides' reranker): how /classify and LLM.classify pool a
        # prompt, and /score, /rerank and LLM.score a (query, document) one; None: the model embeds, pairs by cosine
        self.classifier = classifier_pooling(self.config.model.hf_overrides, tokenizer, self.model_config)

    # ---- on any thread ------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the text, if any, and the token ids) of a prompt given as text or as token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass prompt token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        token_ids = [int(t) for t in prompt]
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return None, token_ids

    def prepare_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> PreparedRequest:
        """Tokenizes and checks a request (ValueError if it can never be served) without queueing it."""
        params = self.with_logprobs_resolved(self._with_bad_words_tokenized(params or SamplingParams()))
        if self.model_config.num_labels and params.pooling is None:
            raise InvalidField("model", "this checkpoint is a classifier (its own classification head): it classifies, "
                               "scores and pools prompts, and generates no text")  # fmt: skip
        vocab = self.model_config.vocab_size
        checked = (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {}),
                   ("allowed_token_ids", params.allowed_token_ids or []),
                   ("bad_words", [t for ids in params.bad_words_token_ids or [] for t in ids]))  # fmt: skip
        for name, tokens in checked:
            if any(t < 0 or t >= vocab for t in tokens):
                raise InvalidField(name, f"{name}: token ids must be in [0, {vocab})")
        hidden = self.model_config.hidden_size
        if params.pooling is not None and (params.pooling.dimensions or 0) > hidden:
            raise InvalidField("dimensions", f"dimensions must be at most the model's hidden size, {hidden}")
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise InvalidField("cache_salt", "cache_salt must be a non-empty string")
        prompt_text, token_ids = self.tokenize(prompt)
        request = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=token_ids,
            sampling_params=params,
            priority=priority,
            tenant=tenant,
            lora_request=lora_request,
            cache_salt=cache_salt,
        )
        if lora_request is not None:
            self.check_adapter(lora_request)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self._limits.check(request)
        if params.structured_outputs is not None:
            self._grammars.compile(params.structured_outputs)  # a bad schema is the caller's error, found here
        return PreparedRequest(request, self.processor.new_state(prompt_text, token_ids, params))

    def with_logprobs_resolved(self, params: SamplingParams) -> SamplingParams:
        """The params with -1 logprobs (the whole vocabulary, vLLM's) made the vocabulary's size; InvalidField if the
        request asks for more alternatives per token than --max-logprobs allows."""
        vocab = self.model_config.vocab_size
        if params.logprobs == -1:
            params = dataclasses.replace(params, logprobs=vocab)
        if params.prompt_logprobs == -1:
            params = dataclasses.replace(params, prompt_logprobs=vocab)
        for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if asked is not None and asked > self.max_logprobs:
                message = f"Requested {name} of {asked}, which is greater than max allowed: {self.max_logprobs}"
                raise InvalidField(name, message + " (--max-logprobs)")
        return params

    def check_adapter(self, lora: LoRARequest) -> None:
        """InvalidField unless the adapter may be served (its config, read here once per name and path; its weights
        load in the core)."""
        if not self.config.lora.enable_lora:
            raise InvalidField("model", f"the LoRA adapter {lora.lora_name!r} was asked for, but LoRA is not enabled "
                               "(--enable-lora)")  # fmt: skip
        if (lora.lora_name, lora.lora_path) in self._adapters_checked:
            return
        try:
            read_adapter_config(lora.lora_path, self.config.lora.max_lora_rank)
        except ValueError as error:
            raise InvalidField("model", str(error)) from error
        self._adapters_checked.add((lora.lora_name, lora.lora_path))

    def _with_bad_words_tokenized(self, params: SamplingParams) -> SamplingParams:
        """vLLM's bad words as token sequences (token_bias.py), made once here."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        if self.tokenizer is None:
            raise InvalidField("bad_words", "bad_words need a tokenizer; this checkpoint has none")
        return dataclasses.replace(params, bad_words_token_ids=bad_word_sequences(self.tokenizer, params.bad_words))

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.decode(token_ids)

    # ---- on the thread that steps the engine --------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "default",
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queues a prompt (text or token ids); raises ValueError if it can never be served."""
        prepared = self.prepare_request(
            prompt, params, request_id, arrival_time, priority, tenant, lora_request, cache_salt
        )
        self.add_prepared(prepared)
        return prepared.request

    @abstractmethod
    def add_prepared(self, prepared: PreparedRequest) -> None: ...

    @abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """An output for every request that received a token (or failed, or ended) since the last call."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    @abstractmethod
    def queue_state(self, count_backlog: bool = True) -> QueueState:
        """Requests waiting, and (a walk over the queue, so only when asked) the prompt tokens they still need."""

    @abstractmethod
    def never_scheduled_since(self, arrived_before: float) -> list[str]: ...

    @abstractmethod
    def request_ids(self) -> list[str]: ...

    @abstractmethod
    def set_tenant_weights(self, weights: dict[str, float]) -> None: ...

    @property
    @abstractmethod
    def healthy(self) -> bool:
        """False once the engine can serve nothing more (its core process died)."""

    @abstractmethod
    def shutdown(self) -> None: ...
