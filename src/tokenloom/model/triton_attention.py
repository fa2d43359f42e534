"""Paged attention in Triton: one launch per layer for the whole flat batch, K and V read in place.

The flat batch is a list of sequences, each a run of query rows ``[query_start_loc[s], query_start_loc[s + 1])``
that are the last tokens of a context of ``context_lens[s]`` tokens (decode rows: one token; prefill chunks: many,
with or without a past; speculative rows later: a few). Every sequence's K and V live in the paged cache (this
step's tokens are written before attention reads), rows ``[num_slots, kv_heads * head_dim]``, reached through its
row of ``block_tables``: key position p is slot ``block_tables[s, p // block_size] * block_size + p % block_size``.

One program handles one sequence, one KV head and a tile of BLOCK_Q query tokens, with the query heads that share
that KV head stacked as rows (grouped-query attention reads each K/V tile once for the whole group, no copy). It
walks the context in tiles of BLOCK_N keys (any block size: a tile's keys are looked up slot by slot), keeping an
online softmax in float32, and stops at the tile's last causal key. With ``num_splits > 1`` (flash-decoding: few
long contexts would leave most of a GPU's SMs idle) each program takes one share of the keys and writes its partial
output and log-sum-exp; a second launch combines the shares.

An 8-bit cache (kv_quant.py: each (token, KV head) an entry of d codes and a float32 scale, laid out head by head
inside each block) is read the same way, ``kv_quant`` saying which codes (1 int8, 2 fp8 e4m3, 3 fp8 e5m2): each
tile's codes are multiplied by their scales as they are loaded, so the cache is never widened in memory; and
``write_kv_codes`` quantizes a step's K and V into their entries in one launch, as kv_quant.write does.

Written for CUDA; on CPU tensors it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
check it against the plain-PyTorch path (in float32: the interpreter's bf16 dot is not exact).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from tokenloom.model.config import SCALE_BYTES


@functools.cache
def has_triton() -> bool:
    """Triton ships with CUDA builds of torch; the CPU build may lack it (then this backend is unavailable)."""
    return importlib.util.find_spec("triton") is not None


def kernels() -> ModuleType:
    """The kernels (triton_kernels.py), imported at the first launch rather than with this module."""
    assert has_triton(), "the Triton attention backend needs Triton"
    from tokenloom.model import triton_kernels

    return triton_kernels


def available(device: torch.device) -> bool:
    """Whether this backend runs on the device: CUDA with Triton, or CPU tensors under Triton's interpreter."""
    if not has_triton():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class FlatBatch:
    """What the kernel reads of a step: each sequence's query rows, context length and block table."""

    query_start_loc: torch.Tensor  # [S + 1] int32: sequence s's queries are rows [loc[s], loc[s + 1])
    context_lens: torch.Tensor  # [S] int32: tokens in its context, this step's included
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with block 0
    max_query_len: int
    max_context_len: int


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def split_count(batch: FlatBatch, num_kv_heads: int, block_n: int, target_programs: int) -> int:
    """How many shares to split each context's keys into: enough programs to fill the device when the batch is a
    few long decodes, never more shares than key tiles."""
    num_seqs = batch.context_lens.shape[0]
    if batch.max_query_len > 1 or num_seqs == 0:
        return 1  # prefill tiles already give the device work; splitting them costs a reduction
    programs = num_seqs * num_kv_heads
    tiles = -(-batch.max_context_len // block_n)
    return max(1, min(tiles, target_programs // max(programs, 1)))


def unified_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    batch: FlatBatch,
    block_size: int,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
    block_q: int = 16,
    block_n: int = 32,
    kv_quant: int = 0,
) -> torch.Tensor:
    """q, out: [T, heads, d]; cache_k, cache_v: [slots, kv_heads * d], or with kv_quant (an 8-bit cache's
    KVFormat.kind) [slots, kv_heads * (d + 4)] bytes. Writes and returns out."""
    jitted = kernels()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache_k.shape[1] // (head_dim + SCALE_BYTES if kv_quant else head_dim)
    assert not kv_quant or (cache_k.dtype == torch.uint8 and head_dim % SCALE_BYTES == 0), "entries of bytes"
    assert num_heads % num_kv_heads == 0 and cache_k.shape == cache_v.shape
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and cache_k.stride(-1) == 1 and cache_v.stride(-1) == 1
    group = num_heads // num_kv_heads
    num_seqs = batch.context_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    group_p = _next_power_of_2(group)
    block_q = min(block_q, _next_power_of_2(batch.max_query_len))
    block_q = max(block_q, max(1, 16 // group_p))  # tl.dot wants at least 16 rows
    head_p = max(16, _next_power_of_2(head_dim))
    q_tiles = -(-batch.max_query_len // block_q)
    grid = (num_seqs, num_kv_heads, q_tiles * num_splits)
    common = dict(
        Q=q, K=cache_k, V=cache_v, QSL=batch.query_start_loc, CTX=batch.context_lens, BT=batch.block_tables,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kv=cache_k.stride(0),
        stride_bt=batch.block_tables.stride(0),
        scale=scale, block_size=block_size, head_dim=head_dim, group=group, num_splits=num_splits,
        BLOCK_Q=block_q, BLOCK_N=block_n, GROUP_P=group_p, HEAD_P=head_p, KV_QUANT=kv_quant,
    )  # fmt: skip
    if num_splits == 1:
        jitted._attention_kernel[grid](
            **common, OUT=out, stride_ot=out.stride(0), stride_oh=out.stride(1),
            PART=out, LSE=out, stride_ps=0, stride_pt=0, stride_ph=0, stride_ls=0, stride_lt=0, SPLIT=False,
        )  # fmt: skip
        return out
    partial = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    jitted._attention_kernel[grid](
        **common, OUT=out, stride_ot=out.stride(0), stride_oh=out.stride(1),
        PART=partial, LSE=lse, stride_ps=partial.stride(0), stride_pt=partial.stride(1), stride_ph=partial.stride(2),
        stride_ls=lse.stride(0), stride_lt=lse.stride(1), SPLIT=True,
    )  # fmt: skip
    jitted._combine_kernel[(num_tokens, num_heads)](
        partial, lse, out, num_splits, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), head_dim, SPLITS_P=_next_power_of_2(num_splits),
        HEAD_P=head_p,
    )  # fmt: skip
    return out


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """This step's K and V into their slots, both in one launch. k, v: [T, kv_heads * d] (or [T, kv_heads, d])."""
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    num_tokens, row = k.shape
    if num_tokens == 0:
        return
    kernels()._write_kv_kernel[(num_tokens,)](
        k, v, cache_k, cache_v, slots, k.stride(0), v.stride(0), cache_k.stride(0), row, ROW_P=_next_power_of_2(row)
    )


def write_kv_codes(
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    kind: int,
    max_code: float,
    head_dim: int,
    block_size: int,
) -> None:
    """This step's K and V quantized into their entries of an 8-bit cache, both in one launch: the bytes
    kv_quant.write leaves (the same scales and codes, rounded to nearest even). k, v: [T, kv_heads * d]."""
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    num_tokens, row = k.shape
    if num_tokens == 0:
        return
    num_kv_heads = row // head_dim
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cache_k.stride() == cache_v.stride()
    assert cache_k.shape[1] == num_kv_heads * (head_dim + SCALE_BYTES) and head_dim % SCALE_BYTES == 0
    kernels()._write_kv_codes_kernel[(num_tokens,)](
        k, v, cache_k, cache_v, slots, k.stride(0), v.stride(0), cache_k.stride(0), block_size, num_kv_heads,
        head_dim, 1.0 / max_code, max_code, KV_QUANT=kind, HEADS_P=_next_power_of_2(num_kv_heads),
        HEAD_P=_next_power_of_2(head_dim),
    )  # fmt: skip
