"""The C++ operators (csrc/fused.cpp, csrc/prefill_attention.cpp, csrc/bf16_linear.cpp) against plain PyTorch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import needs_operator

from tokenloom.model import cpu_kernel
from tokenloom.model.rotary import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def operators():
    needs_operator()


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # below and above the size where the ops go parallel
def test_norms_match_pytorch(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    close(torch.ops.tokenloom.rms_norm(x, weight, 1e-5), F.rms_norm(x.float(), (576,), weight.float(), 1e-5), dtype)
    # float32 rows by a bf16 weight, as the logits' final norm runs (the weight widened exactly)
    bf16_weight = weight.to(torch.bfloat16)
    close(
        torch.ops.tokenloom.rms_norm(x.float(), bf16_weight, 1e-5),
        F.rms_norm(x.float(), (576,), bf16_weight.float(), 1e-5),
        torch.float32,
    )
    residual = torch.randn(rows, 576, generator=g)  # float32, as the model keeps its residual stream
    expected_residual = residual + x.float()
    expected = F.rms_norm(expected_residual, (576,), weight.float(), 1e-5)
    out = x.clone()
    torch.ops.tokenloom.fused_add_rms_norm(out, residual, weight, 1e-5)  # both in place
    close(residual, expected_residual, torch.float32)
    close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_survives_large_activations(dtype):
    """Real models have gate outliers far below -88, where e^-g overflows: the result must stay finite."""
    x = torch.randn(64, 2 * 1536, generator=torch.Generator().manual_seed(0)).mul(100).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    out = torch.ops.tokenloom.silu_and_mul(x)
    assert torch.isfinite(out).all()
    close(out / 100, F.silu(gate) * up / 100, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_views_matches_pytorch_and_fills_the_cache(dtype):
    rotary = RotaryEmbedding(64, 512, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 300, 511])
    slots = torch.tensor([3, 9, 0, 31, 12])
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    q, k = qkv[:, : 9 * 64].view(5, 9, 64), qkv[:, 9 * 64 : 12 * 64].view(5, 3, 64)
    v = qkv[:, 12 * 64 :]
    cache_k, cache_v = torch.zeros(32, 3 * 64, dtype=dtype), torch.zeros(32, 3 * 64, dtype=dtype)
    expected_q, expected_k = apply_rotary(q.float(), k.float(), *rotary.tables(positions, torch.float32))
    expected_v = v.clone()
    op = torch.ops.tokenloom.rotary_embedding_and_cache
    op(q, k, v, positions, *rotary.float32_tables(), cache_k, cache_v, slots)
    close(q, expected_q, dtype)
    close(k, expected_k, dtype)
    assert torch.equal(cache_k[slots], k.reshape(5, -1)), "the cache holds the rotated k, as rounded"
    assert torch.equal(cache_v[slots], expected_v)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not cache_k[untouched].any() and not cache_v[untouched].any()
    with pytest.raises(RuntimeError, match="position 512 out of range"):
        op(q, k, v, torch.tensor([0, 1, 2, 3, 512]), *rotary.float32_tables(), cache_k, cache_v, slots)
    with pytest.raises(RuntimeError, match="slot 32 out of range"):
        op(q, k, v, positions, *rotary.float32_tables(), cache_k, cache_v, torch.tensor([0, 1, 2, 3, 32]))
    with pytest.raises(RuntimeError, match="caches must be contiguous"):
        op(q, k, v, positions, *rotary.float32_tables(), cache_k[:, :64], cache_v, slots)


def reference_prefill(q, k, v, past: int, scale: float) -> torch.Tensor:
    d = q.shape[-1]
    ctx, kv_heads = k.shape[0], k.shape[1] // d
    mask = torch.arange(ctx)[None, :] <= torch.arange(past, ctx)[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().view(ctx, kv_heads, d).transpose(0, 1)[None],
        v.float().view(ctx, kv_heads, d).transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def test_a_missing_operator_is_reported_not_raised():
    """On a CPU without AVX-512 BF16 the bf16 operators are not built; asking for them must not fail the engine."""
    assert cpu_kernel.has_operator("paged_decode_attention")
    assert not cpu_kernel.has_operator("no_such_operator")


def needs_prefill_op(dtype: torch.dtype) -> None:
    if not cpu_kernel.has_prefill_op(dtype):
        pytest.skip(f"the {dtype} prefill operator is built only for CPUs with AVX-512 (and AVX-512 BF16 for bf16)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "past", "heads", "kv_heads", "head_dim"),
    # whole and partial tiles of rows, contexts within one span of 256 keys and over several, a lone query
    [(1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (300, 0, 9, 3, 64), (40, 77, 9, 3, 64), (100, 250, 4, 2, 128),
     (5, 600, 8, 1, 64), (64, 700, 6, 6, 128)],
)  # fmt: skip
def test_prefill_operator_matches_causal_attention(dtype, n, past, heads, kv_heads, head_dim):
    needs_prefill_op(dtype)
    ctx = n + past
    # Views into one fused qkv row, as the model hands them over: strided rows, contiguous heads.
    qkv = torch.randn(ctx, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(n)).to(dtype)
    q = qkv[past:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim]
    v = qkv[:, (heads + kv_heads) * head_dim :]
    # It writes into a slice of the step's output, leaving the rows around it alone.
    step_out = torch.full((n + 4, heads, head_dim), float("nan"), dtype=dtype)
    torch.ops.tokenloom.prefill_attention(q, k, v, head_dim**-0.5, step_out[2 : n + 2])
    close(step_out[2 : n + 2], reference_prefill(q, k, v, past, head_dim**-0.5), dtype)
    assert step_out[:2].isnan().all() and step_out[n + 2 :].isnan().all()
    # The compiled step hands k over as a buffer of its own: k and v rows with different strides.
    own_k = torch.empty_like(q)
    torch.ops.tokenloom.prefill_attention(q, k.contiguous(), v, head_dim**-0.5, own_k)
    close(own_k, reference_prefill(q, k, v, past, head_dim**-0.5), dtype)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.tokenloom.prefill_attention(q.to(other), k, v, 0.1, own_k)
    with pytest.raises(RuntimeError, match="shaped as q"):
        torch.ops.tokenloom.prefill_attention(q, k, v, 0.1, own_k[1:])


def test_bf16_prefill_takes_amx_tiles_where_the_cpu_has_them():
    """With AMX the bf16 chunks go to the operator's tile kernel (the parametrised test above then checks it; without
    AMX the same test checks the AVX-512 BF16 one), and the engine sends them to it rather than to torch's."""
    from tokenloom.model.attention import uses_prefill_op
    from tokenloom.model.platform import cpu_has_amx

    needs_prefill_op(torch.bfloat16)
    granted = cpu_kernel.has_operator("bf16_amx_available") and bool(torch.ops.tokenloom.bf16_amx_available())
    if cpu_has_amx() and not granted:
        pytest.skip("AMX CPU whose tiles were not built for or granted: bf16 chunks stay with torch's attention")
    assert cpu_kernel.prefill_op_uses_amx() == cpu_has_amx()
    assert uses_prefill_op("cpu", torch.bfloat16, 64)
    assert not uses_prefill_op("torch", torch.bfloat16, 64)


def test_the_prefill_operator_refuses_what_it_was_not_built_for():
    needs_prefill_op(torch.float32)
    q, k, out = torch.randn(4, 2, 64), torch.randn(4, 64), torch.empty(4, 2, 64)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.tokenloom.prefill_attention(q.half(), k.half(), k.half(), 0.1, out.half())
    if not cpu_kernel.has_prefill_op(torch.bfloat16):  # built without AVX-512 BF16: bf16 refused, not miscomputed
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            torch.ops.tokenloom.prefill_attention(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0.1, out.bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(9, 3, 64, 16), (4, 2, 128, 4)])
def test_paged_prefill_operator_reads_each_chunks_past_in_the_cache(dtype, heads, kv_heads, head_dim, block_size):
    """Chunks of one step (rows, past): short and long, past shorter and longer than a block and than a span of 256
    keys, a chunk of one token (a beam search step), two that share their first blocks (two beams of one search);
    their blocks scattered in the cache. Each equals the contiguous operator on its gathered context, bit for bit (the
    same sums over the same packed keys), and so the reference; the shared key blocks are packed once."""
    from tokenloom.model.step_inputs import shared_key_blocks

    needs_prefill_op(dtype)
    g = torch.Generator().manual_seed(block_size)
    chunks = [(5, 3), (40, 70), (1, 200), (33, 1), (2, 199), (20, 600)]  # the fifth shares the third's first 192 keys
    width = kv_heads * head_dim
    num_blocks = sum(-(-(n + past) // block_size) for n, past in chunks) + 3
    cache_k = torch.randn(num_blocks * block_size, width, generator=g).to(dtype)
    cache_v = torch.randn(num_blocks * block_size, width, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, segments, row = [], [], 2  # the step's first two rows are someone else's (decodes)
    for n, past in chunks:
        tables.append([free.pop() for _ in range(-(-(n + past) // block_size))])
        segments.append((row, n, n + past))
        row += n
    shared = 192 // block_size
    tables[4][:shared] = tables[2][:shared]
    q = torch.randn(row + 1, heads, head_dim, generator=g).to(dtype)
    padded = torch.zeros(len(chunks), max(map(len, tables)), dtype=torch.long)
    for i, table in enumerate(tables):
        padded[i, : len(table)] = torch.tensor(table)
    units, sources = (torch.from_numpy(a) for a in shared_key_blocks(np.array(segments), padded.numpy(), block_size))
    # The six full key blocks of the shared keys are packed once (over blocks of 4 keys a key block spans eight cache
    # blocks, and is packed for each chunk).
    assert len(sources) == int((units >= 0).sum()) - (192 // 32 if block_size >= 16 else 0)
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    torch.ops.tokenloom.paged_prefill_attention(q, cache_k, cache_v, torch.tensor(segments), padded, units, sources,
                                                block_size, scale, out)  # fmt: skip
    assert out[:2].isnan().all() and out[row:].isnan().all()  # only the chunks' rows are written
    for (start, n, ctx), table in zip(segments, tables, strict=True):
        slots = (torch.tensor(table)[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:ctx]
        k, v = cache_k[slots], cache_v[slots]
        alone = torch.empty(n, heads, head_dim, dtype=dtype)
        torch.ops.tokenloom.prefill_attention(q[start : start + n], k, v, scale, alone)
        assert torch.equal(out[start : start + n], alone)
        close(alone, reference_prefill(q[start : start + n], k, v, ctx - n, scale), dtype)
    with pytest.raises(RuntimeError, match="outside the step's rows"):
        bad = torch.tensor([[row - 1, 5, 10]])
        torch.ops.tokenloom.paged_prefill_attention(q, cache_k, cache_v, bad, padded[:1], units[:1], sources,
                                                    block_size, scale, out)  # fmt: skip


def needs_bf16_linear() -> None:
    if not cpu_kernel.has_operator("bf16_linear"):
        pytest.skip("the bf16 linear operator is built only for CPUs with AVX-512 BF16")


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (64, 48), (128, 16)])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 300])  # whole and partial register tiles of 8 rows
def test_bf16_linear_matches_a_float32_matmul(in_features, out_features, rows):
    needs_bf16_linear()
    g = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    packed = torch.ops.tokenloom.bf16_pack_weight(weight)
    # x is a view with strided rows (as a slice of the step's hidden states can be); out too, inside a larger buffer.
    x = torch.randn(rows, in_features + 10, generator=g).bfloat16()[:, 5 : 5 + in_features]
    buffer = torch.full((rows, out_features + 16), float("nan"), dtype=torch.bfloat16)
    torch.ops.tokenloom.bf16_linear(x, packed, buffer[:, 8 : 8 + out_features])
    expected = x.float() @ weight.float().t()
    scale = expected.abs().max().item()
    torch.testing.assert_close(buffer[:, 8 : 8 + out_features].float(), expected, rtol=1e-2, atol=1e-2 * scale)
    assert buffer[:, :8].isnan().all() and buffer[:, 8 + out_features :].isnan().all()


def test_bf16_linear_shared_between_threads_is_the_same_every_call():
    """The caller and a helper thread take units of one linear from a shared counter: every call, whoever ran which
    unit, must give the same bits, and no unit may be skipped or run twice (a 49,152-wide head: many units)."""
    needs_bf16_linear()
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4096, 576, generator=g).bfloat16()
    packed = torch.ops.tokenloom.bf16_pack_weight(weight)
    x = torch.randn(24, 576, generator=g).bfloat16()
    first = torch.empty(24, 4096, dtype=torch.bfloat16)
    torch.ops.tokenloom.bf16_linear(x, packed, first)
    torch.testing.assert_close(first.float(), x.float() @ weight.float().t(), rtol=1e-2, atol=0.5)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, threads):
            torch.set_num_threads(count)
            for _ in range(50):
                again = torch.full_like(first, float("nan"))
                torch.ops.tokenloom.bf16_linear(x, packed, again)
                assert torch.equal(again, first)
    finally:
        torch.set_num_threads(threads)


def test_bf16_linear_checks_its_inputs():
    needs_bf16_linear()
    weight = torch.randn(32, 64).bfloat16()
    packed = torch.ops.tokenloom.bf16_pack_weight(weight)
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.tokenloom.bf16_linear(x.float(), packed, torch.empty(4, 32))
    with pytest.raises(RuntimeError, match="in features"):
        torch.ops.tokenloom.bf16_linear(torch.randn(4, 62).bfloat16(), packed, torch.empty(4, 32).bfloat16())
    with pytest.raises(RuntimeError, match="out must be"):
        torch.ops.tokenloom.bf16_linear(x, packed, torch.empty(4, 16).bfloat16())
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.tokenloom.bf16_pack_weight(torch.randn(20, 64).bfloat16())


@pytest.mark.parametrize("amx", [False, True])
def test_packed_linear_uses_our_operators_and_onednn_only_for_what_our_amx_kernel_cannot_take(monkeypatch, amx):
    """Without AMX our AVX-512 kernel; with AMX our AMX kernel where it is built and the layer is one it may take (the
    LM head is not), else oneDNN's tiles; every path computes the same linear."""
    needs_bf16_linear()
    from tokenloom.model import prepack

    monkeypatch.setattr(prepack, "cpu_has_amx", lambda: amx)
    g = torch.Generator().manual_seed(5)
    weight, x = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(2, 7, 64, generator=g).bfloat16()
    for amx_kernel in (True, False):
        layer = prepack.PackedLinear(weight, None, amx_kernel=amx_kernel)
        ours = not amx or (amx_kernel and prepack.amx_linear_available())
        assert layer.own is ours and layer.packed.is_mkldnn is not ours and layer.amx is (amx and ours)
        out = layer(x)
        assert out.shape == (2, 7, 96)
        torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=1e-2, atol=5e-2)


def test_with_amx_a_small_batch_goes_to_our_operator_and_a_large_one_to_onednn(monkeypatch):
    """The LM head under AMX: both layouts of one weight, steps of up to SMALL_BATCH_ROWS rows read ours, larger
    ones oneDNN's; the same linear either way. Only models whose weights are small enough to hold twice keep both."""
    needs_bf16_linear()
    from tokenloom.model import prepack

    monkeypatch.setattr(prepack, "cpu_has_amx", lambda: True)
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(96, 64, generator=g).bfloat16()
    layer = prepack.PackedLinear(weight, None, small_batch=True, amx_kernel=False)
    assert layer.small is not None and layer.packed.is_mkldnn
    used = []
    own = prepack._own_linear_rows
    monkeypatch.setattr(prepack, "_own_linear_rows", lambda *a, **k: used.append(a[0].numel() // 64) or own(*a, **k))
    for rows in (1, prepack.SMALL_BATCH_ROWS, prepack.SMALL_BATCH_ROWS + 1, 64):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        torch.testing.assert_close(layer(x).float(), F.linear(x.float(), weight.float()), rtol=1e-2, atol=5e-2)
    assert used == [1, prepack.SMALL_BATCH_ROWS]
    assert prepack.small_batch_copies_pay(1 << 20)
    assert not prepack.small_batch_copies_pay(prepack.SMALL_BATCH_COPY_LIMIT + 1)
    assert prepack.PackedLinear(weight, None, amx_kernel=False).small is None


def needs_f32_linear() -> None:
    if not cpu_kernel.has_operator("f32_linear"):
        pytest.skip("the float32 linear is built only for CPUs with AVX2 and FMA")


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 960), (1536, 576), (5, 16), (24, 48)])
# whole and partial register tiles of 6 rows (AVX2) and 12 (AVX-512), panels of 96 rows; out features of an odd count
# of blocks of 16 (a tile's last side has one block)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 64, 97, 301])
def test_f32_linear_matches_a_float32_matmul(in_features, out_features, rows):
    needs_f32_linear()
    from tokenloom.model.prepack import f32_pack_weight

    g = torch.Generator().manual_seed(rows * out_features)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    packed = f32_pack_weight(weight)
    wide = torch.randn(rows, in_features + 8, generator=g)
    for x in (wide[:, :in_features].contiguous(), wide[:, :in_features]):  # contiguous rows, and rows with a stride
        expected = F.linear(x.double(), weight.double())  # sums of up to 1,536 products of about 1: float32 to 1e-4
        ours = torch.ops.tokenloom.f32_linear(x, packed, None)
        torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-4)
        with_bias = torch.ops.tokenloom.f32_linear(x, packed, bias)
        torch.testing.assert_close(with_bias.double(), expected + bias.double(), rtol=1e-5, atol=1e-4)
    assert torch.ops.tokenloom.f32_linear(torch.empty(0, in_features), packed, None).shape == (0, out_features)


def test_f32_linear_refuses_what_it_cannot_take():
    needs_f32_linear()
    from tokenloom.model.prepack import f32_pack_weight

    packed = f32_pack_weight(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="K is not x's"):
        torch.ops.tokenloom.f32_linear(torch.randn(2, 24), packed, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.tokenloom.f32_linear(torch.randn(2, 16).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.tokenloom.f32_linear(torch.randn(2, 16), packed, torch.randn(16))


def test_a_float32_linear_runs_our_kernel_where_it_is_built():
    """float32 weights: packed for f32_linear (every step, the compiled graph's operator too); the same linear, bias
    included. A shape our kernel cannot take (out features not a multiple of 16) goes to oneDNN."""
    needs_f32_linear()
    from tokenloom.model import prepack

    g = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    layer = prepack.PackedLinear(weight, bias)
    assert layer.own_f32 and not layer.packed.is_mkldnn and layer.small is None
    for rows in (1, 6, 64, 300):
        x = torch.randn(2, rows, 64, generator=g)
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
        compiled_op = prepack.packed_linear(x, layer.handle, layer.bias, 96)
        torch.testing.assert_close(compiled_op, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert not prepack.PackedLinear(torch.randn(40, 64, generator=g), None).own_f32


def needs_amx_linear():
    needs_bf16_linear()
    from tokenloom.model import prepack

    if not prepack.amx_linear_available():
        pytest.skip("our AMX-BF16 kernel is built only where the compiler targets AMX and the CPU grants its tiles")


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("rows", [8, 13, 32, 33, 100, 300])  # partial and whole 32-row blocks, 128-row units
def test_amx_bf16_linear_matches_the_avx512_kernel(rows, gated):
    """Our AMX kernel on the layout bf16_pack_weight makes, against our AVX-512 kernel on the same weight (both sum
    in float32, in other orders) and float32 arithmetic; input rows strided as a slice of a wider tensor."""
    needs_amx_linear()
    from tokenloom.model.prepack import gate_and_up_interleaved

    g = torch.Generator().manual_seed(rows)
    n, k = 192, 576
    weight = torch.randn(n, k, generator=g).div(8).bfloat16()
    wide = torch.randn(rows, k + 64, generator=g).bfloat16()
    x = wide[:, 32 : 32 + k]  # rows with a stride of k + 64
    wide[0, 32:40] = 200.0  # gates far below -88 in row 0, where e^-g overflows float32
    packed = torch.ops.tokenloom.bf16_pack_weight(gate_and_up_interleaved(weight) if gated else weight)
    width = n // 2 if gated else n
    amx, avx = torch.empty(rows, width).bfloat16(), torch.empty(rows, width).bfloat16()
    torch.ops.tokenloom.bf16_amx_linear(x, packed, amx, gated)
    (torch.ops.tokenloom.bf16_linear_silu_and_mul if gated else torch.ops.tokenloom.bf16_linear)(x, packed, avx)
    expected = x.float() @ weight.float().t()
    if gated:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    assert torch.isfinite(amx).all()
    scale = expected.abs().max().item()
    torch.testing.assert_close(amx.float(), expected, rtol=1e-2, atol=1e-2 * scale)
    torch.testing.assert_close(amx.float(), avx.float(), rtol=1e-2, atol=1e-2 * scale)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        narrow = torch.ops.tokenloom.bf16_pack_weight(weight[:, :48].contiguous())  # K = 48: not whole tiles
        torch.ops.tokenloom.bf16_amx_linear(x[:, :48].contiguous(), narrow, amx, gated)


def test_with_amx_a_layer_takes_our_amx_kernel_from_8_rows(monkeypatch):
    needs_amx_linear()
    from tokenloom.model import prepack

    g = torch.Generator().manual_seed(7)
    weight = torch.randn(2 * 96, 64, generator=g).bfloat16()
    layer = prepack.PackedLinear(weight, None, gated=True)
    assert layer.own and layer.amx and layer.gated
    used: list[int] = []
    amx_op = torch.ops.tokenloom.bf16_amx_linear
    monkeypatch.setattr(torch.ops.tokenloom, "bf16_amx_linear", lambda x, *a: used.append(x.shape[0]) or amx_op(x, *a))
    for rows in (1, prepack.AMX_FROM_ROWS - 1, prepack.AMX_FROM_ROWS, 40):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
        torch.testing.assert_close(layer(x).float(), F.silu(gate) * up, rtol=1e-2, atol=5e-2)
    assert used == [prepack.AMX_FROM_ROWS, 40]


@pytest.mark.parametrize("rows", [1, 6, 7, 64, 300])  # whole and partial register tiles of 6 rows
@pytest.mark.parametrize("intermediate", [1536, 48])  # 48: an odd number of gate blocks, a tile of one pair at the end
def test_gated_bf16_linear_matches_silu_of_gate_times_up(rows, intermediate, monkeypatch):
    """A fused [gate; up] projection packed by PackedLinear(gated=True) returns silu(gate) * up, as the model's
    unfused path computes it, including gates far below -88 where e^-g overflows float32. The gated operator is
    ours, used where the CPU has no AMX; on a CPU with AMX it is tested as if it had none."""
    needs_bf16_linear()
    from tokenloom.model import prepack
    from tokenloom.model.prepack import PackedLinear

    monkeypatch.setattr(prepack, "cpu_has_amx", lambda: False)

    g = torch.Generator().manual_seed(rows + intermediate)
    weight = torch.randn(2 * intermediate, 576, generator=g).div(8).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    x[0, :8] = 200.0  # drives some of row 0's gates and ups to hundreds, of both signs
    layer = PackedLinear(weight, None, gated=True)
    assert layer.gated and layer.out_features == intermediate
    out = layer(x)
    gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    assert torch.isfinite(out).all()
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2 * scale)
    with pytest.raises(RuntimeError, match="half the weight's out features"):
        torch.ops.tokenloom.bf16_linear_silu_and_mul(x, layer.packed, torch.empty(rows, 2 * intermediate).bfloat16())
