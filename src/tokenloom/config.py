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

from tokenloom.hf_overrides import HFOverrides
from tokenloom.lora import LoRAConfig
from tokenloom.sampling_params import LogprobsMode
from tokenloom.speculative_config import SpeculativeConfig, require

Batching = Literal["continuous", "static"]
DType = Literal["auto", "float32", "bfloat16", "float16", "half", "float"]
SchedulingPolicy = Literal["fcfs", "priority", "fair"]
PreemptionMode = Literal["recompute", "swap", "auto"]
AttentionBackend = Literal["auto", "torch", "cpu", "triton"]
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"]
Quantization = Literal["int8", "int8_w8a16", "fp8", "gguf", "none"]
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
    tokenizer: str | None = None
    """A local directory holding the tokenizer to use (tokenizer.json, tokenizer.model or vocab.json, with its config
    and chat template), as vLLM's --tokenizer: for a checkpoint that ships none, or a GGUF served with its original
    model's tokenizer. None: the checkpoint's own. Nothing is downloaded."""
    quantization: Quantization | None = None
    """8-bit weights for every linear of the decoder layers, quantized at load time per output channel, activations
    on the fly: 'int8' (CPU: our VNNI, AMX or AVX2 kernels; 8-bit activation codes per token, or per 64 inputs of a
    token where the CPU has VNNI and no AMX, 16-bit ones on AVX2), 'int8_w8a16' (16-bit activation codes on every
    CPU) or 'fp8' (CUDA, Hopper or later: torch._scaled_mm). The embeddings keep the model's dtype; an int8 model's
    logits come from an int8 copy of the LM head, each row's best candidates recomputed from the plain weight
    (model/quantization.py). 'gguf': a GGUF checkpoint's Q4, Q5, Q6_K and Q8_0 linears and LM head kept as stored
    and multiplied as they are widened to float32 (model/gguf_linear.py: the dequantized model's outputs from
    0.19-0.38 of its bytes; CPUs with AVX2 and FMA, one rank). None (auto): a GGUF checkpoint's own blocks where they
    give the dequantized model's outputs bit for bit (float32 on a CPU with the operator, one rank, eager, no LoRA:
    engine/core_setup.py's served_quantization), as vLLM serves a GGUF quantized; else the checkpoint's weights in
    the model's dtype. 'none': the checkpoint's weights in the model's dtype, a GGUF dequantized."""
    seed: int = 0
    """Seeds the sampler of requests that give no seed of their own."""
    logprobs_mode: LogprobsMode = "raw_logprobs"
    """What a token's logprobs are, as vLLM's flag: 'raw_logprobs' (the model's distribution), 'raw_logits',
    'processed_logprobs' or 'processed_logits' (what the token was chosen from: after logit_bias, min_tokens,
    allowed and bad words and penalties, and for a sampled request its temperature, top-k, top-p and min-p; a
    filtered token's is -inf). A prompt's (prompt_logprobs) are the logprobs or, in a logits mode, the logits."""
    max_logprobs: int = 20
    """The most alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs; a beam
    search of width W asks for 2W), as vLLM's flag; -1: the whole vocabulary. What responses may hold in all stays
    bounded by the server's --max-inflight-response-bytes."""
    hf_overrides: HFOverrides | None = None
    """vLLM's JSON, for a reranker only: {"architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true} scores each prompt (a query and a
    document joined, for /score and /rerank) by sigmoid(logit(yes) - logit(no)) at its last token. Other keys are
    refused (hf_overrides.py)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hf_overrides", HFOverrides.parse(self.hf_overrides))
        for name in ("num_threads", "max_model_len"):
            _require_positive_or_none(self, name)
        require(self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}")
        require(self.max_logprobs >= -1, "max_logprobs must be >= 0, or -1 for the whole vocabulary")
        modes = get_args(LogprobsMode)
        require(self.logprobs_mode in modes, f"logprobs_mode must be one of {', '.join(modes)}")
        backends = get_args(AttentionBackend)
        require(self.attention_backend in backends, f"attention_backend must be one of {', '.join(backends)}")
        require(isinstance(self.device, str) and bool(self.device), "device must be a torch device string")
        require(self.tokenizer is None or (isinstance(self.tokenizer, str) and bool(self.tokenizer)),
                "tokenizer must be a directory")  # fmt: skip
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
        if self.model.quantization == "gguf":  # the GGUF's blocks are not sharded, nor wrapped by adapters
            require(self.parallel.tensor_parallel_size == 1 and not self.lora.enable_lora,
                    "--quantization gguf is served on one rank, without LoRA adapters")  # fmt: skip

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


def _require_positive_or_none(config: object, name: str) -> None:
    value = getattr(config, name)
    require(value is None or (isinstance(value, int) and value > 0), f"{name} must be a positive integer")
