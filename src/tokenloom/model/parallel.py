"""Tensor parallelism, Megatron-style, over torch.distributed (gloo on the CPU, NCCL on CUDA).

Each of N ranks holds 1/N of every decoder layer:

    q, k, v, gate, up   column-parallel: split by output rows (whole heads, 1/N of the MLP width)
    o, down             row-parallel: split by input columns; each rank's product is a partial sum, and one
                        all-reduce (in float32) per sublayer makes the whole hidden state on every rank

KV heads are split with the attention heads, so each rank's paged KV cache holds its own heads of every block,
and the block tables are the same on every rank. The embedding, the norms and the LM head are replicated (a
135M-parameter model's head is small; a vocabulary-parallel head would save memory on a large one): every rank
has the whole hidden state after each layer, and rank 0 alone computes logits and samples.

The all-reduce sums partials in an order the single-rank matmul does not, so float32 results differ from TP=1 in
the last bits; greedy tokens match wherever the model's top two logits are further apart than that (the tests
compare tokens, which hold on the models they use).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenloom.model.registry import LLAMA_TENSOR_PARALLEL, TensorParallelLayout


@dataclass(frozen=True)
class TensorParallelGroup:
    """This process's place in the group; all-reduces go over torch.distributed's default group."""

    rank: int
    world_size: int

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial, in float32 whatever the model's dtype, returned in the partial's dtype."""
        if self.world_size == 1:
            return partial
        total = partial.float()
        dist.all_reduce(total)
        return total.to(partial.dtype)


SINGLE = TensorParallelGroup(rank=0, world_size=1)  # no tensor parallelism: all-reduces are the identity


def shard_hf_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    group: TensorParallelGroup,
    layout: TensorParallelLayout = LLAMA_TENSOR_PARALLEL,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A Hugging Face checkpoint's tensors as this rank holds them (the full ones are read and sliced), split as the
    family's layout says by each tensor's module name (the last two parts of its name)."""
    if group.world_size == 1:
        yield from weights
        return
    for name, tensor in weights:
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if module in layout.column_parallel:
            yield name, tensor.chunk(group.world_size, dim=0)[group.rank]
        elif module in layout.row_parallel and kind == "weight":
            yield name, tensor.chunk(group.world_size, dim=1)[group.rank]
        elif module in layout.row_parallel:  # a bias after the all-reduce: added once, by rank 0
            yield name, tensor if group.rank == 0 else torch.zeros_like(tensor)
        else:
            yield name, tensor
