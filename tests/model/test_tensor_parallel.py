"""Tensor parallelism on the CPU: two (or three) gloo processes give the same greedy tokens as one, shard the weights
as Megatron does, refuse a model that does not split, and fail requests cleanly when a rank dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import TINY_ARCHS
from server_process import ServerProcess

from tokenloom import LLM, SamplingParams
from tokenloom.model.loader import load_model
from tokenloom.model.parallel import TensorParallelGroup
from tokenloom.server.launch import ENGINE_DIED_EXIT_CODE

SHARED = list(range(20, 52))  # two full blocks of 16: later prompts take them from the prefix cache
PROMPTS = [[*SHARED, 5, 6, 7], [*SHARED, 9], list(range(60, 130)), [3] * 17, [7, 8]]
# A 24-token budget chunks every long prompt; 14 blocks of 8 cannot hold all five requests, so some are preempted.
PRESSURE = dict(dtype="float32", max_num_batched_tokens=24, block_size=8, num_kv_blocks=14, max_num_seqs=4)


def greedy_tokens(llm: LLM, max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_two_ranks_give_the_same_greedy_tokens_as_one(tiny_checkpoints, arch):
    path = str(tiny_checkpoints[arch])
    expected = greedy_tokens(LLM(path, **PRESSURE))
    llm = LLM(path, **PRESSURE, tensor_parallel_size=2, enable_prefix_caching=True)
    try:
        assert greedy_tokens(llm) == expected
        stats = llm.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0  # the pressure and the sharing happened
        assert stats.kv_blocks_in_use == 0
    finally:
        llm.shutdown()


def test_swap_preemption_copies_every_ranks_share_of_a_block(tiny_llama):
    expected = greedy_tokens(LLM(str(tiny_llama), **PRESSURE))
    llm = LLM(str(tiny_llama), **PRESSURE, tensor_parallel_size=2, preemption_mode="swap", num_swap_blocks=32)
    try:
        assert greedy_tokens(llm) == expected
        assert llm.stats().num_preemptions_swap > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_rank_loads_its_slice_of_every_sharded_weight(tiny_checkpoints, arch):
    full = load_model(str(tiny_checkpoints[arch]), None, torch.float32, torch.device("cpu")).model
    shards = [
        load_model(str(tiny_checkpoints[arch]), None, torch.float32, torch.device("cpu"), TensorParallelGroup(r, 2))
        for r in range(2)
    ]
    cfg = full.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for layer_index, layer in enumerate(full.layers):
        parts = [s.model.layers[layer_index] for s in shards]
        q_full, k_full, v_full = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
        for rank, part in enumerate(parts):
            q_part, k_part, v_part = part.self_attn.qkv_proj.weight.split([q // 2, kv // 2, kv // 2])
            assert torch.equal(q_part, q_full.chunk(2)[rank]) and torch.equal(k_part, k_full.chunk(2)[rank])
            assert torch.equal(v_part, v_full.chunk(2)[rank])
            gate_full, up_full = layer.mlp.gate_up_proj.weight.chunk(2)
            gate_part, up_part = part.mlp.gate_up_proj.weight.chunk(2)
            assert torch.equal(gate_part, gate_full.chunk(2)[rank]) and torch.equal(up_part, up_full.chunk(2)[rank])
        # Row-parallel: the input columns are split; put back together they are the whole weight.
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            whole = layer.get_submodule(name).weight
            assert torch.equal(torch.cat([p.get_submodule(name).weight for p in parts], dim=1), whole)
        if layer.self_attn.qkv_proj.bias is not None:  # Qwen2: the bias is split with its rows
            assert parts[0].self_attn.qkv_proj.bias.shape[0] == layer.self_attn.qkv_proj.bias.shape[0] // 2
    assert torch.equal(shards[1].model.embed_tokens.weight, full.embed_tokens.weight)  # replicated
    assert shards[0].config == full.config and shards[0].model.config.num_kv_heads == cfg.num_kv_heads // 2


@pytest.mark.parametrize(("size", "what"), [(3, "attention heads"), (4, "KV heads")])
def test_a_model_that_does_not_split_is_refused_before_any_process_starts(tiny_llama, size, what):
    # The tiny Llama has 4 attention heads and 2 KV heads.
    with pytest.raises(ValueError, match=f"{what} .* not divisible by tensor_parallel_size={size}"):
        LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=size)


def test_tensor_parallel_with_the_core_process_is_refused_at_the_cli(tiny_llama, capsys):
    from tokenloom.cli import main

    assert main(["serve", str(tiny_llama), "--core-process", "--tensor-parallel-size", "2"]) == 2
    assert "--core-process does not run with --tensor-parallel-size" in capsys.readouterr().err


def test_ranks_take_a_device_each_where_there_are_enough_else_share_it(monkeypatch):
    from tokenloom.model import parallel_runner

    counts = {"cuda": 4, "xpu": 1}
    monkeypatch.setattr(parallel_runner, "accelerator_count", lambda device_type: counts.get(device_type, 0))
    assert parallel_runner.rank_device("cuda", 2) == torch.device("cuda", 2)
    assert parallel_runner.backend_for("cuda", 4) == "nccl" and parallel_runner.backend_for("cuda", 8) == "gloo"
    assert parallel_runner.rank_device("xpu", 1) == torch.device("xpu")  # one device: the ranks share it, over gloo
    assert parallel_runner.backend_for("xpu", 2) == "gloo"
    assert parallel_runner.rank_device("cpu", 1) == torch.device("cpu")
    assert parallel_runner.backend_for("cpu", 2) == "gloo"


def worker_pids(parent: int) -> list[int]:
    pids = []
    for pid in Path(f"/proc/{parent}/task/{parent}/children").read_text().split():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(int(pid))
    return pids


def test_a_served_engine_fails_cleanly_when_a_rank_dies(tiny_chat_model):
    args = ("--model", str(tiny_chat_model), "--served-model-name", "tiny", "--tensor-parallel-size", "2")
    with ServerProcess(*args) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="Hello there", max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens == 5
        assert httpx.get(f"{server.url}/ready", timeout=10).status_code == 200
        (worker,) = worker_pids(server.process.pid)
        stream = client.completions.create(
            model="tiny", prompt="Hello there", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(stream))
        assert first.choices[0].text is not None
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(openai.APIError):  # the stream in flight ends with an error event, never a hang
            for _ in stream:
                pass
        assert server.process.wait(timeout=20) == ENGINE_DIED_EXIT_CODE  # so that its supervisor restarts it


@pytest.mark.real_model
def test_the_real_model_over_three_ranks_matches_one(real_model_dir):
    """SmolLM2-135M has 9 heads and 3 KV heads: 3 ranks is the split it allows (2 is refused)."""
    kwargs = dict(dtype="float32", max_num_batched_tokens=32, block_size=16)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(real_model_dir), **kwargs).generate(prompts, params)]
    llm = LLM(str(real_model_dir), **kwargs, tensor_parallel_size=3)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        llm.shutdown()


def test_an_llm_frees_its_ranks_when_closed_or_dropped_so_another_can_start(tiny_llama):
    """`with LLM(...)`, shutdown() and dropping the last reference each stop the workers and leave the process
    group; a second engine while one still runs is refused with what to do."""
    import gc

    import torch.distributed as dist

    path, expected = str(tiny_llama), None
    with LLM(path, **PRESSURE, tensor_parallel_size=2) as llm:
        expected = greedy_tokens(llm)
    assert not dist.is_initialized()
    dropped = LLM(path, **PRESSURE, tensor_parallel_size=2)
    del dropped
    gc.collect()
    assert not dist.is_initialized()
    running = LLM(path, **PRESSURE, tensor_parallel_size=2)
    try:
        with pytest.raises(RuntimeError, match="shutdown"):
            LLM(path, **PRESSURE, tensor_parallel_size=2)
        assert greedy_tokens(running) == expected  # the refused start left the running engine alone
    finally:
        running.shutdown()
        running.shutdown()  # twice is fine
    assert not dist.is_initialized()


def test_two_ranks_calibrate_int8_weights_together_and_serve(tiny_llama):
    """Every rank runs the calibration prefills for GPTQ at start (their all-reduces pair up, or start would hang):
    the engine starts and serves under pressure with int8 weights on both ranks."""
    from tokenloom.model.quantization import int8_available

    if not int8_available():
        pytest.skip("no int8 kernel for this CPU")
    llm = LLM(str(tiny_llama), **PRESSURE, tensor_parallel_size=2, quantization="int8")
    try:
        tokens = greedy_tokens(llm)
        assert [len(t) for t in tokens] == [10] * len(PROMPTS)
        assert tokens == greedy_tokens(llm)  # the same codes on every step, whatever the batch
        assert llm.stats().kv_blocks_in_use == 0
    finally:
        llm.shutdown()
