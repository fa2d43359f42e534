"""What `tokenloom serve` adds around the engine (EngineConfig, config.py): HTTP, keys, limits, timeouts, and where
the engine core runs; one flag per field, its help the docstring under it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ServerConfig:
    """What `tokenloom serve` adds around the engine: HTTP, keys, limits, timeouts, and where the core runs."""

    host: str = "127.0.0.1"
    """The address to listen on (loopback by default; put a proxy in front before exposing it)."""
    port: int = 8000
    """The TCP port to listen on."""
    api_key: tuple[str, ...] = ()
    """Bearer keys clients must send (one or more, as vLLM takes them: --api-key k1 k2); without one, the
    TOKENLOOM_API_KEY environment variable."""
    served_model_name: tuple[str, ...] = ()
    """The model ids clients use (one or more: the first is the one reported, every one is accepted); none: the
    checkpoint's name."""
    lora_modules: tuple[str, ...] = ()
    """LoRA adapters served from the start, each name=path or vLLM's JSON {"name", "path", "base_model_name"}; a
    request names one as its model. Needs --enable-lora."""
    max_body_bytes: int = 1 << 20
    """Request bodies over this many bytes get 413, counted on the byte stream (chunked bodies too)."""
    max_inflight_body_bytes: int = 128 << 20
    """The bytes of request bodies all requests in flight hold (from their first byte read until their response
    ends); a request that would go over gets 429 (Retry-After): what keeps the server's memory bounded however many
    connections clients open."""
    max_inflight_response_bytes: int = 2 << 30
    """What requests in flight may hold of the server's memory for their responses, each charged at admission the
    most it can hold (a fixed cost, each choice's, each logprob's, and the tokens of several choices: see
    server/response_budget.py); a request that would go over gets 429 (Retry-After), one over it alone 400: what
    keeps the server's memory bounded whatever n, max_tokens and logprobs clients ask for, and however many queue."""
    body_timeout: float = 30.0
    """Seconds a request has to send its whole body once its headers are in; then 408 and the connection closes."""
    tenants: str | None = None
    """A TOML file of tenants: keys, caps, priorities, rates."""
    max_num_queued_requests: int | None = None
    """More requests waiting than this get 429 (with Retry-After); None: no limit."""
    max_num_queued_tokens: int | None = None
    """A prefill backlog (prompt tokens waiting) larger than this gets 429; None: no limit."""
    queue_timeout: float | None = None
    """Seconds a request may wait for its first scheduling before a 503; None: forever."""
    drain_timeout: float = 30.0
    """Seconds in-flight requests get to finish after SIGTERM; then they end with an error event."""
    header_timeout: float = 10.0
    """Seconds a connection has to send a request's headers (idle and slowloris connections are closed)."""
    max_header_bytes: int = 16 * 1024
    """The request line and headers over this many bytes get 431."""
    max_header_count: int = 100
    """More header fields than this get 431."""
    keep_alive_timeout: float = 5.0
    """Seconds an idle keep-alive connection stays open."""
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one, used instead of the checkpoint's (as vLLM's flag)."""
    generation_config: str = "auto"
    """Sampling defaults for what a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty), as
    vLLM's flag: 'auto' reads the checkpoint's generation_config.json if it has one, 'vllm' uses none (OpenAI's
    defaults), a directory reads its generation_config.json."""
    override_generation_config: str | None = None
    """A JSON object of sampling defaults over --generation-config's (or alone, with 'vllm'), as vLLM's flag: e.g.
    '{"temperature": 0.5}'; keys among temperature, top_p, top_k, min_p, repetition_penalty."""
    stream_interval: int = 1
    """A streamed response's chunks after the first carry at least this many tokens (the last goes at once), as
    vLLM's flag: fewer, larger chunks cost the server less CPU a token (benchmarks/RESULTS.md); 1: every token as
    it comes. A request's own stream_interval may raise it, never lower it."""
    responses_store_bytes: int = 32 << 20
    """/v1/responses keeps the latest responses and their conversations (previous_response_id continues one, GET
    /v1/responses/{id} reads it back, as OpenAI's store), up to this many bytes (their JSON and their objects'
    overhead), the least recently used dropped first; each is its tenant's alone. 0: none are kept (vLLM's
    default)."""
    enable_prompt_tokens_details: bool = False
    """Chat and completion usage says how many prompt tokens the prefix cache served
    (prompt_tokens_details.cached_tokens), as vLLM's flag; /v1/responses always says it."""
    enable_force_include_usage: bool = False
    """Every streamed chat or completion ends with a chunk of its usage, asked for or not, as vLLM's flag."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name their tokens 'token_id:N' unless a request says otherwise, as vLLM's flag."""
    response_role: str = "assistant"
    """The role a chat reply names when the request opens the assistant's turn (add_generation_prompt), as vLLM's
    flag; a reply that continues the conversation's last message names that message's role."""
    enable_request_id_headers: bool = False
    """Every response carries X-Request-Id, as vLLM's flag: the request's own X-Request-Id if it sent one, else a new
    one; either names a chat or completion response (its id), as the body's request_id does."""
    disable_fastapi_docs: bool = False
    """No /docs, /redoc or /openapi.json, as vLLM's flag."""
    core_process: bool | None = None
    """Run the engine core (scheduler, model) in a process of its own, apart from HTTP and detokenization, so that the
    event loop's work for each streamed token does not hold the engine's GIL. None: on for a --device other than the
    CPU, where steps are fast and the one-process server streamed about half as many tokens (RESULTS.md); off
    on the CPU, where steps are slow and it measured no faster on two cores; and off with --step-log, --ray or
    tensor parallelism (which the core process does not run yet)."""

    def runs_core_process(self, device_type: str, tensor_parallel_size: int) -> bool:
        """Whether the engine core runs in a process of its own, for an engine on a device of this type."""
        if self.core_process is not None:
            return self.core_process
        return device_type != "cpu" and not (self.step_log or self.ray or tensor_parallel_size > 1)

    log_level: str = "info"
    """tokenloom's log level, and uvicorn's unless --uvicorn-log-level is given."""
    uvicorn_log_level: str | None = None
    """uvicorn's log level (its access log is at info), as vLLM's flag; None: --log-level."""
    disable_uvicorn_access_log: bool = False
    """No line per HTTP request in the log, as vLLM's flag."""
    enable_log_requests: bool = False
    """Log each request as it is admitted: its id, tenant, prompt (cut to --max-log-len) and sampling settings."""
    max_log_len: int | None = None
    """The most prompt characters (or token ids) a request's log line shows; None: all of them."""
    step_log: str | None = None
    """Write each engine step to this file as a JSON line: its scheduled requests and the wall time of the engine
    loop's turn that ran it (what `tokenloom simulate profile` fits a served step's cost from); the engine in this
    process only."""
    root_path: str = ""
    """The path prefix a proxy serves this under (FastAPI's root_path, as vLLM's flag)."""
    allowed_origins: tuple[str, ...] = ()
    """Origins browsers may call from (CORS); '*' for any. None given: no CORS headers."""
    ssl_keyfile: str | None = None
    """A PEM private key: serve HTTPS (with --ssl-certfile)."""
    ssl_certfile: str | None = None
    """A PEM certificate chain for --ssl-keyfile."""
    enable_auto_tool_choice: bool = False
    """Let tool_choice "auto" (the default once tools are given) decide between text and calls, parsed from the
    model's output by --tool-call-parser, as vLLM's flag."""
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "pythonic"] | None = None
    """The model family's tool-call format: 'hermes' (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, Hermes),
    'llama3_json' (a bare {"name", "parameters"} object: Llama 3.1, 3.2), 'mistral' ([TOOL_CALLS][{...}]) or
    'pythonic' ([f(a=1), g()]: Llama 3.2, 4)."""
    disable_log_stats: bool = False
    """No periodic throughput line in the log, as vLLM's flag (/metrics still serves the figures)."""
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    """A reasoning model's thought (<think>...</think>) apart from its answer, as vLLM's flag: the message's
    `reasoning` (and `reasoning_content`), a reasoning item in /v1/responses. 'deepseek_r1': the reply thinks until
    </think> (DeepSeek-R1, Qwen3's thinking-only models); 'qwen3': only a reply that opens with <think> thinks."""
    ray: bool = False
    """Serve num_replicas engine replicas behind Ray Serve's HTTP proxy (on host:port), each a whole tokenloom
    server; requests are routed by their prompt's leading text (replicas/routing.py)."""
    num_replicas: int = 1
    """Engine replicas under --ray; 0: autoscale between 1 and max_replicas on ongoing requests per replica."""
    max_replicas: int = 4
    """The most replicas autoscaling (--num-replicas 0) starts."""
    ray_address: str | None = None
    """An existing Ray cluster to join ('auto', or ray://host:port); None starts a local one."""
    request_router: Literal["prefix", "power_of_two"] = "prefix"
    """Under --ray: 'prefix' sends a prompt to the replica its leading text hashes to (prefix-cache hits stay
    together), falling back to the least loaded; 'power_of_two' is Ray Serve's default (two random replicas,
    the shorter queue)."""

    def __post_init__(self) -> None:
        for name in ("api_key", "served_model_name", "allowed_origins", "lora_modules"):  # one as a plain string
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        _require_server(
            not self.enable_auto_tool_choice or self.tool_call_parser is not None,
            "--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, mistral or pythonic)",
        )
        _require_server(
            (self.ssl_keyfile is None) == (self.ssl_certfile is None), "give both --ssl-keyfile and --ssl-certfile"
        )
        _require_server(self.max_log_len is None or self.max_log_len >= 0, "max_log_len must be >= 0")
        self.generation_overrides()  # a malformed override is refused at start
        _require_server(self.responses_store_bytes >= 0, "responses_store_bytes must be >= 0")
        _require_server(self.max_inflight_response_bytes > 0, "max_inflight_response_bytes must be positive")
        for name in ("max_body_bytes", "max_header_bytes", "max_header_count", "stream_interval"):
            _require_server(getattr(self, name) > 0, f"{name} must be positive")
        _require_server(
            self.max_inflight_body_bytes >= self.max_body_bytes, "max_inflight_body_bytes must be >= max_body_bytes"
        )
        for name in ("drain_timeout", "header_timeout", "keep_alive_timeout", "body_timeout"):
            _require_server(getattr(self, name) > 0, f"{name} must be positive")
        _require_server(self.num_replicas >= 0 and self.max_replicas >= 1, "num_replicas >= 0 and max_replicas >= 1")
        _require_server(
            not self.step_log or not (self.core_process or self.ray),
            "--step-log observes the engine in this process: not with --core-process or --ray",
        )

    def generation_overrides(self) -> dict[str, float]:
        """--override-generation-config's sampling defaults (ValueError naming what is wrong)."""
        if self.override_generation_config is None:
            return {}
        try:
            given = json.loads(self.override_generation_config)
        except json.JSONDecodeError as error:
            raise ValueError(f"ServerConfig: override_generation_config is not JSON ({error})") from None
        _require_server(isinstance(given, dict), "override_generation_config must be a JSON object")
        unknown = sorted(set(given) - set(GENERATION_FIELDS))
        _require_server(not unknown, f"override_generation_config: {unknown} are not among {GENERATION_FIELDS}")
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in given.values())
        _require_server(numbers, "override_generation_config: every value must be a number")
        return {name: float(value) for name, value in given.items()}


GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _require_server(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"ServerConfig: {message}")
