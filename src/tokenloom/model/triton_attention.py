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

Written for CUDA; on CPU tensors it runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
check it against the plain-PyTorch path (in float32: the interpreter's bf16 dot is not exact).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # Triton ships with CUDA builds of torch; the CPU build may lack it (then this backend is unavailable)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is missing
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    """Whether this backend runs on the device: CUDA with Triton, or CPU tensors under Triton's interpreter."""
    if triton is None:
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
) -> torch.Tensor:
    """q, out: [T, heads, d]; cache_k, cache_v: [slots, kv_heads * d]. Writes and returns out."""
    assert triton is not None, "the Triton attention backend needs Triton"
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache_k.shape[1] // head_dim
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
        BLOCK_Q=block_q, BLOCK_N=block_n, GROUP_P=group_p, HEAD_P=head_p,
    )  # fmt: skip
    if num_splits == 1:
        _attention_kernel[grid](
            **common, OUT=out, stride_ot=out.stride(0), stride_oh=out.stride(1),
            PART=out, LSE=out, stride_ps=0, stride_pt=0, stride_ph=0, stride_ls=0, stride_lt=0, SPLIT=False,
        )  # fmt: skip
        return out
    partial = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=q.device)
    _attention_kernel[grid](
        **common, OUT=out, stride_ot=out.stride(0), stride_oh=out.stride(1),
        PART=partial, LSE=lse, stride_ps=partial.stride(0), stride_pt=partial.stride(1), stride_ph=partial.stride(2),
        stride_ls=lse.stride(0), stride_lt=lse.stride(1), SPLIT=True,
    )  # fmt: skip
    _combine_kernel[(num_tokens, num_heads)](
        partial, lse, out, num_splits, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), head_dim, SPLITS_P=_next_power_of_2(num_splits),
        HEAD_P=head_p,
    )  # fmt: skip
    return out


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """This step's K and V into their slots, both in one launch. k, v: [T, kv_heads * d] (or [T, kv_heads, d])."""
    assert triton is not None
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    num_tokens, row = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, cache_k, cache_v, slots, k.stride(0), v.stride(0), cache_k.stride(0), row, ROW_P=_next_power_of_2(row)
    )


if triton is not None:

    @triton.jit
    def _attention_kernel(
        Q, K, V, OUT, PART, LSE, QSL, CTX, BT,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_bt,
        stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
        scale, block_size, head_dim, group, num_splits,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_P: tl.constexpr, HEAD_P: tl.constexpr,
        SPLIT: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        q_tile = tl.program_id(2) // num_splits
        share = tl.program_id(2) % num_splits
        q_start = tl.load(QSL + seq)
        q_len = tl.load(QSL + seq + 1) - q_start
        if q_tile * BLOCK_Q >= q_len:
            return
        ctx_len = tl.load(CTX + seq)
        past = ctx_len - q_len  # keys before this step's first query token

        rows = tl.arange(0, BLOCK_Q * GROUP_P)
        token = q_tile * BLOCK_Q + rows // GROUP_P  # within the sequence's queries
        head = kv_head * group + rows % GROUP_P
        row_ok = (token < q_len) & (rows % GROUP_P < group)
        dims = tl.arange(0, HEAD_P)
        dim_ok = dims < head_dim
        q_ptrs = Q + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        query_pos = past + token  # the last key each row may see

        # Keys this tile of queries may see: [0, last_key]; this program's share of them.
        last_key = past + tl.minimum((q_tile + 1) * BLOCK_Q, q_len) - 1
        num_tiles = last_key // BLOCK_N + 1
        per_share = (num_tiles + num_splits - 1) // num_splits
        first_tile = share * per_share
        end_tile = tl.minimum(first_tile + per_share, num_tiles)

        m_i = tl.full((BLOCK_Q * GROUP_P,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_Q * GROUP_P,), tl.float32)
        acc = tl.zeros((BLOCK_Q * GROUP_P, HEAD_P), tl.float32)
        keys = tl.arange(0, BLOCK_N)
        for tile in range(first_tile, end_tile):
            m_i, l_i, acc = _attend_tile(
                q, K, V, BT + seq * stride_bt, m_i, l_i, acc, tile * BLOCK_N + keys, ctx_len, query_pos, row_ok,
                kv_head * head_dim + dims, dim_ok, stride_kv, block_size, scale,
            )  # fmt: skip

        out_rows = q_start + token
        out_mask = row_ok[:, None] & dim_ok[None, :]
        if SPLIT:  # this share's output, normalised by its own sum, and that sum's log (a share may see no key)
            seen = l_i > 0.0
            denominator = tl.where(seen, l_i, 1.0)
            part_ptrs = PART + share * stride_ps + out_rows[:, None] * stride_pt + head[:, None] * stride_ph
            tl.store(part_ptrs + dims[None, :], acc / denominator[:, None], mask=out_mask)
            lse = tl.where(seen, m_i + tl.log(denominator), float("-inf"))
            tl.store(LSE + share * stride_ls + out_rows * stride_lt + head, lse, mask=row_ok)
        else:
            o_ptrs = OUT + out_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
            denominator = tl.where(l_i > 0.0, l_i, 1.0)  # rows past the sequence's end saw nothing (not stored)
            tl.store(o_ptrs, (acc / denominator[:, None]).to(OUT.dtype.element_ty), mask=out_mask)

    @triton.jit
    def _attend_tile(
        q, K, V, table, m_i, l_i, acc, key_pos, ctx_len, query_pos, row_ok, columns, dim_ok, stride_kv, block_size,
        scale,
    ):  # fmt: skip
        """One tile of keys, read in place through the sequence's block table, folded into the online softmax."""
        key_ok = key_pos < ctx_len
        block = tl.load(table + key_pos // block_size, mask=key_ok, other=0)
        slot = block.to(tl.int64) * block_size + key_pos % block_size
        kv_offsets = slot[:, None] * stride_kv + columns[None, :]
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_ok[None, :] & row_ok[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit
    def _combine_kernel(
        PART, LSE, OUT, num_splits, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
        head_dim, SPLITS_P: tl.constexpr, HEAD_P: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        head = tl.program_id(1)
        shares = tl.arange(0, SPLITS_P)
        share_ok = shares < num_splits
        lse = tl.load(LSE + shares * stride_ls + token * stride_lt + head, mask=share_ok, other=float("-inf"))
        top = tl.max(lse, 0)
        weights = tl.where(share_ok & (lse > float("-inf")), tl.exp(lse - top), 0.0)
        weights = weights / tl.sum(weights, 0)
        dims = tl.arange(0, HEAD_P)
        parts = tl.load(
            PART + shares[:, None] * stride_ps + token * stride_pt + head * stride_ph + dims[None, :],
            mask=share_ok[:, None] & (dims[None, :] < head_dim),
            other=0.0,
        )
        out = tl.sum(parts * weights[:, None], 0)
        tl.store(OUT + token * stride_ot + head * stride_oh + dims, out.to(OUT.dtype.element_ty), mask=dims < head_dim)

    @triton.jit
    def _write_kv_kernel(K, V, CK, CV, SLOTS, stride_k, stride_v, stride_c, row, ROW_P: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(SLOTS + token).to(tl.int64)
        if slot >= 0:  # slot -1: a padded row of a CUDA graph, nothing to write
            cols = tl.arange(0, ROW_P)
            ok = cols < row
            tl.store(CK + slot * stride_c + cols, tl.load(K + token * stride_k + cols, mask=ok), mask=ok)
            tl.store(CV + slot * stride_c + cols, tl.load(V + token * stride_v + cols, mask=ok), mask=ok)
