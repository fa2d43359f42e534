"""CUDA graphs for decode-only steps: captured at start-up for padded batch sizes, replayed whenever a step is
all decode rows.

A decode step of a small model is hundreds of tiny kernel launches; launching them one by one from Python costs
more than running them. A graph records a step's launches once and replays them with one call. Its inputs must
live at fixed addresses, so each step's token ids, positions, slots and attention metadata are copied into static
buffers sized for ``max_num_seqs`` rows, and a batch of n rows replays the graph of the smallest captured size >= n
with the rest padded: a padded row has no query (its sequence's query span is empty, so attention skips it), writes
no K/V (slot -1) and its hidden state is never read.

The attention backend must be Triton (its kernel reads everything it needs from device tensors; the plain path's
per-group Python would be frozen into the graph). On a CPU, or with ``capture=False``, the same buffers run the model
eagerly: that is how the tests check the padding on a machine without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.model.triton_attention import FlatBatch
from tokenloom.utils import cdiv

PADDING_SLOT = -1  # the cache write skips it


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 16: each up to the first size that holds max_num_seqs."""
    sizes, size = [], 1
    while True:
        sizes.append(size)
        if size >= max_num_seqs:
            return sizes
        size = size * 2 if size < 8 else size + (8 if size < 256 else 16)


def padded_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_rows; None if none does (the step runs eagerly)."""
    return next((size for size in sizes if size >= num_rows), None)


@dataclass
class DecodeInputs:
    """A decode-only step as the graph runner takes it: one query row per sequence."""

    input_ids: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    slot_mapping: torch.Tensor  # [n]
    context_lens: torch.Tensor  # [n] int32
    block_tables: torch.Tensor  # [n, width] int32, width <= the runner's max_blocks


# forward(input_ids, positions, slot_mapping, flat batch) -> hidden states [rows, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, FlatBatch], torch.Tensor]


class DecodeGraphs:
    """Static buffers for up to max_num_seqs decode rows, and one captured graph per padded size."""

    def __init__(
        self, forward: Forward, max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device
    ) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        self.device = device
        rows = self.sizes[-1]
        self.max_blocks = cdiv(max_model_len, block_size)
        self.max_model_len = max_model_len

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids, self.positions = zeros(rows), zeros(rows)
        self.slot_mapping = torch.full((rows,), PADDING_SLOT, dtype=torch.long, device=device)
        self.query_start_loc = zeros(rows + 1, dtype=torch.int32)
        self.context_lens = zeros(rows, dtype=torch.int32)
        self.block_tables = zeros(rows, self.max_blocks, dtype=torch.int32)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0

    def covers(self, num_rows: int) -> bool:
        return padded_size(num_rows, self.sizes) is not None

    def capture(self) -> None:
        """Records one graph per size, largest first (smaller ones reuse its memory pool)."""
        assert self.device.type == "cuda", "CUDA graphs need a CUDA device"
        started = time.monotonic()
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._fill_padding(0, size)
            self._outputs[size] = self.forward(*self._step_buffers(size))  # warm-up: kernels compiled outside
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.forward(*self._step_buffers(size))
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.pool_bytes = torch.cuda.memory_allocated(self.device) - before
        self.capture_seconds = time.monotonic() - started

    def run(self, step: DecodeInputs) -> torch.Tensor:
        """The hidden states of the step's rows, by the captured graph of its padded size (or eagerly on the same
        buffers where none was captured)."""
        num_rows = step.input_ids.shape[0]
        size = padded_size(num_rows, self.sizes)
        assert size is not None, f"{num_rows} rows is over the captured sizes (up to {self.sizes[-1]})"
        self._fill(step, size)
        graph = self._graphs.get(size)
        if graph is None:
            return self.forward(*self._step_buffers(size))[:num_rows]
        graph.replay()
        return self._outputs[size][:num_rows]

    def _fill(self, step: DecodeInputs, size: int) -> None:
        n = step.input_ids.shape[0]
        self.input_ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(step.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(step.context_lens, non_blocking=True)
        width = step.block_tables.shape[1]
        assert width <= self.max_blocks, "a block table longer than max_model_len allows"
        self.block_tables[:n, :width].copy_(step.block_tables, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(torch.arange(n + 1, dtype=torch.int32), non_blocking=True)
        self._fill_padding(n, size)

    def _fill_padding(self, n: int, size: int) -> None:
        """Rows n..size: no query (their query span is empty), no K/V write, a context of nothing."""
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(PADDING_SLOT)
        self.context_lens[n:size].zero_()
        self.query_start_loc[n + 1 : size + 1].fill_(n)

    def _step_buffers(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, FlatBatch]:
        batch = FlatBatch(
            self.query_start_loc[: size + 1],
            self.context_lens[:size],
            self.block_tables[:size],
            max_query_len=1,
            max_context_len=self.max_model_len,
        )
        return self.input_ids[:size], self.positions[:size], self.slot_mapping[:size], batch
