"""Builds and runs the server: engine, metrics, tenants, the async engine, the app, uvicorn with its drain."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import FrameType

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenloom.config import EngineConfig
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.engine.core_process import CoreProcessEngine
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.step_log import StepLog
from tokenloom.model.lora import read_adapter_config
from tokenloom.server.app import build_app
from tokenloom.server.connections import with_header_limits
from tokenloom.server.lora_adapters import parse_lora_modules
from tokenloom.server.metrics import ServerMetrics
from tokenloom.server.state import VllmOptions
from tokenloom.server.tenants import load_tenants
from tokenloom.server_config import GENERATION_FIELDS, ServerConfig
from tokenloom.utils import heap_frozen
from tokenloom.version import git_commit

ENGINE_DEATH_GRACE_S = 3.0  # after the engine dies, for the error events of what was in flight to leave
ENGINE_DIED_EXIT_CODE = 1
API_KEY_ENV = "TOKENLOOM_API_KEY"  # as vLLM reads VLLM_API_KEY: a key kept out of `ps`
LOG_STATS_EVERY_S = 10.0  # the periodic throughput line, as vLLM logs it (--disable-log-stats: never)


def without_query_string(record: logging.LogRecord) -> bool:
    """An access-log filter: the path without its query string, where a client may have put a key (?api_key=)."""
    args = record.args
    if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):  # uvicorn's (client, method, path...)
        record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
    return True


def read_chat_template(template: str) -> str:
    """A template given inline, or the contents of the file it names."""
    path = Path(template)
    return path.read_text() if "{" not in template and path.is_file() else template


def generation_defaults(server: ServerConfig, checkpoint: Path) -> dict[str, float]:
    """The sampling defaults of --generation-config's generation_config.json (the checkpoint's for 'auto', none for
    'vllm', or a directory's), with --override-generation-config's over them."""
    return {**_generation_file_defaults(server.generation_config, checkpoint), **server.generation_overrides()}


def _generation_file_defaults(choice: str, checkpoint: Path) -> dict[str, float]:
    if choice == "vllm":
        return {}
    directory = checkpoint if choice == "auto" else Path(choice)
    path = directory / "generation_config.json"
    if not path.is_file():
        if choice != "auto":
            raise FileNotFoundError(f"--generation-config {choice}: no generation_config.json there")
        return {}
    config = json.loads(path.read_text())
    defaults = {name: float(config[name]) for name in GENERATION_FIELDS if config.get(name) is not None}
    if defaults:
        logging.getLogger(__name__).info("sampling defaults from %s: %s", path, defaults)
    return defaults


def build_server(
    server: ServerConfig, engine_config: EngineConfig, replica_id: str | None = None
) -> tuple[FastAPI, AsyncEngine]:
    """The engine (in this process or with its core apart), the metrics, the async engine and the app; not started.
    replica_id: the Ray Serve replica this server is (its metrics' label, and in the ids of the responses it keeps)."""
    lora_modules = _lora_modules(server, engine_config)
    engine, step_log = _engine(server, engine_config)
    model_name, *aliases = server.served_model_name or (engine.model_name,)
    log_every = math.inf if server.disable_log_stats else LOG_STATS_EVERY_S
    labels = None if replica_id is None else {"replica": replica_id}
    metrics = ServerMetrics(engine, model_name, log_interval=log_every, labels=labels)
    tenants = load_tenants(server.tenants) if server.tenants else None
    if tenants:
        engine.set_tenant_weights({t.name: t.weight for t in tenants})
    async_engine = AsyncEngine(
        engine,
        max_num_queued_requests=server.max_num_queued_requests,
        queue_timeout=server.queue_timeout,
        max_num_queued_tokens=server.max_num_queued_tokens,
        on_step=metrics.on_step,
        step_log=step_log,
    )
    app = build_app(
        async_engine,
        metrics,
        model_name,
        api_keys=list(server.api_key) or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else []),
        tenants=tenants,
        max_body_bytes=server.max_body_bytes,
        version_info={"git_commit": git_commit()},
        sampling_defaults=generation_defaults(server, engine.model_path),
        aliases=tuple(aliases),
        tool_call_parser=server.tool_call_parser if server.enable_auto_tool_choice else None,
        reasoning_parser_name=server.reasoning_parser,
        log_requests=server.enable_log_requests,
        max_log_len=server.max_log_len,
        root_path=server.root_path,
        stream_interval=server.stream_interval,
        max_inflight_body_bytes=server.max_inflight_body_bytes,
        max_inflight_response_bytes=server.max_inflight_response_bytes,
        body_timeout=server.body_timeout,
        responses_store_bytes=server.responses_store_bytes,
        replica_id=replica_id,
        prompt_tokens_details=server.enable_prompt_tokens_details,
        vllm_options=_vllm_options(server),
    )
    for name, path, base_model_name in lora_modules:
        app.state.tokenloom.adapters.add(name, path, base_model_name)
    if server.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in server.allowed_origins,
        )
    return app, async_engine


def _lora_modules(server: ServerConfig, engine_config: EngineConfig) -> list[tuple[str, str, str | None]]:
    """--lora-modules, each adapter's config checked before the engine starts (ValueError saying what is wrong)."""
    modules = parse_lora_modules(server.lora_modules)
    if modules and not engine_config.lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    names = [name for name, _, _ in modules] + list(server.served_model_name)
    if len(set(names)) < len(names):
        raise ValueError(f"--lora-modules: each adapter needs a name of its own, apart from the model's: {names}")
    for _, path, _ in modules:
        read_adapter_config(path, engine_config.lora.max_lora_rank)
    return modules


def _engine(server: ServerConfig, engine_config: EngineConfig) -> tuple[LLMEngine | CoreProcessEngine, StepLog | None]:
    """The engine, in this process or with its core apart, its chat template as the server's flags say; and the step
    log it writes to, if asked for."""
    step_log = StepLog(server.step_log) if server.step_log else None  # opened first: a bad path fails at once
    engine: LLMEngine | CoreProcessEngine
    device_type = torch.device(engine_config.model.device).type
    core_process = server.runs_core_process(device_type, engine_config.parallel.tensor_parallel_size)
    engine = CoreProcessEngine(engine_config) if core_process else LLMEngine(engine_config)
    if step_log is not None:
        assert isinstance(engine, LLMEngine), "ServerConfig refuses --step-log with --core-process"
        engine.observe_steps(step_log.observe)
    if server.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = read_chat_template(server.chat_template)
    return engine, step_log


def configure_logging(server: ServerConfig) -> None:
    logging.basicConfig(level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(server: ServerConfig, engine_config: EngineConfig) -> int:
    """Serves with uvicorn in this process (N replicas behind Ray Serve's proxy are replicas/ray_serve.py's)."""
    configure_logging(server)
    app, async_engine = build_server(server, engine_config)
    engine_died = threading.Event()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        with heap_frozen(collect_first=True):
            yield
        async_engine.draining = True
        await app.state.tokenloom.background.stop()
        async_engine.shutdown()

    app.router.lifespan_context = lifespan

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT: stop admitting, let in-flight requests finish (up to the drain timeout), exit 0."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            async_engine.begin_drain(server.drain_timeout)
            if self.should_exit:
                self.force_exit = True  # a second signal stops at once
            self.should_exit = True

    http_server = DrainingServer(_uvicorn_config(app, server))

    def exit_after_engine_death() -> None:
        """As vLLM's API server: a server whose engine died exits non-zero, so a supervisor (Kubernetes' liveness
        probe, systemd) restarts it. What was in flight has been failed with an error of its own; those errors
        get a moment to reach their clients before the connections are cut."""
        engine_died.set()
        http_server.should_exit = True
        cut = threading.Timer(ENGINE_DEATH_GRACE_S, lambda: setattr(http_server, "force_exit", True))
        cut.daemon = True  # a server already down need not wait for it
        cut.start()

    async_engine.on_engine_death = exit_after_engine_death
    http_server.run()
    if engine_died.is_set():
        logging.getLogger(__name__).error("exiting: the engine died")
        return ENGINE_DIED_EXIT_CODE
    return 0


def _vllm_options(server: ServerConfig) -> VllmOptions:
    return VllmOptions(
        fastapi_docs=not server.disable_fastapi_docs,
        request_id_headers=server.enable_request_id_headers,
        force_include_usage=server.enable_force_include_usage,
        return_tokens_as_token_ids=server.return_tokens_as_token_ids,
        response_role=server.response_role,
        score_template=server.chat_template is not None,
    )


def _uvicorn_config(app: FastAPI, server: ServerConfig) -> uvicorn.Config:
    logging.getLogger("uvicorn.access").addFilter(without_query_string)
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_level=server.uvicorn_log_level or server.log_level,
        access_log=not server.disable_uvicorn_access_log,
        root_path=server.root_path,
        ssl_keyfile=server.ssl_keyfile,
        ssl_certfile=server.ssl_certfile,
        http=with_header_limits(server.header_timeout, server.max_header_bytes, server.max_header_count),
        timeout_keep_alive=math.ceil(server.keep_alive_timeout),
        h11_max_incomplete_event_size=server.max_header_bytes + 1,  # ours answers 431 first; h11's closes
        # The engine cuts what is still running at the drain timeout, with a final error event; this leaves
        # time for those events to reach the clients before uvicorn closes the connections.
        timeout_graceful_shutdown=math.ceil(server.drain_timeout + 5.0),
    )
