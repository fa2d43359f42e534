"""An 8-bit KV cache (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``): codes and their scales in one row per slot.

Each (token, KV head) gets one float32 scale, its largest |value| over the largest code (127, 448 or 57344), and
the codes are value / scale rounded to nearest even; both are written once, when the token's K or V enters the
cache. A slot's row holds every KV head's codes, then their scales:

    [ head 0 codes (d bytes) | ... | head H-1 codes | scale 0 (4 bytes) | ... | scale H-1 ]

so a layer's cache stays two uint8 tensors, K and V, and whatever moves rows (swap out and in, block copies) moves
the scales with them. The C++ operators (csrc/kv_codes.h) write and read the same layout; this module is the plain
PyTorch path, the reference they are tested against. Per-(token, head) scales need no calibration and bound each
code's error by its own head's range: one outlier token cannot coarsen the rest of the cache.
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


def kv_bytes_per_element(name: str, model_element_bytes: int, head_dim: int) -> float:
    """Bytes one K or V element takes in the cache, its share of the head's scale included."""
    fmt = kv_format(name)
    if fmt is None:
        return float(model_element_bytes)
    return fmt.row_bytes(1, head_dim) / head_dim


def quantize(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """x: [T, H, d] -> [T, H * (d + 4)] uint8 rows: codes, then scales."""
    num_tokens, heads, head_dim = x.shape
    values = x.float()
    amax = values.abs().amax(dim=-1, keepdim=True)
    # Products of float32 reciprocals, not divisions: what the C++ writer (csrc/kv_codes.h) computes, bit for bit.
    inv_max = torch.tensor(1.0 / fmt.max_code, dtype=torch.float32)
    scale = torch.where(amax > 0, amax * inv_max, torch.ones_like(amax))
    scaled = (values * torch.reciprocal(scale)).clamp(-fmt.max_code, fmt.max_code)
    codes = scaled.round().to(torch.int8) if fmt.code_dtype == torch.int8 else scaled.to(fmt.code_dtype)
    rows = torch.empty(num_tokens, fmt.row_bytes(heads, head_dim), dtype=torch.uint8, device=x.device)
    rows[:, : heads * head_dim] = codes.reshape(num_tokens, -1).view(torch.uint8)
    rows[:, heads * head_dim :] = scale.reshape(num_tokens, heads).view(torch.uint8)
    return rows


def dequantize(rows: torch.Tensor, fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., H * (d + 4)] uint8 rows -> [..., H * d] values in dtype."""
    heads = rows.shape[-1] // (head_dim + SCALE_BYTES)
    assert rows.shape[-1] == fmt.row_bytes(heads, head_dim), "a row holds whole heads and their scales"
    codes = rows[..., : heads * head_dim].view(fmt.code_dtype).float()
    scales = rows[..., heads * head_dim :].contiguous().view(torch.float32)
    values = codes.unflatten(-1, (heads, head_dim)) * scales.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def write(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, fmt: KVFormat, head_dim: int) -> None:
    """This step's K or V ([T, H * d] or [T, H, d]) into its slots, quantized."""
    cache.index_copy_(0, slots, quantize(x.reshape(x.shape[0], -1, head_dim), fmt))
