"""Paged attention in plain PyTorch: the same code runs on CPU and CUDA.

Each layer's cache is two tensors of shape [num_blocks * block_size, kv_heads * head_dim]; a token's KV lives in
one row (its *slot*), and a request's block table says which rows hold its context. A step first writes the K
and V of every new token into its slot, then lets each query read its context. Because all writes of a layer
happen before any read, a request may read blocks another request computes in the same step.

Decode queries (one new token each) are attended all at once over their padded contexts. Prefill chunks are
attended one request at a time, each a causal block of queries over its context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    """A chunk of queries [q_start, q_start + q_len) in the flat batch, at the end of a context of ctx_len."""

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor | None  # [ctx_len] rows of the cache; None when the chunk is its whole context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True where a query may attend


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache, and which context each query reads.

    The flat batch holds the decode tokens first (rows [0, num_decodes)), then the prefill chunks.
    """

    slot_mapping: torch.Tensor  # [num_tokens] long
    num_decodes: int
    decode_slots: torch.Tensor | None  # [num_decodes, max_ctx] long, padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_ctx] bool
    prefills: list[PrefillSegment]


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    cache_k.index_copy_(0, slots, k.reshape(k.shape[0], -1))
    cache_v.index_copy_(0, slots, v.reshape(v.shape[0], -1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] (this step's, already in the cache). Returns [T, heads, d]."""
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode_attention(q[: meta.num_decodes], cache_k, cache_v, meta, scale)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], cache_k, cache_v, seg, scale)
    return out


def _decode_attention(q, cache_k, cache_v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = cache_k.shape[1] // head_dim
    group = num_heads // num_kv_heads
    max_ctx = meta.decode_slots.shape[1]
    # The query heads that share a KV head become that head's "query rows": [D, kv_heads, group, d].
    qg = q.view(num_decodes, num_kv_heads, group, head_dim)
    k = cache_k[meta.decode_slots].view(num_decodes, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    v = cache_v[meta.decode_slots].view(num_decodes, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _prefill_attention(q, k, v, cache_k, cache_v, seg: PrefillSegment, scale: float) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if seg.ctx_slots is not None:
        k = cache_k[seg.ctx_slots].view(seg.ctx_len, num_kv_heads, head_dim)
        v = cache_v[seg.ctx_slots].view(seg.ctx_len, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=seg.mask,
        is_causal=seg.mask is None,
        scale=scale,
    )
    return out.transpose(0, 1)
