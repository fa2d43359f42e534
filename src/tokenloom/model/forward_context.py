"""What a step's attention needs besides its tensors: the KV cache and the attention metadata of this step.

The compiled model (compiled.py) is one graph over token ids and positions; the metadata (lists of decode
groups and prefill segments) changes shape every step and is no graph input. The runner sets it here around
the forward, and the attention operator (attention.py) reads it, as vLLM's forward context does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tokenloom.model.attention import AttentionMetadata, paged_attention, write_kv

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ForwardContext:
    kv_caches: list[KVCache]
    meta: AttentionMetadata


_current: ForwardContext | None = None


@contextmanager
def forward_context(kv_caches: list[KVCache], meta: AttentionMetadata) -> Iterator[None]:
    global _current
    assert _current is None, "forward contexts do not nest: one step runs at a time"
    _current = ForwardContext(kv_caches, meta)
    try:
        yield
    finally:
        _current = None


def current_forward_context() -> ForwardContext:
    assert _current is not None, "the attention operator runs only inside a step's forward context"
    return _current


@torch.library.custom_op("tokenloom::layer_attention", mutates_args=())
def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int, scale: float) -> torch.Tensor:
    """Writes this step's k and v into layer `layer_index`'s cache, then attends q over each query's context.

    Opaque to the compiler: the cache and the metadata come from the forward context. The cache write is hidden
    from the graph, which is safe because the output depends on it and nothing else in the graph reads the cache.
    """
    context = current_forward_context()
    cache_k, cache_v = context.kv_caches[layer_index]
    write_kv(cache_k, cache_v, k, v, context.meta.slot_mapping, context.meta, q.shape[-1])
    return paged_attention(q, k, v, cache_k, cache_v, context.meta, scale)


@layer_attention.register_fake
def _layer_attention_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int, scale: float):
    return torch.empty_like(q)
