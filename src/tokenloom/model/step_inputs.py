"""A scheduler decision as a step's tensors: token ids, positions, cache slots and each query's context.

Built from numpy arrays on the host and copied to the device once per array; decodes go first, shortest context
first, so the attention paths read each decode group as one contiguous block of rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from tokenloom.core.request import PLACEHOLDER_TOKEN
from tokenloom.core.scheduler_output import ScheduledRequest
from tokenloom.model.attention import AttentionMetadata, DecodeGroup, GatherWorkspace, PrefillSegment
from tokenloom.model.kv_quant import KVFormat
from tokenloom.model.triton_attention import FlatBatch, split_count
from tokenloom.utils import cdiv

TRITON_BLOCK_N = 32  # keys per tile of the Triton kernel: split-K counts shares in these


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # the rows of each sampled request's last token and its drafts, request by request
    sampled_items: list[ScheduledRequest]
    prompt_chunks: list[tuple[ScheduledRequest, int]] = field(default_factory=list)  # (chunk, its first row)
    # (row, request id) of each token that is a placeholder: sampled by the step before, still on the device.
    placeholders: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class StepInputBuilder:
    """What a step's inputs depend on besides the scheduled requests: the cache layout and the attention path."""

    block_size: int
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # resolved: torch, cpu or triton
    num_kv_heads: int
    kv_format: KVFormat | None  # an 8-bit cache; None: the model's dtype
    use_prefill_op: bool  # prefill attention through the bf16 C++ operator
    target_programs: int  # programs that fill the device; split-K shares are added only below it
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace)

    @property
    def use_cpu_kernel(self) -> bool:
        return self.attention_backend == "cpu"

    def metadata(self, slot_mapping: torch.Tensor) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            workspace=self.workspace,
            use_cpu_kernel=self.use_cpu_kernel,
            prefill_op=self.use_prefill_op,
            kv_format=self.kv_format,
        )

    def build(self, scheduled: list[ScheduledRequest]) -> ModelInputs:
        # A request verifying drafts is a decode of several rows, row j reading the context up to its own token (all
        # of the step's K and V are in the cache before any query reads it, so the rows see exactly a causal prefix).
        decodes = sorted((s for s in scheduled if is_decode(s)), key=lambda s: s.start)
        ordered = decodes + [s for s in scheduled if not is_decode(s)]
        input_ids = np.fromiter(chain.from_iterable([s.token_ids for s in ordered]), dtype=np.int64)
        positions, slot_mapping = self._positions_and_slots(ordered, len(input_ids))
        ends = np.cumsum([s.num_tokens for s in ordered])
        holes = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN).tolist()
        owners = np.searchsorted(ends, holes, side="right").tolist()
        placeholders = [(row, ordered[owner].request.request_id) for row, owner in zip(holes, owners, strict=True)]
        sample_rows = [
            row
            for s, end in zip(ordered, ends, strict=True)
            if s.sample
            for row in range(int(end) - 1 - len(s.draft_token_ids), int(end))
        ]
        prompt_chunks = [
            (s, int(end) - s.num_tokens)
            for s, end in zip(ordered, ends, strict=True)
            if s.request.sampling_params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens - 1
        ]
        meta = self.metadata(self.tensor(slot_mapping))
        if self.attention_backend == "triton":  # one launch per layer over the flat batch
            meta.flat = self.flat_batch([(s.num_tokens, s.start + s.num_tokens, s.block_ids) for s in ordered])
            meta.num_splits = split_count(meta.flat, self.num_kv_heads, TRITON_BLOCK_N, self.target_programs)
        else:
            rows = [(s.start + j + 1, s.block_ids) for s in decodes for j in range(s.num_tokens)]
            for first, last in group_by_context_length([context for context, _ in rows]):
                meta.decodes.append(self._decode_group(rows[first:last], first))
            for s, end in zip(ordered[len(decodes) :], ends[len(decodes) :], strict=True):
                meta.prefills.append(self._prefill_segment(s, int(end) - s.num_tokens))
        return ModelInputs(
            input_ids=self.tensor(input_ids),
            positions=self.tensor(positions),
            meta=meta,
            sample_rows=self.tensor(np.array(sample_rows, dtype=np.int64)),
            sampled_items=[s for s in ordered if s.sample],
            prompt_chunks=prompt_chunks,
            placeholders=placeholders,
        )

    def scratch_prefill(self, num_tokens: int) -> AttentionMetadata:
        """A prompt of num_tokens written into block 0's slots (over and over), for warming up and profiling: any
        request that gets block 0 overwrites them before it reads them."""
        meta = self.metadata(torch.arange(num_tokens, device=self.device) % self.block_size)
        if self.attention_backend == "triton":
            meta.flat = self.flat_batch([(num_tokens, num_tokens, [0] * cdiv(num_tokens, self.block_size))])
        else:
            meta.prefills = [PrefillSegment(0, num_tokens, num_tokens, None, None)]
        return meta

    def flat_batch(self, sequences: list[tuple[int, int, list[int]]]) -> FlatBatch:
        """(query tokens, context length, block ids) of each sequence in flat order -> the Triton kernel's view."""
        q_lens = np.array([q for q, _, _ in sequences], dtype=np.int32)
        ctx_lens = np.array([c for _, c, _ in sequences], dtype=np.int32)
        tables = self.block_tables(ctx_lens, [block_ids for _, _, block_ids in sequences], np.int32)
        loc = np.zeros(len(sequences) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=loc[1:])
        return FlatBatch(
            self.tensor(loc), self.tensor(ctx_lens), self.tensor(tables), int(q_lens.max()), int(ctx_lens.max())
        )

    def block_tables(self, context_lens: np.ndarray, block_ids: list[list[int]], dtype: type) -> np.ndarray:
        """[rows, blocks of the longest context] block ids of each row's context, zero-padded.

        One numpy assignment for the whole batch: a row at a time cost ~5 us a request (host_overhead.py). A row
        usually holds exactly its context's blocks, and then no row is sliced."""
        counts = -(-context_lens.astype(np.int64) // self.block_size)
        held = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
        if np.array_equal(held, counts):
            used = chain.from_iterable(block_ids)
        else:
            used = chain.from_iterable(ids[:count] for ids, count in zip(block_ids, counts.tolist(), strict=True))
        tables: np.ndarray = np.zeros((len(block_ids), int(counts.max())), dtype=dtype)
        # A boolean mask assigns in row-major order: each row's leading `count` entries, row after row.
        tables[np.arange(tables.shape[1]) < counts[:, None]] = np.fromiter(used, dtype=dtype, count=int(counts.sum()))
        return tables

    def _positions_and_slots(self, ordered: list[ScheduledRequest], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Each token's position and cache slot. A decode token's are two integers, computed as such: converting
        its whole block table to an array cost more than the rest of its inputs (benchmarks/host_overhead.py)."""
        positions = np.empty(num_tokens, dtype=np.int64)
        slots = np.empty(num_tokens, dtype=np.int64)
        at, size = 0, self.block_size
        for s in ordered:
            if s.num_tokens == 1:
                positions[at] = s.start
                slots[at] = s.block_ids[s.start // size] * size + s.start % size
            else:
                positions[at : at + s.num_tokens] = np.arange(s.start, s.start + s.num_tokens)
                slots[at : at + s.num_tokens] = self._slots(s.block_ids, s.start, s.start + s.num_tokens)
            at += s.num_tokens
        return positions, slots

    def _slots(self, block_ids: list[int], start: int, end: int) -> np.ndarray:
        first = start // self.block_size
        positions = np.arange(start, end)
        table = np.asarray(block_ids[first : cdiv(end, self.block_size)], dtype=np.int64)
        return table[positions // self.block_size - first] * self.block_size + positions % self.block_size

    def _decode_group(self, rows: list[tuple[int, list[int]]], row_start: int) -> DecodeGroup:
        """Decode rows, each (its context length, its request's block ids), attended together."""
        context_lens = np.array([context for context, _ in rows], dtype=np.int64)
        max_ctx = int(context_lens.max())
        tables = self.block_tables(context_lens, [block_ids for _, block_ids in rows], np.int64)
        bias = None
        if not self.use_cpu_kernel:  # the operator reads exactly each context; the plain path pads and masks
            bias = self._bias(np.arange(max_ctx)[None, None, :] < context_lens[:, None, None])
        return DecodeGroup(row_start, len(rows), self.tensor(tables), self.tensor(context_lens), bias)

    def _prefill_segment(self, s: ScheduledRequest, q_start: int) -> PrefillSegment:
        ctx_len = s.start + s.num_tokens
        if s.start == 0 and self.kv_format is None:  # the chunk is its whole context: plain causal, no mask at all
            return PrefillSegment(q_start, s.num_tokens, ctx_len, None, None)
        table = self.tensor(np.asarray(s.block_ids[: cdiv(ctx_len, self.block_size)], dtype=np.int64))
        if s.start == 0:
            # From an 8-bit cache all attention reads the cached values, this chunk's too, so a request's output does
            # not depend on how its prompt was chunked, batched or recomputed.
            return PrefillSegment(q_start, s.num_tokens, ctx_len, table, None)
        visible = np.arange(ctx_len)[None, :] <= np.arange(s.start, ctx_len)[:, None]
        return PrefillSegment(q_start, s.num_tokens, ctx_len, table, self.tensor(visible))

    def _bias(self, visible: np.ndarray) -> torch.Tensor:
        """An additive attention mask: 0 where visible, -inf elsewhere."""
        return self.tensor(np.where(visible, 0.0, -np.inf).astype(np.float32)).to(self.dtype)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        """A step input on the device. To an accelerator through pinned host memory, without waiting: the copy
        runs in stream order before the kernels that read it, and the host goes on preparing the step."""
        host = torch.from_numpy(array)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)


def group_by_context_length(
    sorted_lens: list[int], max_waste: float = 0.25, max_groups: int = 1
) -> list[tuple[int, int]]:
    """Splits ascending context lengths into [first, last) runs whose padding to the run's longest stays small.

    Fewer groups mean fewer operator calls; more groups mean less padded memory to read. A new group starts
    when a context is shorter than (1 - max_waste) of the longest in the current group. On the 2-core CPU we
    measure on, one group was fastest: each extra group costs more in per-operator overhead than its padding
    saves (and the compiled CPU kernel reads no padding at all).
    """
    groups: list[tuple[int, int]] = []
    last = len(sorted_lens)
    while last > 0:
        first = last - 1
        floor = sorted_lens[last - 1] * (1 - max_waste)
        while first > 0 and (sorted_lens[first - 1] >= floor or len(groups) == max_groups - 1):
            first -= 1
        groups.append((first, last))
        last = first
    return groups[::-1]


def is_decode(s: ScheduledRequest) -> bool:
    """One new token, or the last token and its drafts: rows that each attend to a context ending at themselves."""
    return s.num_tokens == 1 + len(s.draft_token_ids)
