"""The engine core in a process of its own (vLLM V1's EngineCoreProc pattern), behind LLMEngine's face.

The API process tokenizes, runs the output processor (text, stop strings, logprobs) and serves HTTP; the core
process loads the weights, schedules and runs the model, in a loop of its own that never waits on the API
process. They talk over two ZeroMQ PUSH/PULL sockets on ipc:// paths, with the pickled messages of
core_messages.py (API -> core: AddRequest, AbortRequest, FinishRequest, FailRequest, SetTenantWeights, WatchQueue,
Shutdown; core -> API: CoreReady, CoreReport, CoreFailed).

A request that ends on the API side (an abort, a stop string, a failure to detokenize) ends there at once; the
core is told, and what it still sends for that request is dropped. If the core process dies, ``step`` raises
``CoreDied``: the async engine fails every request in flight, and ``healthy`` turns False (``/ready`` says 503).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import zmq

from tokenloom.config import EngineConfig
from tokenloom.core.request import RequestStatus
from tokenloom.engine.client import EngineClient, PreparedRequest
from tokenloom.engine.core import EngineCore
from tokenloom.engine.core_messages import (
    AbortRequest,
    AddRequest,
    CoreFailed,
    CoreInfo,
    CoreReady,
    CoreReply,
    CoreReport,
    CoreRequest,
    FailRequest,
    FinishRequest,
    QueueWalk,
    SetTenantWeights,
    Shutdown,
    WatchQueue,
)
from tokenloom.engine.core_outputs import EngineCoreOutput, EngineStats, QueueState
from tokenloom.engine.core_setup import load_for_core
from tokenloom.ipc import child_end, receive, send
from tokenloom.model.footprint import held_weight_bytes
from tokenloom.model.loader import load_model_info
from tokenloom.model.platform import resolve_dtype
from tokenloom.outputs import RequestMetrics, RequestOutput
from tokenloom.utils import heap_frozen

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 600.0  # seconds for the core to load the weights (and build or compile what it needs)
IDLE_POLL_MS = 100  # how long an idle core waits for a message before looking again


class CoreDied(RuntimeError):
    """The core process is gone; nothing in flight can finish."""


def _core_main(config: EngineConfig, inputs_path: str, outputs_path: str) -> None:
    """The core process: load, say ready, then loop: take messages, step, report."""
    with child_end(inputs_path, outputs_path) as (inputs, outputs):
        try:
            core = EngineCore(config, *load_for_core(config))
            info = CoreInfo(core.max_model_len, core.request_limits(), core.runner.compiled is not None,
                            core.quantization, held_weight_bytes(core.runner.model))  # fmt: skip
            send(outputs, CoreReady(info))
            with heap_frozen(collect_first=True):
                _serve(core, inputs, outputs)
        except Exception:
            send(outputs, CoreFailed(traceback.format_exc()))
            raise


def _serve(core: EngineCore, inputs: zmq.Socket[bytes], outputs: zmq.Socket[bytes]) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    watched: set[str] = set()  # the walks over the queue the API side asked for
    parent = os.getppid()
    while os.getppid() == parent:  # an API process killed outright leaves no one to serve: end with it
        ended: list[EngineCoreOutput] = []
        timeout = 0 if core.has_unfinished_requests() else IDLE_POLL_MS
        if poller.poll(timeout):
            while True:
                try:
                    message: CoreRequest = receive(inputs, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, WatchQueue):
                    watched.add(message.walk)
                    continue
                ended.extend(_apply(core, message))
        stepped = core.step().outputs if core.has_unfinished_requests() else []
        if ended or stepped:
            send(outputs, core_report(core, ended + stepped, watched))


def core_report(core: EngineCore, outputs: list[EngineCoreOutput], watched: set[str]) -> CoreReport:
    """What the core sends after a step: its outputs, its gauges, and the walks over its queue that were asked for."""
    queue = core.queue_state(count_backlog="backlog" in watched)
    never_scheduled = core.never_scheduled_waiting() if "never_scheduled" in watched else []
    return CoreReport(outputs, core.stats(), queue, never_scheduled)


def _apply(core: EngineCore, message: CoreRequest) -> list[EngineCoreOutput]:
    """One message from the API side; the outputs of the requests it ended. A finish or a fail for a request the
    core no longer has (it ended meanwhile) does nothing."""
    match message:
        case AddRequest(request):
            core.add_request(request)
        case AbortRequest(request_id):
            output = core.abort(request_id)
            return [] if output is None else [output]
        case FinishRequest(request_id, stop) if request_id in core.request_ids():
            return [core.finish(request_id, RequestStatus.FINISHED_STOPPED, stop)]
        case FailRequest(request_id, reason) if request_id in core.request_ids():
            return [core.fail(request_id, RuntimeError(reason))]
        case SetTenantWeights(weights):
            core.set_tenant_weights(weights)
    return []


class CoreProcessEngine(EngineClient):
    """LLMEngine's face (what the async engine and the server use), with the core in its own process."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size > 1:
            # The core process is a daemon, and a daemon may not start the tensor-parallel workers.
            raise ValueError("--core-process does not run with --tensor-parallel-size > 1 yet; use one or the other")
        self.config = config
        self.device = torch.device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        info = load_model_info(config.model.model, config.model.tokenizer)
        self.model_name, self.model_path, self.model_config = info.name, info.path, info.config
        self._in_flight: dict[str, float] = {}  # request id -> arrival time, until its end reaches the API side
        self._stats: EngineStats | None = None
        self._queue = QueueState(0, 0)
        self._never_scheduled: list[tuple[str, float]] = []
        self._watched: set[str] = set()
        self._dead = False
        self._context = zmq.Context()
        # The ipc:// sockets live here; the directory goes at shutdown.
        self._socket_dir = tempfile.TemporaryDirectory(prefix="tokenloom-core-")
        directory = Path(self._socket_dir.name)
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.bind(f"ipc://{directory / 'inputs'}")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{directory / 'outputs'}")
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads or locks
        self._process = spawn.Process(
            target=_core_main,
            args=(config, f"ipc://{directory / 'inputs'}", f"ipc://{directory / 'outputs'}"),
            name="tokenloom-core",
            daemon=True,
        )
        started = time.monotonic()
        self._process.start()
        core_info = self._wait_until_ready()
        self.max_model_len, self.quantization = core_info.max_model_len, core_info.quantization
        self.weight_bytes = core_info.weight_bytes
        self._init_client(info.tokenizer, core_info.request_limits)
        kv = self.kv_cache()
        logger.info(
            "engine core process %d ready in %.1fs (%s step, quantization=%s): weights %.1f MiB, KV cache in %s, %d "
            "tokens (%d blocks)",
            self._process.pid,
            time.monotonic() - started,
            "compiled" if core_info.compiled else "eager",
            self.quantization or "none",
            core_info.weight_bytes / 2**20,
            kv.dtype,
            kv.num_tokens,
            kv.num_blocks,
        )

    def _wait_until_ready(self) -> CoreInfo:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self._outputs.poll(200):
                reply: CoreReply = receive(self._outputs)
                if isinstance(reply, CoreReady):
                    return reply.info
                detail = reply.traceback if isinstance(reply, CoreFailed) else repr(reply)
                raise RuntimeError(f"the engine core failed to start:\n{detail}")
            if not self._process.is_alive():
                raise RuntimeError(f"the engine core process exited with code {self._process.exitcode}")
        self._process.kill()
        raise RuntimeError(f"the engine core was not ready within {STARTUP_TIMEOUT:g}s")

    # ---- requests (as LLMEngine) --------------------------------------------------------------------------

    def add_prepared(self, prepared: PreparedRequest) -> None:
        request = prepared.request
        self.processor.add(request.request_id, prepared.state)
        self._in_flight[request.request_id] = request.arrival_time
        self._send(AddRequest(request))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id not in self._in_flight:
            return None
        self._send(AbortRequest(request_id))
        ended = self._end_here(request_id, RequestStatus.FINISHED_ABORTED)
        del self._in_flight[request_id]
        return self.processor.make_output(ended)

    def has_unfinished_requests(self) -> bool:
        return bool(self._in_flight)

    def request_ids(self) -> list[str]:
        return list(self._in_flight)

    # ---- the step: what the core reported since the last call ---------------------------------------------

    def step(self, timeout_ms: int = 50) -> list[RequestOutput]:
        """The outputs of every report that arrived (waiting up to timeout_ms for the first); CoreDied if gone."""
        results: list[RequestOutput] = []
        waited = False
        while True:
            if not self._outputs.poll(0 if waited else timeout_ms):
                if not self._process.is_alive():
                    self._dead = True
                    raise CoreDied(f"the engine core process exited with code {self._process.exitcode}")
                return results
            waited = True
            report: CoreReply = receive(self._outputs)
            if isinstance(report, CoreFailed):
                self._dead = True
                raise CoreDied(f"the engine core failed:\n{report.traceback}")
            assert isinstance(report, CoreReport), f"unexpected message from the core: {report!r}"
            self._stats, self._queue, self._never_scheduled = report.stats, report.queue, report.never_scheduled
            for output in report.outputs:
                if output.request_id in self._in_flight:
                    result = self.processor.process(output, self)
                    if result is None:  # a final-only request's step between
                        continue
                    if result.finished:
                        del self._in_flight[output.request_id]
                    results.append(result)

    # RequestEnding: the output processor ends requests through these; the core ends its copy on its next loop.

    def stopped(self, output: EngineCoreOutput, stop: str) -> EngineCoreOutput:
        self._send(FinishRequest(output.request_id, stop))
        return self._end_here(output.request_id, RequestStatus.FINISHED_STOPPED, stop)

    def failed(self, output: EngineCoreOutput, error: Exception) -> EngineCoreOutput:
        logger.error("request %s failed: %r", output.request_id, error, exc_info=error)
        self._send(FailRequest(output.request_id, f"{type(error).__name__}: {error}"))
        return self._end_here(output.request_id, RequestStatus.FINISHED_ERROR, error=error)

    def _end_here(
        self,
        request_id: str,
        status: RequestStatus,
        stop: str | None = None,
        error: Exception | None = None,
    ) -> EngineCoreOutput:
        """A request ended on this side at once; the core, told by message, ends its own copy on its next loop. Its
        metrics: the last the core sent, if any, ending now."""
        last = self.processor.metrics_of(request_id) or RequestMetrics(self._in_flight[request_id], None, None, None)
        metrics = dataclasses.replace(last, finished_time=time.monotonic())
        ended = EngineCoreOutput(request_id, [], status.value, stop, metrics)
        if error is not None:
            ended.error = f"{type(error).__name__}: {error}"
        return ended

    # ---- observability and control ------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        if not self._dead and not self._process.is_alive():
            self._dead = True  # nothing more is sent to it (a send to a gone peer queues until it blocks)
        return not self._dead

    def stats(self) -> EngineStats:
        if self._stats is None:
            return EngineStats.empty(self._limits.num_kv_blocks)
        return self._stats

    def queue_state(self, count_backlog: bool = True) -> QueueState:
        """As of the core's last report; the backlog is counted there from the first time it is asked for."""
        if count_backlog:
            self._watch("backlog")
        return self._queue

    def never_scheduled_since(self, arrived_before: float) -> list[str]:
        self._watch("never_scheduled")
        return [rid for rid, arrival in self._never_scheduled if arrival < arrived_before and rid in self._in_flight]

    def set_tenant_weights(self, weights: dict[str, float]) -> None:
        self._send(SetTenantWeights(dict(weights)))

    def shutdown(self) -> None:
        if self._process.is_alive():
            self._send(Shutdown())
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        self._socket_dir.cleanup()

    def _watch(self, walk: QueueWalk) -> None:
        """Asks the core to report a walk over its queue from now on (it costs a step nothing unless asked)."""
        if walk not in self._watched:
            self._watched.add(walk)
            self._send(WatchQueue(walk))

    def _send(self, message: CoreRequest) -> None:
        if not self._dead:
            send(self._inputs, message)
