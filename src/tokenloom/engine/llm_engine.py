"""The engine's synchronous face: tokenize, queue, step, and turn the core's tokens into ``RequestOutput``s.

Three parts, as vLLM V1 splits them: this class (input processing: tokenization and validation, on any thread),
the engine core (core.py: scheduling, the model, sampling; token ids only) and the output processor
(output_processor.py: text, stop strings, logprobs). Callers (the offline ``LLM``, the async front, the server)
use only the methods below; the core and the processor are not theirs to reach into.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from tokenloom.config import EngineConfig
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import AdmissionLimits
from tokenloom.engine.core import EngineCore, EngineCoreOutput, EngineStats, QueueState
from tokenloom.engine.output_processor import OutputProcessor, RequestState
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import LoadedModel, Tokenizer, load_model
from tokenloom.model.platform import dtype_name, resolve_dtype
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A request tokenized and validated, ready to be queued by the engine thread."""

    request: Request
    state: RequestState


class InputProcessor:
    """Text or token ids in, a validated Request with its output state out; any thread may call it."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, limits: AdmissionLimits, processor: OutputProcessor
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.processor = processor
        self._ids = itertools.count()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the text, if any, and the token ids) of a prompt given as text or as token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass prompt token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        token_ids = [int(t) for t in prompt]
        if any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        return None, token_ids

    def prepare(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        arrival_time: float | None,
        priority: int,
        tenant: str,
    ) -> PreparedRequest:
        """Tokenizes and checks a request (ValueError if it can never be served); nothing is queued yet."""
        params = params or SamplingParams()
        prompt_text, token_ids = self.tokenize(prompt)
        request = Request(
            request_id=request_id if request_id is not None else str(next(self._ids)),
            prompt_token_ids=token_ids,
            sampling_params=params,
            priority=priority,
            tenant=tenant,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.limits.check(request)
        return PreparedRequest(request, self.processor.new_state(prompt_text, token_ids, params))


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.model.num_threads is not None:
            torch.set_num_threads(config.model.num_threads)
        device = torch.device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, device)
        started = time.monotonic()
        loaded = loaded or load_model(config.model.model, config.model.max_model_len, self.dtype, device)
        self.model_name = loaded.name
        self.model_path = loaded.path
        self.model_config: ModelConfig = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = device
        self.core = EngineCore(config, loaded, self.dtype, device)
        self.max_model_len = self.core.max_model_len
        self.processor = OutputProcessor(self.tokenizer)
        self.inputs = InputProcessor(
            self.tokenizer, self.model_config.vocab_size, self.core.admission_limits(), self.processor
        )
        logger.info(
            "loaded %s in %.1fs on %s in %s (dtype=%s, %s): %d KV blocks of %d tokens (%d swap blocks), "
            "max_model_len %d",
            loaded.name,
            time.monotonic() - started,
            device,
            dtype_name(self.dtype),
            config.model.dtype,
            "eager" if self.core.runner.compiled is None else "compiled",
            self.core.num_kv_blocks,
            config.cache.block_size,
            self.core.num_swap_blocks,
            self.max_model_len,
        )

    # ---- requests -----------------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "default",
    ) -> Request:
        """Queues a prompt (text or token ids); raises ValueError if it can never be served."""
        prepared = self.prepare_request(prompt, params, request_id, arrival_time, priority, tenant)
        self.add_prepared(prepared)
        return prepared.request

    def prepare_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "default",
    ) -> PreparedRequest:
        """Tokenizes and validates a request without touching the scheduler, so any thread may call it."""
        return self.inputs.prepare(prompt, params, request_id, arrival_time, priority, tenant)

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queues a prepared request; on the thread that steps the engine."""
        self.processor.add(prepared.request.request_id, prepared.state)
        self.core.add_request(prepared.request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        output = self.core.abort(request_id)
        return None if output is None else self.processor.make_output(output)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return self.inputs.tokenize(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.processor.decode(token_ids)

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that received a token (or failed) in it."""
        outputs = []
        for core_output in self.core.step().outputs:
            try:
                outputs.append(self._processed(core_output))
            except Exception as error:  # detokenizing or matching stops for this request alone
                outputs.append(self._failed(core_output, error))
        return outputs

    def _processed(self, output: EngineCoreOutput) -> RequestOutput:
        if output.error is None:
            stop = self.processor.absorb(output)
            if stop is not None:
                output = self.core.finish(output.request_id, RequestStatus.FINISHED_STOPPED, stop)
        return self.processor.make_output(output)

    def _failed(self, output: EngineCoreOutput, error: Exception) -> RequestOutput:
        """Fails one request whose output could not be built; one that already finished has nothing left to free."""
        if output.finished:
            logger.error("request %s failed: %r", output.request_id, error, exc_info=error)
            output.finish_reason, output.error = RequestStatus.FINISHED_ERROR.value, f"{type(error).__name__}: {error}"
        else:
            output = self.core.fail(output.request_id, error)
        return self.processor.make_output(output)

    # ---- observability and control ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return self.core.stats()

    def queue_state(self, count_backlog: bool = True) -> QueueState:
        return self.core.queue_state(count_backlog)

    def never_scheduled_since(self, arrived_before: float) -> list[str]:
        return self.core.never_scheduled_since(arrived_before)

    def request_ids(self) -> list[str]:
        return self.core.request_ids()

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        self.core.set_tenant_weights(weights)

    @property
    def healthy(self) -> bool:
        """In one process the engine is as healthy as the process that asks."""
        return True

    def shutdown(self) -> None:
        """Nothing to stop: the core lives in this process."""
