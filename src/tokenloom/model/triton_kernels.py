"""The Triton kernels of triton_attention.py (which says what they compute), in a module of their own: importing
Triton takes about half a second, which a process that never launches a kernel (the CPU backends, a CLI command)
need not pay; triton_attention.py imports this module at its first launch."""

import triton
import triton.language as tl


@triton.jit
def _attention_kernel(
    Q, K, V, OUT, PART, LSE, QSL, CTX, BT,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    scale, block_size, head_dim, group, num_splits,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_P: tl.constexpr, HEAD_P: tl.constexpr,
    SPLIT: tl.constexpr, KV_QUANT: tl.constexpr,
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
            kv_head, dims, dim_ok, head_dim, stride_kv, block_size, scale, KV_QUANT,
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
    q, K, V, table, m_i, l_i, acc, key_pos, ctx_len, query_pos, row_ok, kv_head, dims, dim_ok, head_dim,
    stride_kv, block_size, scale, KV_QUANT: tl.constexpr,
):  # fmt: skip
    """One tile of keys, read in place through the sequence's block table, folded into the online softmax."""
    key_ok = key_pos < ctx_len
    block = tl.load(table + key_pos // block_size, mask=key_ok, other=0)
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    if KV_QUANT == 0:
        slot = block.to(tl.int64) * block_size + key_pos % block_size
        kv_offsets = slot[:, None] * stride_kv + (kv_head * head_dim + dims)[None, :]
        k = tl.load(K + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_offsets, mask=kv_mask, other=0.0)
    else:
        entry = _entry_offset(block.to(tl.int64), key_pos % block_size, kv_head, head_dim, stride_kv, block_size)
        k = _read_entries(K, entry, dims, kv_mask, key_ok, head_dim, KV_QUANT).to(q.dtype)
        v = _read_entries(V, entry, dims, kv_mask, key_ok, head_dim, KV_QUANT).to(q.dtype)
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
def _entry_offset(block, in_block, kv_head, head_dim, stride_row, block_size):
    """Byte offset of a (slot, KV head) entry of an 8-bit cache: blocks of rows, each head's entries together."""
    entry_bytes = head_dim + 4
    return block * block_size * stride_row + kv_head * block_size * entry_bytes + in_block * entry_bytes


@triton.jit
def _code_pointer(CACHE, offsets, KV_QUANT: tl.constexpr):
    if KV_QUANT == 1:
        return (CACHE + offsets).to(tl.pointer_type(tl.int8))
    elif KV_QUANT == 2:
        return (CACHE + offsets).to(tl.pointer_type(tl.float8e4nv))
    else:
        return (CACHE + offsets).to(tl.pointer_type(tl.float8e5))


@triton.jit
def _read_entries(CACHE, entry, dims, mask, key_ok, head_dim, KV_QUANT: tl.constexpr):
    """A tile of keys' codes times their scales, in float32; masked keys read as zeros."""
    codes = tl.load(_code_pointer(CACHE, entry[:, None] + dims[None, :], KV_QUANT), mask=mask, other=0.0)
    scales = tl.load((CACHE + entry + head_dim).to(tl.pointer_type(tl.float32)), mask=key_ok, other=0.0)
    return codes.to(tl.float32) * scales[:, None]


@triton.jit
def _write_kv_codes_kernel(
    K, V, CK, CV, SLOTS, stride_k, stride_v, stride_c, block_size, num_kv_heads, head_dim, inv_max_code,
    max_code, KV_QUANT: tl.constexpr, HEADS_P: tl.constexpr, HEAD_P: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(SLOTS + token).to(tl.int64)
    if slot >= 0:  # slot -1: a padded row of a CUDA graph, nothing to write
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, HEAD_P)
        head_ok = heads < num_kv_heads
        ok = head_ok[:, None] & (dims[None, :] < head_dim)
        entry = _entry_offset(slot // block_size, slot % block_size, heads, head_dim, stride_c, block_size)
        columns = heads[:, None] * head_dim + dims[None, :]
        _write_entries(K + token * stride_k + columns, CK, entry, dims, ok, head_ok, head_dim, inv_max_code,
                       max_code, KV_QUANT)  # fmt: skip
        _write_entries(V + token * stride_v + columns, CV, entry, dims, ok, head_ok, head_dim, inv_max_code,
                       max_code, KV_QUANT)  # fmt: skip


@triton.jit
def _write_entries(
    values_ptrs, CACHE, entry, dims, ok, head_ok, head_dim, inv_max_code, max_code, KV_QUANT: tl.constexpr
):
    """One token's heads: scale = max |value| / max code (1 for a head of zeros), codes = value / scale rounded
    to nearest even, in kv_quant.encode's float32 operations (an IEEE reciprocal, then a product)."""
    values = tl.load(values_ptrs, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(values), 1)
    scale = tl.where(amax > 0.0, amax * inv_max_code, 1.0)
    inverse = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    scaled = tl.minimum(tl.maximum(values * inverse[:, None], -max_code), max_code)
    code_ptrs = _code_pointer(CACHE, entry[:, None] + dims[None, :], KV_QUANT)
    if KV_QUANT == 1:
        # 1.5 * 2^23 added and taken away: float32 addition rounds the fraction off, to nearest even
        tl.store(code_ptrs, ((scaled + 12582912.0) - 12582912.0).to(tl.int8), mask=ok)
    else:
        tl.store(code_ptrs, scaled.to(code_ptrs.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)
    tl.store((CACHE + entry + head_dim).to(tl.pointer_type(tl.float32)), scale, mask=head_ok)


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
