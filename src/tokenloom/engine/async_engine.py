"""The async engine over the engine: the step loop runs in a thread, each request streams through its own queue.

A thread, not a process: on 2 cores the model's matmuls already use both, the GIL is released inside torch, and
a thread shares the engine without serialising every token across a pipe. The event loop only tokenizes (in a
worker thread), enqueues and relays outputs, so HTTP stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from tokenloom.engine.client import EngineClient, PreparedRequest
from tokenloom.engine.core_outputs import EngineStats
from tokenloom.engine.request_stream import OutputQueue, RequestStream
from tokenloom.engine.step_log import StepLog
from tokenloom.lora import LoRARequest
from tokenloom.model.loader import Tokenizer
from tokenloom.model.platform import dtype_name
from tokenloom.outputs import RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class ErrorReason(enum.Enum):
    """Why a request was refused (the first four) or ended without finishing (the rest); the server maps each to an
    HTTP status."""

    QUEUE_FULL = "queue_full"  # too many requests waiting
    QUEUED_TOKENS_FULL = "queued_tokens_full"  # too many prompt tokens waiting
    SERVER_DRAINING = "server_draining"  # shutting down: no new requests
    ENGINE_UNAVAILABLE = "engine_unavailable"  # the engine core is gone
    QUEUE_TIMEOUT = "queue_timeout"  # waited longer than the queue timeout
    SERVER_SHUTDOWN = "server_shutdown"  # still running at the drain deadline
    ENGINE_ERROR = "engine_error"  # the step failed for the whole batch
    REQUEST_FAILED = "request_failed"  # this request alone failed


class RequestError(Exception):
    """The engine refused this request, or it ended without finishing, and why."""

    def __init__(self, reason: ErrorReason, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message
        self.retry_after = retry_after  # seconds a client should wait before sending it again, when that may work


class AsyncEngine:
    def __init__(
        self,
        engine: EngineClient,
        max_num_queued_requests: int | None = None,
        queue_timeout: float | None = None,
        max_num_queued_tokens: int | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        on_engine_death: Callable[[], None] | None = None,
        step_log: StepLog | None = None,
    ) -> None:
        self.engine = engine
        self.step_log = step_log  # each turn that runs a step, timed (`serve --step-log`)
        self.on_engine_death = on_engine_death  # called once, on the engine thread, after in-flight work is failed
        self.max_num_queued_requests = max_num_queued_requests
        self.max_num_queued_tokens = max_num_queued_tokens
        self.queue_timeout = queue_timeout
        self.on_step = on_step
        self.draining = False
        self._lock = threading.Lock()  # one thread at a time touches the engine's scheduler
        self._pending_lock = threading.Lock()  # guards the requests waiting to join the next step, and the counts
        self._pending: list[PreparedRequest] = []
        self._waiting_requests = 0
        self._backlog_tokens = 0
        self._wake = threading.Event()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._streams: dict[str, OutputQueue] = {}
        self._stopping = False
        self._drain_deadline: float | None = None
        self._thread = threading.Thread(target=self._run, name="tokenloom-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def begin_drain(self, timeout: float) -> None:
        """Stops admitting; requests still in flight after `timeout` seconds are failed with a 503 of their own."""
        if not self.draining:
            self.draining = True
            self._drain_deadline = time.monotonic() + timeout
            self._wake.set()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()
        if self.step_log is not None:
            self.step_log.close()

    @property
    def healthy(self) -> bool:
        """False once the engine can serve nothing more (its core process died)."""
        return self.engine.healthy

    async def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        tenant: str = "default",
        arrival_time: float | None = None,
        wake_every: int | None = 1,
        lora_request: LoRARequest | None = None,
        continues: bool = False,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admits a request (raising RequestError or ValueError if it can't be) and returns its output stream.

        The stream yields the request's output after every step that gave it a token; the last one has
        finished=True. If the caller closes or drops the stream before that (a client disconnected), or is
        cancelled while the request is being admitted, the request is aborted and its blocks freed within a step.
        ``arrival_time`` (monotonic; default now) is its place in an FCFS queue.
        ``wake_every`` n > 1 yields after the first output only once n new tokens are in (DELTA outputs joined),
        or at the last; None yields the first output and then the last (with DELTA outputs, the rest joined).
        ``continues``: the request goes on with one already admitted (an n > 1 request's later choices, a beam
        search's later steps), so neither a full queue nor a drain refuses it: its client's request passed them.
        ``cache_salt``: cached prefix blocks are shared only with requests of the same salt (vLLM's).
        """
        if self.draining and not continues:
            raise RequestError(ErrorReason.SERVER_DRAINING, "the server is shutting down")
        if not self.engine.healthy:
            raise RequestError(ErrorReason.ENGINE_UNAVAILABLE, "the engine core is not running")
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        stream = OutputQueue(asyncio.get_running_loop(), params.output_kind is RequestOutputKind.DELTA, wake_every)
        self._streams[request_id] = stream
        prepare = functools.partial(self.engine.prepare_request, prompt, params, request_id, arrival_time, priority,
                                    tenant, lora_request, cache_salt)  # fmt: skip
        adding = asyncio.ensure_future(asyncio.to_thread(self._add, prepare, limited=not continues))
        try:
            await asyncio.shield(adding)
        except BaseException as error:
            self._streams.pop(request_id, None)
            if isinstance(error, asyncio.CancelledError):  # the thread adds it all the same: abort it once it is in
                adding.add_done_callback(lambda added: self._abort_if_added(added, request_id))
            raise
        self._wake.set()
        return RequestStream(request_id, stream, self._let_go)

    def _abort_if_added(self, added: asyncio.Future[None], request_id: str) -> None:
        if not added.cancelled() and added.exception() is None:
            self.abort(request_id)

    def _let_go(self, request_id: str, abort: bool) -> None:
        """A request's reader is done with it: after its last output, or before (``abort``: it runs on no more)."""
        self._streams.pop(request_id, None)
        if abort:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    @property
    def model_path(self) -> str:
        return str(self.engine.model_path)

    def check_adapter(self, lora: LoRARequest) -> None:
        self.engine.check_adapter(lora)

    def with_logprobs_resolved(self, params: SamplingParams) -> SamplingParams:
        return self.engine.with_logprobs_resolved(params)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.engine.tokenize(prompt)[1]

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.decode(token_ids)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self.engine.model_config.eos_token_ids)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self.engine.max_logprobs

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.engine.model_config.hidden_size

    @property
    def classifier(self) -> PoolingParams | None:
        """How a prompt is classified, and a (query, document) one scored, where the model is a classifier (its own
        head, or the reranker --hf-overrides makes of it); None where it is not."""
        return self.engine.classifier

    @property
    def labels(self) -> tuple[str, ...]:
        """A classifier checkpoint's labels (config.json's id2label); empty otherwise."""
        return self.engine.model_config.labels

    def describe(self) -> dict[str, object]:
        """What /version says of the engine: the resolved dtype, the device and the whole configuration."""
        return {
            "dtype": dtype_name(self.engine.dtype),  # what dtype "auto" resolved to on this machine
            "device": str(self.engine.device),
            "quantization": self.engine.quantization,  # what quantization None (auto) chose, or the one asked for
            "weight_bytes": self.engine.weight_bytes,  # what the served weights hold (one rank's)
            "engine_config": self.engine.config.to_dict(),
            "kv_cache": asdict(self.engine.kv_cache()),  # its dtype and the tokens it holds
        }

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _add(self, prepare: Callable[[], PreparedRequest], limited: bool) -> None:
        """Validates (``prepare``) and queues a request for the engine thread, without waiting for the running step to
        end; a ``limited`` one only if the queue limits leave room.

        Requests that arrive while a step runs all join the next one: a burst fills the next step's token budget
        instead of trickling in one admission per step.
        """
        prepared = prepare()
        with self._pending_lock:
            if limited:
                self._check_queue_room(prepared.request.num_prompt_tokens)
            self._pending.append(prepared)

    def _check_queue_room(self, new_tokens: int) -> None:
        """Under the pending lock."""
        waiting = self._waiting_requests + len(self._pending)
        if self.max_num_queued_requests is not None and waiting >= self.max_num_queued_requests:
            message = f"the request queue is full ({waiting} waiting)"
            raise RequestError(ErrorReason.QUEUE_FULL, message, retry_after=1.0)
        # The prefill backlog: tokens that queued requests still have to compute before their first token.
        backlog = self._backlog_tokens + sum(p.request.num_prompt_tokens for p in self._pending)
        if self.max_num_queued_tokens is not None and backlog + new_tokens > self.max_num_queued_tokens:
            message = f"the prefill backlog is full ({backlog} tokens queued)"
            raise RequestError(ErrorReason.QUEUED_TOKENS_FULL, message, retry_after=1.0)

    def _admit_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, []
            # Counted as waiting until the step's count (_count_queued) replaces these figures: an upper bound (the
            # step may start some), so a limit holds; without it a request admitted during the step passed a full
            # queue, not seeing these.
            self._waiting_requests += len(pending)
            self._backlog_tokens += sum(p.request.num_prompt_tokens for p in pending)
        for prepared in pending:
            self.engine.add_prepared(prepared)

    def _count_queued(self) -> None:
        """What admission limits compare against, counted on the engine thread where the queue changes."""
        # The backlog is a walk over the queue: only when a limit needs it.
        state = self.engine.queue_state(count_backlog=self.max_num_queued_tokens is not None)
        with self._pending_lock:
            self._waiting_requests, self._backlog_tokens = state.num_waiting, state.backlog_tokens

    def _run(self) -> None:
        while not self._stopping:
            turn_started = time.perf_counter()
            if not self.engine.healthy:
                self._after_engine_death()
                return
            with self._lock:
                self._admit_pending()  # before aborts: a request's abort may already be queued behind it
                aborted = self._apply_aborts() + self._expire_queued() + self._cut_after_drain()
                busy = self.engine.has_unfinished_requests()
                try:
                    outputs = self.engine.step() if busy else []
                except Exception as error:  # the forward itself failed: no request can be told apart
                    logger.exception("engine step failed")
                    aborted += self._fail_all(RequestError(ErrorReason.ENGINE_ERROR, f"the engine failed: {error}"))
                    outputs = []
                self._count_queued()
            for output in outputs:
                if output.error is not None:  # this request alone failed; the step went on for the others
                    failure = RequestError(ErrorReason.REQUEST_FAILED, f"the request failed: {output.error}")
                    self._deliver(output.request_id, failure)
                else:
                    self._deliver(output.request_id, output)
            if self.on_step is not None:
                self.on_step(aborted + outputs)
            if self.step_log is not None:
                self.step_log.end_turn(time.perf_counter() - turn_started)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _after_engine_death(self) -> None:
        """The core process or a rank is gone: what is in flight or waiting to join ends with a clear error, new
        requests are refused (``submit`` checks health), and whoever runs the server is told, so it can exit."""
        logger.error("the engine is gone (its core process or a tensor-parallel rank died)")
        dead = RequestError(ErrorReason.ENGINE_UNAVAILABLE, "the engine core is not running")
        with self._lock:
            with self._pending_lock:
                pending, self._pending = self._pending, []
            for prepared in pending:
                self._deliver(prepared.request.request_id, dead)
            self._fail_all(dead)
        if self.on_engine_death is not None:
            self.on_engine_death()

    def _apply_aborts(self) -> list[RequestOutput]:
        request_ids = []
        while True:
            try:
                request_ids.append(self._aborts.get_nowait())
            except queue.Empty:
                return self._abort_each(request_ids)

    def _expire_queued(self) -> list[RequestOutput]:
        if self.queue_timeout is None:
            return []
        expired = self.engine.never_scheduled_since(time.monotonic() - self.queue_timeout)
        message = f"the request waited more than {self.queue_timeout:g}s in the queue"
        return self._abort_each(expired, RequestError(ErrorReason.QUEUE_TIMEOUT, message))

    def _cut_after_drain(self) -> list[RequestOutput]:
        if self._drain_deadline is None or time.monotonic() < self._drain_deadline:
            return []
        message = "the server shut down before this request finished (drain timeout)"
        return self._fail_all(RequestError(ErrorReason.SERVER_SHUTDOWN, message))

    def _fail_all(self, error: RequestError) -> list[RequestOutput]:
        return self._abort_each(self.engine.request_ids(), error)

    def _abort_each(self, request_ids: list[str], error: RequestError | None = None) -> list[RequestOutput]:
        """Aborts these requests (those still in the engine give their final outputs, returned) and tells each
        stream why, where there is a reason to tell (a client's own abort has none: it stopped listening)."""
        outputs = []
        for request_id in request_ids:
            output = self.engine.abort_request(request_id)
            if output is not None:
                outputs.append(output)
            if error is not None:
                self._deliver(request_id, error)
        return outputs

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            with contextlib.suppress(RuntimeError):  # the client's loop closed under us
                stream.loop.call_soon_threadsafe(stream.put, item)
