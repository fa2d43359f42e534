"""The 8-bit KV cache (--kv-cache-dtype): codes round-trip within their format's error, the C++ operators write and
read what the PyTorch path does, and every path that moves KV (chunks, swap, recompute, prefix hits, n > 1 forks,
tensor parallel shards, the core process) keeps a request's tokens what they are alone."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from helpers import collect, needs_operator
from server_process import ServerProcess

from tokenloom import LLM, EngineConfig, SamplingParams
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.engine.core_process import CoreProcessEngine
from tokenloom.model import cpu_kernel, kv_quant
from tokenloom.model.attention import AttentionMetadata, DecodeGroup, PrefillSegment, paged_attention
from tokenloom.model.quantization import int8_kernel_isa

FORMATS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# The largest error of one value, relative to the largest |value| of its head: half a code step for int8; for fp8
# half a unit in the last place of its 3 (e4m3) or 2 (e5m2) mantissa bits, relative to the value itself.
RELATIVE_TO_AMAX = {"int8": 0.5 / 127}
RELATIVE_TO_VALUE = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
BLOCK = 16


def heads(tokens: int, num_heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, num_heads, head_dim, generator=g)
    x[:, :, 5] *= 20  # an outlier channel, as real K has
    x[3] = 0  # a token of zeros: scale 1, codes 0
    return x


@pytest.mark.parametrize("name", FORMATS)
def test_codes_round_trip_within_the_formats_error(name):
    fmt = kv_quant.kv_format(name)
    assert fmt is not None
    x = heads(40, 3, 64)
    entries = kv_quant.encode(x, fmt)
    assert entries.dtype == torch.uint8 and entries.shape == (40, 3, 64 + 4)
    back = kv_quant.decode(entries, fmt, torch.float32).view(40, 3, 64)
    amax = x.abs().amax(-1, keepdim=True)
    if name in RELATIVE_TO_AMAX:
        bound = RELATIVE_TO_AMAX[name] * amax
    else:  # subnormal codes (|x| below 2^-6 of the largest code's magnitude) have an absolute step
        bound = RELATIVE_TO_VALUE[name] * x.abs() + amax * 2.0**-16
    assert ((back - x).abs() <= bound * 1.0001 + 1e-7).all()
    assert torch.equal(back[3], torch.zeros(3, 64)), "a zero token stays zero"
    # Each head's largest value is its largest code: exact but for the float rounding of amax / max_code * max_code.
    torch.testing.assert_close(back.abs().amax(-1), amax.squeeze(-1), rtol=1e-6, atol=0)


def test_fp8_alias_and_bytes_per_token():
    assert kv_quant.kv_format("fp8") == kv_quant.kv_format("fp8_e4m3")
    assert kv_quant.kv_format("auto") is None
    assert kv_quant.FORMATS["int8"].row_bytes(1, 64) == 68  # a head of 64: 64 codes and a 4-byte scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_fused_rotary_op_writes_the_bytes_the_pytorch_path_writes(name, dtype):
    needs_operator()
    fmt = kv_quant.kv_format(name)
    assert fmt is not None
    tokens, kv_heads, head_dim = 9, 2, 64
    q = torch.randn(tokens, 4, head_dim).to(dtype)
    k = heads(tokens, kv_heads, head_dim).to(dtype)
    v = heads(tokens, kv_heads, head_dim, seed=1).reshape(tokens, -1).to(dtype)
    cos, sin = torch.randn(64, head_dim), torch.randn(64, head_dim)
    positions, slots = torch.arange(tokens) * 3, torch.arange(tokens) * 2 + 1
    cache_k = torch.zeros(32, fmt.row_bytes(kv_heads, head_dim), dtype=torch.uint8)
    cache_v = torch.zeros_like(cache_k)
    torch.ops.tokenloom.rotary_embedding_and_cache(
        q, k, v, positions, cos, sin, cache_k, cache_v, slots, fmt.kind, BLOCK
    )
    # k was rotated in place; the caches hold its entries and v's, byte for byte where PyTorch puts them, and
    # nothing anywhere else.
    for cache, x in ((cache_k, k), (cache_v, v)):
        reference = torch.zeros_like(cache)
        kv_quant.write(reference, x, slots, fmt, head_dim, BLOCK)
        assert torch.equal(cache, reference)
        assert torch.equal(kv_quant.read(cache, slots, fmt, head_dim, BLOCK, torch.float32),
                           kv_quant.decode(kv_quant.encode(x.reshape(tokens, kv_heads, head_dim), fmt), fmt,
                                           torch.float32))  # fmt: skip


def quantized_case(name: str, num_heads: int, kv_heads: int, head_dim: int, lens: list[int]):
    fmt = kv_quant.kv_format(name)
    assert fmt is not None
    num_blocks = sum(-(-n // BLOCK) for n in lens) + 4
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(2))
    width = max(-(-n // BLOCK) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    at = 0
    for i, n in enumerate(lens):
        used = -(-n // BLOCK)
        tables[i, :used] = order[at : at + used]
        at += used
    slots = torch.arange(num_blocks * BLOCK)
    cache_k = torch.zeros(num_blocks * BLOCK, fmt.row_bytes(kv_heads, head_dim), dtype=torch.uint8)
    cache_v = torch.zeros_like(cache_k)
    kv_quant.write(cache_k, heads(num_blocks * BLOCK, kv_heads, head_dim, seed=3), slots, fmt, head_dim, BLOCK)
    kv_quant.write(cache_v, heads(num_blocks * BLOCK, kv_heads, head_dim, seed=4), slots, fmt, head_dim, BLOCK)
    q = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    return fmt, q, cache_k, cache_v, tables


def decode(q, cache_k, cache_v, tables, lens, fmt, use_kernel: bool) -> torch.Tensor:
    context_lens = torch.tensor(lens)
    bias = torch.where(torch.arange(tables.shape[1] * BLOCK)[None, None, : max(lens)] < context_lens[:, None, None],
                       0.0, float("-inf")).to(q.dtype)  # fmt: skip
    group = DecodeGroup(0, len(lens), tables, context_lens, bias)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), block_size=BLOCK, decodes=[group], use_cpu_kernel=use_kernel,
        kv_format=fmt,
    )  # fmt: skip
    return paged_attention(q, None, None, cache_k, cache_v, meta, q.shape[-1] ** -0.5)


# The operator's error against attention over the dequantized cache in float32 (the plain path), as a share of each
# output row's norm. fp8 in float32 is the same arithmetic; in bf16 the kernel rounds as for a bf16 cache (measured up
# to 1.8%); int8 through AVX-512 VNNI also quantizes each query head in two int8 parts and each 16 keys' probabilities
# to 8 bits (measured up to 2.0% on K and V with a 20x outlier channel, 3.2% on a 65-key context of
# test_split_contexts_of_an_8_bit_cache_merge_to_the_whole's case, split or not); int8 in float32 on AVX2 quantizes
# each query head and each chunk's weights to 16 bits (measured up to 0.06%).
ROW_ERROR = {"int8": 0.04, "fp8_e4m3": 0.025, "fp8_e5m2": 0.025}
AVX2_INT8_ROW_ERROR = 0.002


@pytest.mark.parametrize(("heads_", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128), (6, 3, 64), (4, 2, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_decode_operator_matches_the_plain_path_on_8_bit_caches(name, dtype, heads_, kv_heads, head_dim):
    needs_operator()
    lens = [1, 5, 16, 17, 64, 65, 300]
    fmt, q, cache_k, cache_v, tables = quantized_case(name, heads_, kv_heads, head_dim, lens)
    reference = decode(q, cache_k, cache_v, tables, lens, fmt, use_kernel=False)  # float32, dequantized
    ours = decode(q.to(dtype), cache_k, cache_v, tables, lens, fmt, use_kernel=True).float()
    # A context of one token is its value, whatever the arithmetic.
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-2, atol=1e-2)
    assert row_error(ours, reference) <= row_error_bound(name, dtype, head_dim)


@pytest.mark.parametrize(("heads_", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_an_8_bit_cache_gives_a_sequence_the_same_output_alone_or_in_a_crowd(
    name, dtype, heads_, kv_heads, head_dim, two_threads
):
    """In a crowd the operator may attend a whole sequence a unit (an int8 cache's blocks read with every KV head at
    once) where a sequence alone is attended KV head by KV head; each head's arithmetic is the same either way, so
    every output bit is. 1,100 keys are split in two on 2 threads, alone and in the crowd alike."""
    needs_operator()
    lens = [1, 17, 64, 65, 300, 700, 1100]
    fmt, q, cache_k, cache_v, tables = quantized_case(name, heads_, kv_heads, head_dim, lens)
    q, context_lens, scale = q.to(dtype), torch.tensor(lens), head_dim**-0.5
    crowd = cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, context_lens, BLOCK, scale, kv_kind=fmt.kind)
    for i in range(len(lens)):
        alone = cpu_kernel.paged_decode_attention(
            q[i : i + 1], cache_k, cache_v, tables[i : i + 1], context_lens[i : i + 1], BLOCK, scale, kv_kind=fmt.kind
        )  # fmt: skip
        assert torch.equal(alone, crowd[i : i + 1]), f"sequence {i} differs alone and in the crowd"
    reference = decode(q.float(), cache_k, cache_v, tables, lens, fmt, use_kernel=False)
    assert row_error(crowd.float(), reference) <= row_error_bound(name, dtype, head_dim)


def row_error_bound(name: str, dtype: torch.dtype, head_dim: int) -> float:
    exact = dtype == torch.float32 and (name != "int8" or head_dim == 48)  # the float32 kernels: no rounding
    avx2_int8 = dtype == torch.float32 and name == "int8" and int8_kernel_isa() == "avx2"  # not VNNI's bytes
    return 1e-4 if exact else AVX2_INT8_ROW_ERROR if avx2_int8 else ROW_ERROR[name]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_the_decode_operator_widens_every_finite_code_exactly(name, dtype, head_dim):
    """Every code of the format (but fp8's NaN and infinities) as a V value: a context of one token attends to its
    V row alone, so the operator's output is the code's value times the scale, which float32 and bf16 hold exactly."""
    needs_operator()
    fmt = kv_quant.kv_format(name)
    assert fmt is not None
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(fmt.code_dtype).float())
    codes = codes[finite]
    rows = -(-len(codes) // head_dim)
    row_codes = torch.cat([codes, codes[: rows * head_dim - len(codes)]]).view(rows, 1, head_dim)
    scale = torch.full((rows, 1, 1), 0.5).view(torch.uint8)  # 4 bytes of float32 per (token, head)
    entries = torch.cat([row_codes, scale.view(rows, 1, 4)], -1)
    cache_v = torch.zeros(rows * BLOCK, head_dim + 4, dtype=torch.uint8)
    cache_v[::BLOCK] = entries[:, 0]  # row i in slot 0 of block i
    tables = torch.arange(rows).view(rows, 1)
    q = torch.randn(rows, 2, head_dim).to(dtype)  # two query heads on the one KV head
    out = cpu_kernel.paged_decode_attention(
        q, torch.zeros_like(cache_v), cache_v, tables, torch.ones(rows, dtype=torch.long), BLOCK, head_dim**-0.5,
        kv_kind=fmt.kind,
    )  # fmt: skip
    expected = kv_quant.decode(entries, fmt, torch.float32).view(rows, 1, head_dim).expand(rows, 2, head_dim)
    if name == "int8" and dtype == torch.float32:  # the integer kernels round the probability 1 to 8 or 16 bits
        assert row_error(out, expected) <= row_error_bound(name, dtype, head_dim)
    else:
        assert torch.equal(out.float(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_split_contexts_of_an_8_bit_cache_merge_to_the_whole(name, dtype):
    """Split-K over an 8-bit cache: each split reads its codes and scales from its first block on, and the merged
    result stays within the format's error of attention over the dequantized cache."""
    needs_operator()
    lens = [1, 16, 17, 64, 65, 300]
    heads_, kv_heads, head_dim = 9, 3, 64
    fmt, q, cache_k, cache_v, tables = quantized_case(name, heads_, kv_heads, head_dim, lens)
    reference = decode(q, cache_k, cache_v, tables, lens, fmt, use_kernel=False)

    def attend(split_keys: int) -> torch.Tensor:
        return cpu_kernel.paged_decode_attention(
            q.to(dtype), cache_k, cache_v, tables, torch.tensor(lens), BLOCK, head_dim**-0.5, kv_kind=fmt.kind,
            split_keys=split_keys,
        ).float()  # fmt: skip

    split, whole = attend(2 * BLOCK), attend(1 << 30)
    assert row_error(split, reference) <= row_error_bound(name, dtype, head_dim)
    if dtype == torch.float32:
        # The same codes and scales, merged: float rounding differs, and on AVX2 each split's probabilities are
        # rounded to 16 bits against its own largest (~1e-5 of a row); a split reading another slot's codes or scale
        # is off by tens of percent.
        assert row_error(split, whole) <= 1e-3


def row_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest error of an output row, as a share of the reference row's norm."""
    return float(((ours - reference).norm(dim=-1) / reference.norm(dim=-1)).max())


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_over_an_8_bit_past_matches_dense_attention_over_dequantized_values(name):
    fmt, _, cache_k, cache_v, tables = quantized_case(name, 4, 2, 64, [40])
    q = torch.randn(8, 4, 64)
    visible = torch.arange(40)[None, :] <= torch.arange(32, 40)[:, None]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), block_size=BLOCK, kv_format=fmt,
        prefills=[PrefillSegment(0, 8, 40, tables[0, :3], visible)],
    )  # fmt: skip
    out = paged_attention(q, None, None, cache_k, cache_v, meta, 0.125)
    slots = tables[0, torch.arange(40) // BLOCK] * BLOCK + torch.arange(40) % BLOCK
    k = kv_quant.read(cache_k, slots, fmt, 64, BLOCK, torch.float32).view(40, 2, 64).repeat_interleave(2, 1)
    v = kv_quant.read(cache_v, slots, fmt, 64, BLOCK, torch.float32).view(40, 2, 64).repeat_interleave(2, 1)
    scores = torch.einsum("qhd,chd->hqc", q, k) * 0.125
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    torch.testing.assert_close(out, torch.einsum("hqc,chd->qhd", weights, v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FORMATS)
def test_the_past_decoded_by_the_operator_is_the_plain_paths_bit_for_bit(name, dtype):
    needs_operator()
    fmt, _, cache_k, _, tables = quantized_case(name, 6, 3, 64, [70])
    gathered = cache_k.view(-1, BLOCK * cache_k.shape[1])[tables[0]].view(-1, cache_k.shape[1])
    plain = kv_quant.dequantize_blocks(gathered, fmt, 64, BLOCK, dtype)
    for length in (70, 64, 1):  # a block cut short, whole blocks, one slot
        out = torch.full((length, 3 * 64), float("nan"), dtype=dtype)
        cpu_kernel.dequantize_past(cache_k, tables[0], length, 64, fmt.kind, BLOCK, out)
        assert torch.equal(out, plain[:length])
    with pytest.raises(RuntimeError, match="length exceeds"):
        cpu_kernel.dequantize_past(cache_k, tables[0, :2], 70, 64, fmt.kind, BLOCK, torch.empty(70, 192, dtype=dtype))
    with pytest.raises(RuntimeError, match="out of range"):
        bad = tables[0].clone()
        bad[1] = cache_k.shape[0] // BLOCK
        cpu_kernel.dequantize_past(cache_k, bad, 70, 64, fmt.kind, BLOCK, torch.empty(70, 192, dtype=dtype))


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_over_an_8_bit_past_is_the_same_on_the_operators(name):
    needs_operator()
    fmt, _, cache_k, cache_v, tables = quantized_case(name, 4, 2, 64, [40])
    q = torch.randn(8, 4, 64)
    visible = torch.arange(40)[None, :] <= torch.arange(32, 40)[:, None]
    outs = []
    for on_operators in (False, True):
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(0, dtype=torch.long), block_size=BLOCK, kv_format=fmt,
            prefills=[PrefillSegment(0, 8, 40, tables[0, :3], visible)], use_cpu_kernel=on_operators,
        )  # fmt: skip
        outs.append(paged_attention(q, torch.zeros(8, 128), torch.zeros(8, 128), cache_k, cache_v, meta, 0.125))
    assert torch.equal(outs[0], outs[1])


# ---- the engine ---------------------------------------------------------------------------------------------

SHARED = list(range(20, 52))  # four blocks of 8, which the second prompt finds cached
PROMPTS = [[*SHARED, 5, 6], [*SHARED, 9], list(range(60, 130)), [3] * 17, [7, 8]]
PRESSURE = dict(max_num_batched_tokens=24, block_size=8, num_kv_blocks=14, max_num_seqs=4)  # chunks and preempts


def greedy(llm: LLM, n: int = 1) -> list[list[int]]:
    """Each prompt's tokens; n > 1: the prompt n times in one batch, as the server forks a request's n choices."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS for _ in range(n)], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def alone(request, tiny_llama):
    """Each prompt served alone, unchunked, with the module's cache dtype."""
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=request.param, max_num_seqs=1)
    return request.param, [greedy_one(llm, p) for p in PROMPTS]


def greedy_one(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "config",
    [
        dict(PRESSURE),  # recompute
        dict(PRESSURE, preemption_mode="swap", num_swap_blocks=32),
        dict(PRESSURE, enable_prefix_caching=False),
    ],
)
def test_chunks_preemption_and_prefix_hits_keep_each_requests_tokens(tiny_llama, alone, config):
    name, expected = alone
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=name, **config)
    assert llm.engine.core.runner.kv_caches[0][0].dtype == torch.uint8
    assert greedy(llm) == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_in_use == 0
    if config.get("enable_prefix_caching", True):
        assert stats.prefix_cache_hits > 0


def test_forks_of_one_prompt_read_its_shared_8_bit_blocks(tiny_llama, alone):
    name, expected = alone
    # A 40-token budget admits one copy of a prompt a step: the later copies find its full blocks cached.
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=name, block_size=8, max_num_batched_tokens=40)
    assert greedy(llm, n=3) == [tokens for tokens in expected for _ in range(3)]
    stats = llm.stats()
    assert stats.prefix_cache_hits > 0 and stats.kv_blocks_in_use == 0


def test_the_same_memory_holds_about_twice_the_tokens_of_bf16(tiny_llama):
    memory = 4 * 2**20
    bf16 = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory=memory)
    int8 = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory=memory, kv_cache_dtype="int8")
    cfg = bf16.engine.model_config  # head_dim 16: a scale per 16 codes
    ratio = int8.engine.core.num_kv_blocks / bf16.engine.core.num_kv_blocks
    assert ratio == pytest.approx(2 * cfg.head_dim / (cfg.head_dim + 4), rel=0.01)
    layer_bytes = sum(t.numel() * t.element_size() for t in int8.engine.core.runner.kv_caches[0])
    assert layer_bytes * cfg.num_layers <= memory


def test_an_unknown_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig.from_kwargs(kv_cache_dtype="int4")


def test_the_triton_backend_serves_an_8_bit_cache_with_chunks_preemption_and_prefix_hits(tiny_llama, alone):
    """The Triton kernels write and read the same entries (under the interpreter here): each prompt's tokens are
    those it gets alone on the default path. int8 only: the interpreter's float32-to-fp8 conversion is wrong where
    rounding carries into the exponent (test_triton_attention.py), which the GPU's is not."""
    name, expected = alone
    if name != "int8":
        pytest.skip("the interpreter's fp8 conversion is not the GPU's")
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=name, attention_backend="triton", **PRESSURE)
    assert greedy(llm) == expected
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and stats.kv_blocks_in_use == 0


def test_two_tensor_parallel_ranks_give_the_tokens_of_one(tiny_llama, alone):
    name, expected = alone
    if name != "int8":
        pytest.skip("one format is enough to show each rank quantizes its own heads")
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_dtype=name, tensor_parallel_size=2, **PRESSURE)
    try:
        assert greedy(llm) == expected
    finally:
        llm.shutdown()


def test_the_core_process_serves_an_8_bit_cache(tiny_llama, alone):
    name, expected = alone
    config = EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32", kv_cache_dtype=name)
    front = AsyncEngine(CoreProcessEngine(config))
    front.start()

    async def all_at_once() -> list[list[int]]:
        return await asyncio.gather(*(collect(front, p, f"r{i}", max_tokens=10) for i, p in enumerate(PROMPTS)))

    try:
        assert asyncio.run(all_at_once()) == expected
    finally:
        front.shutdown()


def test_cpu_kernel_module_reads_every_format():
    needs_operator()
    assert cpu_kernel.has_operator("paged_decode_attention")
    _, q, cache_k, cache_v, tables = quantized_case("int8", 4, 2, 64, [5])
    with pytest.raises(RuntimeError, match="kv_kind"):
        cpu_kernel.paged_decode_attention(q, cache_k, cache_v, tables, torch.tensor([5]), BLOCK, 0.1, kv_kind=7)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_kernel.paged_decode_attention(
            q, cache_k.float(), cache_v.float(), tables, torch.tensor([5]), BLOCK, 0.1, kv_kind=1
        )


def test_a_server_says_its_8_bit_cache_and_forks_n_choices_over_it(tiny_chat_model):
    proc = ServerProcess("--model", str(tiny_chat_model), "--kv-cache-dtype", "int8", "--num-kv-blocks", "64")
    try:
        version = httpx.get(f"{proc.url}/version", timeout=10).json()
        assert version["engine_config"]["kv_cache_dtype"] == "int8"
        assert version["kv_cache"]["dtype"] == "int8" and version["kv_cache"]["num_tokens"] == 64 * 16
        assert proc.metric('tokenloom:cache_config_info{cache_dtype="int8",num_gpu_blocks="64"}') == 1
        assert proc.metric("tokenloom:kv_cache_capacity_tokens") == 64 * 16
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0, timeout=60)
        result = client.completions.create(model=client.models.list().data[0].id, prompt="Once upon a time",
                                           max_tokens=8, temperature=0, n=3)  # fmt: skip
        texts = [c.text for c in result.choices]
        assert len(texts) == 3 and texts[0] and texts.count(texts[0]) == 3, texts
        assert proc.metric("tokenloom:kv_cache_usage_perc") == 0
    finally:
        proc.stop()
