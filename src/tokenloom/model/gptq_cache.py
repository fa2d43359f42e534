"""GPTQ's int8 codes kept on disk, so a second start with the same weights skips the calibration and the rounding.

GPTQ runs at load (gptq.py): calibration prefills through the unquantized model, then one solve per linear; for
SmolLM2-135M on two AVX2 cores 26 s of a 42 s start, and it grows with the model. Its result depends only on the
weights, the calibration sequences, GPTQ's constants and how the CPU's kernels lay the codes out (the fused gate/up
projection is interleaved where the VNNI kernel's epilogue takes it): all of that is in the key, a hash of the
bytes themselves, so changed weights or a changed calibration can never reuse old codes. Each tensor-parallel rank
hashes its own shards and keeps its own file. The codes live under $TOKENLOOM_CACHE/gptq (the compiled operators'
cache); TOKENLOOM_GPTQ_CACHE=0 turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from tokenloom.model import gptq, quantization
from tokenloom.model.gguf_convert import cache_root
from tokenloom.model.quantization import Int8Linear

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when what the codes mean changes (rounding, rotation, layout)


def cache_enabled() -> bool:
    return os.environ.get("TOKENLOOM_GPTQ_CACHE", "1") != "0"


def codes_key(layers: nn.Module, calibration: list[list[int]], layout: str) -> str:
    """A hash of everything GPTQ's codes depend on: each decoder linear's name and weight bytes, the calibration ids,
    GPTQ's constants, the rotation and the kernels' layout (quantization.int8_kernel_isa)."""
    digest = hashlib.blake2b(digest_size=20)
    rotation = (quantization.ROTATION_BLOCK, quantization.ROTATION_SEED)
    constants = (FORMAT, gptq.BLOCK, gptq.ACT_ORDER, gptq.DAMPING, rotation)
    digest.update(repr((constants, layout, calibration)).encode())
    for name, module in layers.named_modules():
        if isinstance(module, nn.Linear):
            weight = module.weight.detach().contiguous().cpu()
            digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype}".encode())
            digest.update(weight.view(torch.uint8).numpy().data)  # the tensor's own buffer, not a copy
    return digest.hexdigest()


def cache_dir() -> Path:
    return cache_root() / "gptq"


def _path(key: str) -> Path:
    return cache_dir() / f"{key}.pt"


def load_codes(key: str) -> dict[str, torch.Tensor] | None:
    """The codes stored under key, by linear name, or None (none stored, or a file that does not load)."""
    path = _path(key)
    if not path.exists():
        return None
    try:
        codes = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: recompute, never fail the start
        logger.warning("ignoring the GPTQ codes in %s (%s)", path, error)
        return None
    logger.info("GPTQ codes from %s", path)
    return codes


def save_gptq_codes(key: str, layers: nn.Module) -> None:
    """Stores the codes of every Int8Linear under `layers`, by name, where our kernels' packing holds them all."""
    codes: dict[str, torch.Tensor] = {}
    for name, module in layers.named_modules():
        if isinstance(module, Int8Linear):
            rounded = module.rounded_codes()
            if rounded is None:  # only oneDNN's opaque packing holds them: nothing to keep
                return
            codes[name] = rounded
    if codes:
        save_codes(key, codes)


def save_codes(key: str, codes: dict[str, torch.Tensor]) -> None:
    """Writes atomically (a rename), so a rank or a process reading at the same time sees all of it or nothing."""
    path = _path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as handle:
        torch.save(codes, handle)
    os.replace(handle.name, path)
