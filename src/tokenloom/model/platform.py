"""What the hardware can do fast, asked of torch rather than guessed: the dtype "auto" resolves to.

On a CPU, bfloat16 pays only with native bf16 dot products (AVX-512 BF16 or AMX): measured on our machines,
bf16 matmuls ran 2.2x faster than float32 with AVX-512 BF16, and ~100x slower on a CPU with AVX2 only, where
they are emulated. On CUDA, bfloat16 where the device supports it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX-BF16), as torch reports it."""
    capabilities = _cpu_capabilities()
    return bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))


def cpu_can_reorder_bf16() -> bool:
    """True where oneDNN packs a bf16 weight for its matmul: it needs AVX-512 BW, VL and DQ, or AVX-NE-CONVERT (an
    AVX2-only CPU raises "bf16 path needs the cpu support ...")."""
    capabilities = _cpu_capabilities()
    avx512 = all(capabilities.get(name) for name in ("avx512_bw", "avx512_vl", "avx512_dq"))
    return bool(avx512 or capabilities.get("avx_ne_convert"))


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles for bfloat16, where oneDNN's GEMMs outrun our AVX-512 BF16 linear."""
    return bool(_cpu_capabilities().get("amx_bf16"))


def _cpu_capabilities() -> Mapping[str, object]:
    return torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}


def accelerator_count(device_type: str) -> int:
    """How many devices of this type the machine has: 0 for the CPU, or for a type that is not its accelerator."""
    accelerator = torch.accelerator.current_accelerator()
    return torch.accelerator.device_count() if accelerator is not None and accelerator.type == device_type else 0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype for a config's dtype name; "auto" picks the fastest exact-enough one for the device."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (1 where it has none: the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 1
