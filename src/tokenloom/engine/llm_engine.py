"""The engine's synchronous face: tokenize, queue, step, and turn the core's tokens into ``RequestOutput``s.

Three parts, as vLLM V1 splits them: the client (client.py: tokenization and validation, on any thread), the engine
core (core.py: scheduling, the model, sampling; token ids only) and the output processor
(output_processor.py: text, stop strings, logprobs). Callers (the offline ``LLM``, the async engine, the server)
use only the methods below; the core and the processor are not theirs to reach into.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tokenloom.config import EngineConfig
from tokenloom.core.request import RequestStatus
from tokenloom.core.scheduler_output import SchedulerOutput
from tokenloom.engine.client import EngineClient, PreparedRequest
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_outputs import EngineCoreOutput, EngineStats, QueueState
from tokenloom.engine.core_setup import load_for_core
from tokenloom.model.footprint import held_weight_bytes
from tokenloom.model.loader import LoadedModel
from tokenloom.model.platform import dtype_name
from tokenloom.outputs import RequestOutput

logger = logging.getLogger(__name__)


class LLMEngine(EngineClient):
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        started = time.monotonic()
        loaded, self.dtype, self.device = load_for_core(config, loaded)
        self.model_name, self.model_path, self.model_config = loaded.name, loaded.path, loaded.config
        self.core = EngineCore(config, loaded, self.dtype, self.device)
        self.max_model_len, self.quantization = self.core.max_model_len, self.core.quantization
        self._init_client(loaded.tokenizer, self.core.request_limits(), self.core.structured.compiler)
        kv = self.kv_cache()
        self.weight_bytes = held_weight_bytes(self.core.runner.model)  # this rank's under tensor parallelism
        logger.info(
            "loaded %s in %.1fs on %s in %s (dtype=%s, %s, quantization=%s): weights %.1f MiB, KV cache in %s, %d "
            "tokens (%d blocks of %d, %d swap blocks), max_model_len %d",
            loaded.name,
            time.monotonic() - started,
            self.device,
            dtype_name(self.dtype),
            config.model.dtype,
            "eager" if self.core.runner.compiled is None else "compiled",
            self.quantization or "none",
            self.weight_bytes / 2**20,
            kv.dtype,
            kv.num_tokens,
            self.core.num_kv_blocks,
            config.cache.block_size,
            self.core.num_swap_blocks,
            self.max_model_len,
        )

    # ---- requests -----------------------------------------------------------------------------------------

    def add_prepared(self, prepared: PreparedRequest) -> None:
        """Queues a prepared request; on the thread that steps the engine."""
        self.processor.add(prepared.request.request_id, prepared.state)
        self.core.add_request(prepared.request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        output = self.core.abort(request_id)
        return None if output is None else self.processor.make_output(output)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- the step -----------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns an output for every request that received a token (or failed) in it, except the
        unfinished ones whose caller takes only final outputs (RequestOutputKind.FINAL_ONLY)."""
        results = (self.processor.process(output, self) for output in self.core.step().outputs)
        return [result for result in results if result is not None]

    def observe_steps(self, observer: Callable[[SchedulerOutput], None] | None) -> None:
        """Shows `observer` each step's schedule before it runs (a profiler's hook); None stops it."""
        self.core.step_observer = observer

    # RequestEnding: the output processor ends requests through these.

    def stopped(self, output: EngineCoreOutput, stop: str) -> EngineCoreOutput:
        return self.core.finish(output.request_id, RequestStatus.FINISHED_STOPPED, stop)

    def failed(self, output: EngineCoreOutput, error: Exception) -> EngineCoreOutput:
        """Fails one request whose output could not be built; one that already finished has nothing left to free."""
        if not output.finished:
            return self.core.fail(output.request_id, error)
        logger.error("request %s failed: %r", output.request_id, error, exc_info=error)
        output.finish_reason, output.error = RequestStatus.FINISHED_ERROR.value, f"{type(error).__name__}: {error}"
        return output

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
        """In one process the engine is as healthy as the process that asks, and its tensor-parallel ranks."""
        return self.core.healthy

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers, if any; the core itself lives in this process."""
        self.core.shutdown()
