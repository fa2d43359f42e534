"""Turns a scheduler decision into tensors, runs one forward over the flat batch, and samples.

The runner owns the KV cache tensors (and their host-memory swap pool) and the per-request random generators;
it is the only place where requests meet tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenloom.core.scheduler_output import ScheduledRequest
from tokenloom.lora import LoRAConfig, LoRARequest
from tokenloom.model import kv_quant
from tokenloom.model import lora as lora_adapters
from tokenloom.model.attention import AttentionMetadata, resolve_backend, uses_prefill_op
from tokenloom.model.compiled import CompiledForward, compile_model
from tokenloom.model.cuda_graphs import DecodeGraphs, DecodeInputs
from tokenloom.model.forward_context import forward_context
from tokenloom.model.gguf_linear import serve_gguf
from tokenloom.model.gptq import recording_input_hessians
from tokenloom.model.gptq_cache import cache_enabled as gptq_cache_enabled
from tokenloom.model.gptq_cache import codes_key, load_codes, save_gptq_codes
from tokenloom.model.huge_pages import zeros_on_huge_pages
from tokenloom.model.kv_quant import kv_format
from tokenloom.model.llama import CausalLM
from tokenloom.model.penalties import SeenTokens
from tokenloom.model.platform import accelerator_count, multiprocessors
from tokenloom.model.prepack import can_prepack
from tokenloom.model.prompt_outputs import embeddings, prompt_logprobs
from tokenloom.model.quantization import INT8_METHODS, check_quantization, int8_kernel_isa
from tokenloom.model.sampler import (
    GrammarMask,
    SampledOnDevice,
    SampledToken,
    Sampler,
    SamplingBatch,
    SeededGenerators,
    mask_disallowed,
)
from tokenloom.model.step_inputs import ModelInputs, StepInputBuilder
from tokenloom.model.triton_attention import FlatBatch

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)  # one token, or with drafts those kept
    failed: dict[str, Exception] = field(default_factory=dict)  # requests whose sampling raised
    # Per request asking for prompt logprobs: prompt token index -> that token's logprob and the top alternatives.
    prompt_logprobs: dict[str, dict[int, SampledToken]] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # per embedding request, in the step it ends


@dataclass
class VerifiedDrafts:
    """Each request's kept tokens after verifying its drafts (read from the device as they were verified)."""

    kept: list[list[SampledToken]]

    def per_request(self) -> list[list[SampledToken]]:
        return self.kept


class LaunchedStep:
    """A step whose forward and sampling are queued on the device; ``wait()`` gives its result once the sampled
    tokens reach the host (at once on a CPU, where the step ran as it was launched)."""

    def __init__(
        self,
        result: StepResult,
        request_ids: list[str] | None = None,
        sampled: Callable[[], list[list[SampledToken]]] | None = None,
        embeddings: Callable[[], dict[str, list[float]]] | None = None,
    ) -> None:
        self._result = result
        self._request_ids = request_ids or []
        self._sampled = sampled
        self._embeddings = embeddings

    def wait(self) -> StepResult:
        if self._sampled is not None:
            self._result.sampled = dict(zip(self._request_ids, self._sampled(), strict=True))
            self._sampled = None
        if self._embeddings is not None:
            self._result.embeddings = self._embeddings()
            self._embeddings = None
        return self._result


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_kv_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        num_swap_blocks: int = 0,
        compile_step: bool = False,
        attention_backend: str = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        calibration: list[list[int]] | None = None,
        lora: LoRAConfig | None = None,
    ) -> None:
        """calibration: token ids of sequences run through the unquantized model at start, whose inputs to each
        linear make GPTQ round its int8 codes (gptq.py); None or empty: codes rounded to the nearest. lora: serve
        LoRA adapters (lora.py) where it enables them."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        cfg = model.config
        self.attention_backend = resolve_backend(attention_backend, device, dtype)
        self.kv_format = kv_format(kv_cache_dtype)
        kv_quant.check_kv_format(self.kv_format, self.attention_backend, device)
        row, cache_dtype = self._cache_row()
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate_kv_cache(num_kv_blocks)
        # The swap pool is host memory even when the device is the CPU: a pool of its own, never the KV cache's.
        # Empty, not zeroed: a slot is only ever copied in after a whole device block was copied out to it, and
        # untouched pages of a large pool cost no memory until swapping reaches them.
        pin = accelerator_count(device.type) > 0  # pinned host memory: faster copies to and from an accelerator
        self.swap_caches = [
            tuple(torch.empty(num_swap_blocks * block_size, row, dtype=cache_dtype, pin_memory=pin) for _ in range(2))
            for _ in range(cfg.num_layers if num_swap_blocks else 0)
        ]
        self.sampler = Sampler(device, seed, cfg.eos_token_ids)
        self.inputs = StepInputBuilder(
            block_size=block_size,
            device=device,
            dtype=dtype,
            attention_backend=self.attention_backend,
            num_kv_heads=cfg.num_kv_heads,
            kv_format=self.kv_format,
            use_prefill_op=uses_prefill_op(self.attention_backend, dtype, cfg.head_dim),
            # Programs that fill the device: split-K shares are added only where a step has fewer (few long decodes).
            target_programs=4 * multiprocessors(device),
            with_adapters=lora is not None and lora.enable_lora,
        )
        self.compiled: CompiledForward | None = compile_model(model, device) if compile_step else None
        self.graphs: DecodeGraphs | None = None  # enable_decode_graphs
        self.adapters = self._prepare_linears(quantization, calibration, lora)
        self._generators = SeededGenerators(device)  # of live requests with a seed
        self._seen = SeenTokens()  # the token counts of live requests with penalties
        # The last step's sampled token ids on the device, by request: a step scheduled ahead reads its placeholders.
        self._last_sampled: tuple[list[str], torch.Tensor] | None = None

    def _prepare_linears(
        self, quantization: str | None, calibration: list[list[int]] | None, lora: LoRAConfig | None
    ) -> lora_adapters.AdapterSet | None:
        """The decoder's linears in the form this runner runs them: quantized, prepacked, then wrapped so that the
        step's LoRA adapters add their deltas to their rows (lora.py); returns the adapters' set where LoRA is on."""
        if self.inputs.with_adapters:
            self.model.gated_projections = frozenset()  # the adapters add to gate and up before silu(gate) * up
        if quantization == "gguf":
            check_quantization("gguf", self.device)
            serve_gguf(self.model)
        elif quantization is not None:
            self._quantize(quantization, calibration)
        if can_prepack(self.device, self.dtype):
            self.model.prepack_weights(layers=quantization in (None, "gguf"))
        if lora is None or not lora.enable_lora:
            return None
        adapters = lora_adapters.AdapterSet(
            self.model.config, lora.max_lora_rank, lora.kept_adapters, self.dtype, self.device
        )
        lora_adapters.attach(self.model.layers, adapters.step)
        self.model.operator_layers_changed()
        return adapters

    def _quantize(self, method: str, calibration: list[list[int]] | None) -> None:
        check_quantization(method, self.device)
        started = time.monotonic()
        by_gptq = method in INT8_METHODS and bool(calibration)
        cached = by_gptq and gptq_cache_enabled()
        key = codes_key(self.model.layers, calibration or [], str(int8_kernel_isa())) if cached else None
        codes = None if key is None else load_codes(key)
        hessians = self._input_hessians(calibration or []) if by_gptq and codes is None else None
        count = self.model.quantize_weights(method, hessians, codes)
        if key is not None and hessians is not None:
            save_gptq_codes(key, self.model.layers)
        rounding = "from the GPTQ cache" if codes else "by GPTQ" if hessians else "to the nearest"
        logger.info("quantized %d linears to %s (rounded %s) in %.1fs", count, method, rounding,
                    time.monotonic() - started)  # fmt: skip

    @torch.inference_mode()
    def _input_hessians(self, calibration: list[list[int]]) -> dict[str, torch.Tensor]:
        """X^T X of every decoder linear's inputs over the calibration sequences, each run as one prefill."""
        with recording_input_hessians(self.model.layers) as recorders:
            for ids in calibration:
                ids = ids[: self.model.rotary.max_len]
                meta = self.inputs.scratch_prefill(len(ids))
                tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
                self.model(tokens, torch.arange(len(ids), device=self.device), self.kv_caches, meta)
        return {name: recorder.sum for name, recorder in recorders.items()}

    def _cache_row(self) -> tuple[int, torch.dtype]:
        """A cache slot's row: its elements and their dtype (an 8-bit cache: bytes, each head's codes and scale)."""
        cfg = self.model.config
        if self.kv_format is None:
            return cfg.num_kv_heads * cfg.head_dim, self.dtype
        return self.kv_format.row_bytes(cfg.num_kv_heads, cfg.head_dim), torch.uint8

    def allocate_kv_cache(self, num_kv_blocks: int) -> None:
        """(Re)allocates every layer's K and V cache for this many blocks; what was in the old one is gone."""
        num_slots, (row, dtype) = num_kv_blocks * self.block_size, self._cache_row()
        self.kv_caches = []  # the old cache is freed before the new one is taken
        # Zeroed, not empty: padded attention reads masked slots, and 0 * NaN would poison the output (an 8-bit
        # slot of zeros is codes 0 with scale 0: the value 0).
        self.kv_caches = [
            (
                zeros_on_huge_pages(num_slots, row, dtype, self.device),
                zeros_on_huge_pages(num_slots, row, dtype, self.device),
            )
            for _ in range(self.model.config.num_layers)
        ]

    @torch.inference_mode()
    def profile_peak_activation_bytes(self, num_tokens: int) -> int:
        """Runs one prefill of num_tokens through the model (into the cache's first block, a scratch write) and
        returns the device memory it needed beyond what was allocated before (0 where the device cannot tell)."""
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        meta = self.inputs.scratch_prefill(num_tokens)
        hidden = self.model(ids, positions, self.kv_caches, meta)  # eager: the compiled step is not built yet
        self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden
        torch.cuda.empty_cache()  # what the step took goes back, so the free memory read next does not count it twice
        return int(peak)

    def execute(self, scheduled: list[ScheduledRequest], grammar: GrammarMask | None = None) -> StepResult:
        """Runs one step; samples a token for each request whose chunk reached its last token, from the tokens its
        grammar allows if it has one.

        Sampling is where one request's settings can raise; such a request is failed alone (in
        ``StepResult.failed``) and the others still get their tokens. A failing forward fails the whole step.
        """
        return self.launch(scheduled, grammar).wait()

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], grammar: GrammarMask | None = None) -> LaunchedStep:
        """``execute`` without waiting for the device: the step's forward and sampling are queued, and the sampled
        tokens come to the host when the returned step's ``wait()`` is called (verifying drafts, computing prompt
        logprobs and sampling request by request after a failure read the device before returning)."""
        inputs = self.prepare_inputs(scheduled)
        if inputs.placeholders:
            self._fill_placeholders(inputs)
        self._last_sampled = None
        hidden = self._forward(inputs)
        result = StepResult()
        for chunk, first_row in inputs.prompt_chunks:
            request_id = chunk.request.request_id
            try:
                result.prompt_logprobs[request_id] = prompt_logprobs(self.model, self.sampler, hidden, chunk, first_row)
            except Exception as error:
                result.failed[request_id] = error
        read_embeddings = embeddings(self.model, hidden, inputs.pooled_rows)
        if not inputs.sampled_items:
            return LaunchedStep(result, embeddings=read_embeddings)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        items = inputs.sampled_items
        if grammar is not None:
            first_rows = self._first_rows(items)
            row_of = {item.request.request_id: int(row) for item, row in zip(items, first_rows, strict=False)}
            rows = [
                row_of[rid] + offset for rid, offset in zip(grammar.request_ids, grammar.row_offsets(), strict=True)
            ]
            mask_disallowed(logits, rows, grammar.bitmask)
        request_ids = [item.request.request_id for item in items]
        # Each sampled row's input, its request's last token: a penalized request counts it there while it is a
        # placeholder on the host (penalties.py). Only while a penalized request lives (it has counts).
        last = inputs.input_ids[inputs.sample_rows] if inputs.placeholders and len(self._seen) else None
        try:
            sampled = self._sample(logits, items, last)
            if isinstance(sampled, SampledOnDevice):
                self._last_sampled = (request_ids, sampled.device_tokens)
            return LaunchedStep(result, request_ids, sampled.per_request, read_embeddings)
        except Exception:
            # Something in the batch raised: sample request by request to find whose it was.
            first_rows = self._first_rows(items)
            for item, lo, hi in zip(items, first_rows[:-1], first_rows[1:], strict=True):
                request_id = item.request.request_id
                try:
                    span = slice(int(lo), int(hi))
                    sampled = self._sample(logits[span], [item], None if last is None else last[span])
                    result.sampled[request_id] = sampled.per_request()[0]
                except Exception as error:
                    result.failed[request_id] = error
        # A failed request's row reads 0: the step it is in is read after it fails, and passes it over.
        tokens = [result.sampled[rid][0].token_id if rid in result.sampled else 0 for rid in request_ids]
        self._last_sampled = (request_ids, torch.tensor(tokens, device=self.device))
        return LaunchedStep(result, embeddings=read_embeddings)

    @staticmethod
    def _first_rows(items: list[ScheduledRequest]) -> np.ndarray:
        """Where each sampled request's logits rows start (its last token's row, then its drafts'), and the end."""
        return np.cumsum([0] + [1 + len(item.draft_token_ids) for item in items])

    def _sample(
        self, logits: torch.Tensor, items: list[ScheduledRequest], last_tokens: torch.Tensor | None
    ) -> SampledOnDevice | VerifiedDrafts:
        """Each request's new tokens: one sampled (still on the device), or its drafts verified (read here: the
        accepted ones and one more)."""
        batch = self._sampling_batch(items, last_tokens)
        if any(item.draft_token_ids for item in items):
            return VerifiedDrafts(self.sampler.verify(logits, batch, [item.draft_token_ids for item in items]))
        return self.sampler.sample(logits, batch)

    def _fill_placeholders(self, inputs: ModelInputs) -> None:
        """Puts in each placeholder the token its request sampled in the step before, on the device."""
        assert self._last_sampled is not None, "placeholders, but the step before sampled nothing"
        request_ids, tokens = self._last_sampled
        row_of = {request_id: row for row, request_id in enumerate(request_ids)}
        rows = np.array([row for row, _ in inputs.placeholders], dtype=np.int64)
        sources = np.array([row_of[request_id] for _, request_id in inputs.placeholders], dtype=np.int64)
        inputs.input_ids[self.inputs.tensor(rows)] = tokens[self.inputs.tensor(sources)]

    @torch.inference_mode()
    def forward_only(self, scheduled: list[ScheduledRequest]) -> None:
        """A tensor-parallel worker's share of a step: the forward (and its all-reduces), no logits, no sampling."""
        self._forward(self.prepare_inputs(scheduled))

    @property
    def healthy(self) -> bool:
        """False once the runner can run no further step (a tensor-parallel rank is gone)."""
        return True

    def shutdown(self) -> None:
        """Stops what the runner started (tensor-parallel workers); nothing for a single rank."""

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles the step before the first request: one forward per size class (one token, more than one). The
        scratch tokens are written into block 0's slots, which any request that gets block 0 overwrites before it
        reads them."""
        started = time.monotonic()
        for num_tokens in (1, 2):
            assert num_tokens <= self.block_size
            meta = self.inputs.scratch_prefill(num_tokens)
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            self._forward(ModelInputs(ids, torch.arange(num_tokens, device=self.device), meta, ids[:0], []))
        logger.info("compiled the step in %.1fs", time.monotonic() - started)

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> DecodeGraphs:
        """Decode-only steps of up to max_num_seqs rows run through static buffers, replayed as CUDA graphs on a
        CUDA device (captured here, once) or eagerly on the same buffers elsewhere. Needs the Triton backend."""
        assert self.attention_backend == "triton", "decode graphs read the batch through the Triton kernel's tensors"
        self.graphs = DecodeGraphs(self._graph_forward, max_num_seqs, max_model_len, self.block_size, self.device)
        if capture and self.device.type == "cuda":
            self.graphs.capture()
        return self.graphs

    def _graph_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, batch: FlatBatch
    ) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, block_size=self.block_size, flat=batch, kv_format=self.kv_format
        )
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor:
        if self.adapters is not None:
            self.adapters.activate(inputs.adapter_rows, inputs.input_ids.shape[0])
        flat = inputs.meta.flat
        if (
            self.graphs is not None
            and flat is not None
            and flat.max_query_len == 1
            and self.graphs.covers(flat.context_lens.shape[0])
        ):
            step = DecodeInputs(
                inputs.input_ids, inputs.positions, inputs.meta.slot_mapping, flat.context_lens, flat.block_tables
            )
            return self.graphs.run(step)
        if self.compiled is None:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        with forward_context(self.kv_caches, inputs.meta):
            return self.compiled(inputs.input_ids, inputs.positions)

    @torch.inference_mode()
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copies (device block, host slot) pairs to the swap pool; before a step's swap-ins and its forward."""
        self._copy_blocks(self.kv_caches, self.swap_caches, pairs)

    @torch.inference_mode()
    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copies (host slot, device block) pairs back from the swap pool; before the step's forward."""
        self._copy_blocks(self.swap_caches, self.kv_caches, pairs)

    def _copy_blocks(self, sources: list, destinations: list, pairs: list[tuple[int, int]]) -> None:
        src_index = torch.tensor([p[0] for p in pairs], device=sources[0][0].device)
        dst_index = torch.tensor([p[1] for p in pairs], device=destinations[0][0].device)
        for source_layer, destination_layer in zip(sources, destinations, strict=True):
            for source, destination in zip(source_layer, destination_layer, strict=True):
                blocks = source.view(-1, self.block_size, source.shape[-1]).index_select(0, src_index)
                # Blocking: a copy to the host must have landed before the host pool is read again.
                destination.view(-1, self.block_size, destination.shape[-1]).index_copy_(
                    0, dst_index, blocks.to(destination.device)
                )

    def retain_adapter(self, request_id: str, lora: LoRARequest) -> None:
        """Holds the request's LoRA adapter, loading it if needed: ValueError if LoRA is off or it does not load."""
        if self.adapters is None:
            raise ValueError(f"the request asks for the LoRA adapter {lora.lora_name!r}, but LoRA is not enabled")
        self.adapters.retain(request_id, lora)

    def release(self, request_id: str) -> None:
        self._generators.drop(request_id)
        self._seen.drop(request_id)
        if self.adapters is not None:
            self.adapters.release(request_id)

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> ModelInputs:
        return self.inputs.build(scheduled)

    def _sampling_batch(self, items: list[ScheduledRequest], last_tokens: torch.Tensor | None) -> SamplingBatch:
        requests = [s.request for s in items]
        return SamplingBatch(
            params=[r.sampling_params for r in requests],
            generators=[self._generators.of(r.request_id, r.sampling_params.seed) for r in requests],
            token_counts=[self._seen.of(r) for r in requests],
            last_tokens=last_tokens,
            output_index=[item.sampled_output_index for item in items],
            history_of=lambda row: items[row].request.output_token_ids + items[row].draft_token_ids,
        )
