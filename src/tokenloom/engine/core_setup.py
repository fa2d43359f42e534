"""What an engine core is built from: the weights, dtype and device (``load_for_core``), and its runner: the only
one, or rank 0 of a tensor-parallel group whose workers it starts (``make_runner``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenloom.config import EngineConfig
from tokenloom.model.loader import LoadedModel, load_model
from tokenloom.model.parallel import TensorParallelGroup
from tokenloom.model.platform import resolve_dtype
from tokenloom.model.quantization import calibration_for, gguf_linear_available
from tokenloom.model.runner import ModelRunner

if TYPE_CHECKING:
    from tokenloom.model.parallel_runner import WorkerSpec


def load_for_core(
    config: EngineConfig, loaded: LoadedModel | None = None
) -> tuple[LoadedModel, torch.dtype, torch.device]:
    """What an EngineCore is built from: the weights (rank 0's shard under tensor parallelism), the dtype "auto"
    resolves to here, and the device (with torch's thread count set first: the config's, or under tensor
    parallelism the cores shared out between the ranks)."""
    size = config.parallel.tensor_parallel_size
    threads = config.model.num_threads or (max(1, (os.cpu_count() or 1) // size) if size > 1 else None)
    if threads is not None:
        torch.set_num_threads(threads)
    device = torch.device(config.model.device)
    if size > 1:
        from tokenloom.model.parallel_runner import rank_device  # see make_runner

        device = rank_device(config.model.device, 0)
    dtype = resolve_dtype(config.model.dtype, device)
    if loaded is None:
        group = TensorParallelGroup(rank=0, world_size=size)
        loaded = load_model(
            config.model.model, config.model.max_model_len, dtype, device, group, config.model.tokenizer
        )
    return loaded, dtype, device


def served_quantization(
    config: EngineConfig, gguf_file: Path | None, dtype: torch.dtype, device: torch.device
) -> str | None:
    """The form the runner serves the weights in: the quantization asked for, None for the checkpoint's weights in
    the model's dtype ('none'). Where none is asked, a GGUF checkpoint's own blocks (gguf_linear.py) wherever they
    give the dequantized model's outputs bit for bit and nothing needs the dequantized linears: float32 on a CPU
    with the operator, one rank, an eager step, no LoRA adapters. As vLLM serves a GGUF quantized; here the same
    tokens and logprobs from a fifth of the linears' bytes, 1.4-2x faster at batch 1 (benchmarks/RESULTS.md)."""
    asked = config.model.quantization
    if asked is not None:
        return None if asked == "none" else asked
    exact = gguf_file is not None and dtype == torch.float32 and gguf_linear_available(device)
    plain_linears = (config.parallel.tensor_parallel_size > 1 or config.lora.enable_lora
                     or config.compiles_step(device.type))  # fmt: skip
    return "gguf" if exact and not plain_linears else None


def make_runner(
    config: EngineConfig,
    loaded: LoadedModel,
    device: torch.device,
    dtype: torch.dtype,
    num_kv_blocks: int,
    num_swap_blocks: int,
    max_model_len: int,
    quantization: str | None,
) -> ModelRunner:
    """This process's runner: the only one, or rank 0 of a tensor-parallel group whose workers it starts, with the
    weights in the form served_quantization chose. Rank 0 alone samples, so its sampler alone takes the logprobs
    mode."""
    size = config.parallel.tensor_parallel_size
    calibration = calibration_for(quantization, loaded.tokenizer, loaded.config.vocab_size)
    runner: ModelRunner
    if size == 1:
        runner = ModelRunner(
            loaded.model,
            num_kv_blocks,
            config.cache.block_size,
            device,
            dtype,
            config.model.seed,
            num_swap_blocks,
            compile_step=config.compiles_step(device.type),
            attention_backend=config.model.attention_backend,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            quantization=quantization,
            calibration=calibration,
            lora=config.lora,
        )
    else:
        # Imported only when there are ranks to run: the tensor-parallel runner needs the IPC library (pyzmq), which
        # a GPU image serving one rank may lack (tests/engine/test_gpu_image_imports.py).
        from tokenloom.model.parallel_runner import TensorParallelRunner, TensorParallelWorkers

        spec = _worker_spec(config, dtype, num_kv_blocks, num_swap_blocks, max_model_len, quantization)
        runner = TensorParallelRunner(loaded.model, TensorParallelWorkers(spec), device, calibration)
    runner.sampler.logprobs_mode = config.model.logprobs_mode
    return runner


def _worker_spec(
    config: EngineConfig,
    dtype: torch.dtype,
    num_kv_blocks: int,
    num_swap_blocks: int,
    max_model_len: int,
    quantization: str | None,
) -> WorkerSpec:
    """What each tensor-parallel worker builds its rank from."""
    from tokenloom.model.parallel_runner import WorkerSpec, backend_for, free_local_init_method

    size = config.parallel.tensor_parallel_size
    return WorkerSpec(
        model=config.model.model,
        max_model_len=max_model_len,
        dtype=dtype,
        device=config.model.device,
        num_kv_blocks=num_kv_blocks,
        block_size=config.cache.block_size,
        num_swap_blocks=num_swap_blocks,
        seed=config.model.seed,
        world_size=size,
        init_method=config.parallel.distributed_init_method or free_local_init_method(),
        backend=backend_for(config.model.device, size),
        num_threads=torch.get_num_threads(),
        attention_backend=config.model.attention_backend,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        quantization=quantization,
    )
