"""Paged attention: the C++ decode operator and the plain PyTorch path agree with a dense reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import needs_operator

from tokenloom.core.scheduler_output import ScheduledRequest
from tokenloom.model import cpu_kernel
from tokenloom.model.attention import AttentionMetadata, DecodeGroup, PrefillSegment, attends_apart, paged_attention
from tokenloom.model.step_inputs import BlockTableRows, group_by_context_length
from tokenloom.utils import cdiv

BLOCK = 4


def dense_reference(q, k_ctx, v_ctx, scale):
    """q: [heads, d]; k_ctx, v_ctx: [ctx, kv_heads, d] -> [heads, d], plain softmax attention."""
    group = q.shape[0] // k_ctx.shape[1]
    k = k_ctx.repeat_interleave(group, dim=1)  # [ctx, heads, d]
    v = v_ctx.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,chd->hc", q, k) * scale, dim=-1)
    return torch.einsum("hc,chd->hd", weights, v)


def random_case(num_heads, num_kv_heads, head_dim, context_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 128
    row = num_kv_heads * head_dim
    cache_k = torch.randn(num_blocks * BLOCK, row, generator=g)
    cache_v = torch.randn(num_blocks * BLOCK, row, generator=g)
    max_blocks = cdiv(max(context_lens), BLOCK)
    # Scattered, non-overlapping block tables, as a fragmented pool would hand out.
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.stack([order[i * max_blocks : (i + 1) * max_blocks] for i in range(len(context_lens))])
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=g)
    return q, cache_k, cache_v, tables


def expected(q, cache_k, cache_v, tables, context_lens, num_kv_heads, head_dim):
    outs = []
    for i, ctx in enumerate(context_lens):
        positions = torch.arange(ctx)
        slots = tables[i, positions // BLOCK] * BLOCK + positions % BLOCK
        k = cache_k[slots].view(ctx, num_kv_heads, head_dim)
        v = cache_v[slots].view(ctx, num_kv_heads, head_dim)
        outs.append(dense_reference(q[i], k, v, head_dim**-0.5))
    return torch.stack(outs)


def decode_meta(tables, context_lens, use_kernel):
    lens = torch.tensor(context_lens)
    max_ctx = max(context_lens)
    bias = torch.zeros(len(context_lens), 1, max_ctx)
    bias[torch.arange(max_ctx)[None, None, :].expand_as(bias) >= lens[:, None, None]] = float("-inf")
    group = DecodeGroup(0, len(context_lens), tables, lens, bias)
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), block_size=BLOCK, decodes=[group], use_cpu_kernel=use_kernel
    )


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 3, 48)])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_decode_attention_matches_dense_reference(heads, kv_heads, head_dim, use_kernel):
    if use_kernel:
        needs_operator()
    context_lens = [1, 4, 5, 17, 30, 63]
    q, cache_k, cache_v, tables = random_case(heads, kv_heads, head_dim, context_lens)
    meta = decode_meta(tables, context_lens, use_kernel)
    out = paged_attention(q, None, None, cache_k, cache_v, meta, head_dim**-0.5)
    reference = expected(q, cache_k, cache_v, tables, context_lens, kv_heads, head_dim)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_decode_groups_bound_padding():
    lens = [10, 11, 12, 40, 41, 100]
    assert group_by_context_length(lens, max_groups=1) == [(0, 6)]
    groups = group_by_context_length(lens, max_waste=0.25, max_groups=4)
    assert groups == [(0, 3), (3, 5), (5, 6)]
    assert group_by_context_length([], max_groups=3) == []


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 3, 48), (12, 1, 64)])
def test_bfloat16_operator_and_plain_path_agree_with_a_float32_reference(heads, kv_heads, head_dim):
    needs_operator()
    context_lens = [1, 3, 16, 33, 64]
    q, cache_k, cache_v, tables = (t.bfloat16() if t.is_floating_point() else t for t in random_case(
        heads, kv_heads, head_dim, context_lens, seed=3
    ))  # fmt: skip
    reference = expected(q.float(), cache_k.float(), cache_v.float(), tables, context_lens, kv_heads, head_dim)
    outputs = {}
    for use_kernel in (True, False):
        meta = decode_meta(tables, context_lens, use_kernel)
        meta.decodes[0].bias = meta.decodes[0].bias.bfloat16()
        outputs[use_kernel] = paged_attention(q, None, None, cache_k, cache_v, meta, head_dim**-0.5)
        assert outputs[use_kernel].dtype == torch.bfloat16
        # bfloat16 keeps 8 bits of mantissa: the output is rounded to ~0.4% of its size.
        torch.testing.assert_close(outputs[use_kernel].float(), reference, atol=2e-2, rtol=2e-2)
    # The operator accumulates in float32 from the bf16 rows; it is at least as close as the plain path.
    kernel_error = (outputs[True].float() - reference).abs().max()
    plain_error = (outputs[False].float() - reference).abs().max()
    assert kernel_error <= plain_error + 1e-2


def test_operator_checks_its_inputs():
    needs_operator()
    context_lens = [5, 9]
    q, cache_k, cache_v, tables = random_case(4, 2, 32, context_lens)
    lens = torch.tensor(context_lens)
    op = torch.ops.tokenloom.paged_decode_attention
    out = torch.empty_like(q)
    op(q, cache_k, cache_v, tables, lens, BLOCK, 0.1, out)
    torch.testing.assert_close(out, cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, lens, BLOCK, 0.1))
    bad_calls = {
        "float32 or bfloat16": (q.half(), cache_k.half(), cache_v.half(), tables, lens, out.half()),
        "share a dtype": (q, cache_k.bfloat16(), cache_v, tables, lens, out),
        "int64": (q, cache_k, cache_v, tables.int(), lens, out),
        "contiguous": (q, cache_k.t().contiguous().t(), cache_v, tables, lens, out),
        "heads and dims contiguous": (q.mT.contiguous().mT, cache_k, cache_v, tables, lens, out),
        "shaped as q": (q, cache_k, cache_v, tables, lens, out[:1]),
        "out of range": (q, cache_k, cache_v, tables + 1000, lens, out),
        "context length": (q, cache_k, cache_v, tables, torch.tensor([5, 10_000]), out),
        "one block table": (q, cache_k, cache_v, tables[:1], lens, out),
    }
    for message, args in bad_calls.items():
        with pytest.raises(RuntimeError, match=message):
            op(*args[:5], BLOCK, 0.1, args[5])


def test_operator_reads_and_writes_strided_rows():
    """The model hands the operator q as a view into the fused qkv output and a slice of the step's output."""
    needs_operator()
    context_lens = [5, 9, 17]
    q, cache_k, cache_v, tables = random_case(4, 2, 32, context_lens)
    lens = torch.tensor(context_lens)
    expected = cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, lens, BLOCK, 0.1)
    fused = torch.randn(q.shape[0], q[0].numel() + 50)
    fused[:, : q[0].numel()] = q.flatten(1)
    strided_q = fused[:, : q[0].numel()].view(q.shape)
    step_out = torch.full((q.shape[0] + 3, *q.shape[1:]), float("nan"))
    cpu_kernel.paged_decode_attention(strided_q, cache_k, cache_v, tables, lens, BLOCK, 0.1, step_out[2:5])
    torch.testing.assert_close(step_out[2:5], expected)
    assert step_out[:2].isnan().all() and step_out[5:].isnan().all(), "rows outside the slice stay untouched"


TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def blocked_case(context_lens, heads, kv_heads, head_dim, block_size, dtype, seed, spare_blocks=0, peaked=False):
    """Caches whose blocks the contexts' tables take in a random order, and one query per context; `peaked` makes
    every other query's softmax sharp, so its running maximum moves between chunks (and splits)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = cdiv(max(context_lens), block_size)
    num_blocks = max_blocks * len(context_lens) + spare_blocks
    cache_k = torch.randn(num_blocks * block_size, kv_heads * head_dim, generator=g).to(dtype)
    cache_v = torch.randn(num_blocks * block_size, kv_heads * head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: max_blocks * len(context_lens)].view(len(context_lens), -1)
    q = torch.randn(len(context_lens), heads, head_dim, generator=g)
    if peaked:
        q[1::2] *= 6
    return q.to(dtype), cache_k, cache_v, tables


def blocked_reference(q_row, cache_k, cache_v, table, ctx, block_size, scale):
    """Attention of one query over its context read through its block table, in float32."""
    head_dim = q_row.shape[-1]
    kv_heads = cache_k.shape[1] // head_dim
    positions = torch.arange(ctx)
    slots = table[positions // block_size] * block_size + positions % block_size
    k = cache_k[slots].float().view(ctx, kv_heads, head_dim)
    v = cache_v[slots].float().view(ctx, kv_heads, head_dim)
    return dense_reference(q_row.float(), k, v, scale)


@pytest.mark.parametrize("block_size", [8, 12, 16, 32])  # 16 keys inside one block, or spread over two or three
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_walks_blocks_of_any_size(block_size, dtype):
    """The bf16 operator takes 16 keys at a time from one block when blocks hold a multiple of 16 (and prefetches
    the next block), and key by key otherwise; the float32 one walks each chunk's keys block by block and prefetches
    the next chunk's: every way must read the same rows."""
    needs_operator()
    context_lens = [1, 15, 16, 17, 47, 70, 129]
    head_dim, scale = 64, 64**-0.5
    q, cache_k, cache_v, tables = blocked_case(context_lens, 9, 3, head_dim, block_size, dtype, block_size, 3)
    out = cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, torch.tensor(context_lens), block_size, scale)
    for i, ctx in enumerate(context_lens):
        reference = blocked_reference(q[i], cache_k, cache_v, tables[i], ctx, block_size, scale)
        torch.testing.assert_close(out[i].float(), reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (16, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operator_gives_a_sequence_the_same_output_alone_or_in_a_crowd(heads, kv_heads, head_dim, dtype, two_threads):
    """The operator's online softmax walks each context in chunks of 64 keys; a sequence's output must not depend
    on the batch around it or on which thread took it (bit for bit), and must match a float32 reference across
    chunks, including sharp softmaxes whose maximum comes late. 16 query heads per KV head exceed the 8 whose bf16
    accumulators are held at once."""
    needs_operator()
    block_size = 16
    # 1,100 keys: over twice the operator's shortest split (512 keys), so with 2 threads it is attended in two splits,
    # alone and in the crowd alike (split-K cuts by the context and the thread count, never by the batch).
    context_lens = [1, 2, 63, 64, 65, 130, 200, 333] * 5 + [1100]
    q, cache_k, cache_v, tables = blocked_case(
        context_lens, heads, kv_heads, head_dim, block_size, dtype, seed=heads, peaked=True
    )
    lens = torch.tensor(context_lens)
    scale = head_dim**-0.5
    crowd = cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size, scale)
    for i in range(len(context_lens)):
        alone = cpu_kernel.paged_decode_attention(
            q[i : i + 1], cache_k, cache_v, tables[i : i + 1], lens[i : i + 1], block_size, scale
        )
        assert torch.equal(alone, crowd[i : i + 1]), f"sequence {i} differs alone and in the crowd"
    for i in [*range(8), len(context_lens) - 1]:
        reference = blocked_reference(q[i], cache_k, cache_v, tables[i], context_lens[i], block_size, scale)
        torch.testing.assert_close(crowd[i].float(), reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


NO_SPLIT = 1 << 20  # split_keys past any context here: each (sequence, KV head) attended whole


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_keys", [16, 48])  # one block a split, or three
def test_contexts_attended_in_splits_and_merged_match_the_whole_context(heads, kv_heads, head_dim, dtype, split_keys):
    """Split-K: a context longer than split_keys is attended in splits of that many keys (any thread takes any
    split) and each head's splits are merged by their log-sum-exps. The result must be attention over the whole
    context, wherever the softmax's maximum lies (peaked queries put it in any split), through every kernel (48:
    the generic loop; bf16 partial rows are kept in float32, so only the output is rounded)."""
    needs_operator()
    block_size = 16
    context_lens = [1, 16, 17, 48, 49, 95, 300]
    q, cache_k, cache_v, tables = blocked_case(
        context_lens, heads, kv_heads, head_dim, block_size, dtype, seed=head_dim + split_keys, peaked=True
    )
    lens = torch.tensor(context_lens)
    scale = head_dim**-0.5
    split, whole = (
        cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, lens, block_size, scale, split_keys=keys)
        for keys in (split_keys, NO_SPLIT)
    )
    for i, ctx in enumerate(context_lens):
        if ctx <= split_keys:  # attended whole either way: the same arithmetic
            assert torch.equal(split[i], whole[i])
        reference = blocked_reference(q[i], cache_k, cache_v, tables[i], ctx, block_size, scale)
        torch.testing.assert_close(split[i].float(), reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(split, whole, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operator_splits_a_long_context_once_per_thread(dtype, two_threads):
    """Left to itself (split_keys 0) the operator cuts a context into one split per thread of at least 512 keys,
    whole blocks each: on 2 threads 1,000 keys stay whole, 1,100 go in splits of 560 and 4,000 of 2,000; more
    splits than threads only cost a crowd (each split starts on keys not yet fetched, and is merged)."""
    needs_operator()
    block_size = 16
    context_lens = [1000, 1100, 4000]
    q, cache_k, cache_v, tables = blocked_case(context_lens, 9, 3, 64, block_size, dtype, seed=7, peaked=True)
    scale = 64**-0.5
    for i, (ctx, keys) in enumerate(zip(context_lens, [NO_SPLIT, 560, 2000], strict=True)):
        lens = torch.tensor([ctx])
        args = (q[i : i + 1], cache_k, cache_v, tables[i : i + 1], lens, block_size, scale)
        auto = cpu_kernel.paged_decode_attention(*args)
        assert torch.equal(auto, cpu_kernel.paged_decode_attention(*args, split_keys=keys)), ctx
        # The same context in splits of 512 is other arithmetic, seen in float32 outputs: rounded to bf16, those of
        # the kernel that widens bf16 rows (CPUs without AVX-512 BF16) came out the same bits.
        if keys != NO_SPLIT and dtype == torch.float32:
            assert not torch.equal(auto, cpu_kernel.paged_decode_attention(*args, split_keys=512)), ctx


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("past", "q_len"), [(1, 1), (40, 8), (37, 100), (1200, 1030)])
def test_a_chunk_after_a_past_attends_as_the_causal_mask_says(past, q_len, dtype, tolerance):
    """A prefill chunk with a past, given without a mask (attended apart from its past and merged, as the CPU's steps
    give chunks large enough): the same as one call given the causal mask (the chunk the context's last q_len tokens)
    and as dense attention over the gathered context; grouped-query heads, blocks the chunk ends inside."""
    heads, kv_heads, head_dim, block_size = 6, 2, 64, 16
    ctx = past + q_len
    q, cache_k, cache_v, tables = blocked_case([ctx], heads, kv_heads, head_dim, block_size, torch.float32, seed=ctx)
    q = torch.randn(q_len, heads, head_dim, generator=torch.Generator().manual_seed(q_len)).to(dtype)
    cache_k, cache_v = cache_k.to(dtype), cache_v.to(dtype)
    table = tables[0, : cdiv(ctx, block_size)]
    visible = torch.arange(ctx)[None, :] <= torch.arange(past, ctx)[:, None]
    outs = []
    for mask in (None, visible):
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), block_size,
                                 prefills=[PrefillSegment(0, q_len, ctx, table, mask)])  # fmt: skip
        outs.append(paged_attention(q, None, None, cache_k, cache_v, meta, head_dim**-0.5).float())
    slots = table[torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
    k, v = (c[slots].float().view(ctx, kv_heads, head_dim).repeat_interleave(3, 1) for c in (cache_k, cache_v))
    scores = torch.einsum("qhd,chd->hqc", q.float(), k) * head_dim**-0.5
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    reference = torch.einsum("hqc,chd->qhd", weights, v)
    torch.testing.assert_close(outs[0], outs[1], rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(outs[0], reference, rtol=tolerance, atol=tolerance)


def test_only_chunks_large_enough_on_the_cpu_are_attended_apart_from_their_past():
    cpu = torch.device("cpu")
    assert attends_apart(1030, 2230, torch.float32, cpu) and attends_apart(1030, 2230, torch.bfloat16, cpu)
    assert attends_apart(512, 1024, torch.float32, cpu) and not attends_apart(512, 1024, torch.bfloat16, cpu)
    assert not attends_apart(40, 1540, torch.float32, cpu)  # two calls and the merge would cost more
    assert not attends_apart(2048, 2048, torch.float32, cpu)  # no past: one causal call
    assert not attends_apart(2048, 4096, torch.float32, torch.device("meta"))  # other devices take the mask


def test_split_keys_must_be_whole_blocks():
    needs_operator()
    q, cache_k, cache_v, tables = random_case(9, 3, 64, [40])
    with pytest.raises(RuntimeError, match="multiple of block_size"):
        cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, torch.tensor([40]), BLOCK, 0.1, split_keys=6)


def scheduled_blocks(request_id: str, block_ids: list[int], epoch: int | None) -> ScheduledRequest:
    return ScheduledRequest(
        SimpleNamespace(request_id=request_id, prompt_token_ids=[]), 0, [1], block_ids, True, block_epoch=epoch
    )


def test_block_table_rows_read_a_scheduled_list_only_as_far_as_it_was_when_scheduled():
    """The scheduler hands over the KV manager's own list, which the next schedule may extend before this step's
    inputs are built (scheduling ahead): a row holds the ids the step was given, and the next step's tail after."""
    table, ids = BlockTableRows(), [7, 9]
    first = ScheduledRequest(
        SimpleNamespace(request_id="a", prompt_token_ids=[]), 0, [1], ids, True, block_epoch=0, num_blocks=2
    )
    ids.append(5)  # the next step's block, given before this step is prepared
    rows = table.rows([first])
    assert table.ids[rows[0], :3].tolist() == [7, 9, 0]
    second = ScheduledRequest(
        SimpleNamespace(request_id="a", prompt_token_ids=[]), 8, [1], ids, True, block_epoch=0, num_blocks=3
    )
    rows = table.rows([second])
    assert table.tables(rows, np.array([9]), 4).tolist() == [[7, 9, 5]]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_block_table_rows_follow_each_requests_blocks_from_step_to_step(block_size):
    """The rows kept from step to step against each step's lists read whole: a request's table holds the blocks its
    context reaches and zeros to the widest row; its ids grow by a tail under one epoch, are read again whole under a
    new or unknown one; rows of requests gone are reused, and the array grows past its first size."""
    table = BlockTableRows()
    steps = [
        [("a", [7, 9], 0), ("b", [3], 1)],
        [("a", [7, 9, 5], 0), ("c", [11, 4, 6, 1, 10, 12], 2)],  # b gone: its row goes to c
        [("a", [2, 8], 3), ("c", [11, 4, 6, 1, 10, 12, 13], 2)],  # a freed and given new blocks: a new epoch
        [("a", [6, 1], None), ("c", [11, 4, 6, 1, 10, 12, 13], 2)],  # unknown epoch: read whole
        [(f"r{i}", list(range(i, i + 3 * i + 70)), 4) for i in range(40)],  # more rows and columns than at first
    ]
    for step in steps:
        scheduled = [scheduled_blocks(*entry) for entry in step]
        rows = table.rows(scheduled)
        assert len(set(rows.tolist())) == len(rows), "each request its own row"
        # A context that reaches each of its blocks, or fewer of them (the blocks after are not read).
        for contexts in (
            [len(ids) * block_size for _, ids, _ in step],
            [1 + block_size * (len(ids) // 2) for _, ids, _ in step],
        ):
            lens = np.array(contexts, dtype=np.int64)
            width = max(cdiv(c, block_size) for c in contexts)
            expected = [
                ids[: cdiv(c, block_size)] + [0] * (width - cdiv(c, block_size))
                for (_, ids, _), c in zip(step, contexts, strict=True)
            ]
            assert table.tables(rows, lens, block_size).tolist() == expected
        positions = np.array([len(ids) * block_size - 1 for _, ids, _ in step] + [0 for _ in step])
        slots = table.slots(np.concatenate([rows, rows]), positions, block_size)
        last = [ids[-1] * block_size + block_size - 1 for _, ids, _ in step]
        assert slots.tolist() == last + [ids[0] * block_size for _, ids, _ in step]
    assert len(table.ids) >= 40 and table.ids.shape[1] >= 3 * 39 + 70
