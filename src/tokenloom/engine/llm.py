"""The offline API: ``LLM(model).generate(prompts, params)``, as vLLM spells it."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tokenloom.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence, step_candidates
from tokenloom.config import EngineConfig
from tokenloom.engine.core_outputs import EngineStats
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.lora import LoRARequest
from tokenloom.model.loader import Tokenizer
from tokenloom.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import RequestOutputKind, SamplingParams
from tokenloom.scoring import cosine, score_pairs
from tokenloom.utils import heap_frozen

if TYPE_CHECKING:
    from tokenloom.engine.core_process import CoreProcessEngine

PromptInput = str | dict[str, Any] | list[int]
Conversation = list[dict[str, str]]


class LLM:
    """Runs a model over a batch of prompts with continuous batching (or static, for comparison).

    Under tensor parallelism it starts worker processes and joins torch.distributed's process group; ``shutdown()``
    stops them, as does leaving a ``with LLM(...) as llm:`` block or dropping the last reference to the LLM (and
    the interpreter's exit), so a later ``LLM(tensor_parallel_size=N)`` in the same process can start.
    """

    def __init__(self, model: str | None = None, core_process: bool = False, **config: Any) -> None:
        """core_process: the engine core (scheduler, model, sampling) in a process of its own, as the server's
        --core-process; this process then only tokenizes and turns tokens into text, beside the core's steps."""
        engine_config = EngineConfig.from_kwargs(model=model, **config)
        self.engine: LLMEngine | CoreProcessEngine
        if core_process:
            from tokenloom.engine.core_process import CoreProcessEngine  # pyzmq: not needed by an engine in-process

            self.engine = CoreProcessEngine(engine_config)
        else:
            self.engine = LLMEngine(engine_config)
        # Holds the engine, not the LLM: runs when the LLM is collected (or at exit), whoever forgot shutdown().
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stops the engine's worker processes (tensor parallelism); the LLM serves nothing afterwards. Safe to
        call more than once."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer | None:
        """vLLM's spelling of ``tokenizer``."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns the outputs in input order.

        `priority` (one per prompt, lower first) matters under scheduling_policy="priority". `lora_request`: the LoRA
        adapter every prompt runs under, or one per prompt (None: the base model); needs enable_lora=True.
        """
        prompt_list = _as_prompt_list(prompts)
        # Only each request's final output is read here: the steps between build none (as vLLM's LLM asks).
        params_list = [
            dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            for params in _as_params_list(sampling_params, len(prompt_list))
        ]
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        adapters = _per_prompt(lora_request, len(prompt_list))
        request_ids = [
            self._add(prompt, params, p, lora)
            for prompt, params, p, lora in zip(prompt_list, params_list, priorities, adapters, strict=True)
        ]
        return self._run(request_ids, use_tqdm)

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding, as vLLM's ``LLM.embed``: ``output.outputs.embedding``, the final hidden state of
        the prompt's last token, normalized (pooling_params.py). Raises if a prompt's request failed."""
        params = SamplingParams.for_embedding(pooling_params or PoolingParams())
        outputs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
        return [EmbeddingRequestOutput.of(output) for output in outputs]

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities, as vLLM's ``LLM.classify``: ``output.outputs.probs``, from the model's
        classifier (a *ForSequenceClassification checkpoint's head, or the one hf_overrides' classifier_from_token
        makes of a causal LM); ValueError for a model that is not one."""
        if self.engine.classifier is None:
            raise ValueError("LLM.classify needs a classifier: a *ForSequenceClassification checkpoint, or "
                             "hf_overrides with classifier_from_token")  # fmt: skip
        return [
            ClassificationRequestOutput(
                o.request_id, o.prompt_token_ids, o.finished, ClassificationOutput(o.outputs.embedding)
            )
            for o in self.embed(prompts, self.engine.classifier, use_tqdm, lora_request)
        ]

    def score(
        self,
        data_1: PromptInput | Sequence[PromptInput],
        data_2: PromptInput | Sequence[PromptInput],
        use_tqdm: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """As vLLM's ``LLM.score``: data_1's prompt against each of data_2's (1:N), or pair by pair (N:N). With an
        embedding model each score is the cosine similarity of the two prompts' embeddings (scoring.py), each prompt
        embedded once; with a reranker (hf_overrides) it is the classifier's score of the two joined."""
        firsts, seconds = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = score_pairs(len(firsts), len(seconds))
        if self.engine.classifier is not None:
            if not self.engine.classifier.scores_pairs:
                raise ValueError("LLM.score needs a classifier with one score; this one has labels: use LLM.classify")
            return self._cross_scores(firsts, seconds, pairs, use_tqdm, lora_request)
        embedded = self.embed([*firsts, *seconds], use_tqdm=use_tqdm, lora_request=lora_request)
        return [
            ScoringRequestOutput(
                f"{embedded[a].request_id}_{embedded[b].request_id}",
                embedded[a].prompt_token_ids + embedded[b].prompt_token_ids,
                True,
                ScoringOutput(cosine(embedded[a].outputs.embedding, embedded[b].outputs.embedding)),
            )
            for a, b in pairs
        ]

    def _cross_scores(
        self,
        firsts: list[PromptInput],
        seconds: list[PromptInput],
        pairs: list[tuple[int, int]],
        use_tqdm: bool,
        lora_request: LoRARequest | None,
    ) -> list[ScoringRequestOutput]:
        """Each pair's two prompts joined (two texts as one text, as vLLM's; else the first's tokens, then the
        second's) and scored by the reranker."""
        prompts = [_prompt_of(prompt) for prompt in [*firsts, *seconds]]
        joined = [_joined(self.engine.tokenize, prompts[a], prompts[b]) for a, b in pairs]
        pooling = self.engine.classifier
        assert pooling is not None, "a reranker scores pairs joined"
        scored = self.embed([{"prompt_token_ids": ids} for ids in joined], pooling, use_tqdm, lora_request)
        return [
            ScoringRequestOutput(o.request_id, o.prompt_token_ids, True, ScoringOutput(o.outputs.embedding[0]))
            for o in scored
        ]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates. As vLLM's: the assistant's turn
        opened after the messages (add_generation_prompt) or the last message left open for the reply to continue
        (continue_final_message), and chat_template_kwargs the variables the template reads."""
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [cast(Conversation, messages)] if one else list(cast(Sequence[Conversation], messages))
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        options = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message)  # fmt: skip
        prompts = [self.apply_chat_template(c, **options) for c in conversations]
        return self.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm, lora_request=lora_request
        )

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt its params.beam_width best sequences, best first; as vLLM's, each
        sequence's ``tokens`` and ``text`` begin with the prompt's. Every prompt's beams share each step's batch."""
        prompt_list = _as_prompt_list(prompts)
        prompt_ids = [self.engine.tokenize(_prompt_of(p))[1] for p in prompt_list]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompt_list]
        for ids in prompt_ids:
            if len(ids) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"a prompt of {len(ids)} tokens and max_tokens={params.max_tokens} exceed the "
                                 f"model's context of {self.engine.max_model_len} tokens")  # fmt: skip
        adapters = _per_prompt(lora_request, len(prompt_ids))
        eos = set(self.engine.model_config.eos_token_ids)
        searches = [BeamSearch(ids, params, eos) for ids in prompt_ids]
        searches[0].check_logprobs(self.engine.max_logprobs)
        for _ in range(params.max_tokens):
            steps = [[self._add(beam, search.step_params, 0, adapter, salt) for beam in search.step_prompts()]
                     for search, adapter, salt in zip(searches, adapters, salts, strict=True)]  # fmt: skip
            finals = iter(self._run([request_id for step in steps for request_id in step], use_tqdm=False))
            for search, step in zip(searches, steps, strict=True):
                search.advance([step_candidates(next(finals)) for _ in step])
        return [BeamSearchOutput(self._with_text(search)) for search in searches]

    def _with_text(self, search: BeamSearch) -> list[BeamSearchSequence]:
        answers = search.answers()
        for beam in answers:
            beam.text = self.engine.decode(beam.tokens)
        return answers

    def apply_chat_template(self, conversation: Conversation, **options: Any) -> list[int]:
        """The conversation's token ids through the model's chat template; options: apply_chat_template's keyword
        arguments (add_generation_prompt, True unless given) and the template's variables."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        options.setdefault("add_generation_prompt", True)
        ids = self.tokenizer.apply_chat_template(conversation, tokenize=True, **options)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def stats(self) -> EngineStats:
        """Counters since start: steps, tokens, preemptions, prefix-cache queries and hits, KV blocks."""
        return self.engine.stats()

    def _add(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        priority: int = 0,
        lora: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """A prompt given as a dict may carry its cache_salt (vLLM's)."""
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt", cache_salt)
        request = self.engine.add_request(_prompt_of(prompt), params, priority=priority, lora_request=lora,
                                          cache_salt=cache_salt)  # fmt: skip
        return request.request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        progress = Progress(
            TextColumn("generating"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[tokens]} tok"),
            disable=not use_tqdm,
            transient=True,
        )
        # What lives before the run is not walked by the run's full collections (cheap: no collection first).
        with progress, heap_frozen(collect_first=False):
            task = progress.add_task("generate", total=len(request_ids), tokens=0)
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                progress.update(task, completed=len(done), tokens=self.engine.stats().generated_tokens)
        return [done[request_id] for request_id in request_ids]


def _prompt_of(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, dict):
        return list(prompt["prompt_token_ids"]) if "prompt_token_ids" in prompt else prompt["prompt"]
    return prompt


def _joined(
    tokenize: Callable[[str | list[int]], tuple[str | None, list[int]]], first: str | list[int], second: str | list[int]
) -> list[int]:
    if isinstance(first, str) and isinstance(second, str):
        return tokenize(first + second)[1]
    return tokenize(first)[1] + tokenize(second)[1]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [[int(p) for p in items]]  # a single prompt of token ids
    return items


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _per_prompt(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    adapters = list(lora)
    if len(adapters) != n:
        raise ValueError(f"got {len(adapters)} LoRA requests for {n} prompts")
    return adapters
