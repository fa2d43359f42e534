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
from tokenloom.model.attention import (
    AttentionMetadata,
    DecodeGroup,
    GatherWorkspace,
    PagedPrefills,
    PrefillSegment,
    attends_apart,
)
from tokenloom.model.kv_quant import KVFormat
from tokenloom.model.lora import adapter_rows
from tokenloom.model.triton_attention import FlatBatch, split_count
from tokenloom.pooling_params import PoolingParams
from tokenloom.utils import cdiv

TRITON_BLOCK_N = 32  # keys per tile of the Triton kernel: split-K counts shares in these
PACKED_KEYS = 32  # keys per packed block of the prefill operators (csrc/prefill_attention.cpp's kKeys)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # the rows of each sampled request's last token and its drafts, request by request
    sampled_items: list[ScheduledRequest]
    prompt_chunks: list[tuple[ScheduledRequest, int]] = field(default_factory=list)  # (chunk, its first row)
    pooled_rows: list[tuple[str, int, PoolingParams]] = field(default_factory=list)  # (request id, row, params)
    # (row, request id) of each token that is a placeholder: sampled by the step before, still on the device.
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    adapter_rows: dict[str, np.ndarray] = field(default_factory=dict)  # each LoRA adapter's rows (lora.py)


@dataclass
class StepInputBuilder:
    """What a step's inputs depend on besides the scheduled requests: the cache layout and the attention path."""

    block_size: int
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # resolved: torch, cpu or triton
    num_kv_heads: int
    kv_format: KVFormat | None  # an 8-bit cache; None: the model's dtype
    use_prefill_op: bool  # prefill attention through the C++ operator (float32 or bf16)
    target_programs: int  # programs that fill the device; split-K shares are added only below it
    with_adapters: bool = False  # LoRA is enabled: each step's rows are grouped by adapter
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace)
    block_rows: BlockTableRows = field(default_factory=lambda: BlockTableRows())

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
        decodes: list[ScheduledRequest] = []
        others: list[ScheduledRequest] = []
        for s in scheduled:
            (decodes if is_decode(s) else others).append(s)
        decodes.sort(key=lambda s: s.start)
        ordered = decodes + others
        table_rows = self.block_rows.rows(ordered)
        input_ids = np.fromiter(chain.from_iterable([s.token_ids for s in ordered]), dtype=np.int64)
        counts = np.fromiter([s.num_tokens for s in ordered], dtype=np.int64, count=len(ordered))
        starts = np.fromiter([s.start for s in ordered], dtype=np.int64, count=len(ordered))
        ends = np.cumsum(counts)
        # Token by token: its request's start plus its offset in the request's chunk, and the cache slot there.
        positions = np.repeat(starts - (ends - counts), counts) + np.arange(len(input_ids))
        slot_mapping = self.block_rows.slots(np.repeat(table_rows, counts), positions, self.block_size)
        holes = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN).tolist()
        owners = np.searchsorted(ends, holes, side="right").tolist()
        placeholders = [(row, ordered[owner].request.request_id) for row, owner in zip(holes, owners, strict=True)]
        sample_rows = self._sample_rows(ordered, ends)
        prompt_chunks, pooled_rows = self._prompt_rows(ordered, ends)
        meta = self.metadata(self.tensor(slot_mapping))
        if self.attention_backend == "triton":  # one launch per layer over the flat batch
            context_lens = starts + counts
            tables = self.block_rows.tables(table_rows, context_lens, self.block_size)
            meta.flat = self.flat_batch(counts, context_lens, tables)
            meta.num_splits = split_count(meta.flat, self.num_kv_heads, TRITON_BLOCK_N, self.target_programs)
        else:
            num_decode_rows = int(counts[: len(decodes)].sum())
            decode_contexts = positions[:num_decode_rows] + 1  # each decode row reads up to its own token
            decode_table_rows = np.repeat(table_rows[: len(decodes)], counts[: len(decodes)])
            for first, last in group_by_context_length(decode_contexts.tolist()):
                meta.decodes.append(
                    self._decode_group(decode_contexts[first:last], decode_table_rows[first:last], first)
                )
            with_past: list[int] = []  # the chunks' places in `ordered`
            for i in range(len(decodes), len(ordered)):
                if self.pages_prefills and ordered[i].start > 0:
                    with_past.append(i)
                else:
                    meta.prefills.append(self._prefill_segment(ordered[i], int(ends[i] - counts[i])))
            if with_past:
                chosen = np.array(with_past)
                meta.paged_prefills = self._paged_prefills(table_rows[chosen], starts[chosen], counts[chosen],
                                                           ends[chosen])  # fmt: skip
        return ModelInputs(
            input_ids=self.tensor(input_ids),
            positions=self.tensor(positions),
            meta=meta,
            sample_rows=self.tensor(sample_rows),
            sampled_items=[s for s in ordered if s.sample],
            prompt_chunks=prompt_chunks,
            pooled_rows=pooled_rows,
            placeholders=placeholders,
            adapter_rows=adapter_rows([s.request.lora_name for s in ordered], counts) if self.with_adapters else {},
        )

    @staticmethod
    def _prompt_rows(
        ordered: list[ScheduledRequest], ends: np.ndarray
    ) -> tuple[list[tuple[ScheduledRequest, int]], list[tuple[str, int, PoolingParams]]]:
        """The chunks whose prompt logprobs are asked for (each with its first row), and each embedding request's
        last prompt row, in the step it is sampled (and ends)."""
        prompt_chunks = [
            (s, int(end) - s.num_tokens)
            for s, end in zip(ordered, ends, strict=True)
            if s.request.sampling_params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens - 1
        ]
        pooled_rows = [
            (s.request.request_id, int(ends[i]) - 1, pooling)
            for i, s in enumerate(ordered)
            if (pooling := s.request.sampling_params.pooling) is not None and s.sample
        ]
        return prompt_chunks, pooled_rows

    @staticmethod
    def _sample_rows(ordered: list[ScheduledRequest], ends: np.ndarray) -> np.ndarray:
        """The rows whose logits are sampled: a sampled request's last `1 + drafts` rows, request after request."""
        sampled = np.fromiter([s.sample for s in ordered], dtype=bool, count=len(ordered))
        drafts = np.fromiter([len(s.draft_token_ids) for s in ordered], dtype=np.int64, count=len(ordered))
        per_request = (1 + drafts)[sampled]
        firsts = (ends - 1 - drafts)[sampled]
        offsets = np.arange(int(per_request.sum())) - np.repeat(np.cumsum(per_request) - per_request, per_request)
        return np.repeat(firsts, per_request) + offsets

    def scratch_prefill(self, num_tokens: int) -> AttentionMetadata:
        """A prompt of num_tokens written into block 0's slots (over and over), for warming up and profiling: any
        request that gets block 0 overwrites them before it reads them."""
        meta = self.metadata(torch.arange(num_tokens, device=self.device) % self.block_size)
        if self.attention_backend == "triton":
            lens = np.array([num_tokens], dtype=np.int64)
            meta.flat = self.flat_batch(lens, lens, np.zeros((1, cdiv(num_tokens, self.block_size)), dtype=np.int32))
        else:
            meta.prefills = [PrefillSegment(0, num_tokens, num_tokens, None, None)]
        return meta

    def flat_batch(self, q_lens: np.ndarray, context_lens: np.ndarray, tables: np.ndarray) -> FlatBatch:
        """Each sequence's query tokens, context length and block table (int32), in flat order -> the Triton
        kernel's view."""
        assert tables.dtype == np.int32, "block tables are made int32 (BlockTableRows), as the kernel reads them"
        loc = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=loc[1:])
        return FlatBatch(
            self.tensor(loc),
            self.tensor(context_lens.astype(np.int32)),
            self.tensor(tables),
            int(q_lens.max()),
            int(context_lens.max()),
        )

    def _decode_group(self, context_lens: np.ndarray, table_rows: np.ndarray, row_start: int) -> DecodeGroup:
        """Decode rows, each its context length and its request's row of block_rows, attended together."""
        max_ctx = int(context_lens.max())
        tables = self.block_rows.tables(table_rows, context_lens, self.block_size).astype(np.int64)
        bias = None
        if not self.use_cpu_kernel:  # the operator reads exactly each context; the plain path pads and masks
            bias = self._bias(np.arange(max_ctx)[None, None, :] < context_lens[:, None, None])
        return DecodeGroup(row_start, len(context_lens), self.tensor(tables), self.tensor(context_lens), bias)

    @property
    def pages_prefills(self) -> bool:
        """A chunk with a past goes to the paged operator (a 16-bit cache; an 8-bit one is decoded per chunk)."""
        return self.use_prefill_op and self.kv_format is None

    def _paged_prefills(
        self, table_rows: np.ndarray, starts: np.ndarray, counts: np.ndarray, ends: np.ndarray
    ) -> PagedPrefills:
        """Chunks with a past (their rows of the block tables, first positions, lengths, ends in the flat batch)."""
        contexts = starts + counts
        segments = np.stack([ends - counts, counts, contexts], axis=1).astype(np.int64)
        tables = self.block_rows.tables(table_rows, contexts, self.block_size).astype(np.int64)
        units, sources = shared_key_blocks(segments, tables, self.block_size)
        return PagedPrefills(self.tensor(segments), self.tensor(tables), self.tensor(units), self.tensor(sources))

    def _prefill_segment(self, s: ScheduledRequest, q_start: int) -> PrefillSegment:
        ctx_len = s.start + s.num_tokens
        if s.start == 0 and self.kv_format is None:  # the chunk is its whole context: plain causal, no mask at all
            return PrefillSegment(q_start, s.num_tokens, ctx_len, None, None)
        table = self.tensor(np.asarray(s.block_ids[: cdiv(ctx_len, self.block_size)], dtype=np.int64))
        if s.start == 0 or self.use_prefill_op or attends_apart(s.num_tokens, ctx_len, self.dtype, self.device):
            # From an 8-bit cache all attention reads the cached values, this chunk's too, so a request's output does
            # not depend on how its prompt was chunked, batched or recomputed. The operator, and a chunk attended apart
            # from its past, need no mask.
            return PrefillSegment(q_start, s.num_tokens, ctx_len, table, None)
        visible = np.arange(ctx_len)[None, :] <= np.arange(s.start, ctx_len)[:, None]
        return PrefillSegment(q_start, s.num_tokens, ctx_len, table, self.tensor(visible))

    def _bias(self, visible: np.ndarray) -> torch.Tensor:
        """An additive attention mask: 0 where visible, -inf elsewhere."""
        return self.tensor(np.where(visible, 0.0, -np.inf).astype(np.float32)).to(self.dtype)

    def tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)


def shared_key_blocks(segments: np.ndarray, tables: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """For the paged prefill operator: which packed unit each chunk's block of PACKED_KEYS keys reads ([S, most key
    blocks], -1 past its context), and where each unit is packed from ([U, 2]: a chunk and its key block). A full key
    block over the same cache slots as another chunk's is packed once a layer, whichever chunks read it (the beams of
    one search, requests after one prefix); a partial one, or one over more than two cache blocks, is its own."""
    contexts = segments[:, 2]
    starts = np.arange(int(cdiv(int(contexts.max()), PACKED_KEYS)))[None, :] * PACKED_KEYS  # each block's first key
    inside = starts < contexts[:, None]
    lasts = np.minimum(starts + PACKED_KEYS, contexts[:, None]) - 1
    last_column = tables.shape[1] - 1
    first_block = np.take_along_axis(tables, np.minimum(starts // block_size, last_column), axis=1)
    last_block = np.take_along_axis(tables, np.minimum(lasts // block_size, last_column), axis=1)
    full = starts + PACKED_KEYS <= contexts[:, None]
    shareable = inside & full & (lasts // block_size - starts // block_size <= 1)
    own = -1 - np.arange(inside.size).reshape(inside.shape)  # a key of its own, negative, for each other block
    offsets = np.broadcast_to(starts % block_size, inside.shape)
    keys = np.stack([np.where(shareable, first_block, own), np.where(shareable, last_block, 0), offsets], axis=-1)
    _, first_seen, inverse = np.unique(keys[inside], axis=0, return_index=True, return_inverse=True)
    units = np.full(inside.shape, -1, dtype=np.int64)
    units[inside] = inverse.reshape(-1)
    rows, cols = np.nonzero(inside)
    return units, np.stack([rows[first_seen], cols[first_seen]], axis=1).astype(np.int64)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A step input on the device. To an accelerator through pinned host memory, without waiting: the copy runs in
    stream order before the kernels that read it, and the host goes on preparing the step."""
    host = torch.from_numpy(array)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class BlockTableRows:
    """The block ids of the requests of the last step, a row of one host array each, kept from step to step.

    A step's block tables and cache slots are gathered from it by numpy indexing, and only the blocks a request gained
    since its last step are written: converting every request's list of ids each step cost ~0.4 ms at 256 requests
    of 1,024 tokens (benchmarks/host_overhead.py). A row is written whole again when its request's ids are no longer
    an extension of what it holds (their epoch changed: freed and given again, or trimmed; or unknown). A request
    that is not in a step gives its row back, so the array holds one step's requests and no one need release them.
    """

    def __init__(self) -> None:
        self.ids = np.zeros((16, 64), dtype=np.int32)
        self._held: dict[str, list[int]] = {}  # request id -> [its row, the epoch of its ids, how many are written]
        self._free_rows = list(range(len(self.ids)))[::-1]

    def rows(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """Each scheduled request's row, its ids written."""
        previous, held = self._held, {}
        rows = []
        newcomers = []
        for i, s in enumerate(scheduled):
            request_id = s.request.request_id
            entry = previous.pop(request_id, None)
            if entry is None:
                newcomers.append(i)
                rows.append(-1)
                continue
            held[request_id] = entry
            rows.append(entry[0])
            if s.block_epoch is None or entry[1] != s.block_epoch or entry[2] != s.num_blocks:  # seldom
                self._write(entry, s)
        self._free_rows.extend(entry[0] for entry in previous.values())
        for i in newcomers:
            s = scheduled[i]
            entry = held[s.request.request_id] = [self._take_row(), -1, 0]
            rows[i] = entry[0]
            self._write(entry, s)
        self._held = held
        return np.array(rows, dtype=np.int64)

    def tables(self, rows: np.ndarray, context_lens: np.ndarray, block_size: int) -> np.ndarray:
        """[len(rows), blocks of the longest context]: each row's blocks that its context reaches, zeros after."""
        counts = -(-context_lens // block_size)
        width = int(counts.max())
        tables: np.ndarray = self.ids[rows, :width]  # a copy: the step's tables outlive the next step's writes
        tables[np.arange(width) >= counts[:, None]] = 0
        return tables

    def slots(self, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """The cache slot of each token: position p of row r is in block ids[r, p // block_size]."""
        return self.ids[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size

    def _write(self, entry: list[int], s: ScheduledRequest) -> None:
        """Brings the row up to the request's ids: their new tail, or all of them where the epoch changed."""
        row, epoch, written = entry
        needed = s.num_blocks
        assert needed is not None
        if s.block_epoch is None or epoch != s.block_epoch or written > needed:
            written = 0
        if needed > self.ids.shape[1]:
            self._grow(len(self.ids), max(needed, 2 * self.ids.shape[1]))
        self.ids[row, written:needed] = s.block_ids[written:needed]
        entry[1], entry[2] = -1 if s.block_epoch is None else s.block_epoch, needed

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = len(self.ids)
            self._grow(2 * rows, self.ids.shape[1])
            self._free_rows.extend(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def _grow(self, rows: int, columns: int) -> None:
        grown = np.zeros((rows, columns), dtype=np.int32)
        grown[: len(self.ids), : self.ids.shape[1]] = self.ids
        self.ids = grown


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
