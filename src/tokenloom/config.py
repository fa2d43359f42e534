"""Every engine knob, with its meaning and default, one frozen dataclass per concern. Validated on construction.

    EngineConfig
      model: ModelLoadConfig     which checkpoint, in which dtype, on which device, compiled or eager
      cache: CacheConfig         the paged KV cache and its host swap pool
      scheduler: SchedulerConfig the step's budget and cap, chunking, the policy and the preemption mode
      parallel: ParallelConfig   tensor parallelism: how many processes share each layer
      structured_outputs: StructuredOutputsConfig  what a request's grammar may cost: cache bytes, size, time
      speculative: SpeculativeDecodingConfig  speculative decoding: --speculative-config, vLLM's JSON
      lora: LoRAConfig           LoRA adapters served over the base model (lora.py)

Each part is built from its own config (the scheduler from SchedulerConfig, the KV cache from CacheConfig), so a
new knob is one field in one class: the CLI flags (one per field, help from the docstring under it),
``EngineConfig.from_kwargs`` (the flat keywords of ``LLM(...)``) and ``to_dict`` (``/version``) follow by themselves.
Field names are unique across the parts, as flat options need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, get_args

from tokenloom.lora import LoRAConfig
from tokenloom.speculative_config import SpeculativeConfig, require

Batching = Literal["continuous", "static"]
DType = Literal["auto", "float32", "bfloat16", "float16", "half", "float"]
SchedulingPolicy = Literal["fcfs", "priority", "fair"]
PreemptionMode = Literal["recompute", "swap", "auto"]
AttentionBackend = Literal["auto", "torch", "cpu", "triton"]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]
Quantization = Literal["int8", "int8_w8a16", "fp8"]
DTYPES: tuple[str, ...] = get_args(DType)
POLICY_NAMES: tuple[str, ...] = get_args(SchedulingPolicy)
PREEMPTION_MODES: tuple[str, ...] = get_args(PreemptionMode)


@dataclass(frozen=True)
class ModelLoadConfig:
    model: str | None = None
    """A GGUF file, a Hugging Face checkpoint directory, or None for the embedded SmolLM2-135M-Instruct."""
    dtype: DType = "auto"
    """Weights, activations and KV cache: 'auto' (bfloat16 on a CPU with native bf16 dot products, AVX-512 BF16
    or AMX, and on CUDA devices that support it; float32 otherwise), float32 (exact against transformers),
    bfloat16 or float16."""
    device: str = "cpu"
    """A torch device string, as torch.device takes it (cpu, a CUDA device and its index, mps)."""
    attention_backend: AttentionBackend = "auto"
    """Paged attention: 'triton' (one Triton launch per layer for the whole batch, K/V read in place; CUDA, or CPU
    tensors under TRITON_INTERPRET=1), 'cpu' (our C++ operators: attention, norms, rotary), 'torch' (plain
    PyTorch, the reference), or 'auto' (triton on CUDA where Triton is installed, cpu on a CPU whose operators
    build, else torch)."""
    enforce_eager: bool | None = None
    """True: run the model eagerly; False: compile the step with torch.compile (inductor), once per size class,
    warmed up at start and cached under $TOKENLOOM_CACHE; None (auto): compile on an accelerator, eager on CPU,
    where the C++ operators already fuse the small ops and the compiled step measured no faster
    (benchmarks/RESULTS.md)."""
    num_threads: int | None = None
    """Threads torch uses for intra-op work on CPU; None leaves torch's default (the number of cores)."""
    max_model_len: int | None = None
    """The longest sequence (prompt plus output); None takes the model's own context length."""
    quantization: Quantization | None = None
    """8-bit weights for every linear of the decoder layers, quantized at load time per output channel, activations
    on the fly: 'int8' (CPU: our VNNI, AMX or AVX2 kernels; 8-bit activation codes per token, or per 64 inputs of a
    token where the CPU has VNNI and no AMX, 16-bit ones on AVX2), 'int8_w8a16' (16-bit activation codes on every
    CPU) or 'fp8' (CUDA, Hopper or later: torch._scaled_mm). The embeddings keep the model's dtype; an int8 model's
    logits come from an int8 copy of the LM head, each row's best candidates recomputed from the plain weight
    (model/quantization.py). None: the checkpoint's weights in the model's dtype."""
    seed: int = 0
    """Seeds the sampler of requests that give no seed of their own."""

    def __post_init__(self) -> None:
        for name in ("num_threads", "max_model_len"):
            _require_positive_or_none(self, name)
        require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}")
        backends = get_args(AttentionBackend)
        require(self.attention_backend in backends, f"attention_backend must be one of {', '.join(backends)}")
        require(isinstance(self.device, str) and bool(self.device), "device must be a torch device string")
        methods = get_args(Quantization)
        require(self.quantization in (None, *methods), f"quantization must be one of {', '.join(methods)}")

    def compiles_step(self, device_type: str) -> bool:
        if self.enforce_eager is None:
            return device_type != "cpu"
        return not self.enforce_eager


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV cache block."""
    num_kv_blocks: int | None = None
    """The size of the KV cache in blocks; overrides kv_cache_memory."""
    kv_cache_memory: int | None = None
    """The size of the KV cache in bytes; by default on an accelerator what gpu_memory_utilization leaves, on a CPU
    2 GiB (or less when max_num_seqs full-length requests need less)."""
    gpu_memory_utilization: float = 0.9
    """The share of an accelerator's memory this engine may take (weights, the activations of a profiling step at
    max_num_batched_tokens, the KV cache), as vLLM's flag: the KV cache gets what is left. Unused on a CPU or when
    num_kv_blocks or kv_cache_memory is given."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes."""
    swap_space: float = 4.0
    """GiB of host memory for swapped-out KV blocks; allocated only when preemption_mode is 'swap' or 'auto'."""
    num_swap_blocks: int | None = None
    """The size of the swap pool in blocks; overrides swap_space."""
    kv_cache_dtype: KVCacheDType = "auto"
    """What the KV cache stores: 'auto' (the model's dtype), or 8 bits per value with one float32 scale per token and
    KV head: 'int8', 'fp8_e4m3' ('fp8', as vLLM spells it) or 'fp8_e5m2'. 8-bit roughly halves a bf16 cache's bytes
    per token, so the same memory holds about twice the tokens."""

    def __post_init__(self) -> None:
        require(isinstance(self.block_size, int) and self.block_size > 0, "block_size must be a positive integer")
        for name in ("num_kv_blocks", "kv_cache_memory", "num_swap_blocks"):
            _require_positive_or_none(self, name)
        require(isinstance(self.swap_space, int | float) and self.swap_space >= 0, "swap_space must be >= 0 GiB")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1]")
        kinds = get_args(KVCacheDType)
        require(self.kv_cache_dtype in kinds, f"kv_cache_dtype must be one of {', '.join(kinds)}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    """The most requests in the running batch at once."""
    max_num_batched_tokens: int = 2048
    """The token budget of one step: prompt chunks and decode tokens of all running requests together. 2048 (as
    vLLM's CPU backend chunks prefill): large enough that a burst's prefill takes few steps, so few decode
    intervals wait behind one (ITL p95 within 1.5x p50 on mixed-64), small enough to keep TTFT low."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so they share each step with other requests' decode tokens."""
    long_prefill_token_threshold: int = 0
    """Stall-free prefill: one prompt gets at most this many tokens of a step, so decodes keep moving; 0: no cap."""
    max_num_partial_prefills: int = 0
    """Stall-free prefill: at most this many prompts are prefilled in one step; 0: no limit."""
    scheduling_policy: SchedulingPolicy = "fcfs"
    """'fcfs' (arrival order), 'priority' (a request's priority, then arrival; may displace at the cap) or 'fair'
    (weighted fair share of tokens between tenants)."""
    preemption_mode: PreemptionMode = "recompute"
    """When KV blocks run out: 'recompute' drops a victim's KV and computes it again on resuming; 'swap' copies its
    blocks to a host-memory pool and back (recompute when the pool is full); 'auto' picks the cheaper per victim."""
    batching: Batching = "continuous"
    """'continuous' re-forms the batch every step; 'static' admits a batch only when the previous one has finished."""
    async_output_proc: bool | None = None
    """Asynchronous output processing (vLLM V0's, on by default there on CUDA): the next step is scheduled and
    launched on the device before this step's tokens are turned into outputs (detokenized, checked for stop strings,
    delivered), so the device runs while the host does that. A request ended by what the output side finds (a stop
    string, an abort) has computed one more token, never shown. None (auto): on for an accelerator, off on a CPU,
    where the step runs on the host itself and nothing overlaps; True also on a CPU (the same tokens, no gain)."""
    async_scheduling: bool = False
    """Asynchronous scheduling (vLLM V1's flag): each step is scheduled and launched before the step before it is
    read, its decode rows' tokens taken on the device from that step's samples, so the scheduler and the input
    preparation run while the device does too (implies asynchronous output processing). Steps are read first, as
    without it, while a request with a grammar or penalties is live (they need the tokens on the host); not with
    speculative decoding or tensor parallelism. A request that ends at a token the next step was already scheduled
    past has computed one more token, never shown."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"{name} must be a positive integer")
        for name in ("long_prefill_token_threshold", "max_num_partial_prefills"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"{name} must be an integer >= 0")
        require(
            self.enable_chunked_prefill or not self.long_prefill_token_threshold,
            "long_prefill_token_threshold needs chunked prefill",
        )
        require(self.preemption_mode in PREEMPTION_MODES, f"preemption_mode must be one of {PREEMPTION_MODES}")
        require(self.batching in get_args(Batching), "batching must be 'continuous' or 'static'")
        require(self.scheduling_policy in POLICY_NAMES, f"scheduling_policy must be one of {', '.join(POLICY_NAMES)}")
        require(
            not (self.async_scheduling and self.async_output_proc is False),
            "async_scheduling reads each step after launching the next: it needs async_output_proc",
        )

    def overlaps_output_processing(self, device_type: str) -> bool:
        if self.async_scheduling:
            return True
        return device_type != "cpu" if self.async_output_proc is None else self.async_output_proc


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Processes that share every layer (Megatron-style: heads and MLP width split, one all-reduce after the
    attention output and one after the MLP), over torch.distributed (gloo on CPU, NCCL on CUDA). The attention and
    KV heads and the MLP width must divide by it. Runs the step eagerly."""
    distributed_init_method: str | None = None
    """Where the ranks meet, as torch.distributed takes it (tcp://host:port); None: a free port on 127.0.0.1."""

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        require(isinstance(size, int) and size > 0, "tensor_parallel_size must be a positive integer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    grammar_cache_bytes: int = 256 << 20
    """Bytes the grammar compiler's cache of compiled grammars may hold; the least recently used go first (each
    distinct JSON schema keeps its token-mask tables, ~1 MB per 300 properties on a 49k vocabulary)."""
    max_grammar_bytes: int = 64 << 10
    """The longest structured-output spec (JSON schema, regex, grammar, the choices together) a request may send;
    longer gets 400."""
    grammar_compile_timeout: float = 10.0
    """Seconds a request's grammar may take to compile before the request gets 400. Compiles run in worker
    threads, off the event loop and the engine's step; a compile past its deadline still finishes in its thread
    (xgrammar cannot be interrupted) and its spec is then refused at once."""

    def __post_init__(self) -> None:
        for name in ("grammar_cache_bytes", "max_grammar_bytes"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"{name} must be a positive integer")
        require(self.grammar_compile_timeout > 0, "grammar_compile_timeout must be positive")


@dataclass(frozen=True)
class SpeculativeDecodingConfig:
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, as vLLM's JSON: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    or {"method": "suffix"}. Draft tokens are proposed from the text itself (no draft model) and verified in the same
    step as everything else; greedy output is unchanged and sampled output keeps its distribution. None: off."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))


PARTS: dict[str, type] = {
    "model": ModelLoadConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "structured_outputs": StructuredOutputsConfig,
    "speculative": SpeculativeDecodingConfig,
    "lora": LoRAConfig,
}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelLoadConfig = dataclasses.field(default_factory=ModelLoadConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = dataclasses.field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeDecodingConfig = dataclasses.field(default_factory=SpeculativeDecodingConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.lora.enable_lora:  # an adapter's matrices are not sharded across ranks
            require(self.parallel.tensor_parallel_size == 1, "LoRA adapters are served on one rank")
        if self.scheduler.async_scheduling:
            # Drafts are proposed from the tokens just sampled, and tensor-parallel workers are sent token ids:
            # both need each step's tokens on the host before the next step is scheduled.
            require(self.speculative.speculative_config is None, "async_scheduling does not speculate")
            require(self.parallel.tensor_parallel_size == 1, "async_scheduling runs on one rank")

    @classmethod
    def field_names(cls) -> list[str]:
        """Every option's flat name, across the parts."""
        return [f.name for part in PARTS.values() for f in dataclasses.fields(part)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """From flat options (``max_num_seqs=8, dtype="float32"``), each routed to the part that holds it."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; the options are: {', '.join(cls.field_names())}")
        parts = {}
        for name, part in PARTS.items():
            own = {f.name for f in dataclasses.fields(part)}
            parts[name] = part(**{k: v for k, v in kwargs.items() if k in own})
        return cls(**parts)

    def to_dict(self) -> dict[str, Any]:
        """Every option by its flat name, as from_kwargs takes them."""
        flat: dict[str, Any] = {}
        for name in PARTS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        return flat

    def compiles_step(self, device_type: str) -> bool:
        single = self.parallel.tensor_parallel_size == 1
        return self.model.compiles_step(device_type) and single and not self.lora.enable_lora


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


def _require_positive_or_none(config: object, name: str) -> None:
    value = getattr(config, name)
    require(value is None or (isinstance(value, int) and value > 0), f"{name} must be a positive integer")


def _require_server(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"ServerConfig: {message}")
