"""How many KV blocks the engine allocates, on the device and in the host swap pool, and the longest request."""

from __future__ import annotations

import torch

from tokenloom.config import EngineConfig
from tokenloom.model.config import ModelConfig
from tokenloom.model.lora import adapter_bytes
from tokenloom.utils import cdiv

DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


def kv_block_bytes(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    per_token = model_config.kv_bytes_per_token(element, config.cache.kv_cache_dtype)
    return config.cache.block_size * per_token


def configured_kv_blocks(config: EngineConfig, per_block: int, max_model_len: int) -> int:
    """The blocks --num-kv-blocks or --kv-cache-memory ask for; by default 2 GiB of them, capped at what
    max_num_seqs full-length requests could ever use."""
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    memory = config.cache.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    blocks_for_memory = memory // per_block
    if blocks_for_memory < 1:
        raise ValueError(f"kv_cache_memory={memory} bytes holds no block of {per_block} bytes")
    if config.cache.kv_cache_memory is not None:
        return blocks_for_memory
    blocks_for_batch = config.scheduler.max_num_seqs * cdiv(max_model_len, config.cache.block_size)
    return min(blocks_for_memory, blocks_for_batch)


def sizes_kv_from_device_memory(config: EngineConfig, device: torch.device) -> bool:
    """On CUDA with no size given, the KV cache takes what --gpu-memory-utilization leaves (single rank; with
    tensor parallelism each rank's share is still sized by bytes)."""
    cache = config.cache
    return (
        device.type == "cuda"
        and cache.num_kv_blocks is None
        and cache.kv_cache_memory is None
        and config.parallel.tensor_parallel_size == 1
    )


def kv_blocks_that_fit(total: int, in_use: int, activation_peak: int, utilization: float, per_block: int) -> int:
    """KV blocks in the share of a device's memory the engine may take, less what is already in use (the weights,
    the allocator's cache, other processes) and the activations of the largest step."""
    return max(0, int(total * utilization) - in_use - activation_peak) // per_block


def lora_reserve_bytes(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """What the LoRA adapters kept loaded may take of the device: max_cpu_loras of them at max_lora_rank."""
    lora = config.lora
    if not lora.enable_lora:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    return lora.kept_adapters * adapter_bytes(model_config, lora.max_lora_rank, element)


def swap_blocks_for(config: EngineConfig, kv_bytes_per_block: int) -> int:
    """The host swap pool's blocks: none under recompute, else --num-swap-blocks or --swap-space GiB of blocks."""
    if config.scheduler.preemption_mode == "recompute":
        return 0
    if config.cache.num_swap_blocks is not None:
        return config.cache.num_swap_blocks
    return int(config.cache.swap_space * 1024**3) // kv_bytes_per_block


def max_model_len_for(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if model_config.sliding_window:
        limit = min(limit, model_config.sliding_window)  # beyond the window we would attend too far
    wanted = config.model.max_model_len or limit
    if wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds the model's context length {limit}")
    return wanted
