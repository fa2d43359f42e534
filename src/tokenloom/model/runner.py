"""Turns a scheduler decision into tensors, runs one forward over the flat batch, and samples.

The runner owns the KV cache tensors and the per-request random generators; it is the only place where
requests meet tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.core.scheduler import ScheduledRequest
from tokenloom.model.attention import AttentionMetadata, PrefillSegment
from tokenloom.model.llama import CausalLM
from tokenloom.model.sampler import SampledToken, Sampler, SamplingBatch


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # the row of each sampled request's last token
    sampled_items: list[ScheduledRequest]


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_kv_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        cfg = model.config
        num_slots = num_kv_blocks * block_size
        row = cfg.num_kv_heads * cfg.head_dim
        # Zeroed, not empty: padded attention reads masked slots, and 0 * NaN would poison the output.
        self.kv_caches = [
            (
                torch.zeros(num_slots, row, dtype=dtype, device=device),
                torch.zeros(num_slots, row, dtype=dtype, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler(device, seed)
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> dict[str, SampledToken]:
        """Runs one step; returns the sampled token of each request whose chunk reached its last token."""
        inputs = self.prepare_inputs(scheduled)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampled_items:
            return {}
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        results = self.sampler(logits, self._sampling_batch(inputs.sampled_items))
        return {item.request.request_id: r for item, r in zip(inputs.sampled_items, results, strict=True)}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def prepare_inputs(self, scheduled: list[ScheduledRequest]) -> ModelInputs:
        # Single-token items (decodes) go first so their queries are one contiguous block of rows.
        ordered = [s for s in scheduled if s.num_tokens == 1] + [s for s in scheduled if s.num_tokens > 1]
        num_decodes = sum(1 for s in ordered if s.num_tokens == 1)
        input_ids = np.fromiter((t for s in ordered for t in s.token_ids), dtype=np.int64)
        positions = np.concatenate([np.arange(s.start, s.start + s.num_tokens) for s in ordered])
        slot_mapping = np.concatenate([self._slots(s.block_ids, s.start, s.start + s.num_tokens) for s in ordered])
        ends = np.cumsum([s.num_tokens for s in ordered])
        sample_rows = [int(end) - 1 for s, end in zip(ordered, ends, strict=True) if s.sample]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping), block_size=self.block_size, num_decodes=num_decodes, prefills=[]
        )
        if num_decodes:
            meta.decode_block_tables, meta.decode_bias = self._decode_context(ordered[:num_decodes])
        for s, end in zip(ordered[num_decodes:], ends[num_decodes:], strict=True):
            meta.prefills.append(self._prefill_segment(s, int(end) - s.num_tokens))
        return ModelInputs(
            input_ids=self._tensor(input_ids),
            positions=self._tensor(positions),
            meta=meta,
            sample_rows=self._tensor(np.array(sample_rows, dtype=np.int64)),
            sampled_items=[s for s in ordered if s.sample],
        )

    def _slots(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        positions = np.arange(start, end)
        table = np.asarray(block_ids, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _decode_context(self, decodes: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        context_lens = np.array([s.start + 1 for s in decodes])
        max_ctx = int(context_lens.max())
        num_blocks = -(-max_ctx // self.block_size)
        tables = np.zeros((len(decodes), num_blocks), dtype=np.int64)
        for row, s in enumerate(decodes):
            used = s.block_ids[:num_blocks]
            tables[row, : len(used)] = used
        visible = np.arange(max_ctx)[None, :] < context_lens[:, None]
        return self._tensor(tables), self._bias(visible[:, None, :])

    def _prefill_segment(self, s: ScheduledRequest, q_start: int) -> PrefillSegment:
        ctx_len = s.start + s.num_tokens
        visible = np.arange(ctx_len)[None, :] <= np.arange(s.start, ctx_len)[:, None]
        table = None
        if s.start > 0:
            table = self._tensor(np.asarray(s.block_ids[: -(-ctx_len // self.block_size)], dtype=np.int64))
        return PrefillSegment(q_start, s.num_tokens, ctx_len, table, self._bias(visible))

    def _bias(self, visible: np.ndarray) -> torch.Tensor:
        """An additive attention mask: 0 where visible, -inf elsewhere."""
        return self._tensor(np.where(visible, 0.0, -np.inf).astype(np.float32)).to(self.dtype)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    def _sampling_batch(self, items: list[ScheduledRequest]) -> SamplingBatch:
        requests = [s.request for s in items]
        return SamplingBatch(
            params=[r.sampling_params for r in requests],
            generators=[self._generator_for(r.request_id, r.sampling_params.seed) for r in requests],
            prompt_token_ids=[r.prompt_token_ids for r in requests],
            output_token_ids=[r.output_token_ids for r in requests],
        )

    def _generator_for(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request_id] = generator
        return generator
