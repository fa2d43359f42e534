"""The Triton paged-attention kernel against a plain-PyTorch reference, under Triton's interpreter on CPU tensors.

float32 only (the interpreter's bf16 dot is not exact); conftest.py sets TRITON_INTERPRET=1 before any import.
Small shapes: decode rows, prefill chunks with and without a past, a mixed batch, grouped-query heads (a power of
two per KV head and not), split-K, several block sizes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tokenloom
from tokenloom.model import kv_quant, triton_attention

triton = pytest.importorskip("triton")

FlatBatch = triton_attention.FlatBatch


def reference(q, cache_k, cache_v, seqs, block_tables, block_size, scale):
    """Each sequence's queries over its context, gathered slot by slot, causal from the context's end."""
    _, num_heads, head_dim = q.shape
    num_kv = cache_k.shape[1] // head_dim
    group = num_heads // num_kv
    out = torch.zeros_like(q)
    for s, (q_start, q_len, ctx) in enumerate(seqs):
        pos = torch.arange(ctx)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size
        k = cache_k[slots].view(ctx, num_kv, head_dim)
        v = cache_v[slots].view(ctx, num_kv, head_dim)
        for h in range(num_heads):
            scores = q[q_start : q_start + q_len, h] @ k[:, h // group].T * scale
            query_pos = torch.arange(ctx - q_len, ctx)[:, None]
            scores = scores.masked_fill(pos[None, :] > query_pos, float("-inf"))
            out[q_start : q_start + q_len, h] = torch.softmax(scores, -1) @ v[:, h // group]
    return out


def make_batch(shape, block_size, num_heads, num_kv, head_dim, seed=0):
    """shape: [(q_len, ctx_len)] per sequence. Blocks are handed out shuffled, so tables are not in order."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in shape]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g)[: sum(blocks_per_seq)]
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(shape), max_blocks, dtype=torch.int32)
    at = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[at : at + n].to(torch.int32)
        at += n
    cache_k = torch.randn(num_blocks * block_size, num_kv * head_dim, generator=g)
    cache_v = torch.randn(num_blocks * block_size, num_kv * head_dim, generator=g)
    total = sum(q_len for q_len, _ in shape)
    q = torch.randn(total, num_heads, head_dim, generator=g)
    seqs, loc = [], [0]
    for q_len, ctx in shape:
        seqs.append((loc[-1], q_len, ctx))
        loc.append(loc[-1] + q_len)
    batch = FlatBatch(
        query_start_loc=torch.tensor(loc, dtype=torch.int32),
        context_lens=torch.tensor([ctx for _, ctx in shape], dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_len for q_len, _ in shape),
        max_context_len=max(ctx for _, ctx in shape),
    )
    return q, cache_k, cache_v, seqs, batch


CASES = {
    "decode": [(1, 1), (1, 17), (1, 64), (1, 5)],
    "prefill-whole": [(23, 23), (40, 40)],
    "prefill-with-past": [(5, 40), (16, 70)],
    "mixed": [(1, 33), (1, 9), (7, 7), (12, 50), (1, 100)],
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("num_heads", "num_kv", "head_dim"), [(4, 2, 16), (6, 2, 32), (4, 4, 24)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_one_launch_matches_the_reference(case, num_heads, num_kv, head_dim, block_size):
    q, cache_k, cache_v, seqs, batch = make_batch(CASES[case], block_size, num_heads, num_kv, head_dim)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    triton_attention.unified_attention(q, cache_k, cache_v, batch, block_size, scale, out, block_n=16)
    torch.testing.assert_close(out, reference(q, cache_k, cache_v, seqs, batch.block_tables, block_size, scale))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_decode_matches_one_share(num_splits):
    """Shares that see no key at all (8 shares of a 5-token context) must not disturb the combination."""
    q, cache_k, cache_v, seqs, batch = make_batch([(1, 130), (1, 5), (1, 64)], 16, 8, 2, 32, seed=3)
    scale = 32**-0.5
    out = torch.full_like(q, float("nan"))
    triton_attention.unified_attention(q, cache_k, cache_v, batch, 16, scale, out, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, reference(q, cache_k, cache_v, seqs, batch.block_tables, 16, scale))


def test_queries_read_in_place_from_a_strided_qkv_output():
    """q as the fused qkv matmul leaves it: a strided view, never copied."""
    q, cache_k, cache_v, seqs, batch = make_batch(CASES["mixed"], 16, 4, 2, 16, seed=5)
    qkv = torch.randn(q.shape[0], (4 + 2 * 2) * 16)
    qkv[:, : 4 * 16] = q.reshape(q.shape[0], -1)
    strided_q = qkv[:, : 4 * 16].view(q.shape[0], 4, 16)
    assert not strided_q.is_contiguous()
    out = torch.empty_like(q)
    triton_attention.unified_attention(strided_q, cache_k, cache_v, batch, 16, 0.25, out, block_n=16)
    torch.testing.assert_close(out, reference(q, cache_k, cache_v, seqs, batch.block_tables, 16, 0.25))


def test_the_cache_write_puts_each_token_in_its_slot():
    cache_k, cache_v = torch.zeros(64, 32), torch.zeros(64, 32)
    k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, 40, 17, 0, 63])
    triton_attention.write_kv(cache_k, cache_v, k, v, slots)
    torch.testing.assert_close(cache_k[slots], k.reshape(5, 32))
    torch.testing.assert_close(cache_v[slots], v.reshape(5, 32))
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert cache_k[untouched].abs().sum() == 0 and cache_v[untouched].abs().sum() == 0


def test_split_count_fills_the_device_only_for_few_long_decodes():
    def batch(q_lens, ctxs):
        return FlatBatch(torch.zeros(1), torch.tensor(ctxs), torch.zeros(1), max(q_lens), max(ctxs))

    assert triton_attention.split_count(batch([1, 1], [4096, 4096]), 8, 32, target_programs=132) == 8
    assert triton_attention.split_count(batch([1] * 64, [4096] * 64), 8, 32, target_programs=132) == 1
    assert triton_attention.split_count(batch([1], [40]), 8, 32, target_programs=132) == 2  # no more than tiles
    assert triton_attention.split_count(batch([16, 1], [4096, 4096]), 8, 32, target_programs=132) == 1


# ---- the engine with the Triton backend: float32 greedy equals transformers' -------------------------------


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(500) for _ in range(24)]  # a common prefix: later prompts hit the prefix cache
    return [shared + [rng.randrange(500) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def _hf_greedy(path, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    from conftest import hf_oracle

    model = hf_oracle(path)
    outputs = []
    for ids in prompt_ids:
        tokens = torch.tensor([ids])
        generated = model.generate(tokens, max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens)
        outputs.append(generated[0, len(ids) :].tolist())
    return outputs


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_seqs=8, max_num_batched_tokens=24, num_kv_blocks=14, block_size=8),  # chunks and preemption
        dict(max_num_seqs=8, max_num_batched_tokens=24, num_kv_blocks=14, block_size=8, preemption_mode="swap",
             num_swap_blocks=64),
        dict(max_num_seqs=8, max_num_batched_tokens=512, block_size=16),  # whole prompts, prefix-cache hits
    ],
    ids=["recompute", "swap", "prefix"],
)  # fmt: skip
def test_the_engine_on_triton_attention_matches_transformers(tiny_checkpoints, arch, config):
    from tokenloom import LLM, SamplingParams

    path = tiny_checkpoints[arch]
    prompts = _prompts(6, seed=7)
    llm = LLM(str(path), dtype="float32", attention_backend="triton", **config)
    assert llm.engine.core.runner.attention_backend == "triton"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # The first prompt alone, then the rest: they find the shared prefix's blocks in the cache.
    first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == _hf_greedy(path, prompts, 8)
    stats = llm.stats()
    assert stats.kv_blocks_in_use == 0
    if "num_kv_blocks" in config:
        assert stats.num_preemptions > 0  # the pressure was real
    else:
        assert stats.prefix_cache_hits > 0


def test_a_backend_that_cannot_run_here_is_refused_at_start(tiny_llama, monkeypatch):
    from tokenloom import LLM
    from tokenloom.model import triton_attention

    monkeypatch.setattr(triton_attention, "available", lambda device: False)
    with pytest.raises(ValueError, match="attention-backend triton needs Triton"):
        LLM(str(tiny_llama), attention_backend="triton")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(str(tiny_llama), attention_backend="flash")
    llm = LLM(str(tiny_llama), attention_backend="torch")
    assert llm.engine.core.runner.attention_backend == "torch" and not llm.engine.core.runner.inputs.use_cpu_kernel


# ---- decode graphs: padded static buffers (replayed as CUDA graphs on a GPU, run eagerly here) ---------------


def test_capture_sizes_pad_every_batch_up_to_max_num_seqs():
    from tokenloom.model.cuda_graphs import capture_sizes, padded_size

    assert capture_sizes(1) == [1]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(60)[-1] == 64  # the first size that holds max_num_seqs
    sizes = capture_sizes(300)
    assert sizes[sizes.index(248) :] == [248, 256, 272, 288, 304]  # every 8 up to 256, then every 16
    assert [padded_size(n, capture_sizes(64)) for n in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert padded_size(65, capture_sizes(64)) is None


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_steps_through_the_padded_buffers_match_transformers(tiny_checkpoints, arch):
    """Every decode step runs on the static buffers, its batch padded to a captured size (3 rows in 4, 5 in 8):
    the padded rows must neither write the cache nor change a real row."""
    from tokenloom import LLM, SamplingParams

    path = tiny_checkpoints[arch]
    prompts = _prompts(5, seed=7)
    llm = LLM(str(path), dtype="float32", attention_backend="triton", max_num_seqs=8, max_num_batched_tokens=64,
              num_kv_blocks=40, block_size=8)  # fmt: skip
    runner = llm.engine.core.runner
    graphs = runner.enable_decode_graphs(max_num_seqs=8, max_model_len=256)
    replayed = []
    original_run = graphs.run
    graphs.run = lambda step: replayed.append(step.input_ids.shape[0]) or original_run(step)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == _hf_greedy(path, prompts, 8)
    assert replayed and max(replayed) == 5  # decode steps went through the buffers, padded to 8
    assert llm.stats().kv_blocks_in_use == 0


def test_a_padded_row_writes_no_kv():
    from tokenloom.model.triton_attention import write_kv

    cache_k, cache_v = torch.zeros(16, 8), torch.zeros(16, 8)
    write_kv(cache_k, cache_v, torch.ones(3, 8), torch.ones(3, 8), torch.tensor([2, -1, 5]))
    assert cache_k.sum() == 16 and cache_k[2].sum() == 8 and cache_k[5].sum() == 8 and cache_v.sum() == 16


def test_half_precision_inputs_keep_float32_softmax_and_accumulators():
    """float16 K/V/q (the interpreter runs float16 exactly as numpy does; its bfloat16 dot is not exact, so bf16 is
    checked on a GPU by benchmarks/gpu_check.py): within half precision's error of the float32 reference."""
    q, cache_k, cache_v, seqs, batch = make_batch(CASES["mixed"], 16, 4, 2, 16, seed=9)
    q, cache_k, cache_v = q.half(), cache_k.half(), cache_v.half()
    out = torch.empty_like(q)
    triton_attention.unified_attention(q, cache_k, cache_v, batch, 16, 0.25, out, block_n=16)
    expected = reference(q.float(), cache_k.float(), cache_v.float(), seqs, batch.block_tables, 16, 0.25)
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_8_bit_cache_write_leaves_the_bytes_of_the_pytorch_path(name):
    """Scales and codes as kv_quant.write leaves them, bit for bit; a padded row's slot (-1) is skipped; a head of
    zeros gets scale 1. Triton's interpreter converts float32 to fp8 wrongly where rounding carries into the
    exponent (31.96 becomes 16, not 32: a defect of its software conversion, not of the GPU's), so for fp8 codes
    exactly there are let through when they are half the reference's; everything else must be equal."""
    fmt = kv_quant.FORMATS[name]
    kv_heads, head_dim, block_size = 3, 32, 16
    torch.manual_seed(4)
    cache_k = torch.zeros(8 * block_size, kv_heads * (head_dim + 4), dtype=torch.uint8)
    cache_v = torch.zeros_like(cache_k)
    expected_k, expected_v = cache_k.clone(), cache_v.clone()
    qkv = torch.randn(20, (4 + 2 * kv_heads) * head_dim) * 3  # k and v as strided views of a fused projection
    k, v = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim], qkv[:, (4 + kv_heads) * head_dim :]
    k[3, :head_dim] = 0.0
    slots = torch.randperm(cache_k.shape[0])[:20]
    slots[5] = -1
    triton_attention.write_kv_codes(cache_k, cache_v, k, v, slots, fmt.kind, fmt.max_code, head_dim, block_size)
    kept = slots >= 0
    kv_quant.write(expected_k, k[kept], slots[kept], fmt, head_dim, block_size)
    kv_quant.write(expected_v, v[kept], slots[kept], fmt, head_dim, block_size)
    for cache, expected in ((cache_k, expected_k), (cache_v, expected_v)):
        got = kv_quant.blocks_view(cache, head_dim, block_size)
        want = kv_quant.blocks_view(expected, head_dim, block_size)
        assert torch.equal(got[..., head_dim:], want[..., head_dim:])  # the scales
        got_codes = got[..., :head_dim].view(fmt.code_dtype).float()
        want_codes = want[..., :head_dim].view(fmt.code_dtype).float()
        differ = got_codes != want_codes
        if fmt.code_dtype == torch.int8:
            assert not differ.any()
        else:
            carried = torch.frexp(want_codes)[0].abs() == 0.5  # a power of two, reached by rounding up
            assert not (differ & ~(carried & (got_codes * 2 == want_codes))).any()
            assert differ.sum() < 0.05 * differ.numel()
    entries = kv_quant.blocks_view(cache_k, head_dim, block_size)[slots[3] // block_size, 0, slots[3] % block_size]
    assert entries[head_dim:].view(torch.float32).item() == 1.0


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("case", ["decode", "mixed"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_over_an_8_bit_cache_equals_attention_over_its_decoded_values(name, case, num_splits):
    """Codes times scales as each tile is loaded: the plain reference over kv_quant's decoded cache."""
    fmt = kv_quant.FORMATS[name]
    block_size, kv_heads, head_dim = 16, 2, 32
    q, cache_k, cache_v, seqs, batch = make_batch(CASES[case], block_size, 6, kv_heads, head_dim, seed=7)
    all_slots = torch.arange(cache_k.shape[0])
    codes_k = torch.zeros(cache_k.shape[0], kv_heads * (head_dim + 4), dtype=torch.uint8)
    codes_v = torch.zeros_like(codes_k)
    kv_quant.write(codes_k, cache_k * 4, all_slots, fmt, head_dim, block_size)
    kv_quant.write(codes_v, cache_v, all_slots, fmt, head_dim, block_size)
    decoded_k = kv_quant.read(codes_k, all_slots, fmt, head_dim, block_size, torch.float32)
    decoded_v = kv_quant.read(codes_v, all_slots, fmt, head_dim, block_size, torch.float32)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    triton_attention.unified_attention(
        q, codes_k, codes_v, batch, block_size, scale, out, num_splits=num_splits, block_n=16, kv_quant=fmt.kind
    )
    expected = reference(q, decoded_k, decoded_v, seqs, batch.block_tables, block_size, scale)
    torch.testing.assert_close(out, expected)


def test_every_kernel_compiles_for_a_hopper_gpu(tmp_path):
    """The interpreter never compiles a kernel: each specialization the engine launches (SmolLM2's and
    Llama-3.1-8B's head shapes, decode, prefill and mixed steps, split-K, bf16 and float32, each 8-bit cache) is
    compiled here for
    sm_90 by Triton's own compiler and ptxas, in a process without the interpreter (triton_aot_compile.py)."""
    compiler = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not compiler.exists():
        pytest.skip("this Triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tokenloom.__file__).parents[1]), env.get("PYTHONPATH", "")])
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    script = Path(__file__).with_name("triton_aot_compile.py")
    # One process per dtype, both at once: compiling is single-threaded, and CI has two cores.
    runs = [
        subprocess.Popen([sys.executable, str(script), "--dtypes", dtype], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for dtype in ("bfloat16", "float32")
    ]  # fmt: skip
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (_, stderr) in zip(runs, outputs, strict=True):
        assert run.returncode == 0, stderr[-4000:]
    stdout = "".join(out for out, _ in outputs)
    compiled = [line for line in stdout.splitlines() if line.startswith("compiled ")]
    names = {line.split()[1] for line in compiled}
    assert names == {"_attention_kernel", "_combine_kernel", "_write_kv_kernel", "_write_kv_codes_kernel"}, stdout
    assert any("'SPLIT': True" in line and "'HEAD_P': 128" in line for line in compiled), stdout
    for kind in (1, 2, 3):  # an 8-bit cache of each format, read and written
        assert sum(f"'KV_QUANT': {kind}" in line for line in compiled) >= 3, stdout
