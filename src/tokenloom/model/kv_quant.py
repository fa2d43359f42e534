"""An 8-bit KV cache (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``): codes and their scales, head by head.

Each (token, KV head) gets one float32 scale, its largest |value| over the largest code (127, 448 or 57344), and
the codes are value / scale rounded to nearest even; both are written once, when the token's K or V enters the
cache. A layer's K (or V) cache stays one uint8 tensor of [num_slots, kv_heads * (d + 4)] bytes, so whatever moves
whole blocks (swap out and in, block copies) moves the scales with the codes; but inside a block the bytes are laid
out head by head, each head's slots one after the other, an *entry* of d codes and then the scale:

    block b:  [ head 0: slot 0 entry | slot 1 entry | ... | slot B-1 entry ] [ head 1: ... ] ... [ head H-1: ... ]
    entry:    [ d codes | 4-byte float32 scale ]

so the decode operator, which attends one (sequence, KV head) at a time, reads each block's share of a head as
B * (d + 4) contiguous bytes (17 cache lines at d = 64, B = 16) instead of picking 64 codes and a scale out of every
slot's row of all heads (~40 lines). The C++ operators (csrc/kv_codes.h) write and read the same layout; this
module is the plain PyTorch path, the reference they are tested against. Per-(token, head) scales need no
calibration and bound each code's error by its own head's range: one outlier token cannot coarsen the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.model.config import SCALE_BYTES


@dataclass(frozen=True)
class KVFormat:
    name: str
    code_dtype: torch.dtype
    max_code: float
    kind: int  # the C++ operators' number for it (csrc/kv_codes.h)

    def row_bytes(self, num_kv_heads: int, head_dim: int) -> int:
        return num_kv_heads * (head_dim + SCALE_BYTES)


FORMATS = {
    "int8": KVFormat("int8", torch.int8, 127.0, 1),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 2),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 3),
}
ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's --kv-cache-dtype fp8 is e4m3


def kv_format(name: str) -> KVFormat | None:
    """The format --kv-cache-dtype names; None for 'auto' (the model's dtype, unquantized)."""
    if name == "auto":
        return None
    return FORMATS[ALIASES.get(name, name)]


def encode(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x: [T, H, d] -> [T, H, d + 4] uint8 entries: each head's codes, then its scale."""
    num_tokens, heads, head_dim = x.shape
    values = x.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    # Products of float32 reciprocals, not divisions: what the C++ writer (csrc/kv_codes.h) computes, bit for bit.
    inv_max = torch.tensor(1.0 / fmt.max_code, dtype=torch.float32)
    scale = torch.where(amax > 0, amax * inv_max, torch.ones_like(amax))
    scaled = (values * torch.reciprocal(scale)).clamp(-fmt.max_code, fmt.max_code)
    codes = scaled.round().to(torch.int8) if fmt.code_dtype == torch.int8 else scaled.to(fmt.code_dtype)
    entries = torch.empty(num_tokens, heads, head_dim + SCALE_BYTES, dtype=torch.uint8, device=x.device)
    entries[..., :head_dim] = codes.view(torch.uint8)
    entries[..., head_dim:] = scale.view(torch.uint8)
    return entries


def decode(entries: torch.Tensor, fmt: KVFormat, dtype: torch.dtype) -> torch.Tensor:
    """[..., H, d + 4] uint8 entries -> [..., H * d] values in dtype."""
    head_dim = entries.shape[-1] - SCALE_BYTES
    codes = entries[..., :head_dim].view(fmt.code_dtype).float()
    scales = entries[..., head_dim:].contiguous().view(torch.float32)
    return (codes * scales).flatten(-2).to(dtype)


def blocks_view(cache: torch.Tensor, head_dim: int, block_size: int) -> torch.Tensor:
    """A cache's (or a gathered copy's) [..., slots, H * (d + 4)] bytes as [..., blocks, H, B, d + 4]."""
    heads = cache.shape[-1] // (head_dim + SCALE_BYTES)
    return cache.reshape(*cache.shape[:-2], -1, heads, block_size, head_dim + SCALE_BYTES)


def write(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, fmt: KVFormat, head_dim: int, block_size: int):
    """This step's K or V ([T, H * d] or [T, H, d]) into its slots, quantized."""
    entries = encode(x.reshape(x.shape[0], -1, head_dim), fmt)
    blocks_view(cache, head_dim, block_size)[slots // block_size, :, slots % block_size] = entries


def read(cache: torch.Tensor, slots: torch.Tensor, fmt: KVFormat, head_dim: int, block_size: int, dtype: torch.dtype):
    """The values at these slots: [len(slots), H * d]."""
    return decode(blocks_view(cache, head_dim, block_size)[slots // block_size, :, slots % block_size], fmt, dtype)


def dequantize_blocks(
    gathered: torch.Tensor, fmt: KVFormat, head_dim: int, block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Whole blocks copied out of the cache ([..., blocks * B, H * (d + 4)] bytes) -> [..., blocks * B, H * d]."""
    by_slot = blocks_view(gathered, head_dim, block_size).transpose(-3, -2)  # [..., blocks, B, H, d + 4]
    values = decode(by_slot, fmt, dtype)
    return values.reshape(*gathered.shape[:-1], values.shape[-1])


def check_kv_format(fmt: KVFormat | None, backend: str, device: torch.device) -> None:
    """An 8-bit cache on a path that cannot run it is refused at start, never a silent fallback to another path: every
    backend reads every format, but the Triton kernels' fp8 conversions need an Ada or Hopper GPU."""
    if fmt is None or backend != "triton" or fmt.code_dtype == torch.int8 or device.type != "cuda":
        return
    if torch.cuda.get_device_capability(device) < (8, 9):  # fp8 conversions came with Ada and Hopper
        raise ValueError(
            f"--kv-cache-dtype {fmt.name}: the Triton kernels' fp8 codes need a GPU of compute capability 8.9 or "
            f"newer (this one: {torch.cuda.get_device_name(device)}); use --kv-cache-dtype int8"
        )
