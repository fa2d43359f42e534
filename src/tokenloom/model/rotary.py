"""Rotary position embeddings, with the rope_scaling variants Llama-family checkpoints use."""

from __future__ import annotations

import math
from typing import Any

import torch

from tokenloom.model.registry import UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default" or scaling is None:
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3 are)")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables for every position, applied in the rotate-half layout of HF checkpoints."""

    cos: torch.Tensor
    sin: torch.Tensor
    holds_weights = False  # tables of positions, sized by the context (model/footprint.py counts weights alone)

    def __init__(self, head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_len, self.theta, self.scaling = head_dim, max_len, theta, scaling
        self.register_buffer("cos", torch.empty(max_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, head_dim), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)computes the tables on the buffers' device; needed after building the model on the meta device."""
        if self.cos.is_meta:
            return
        angles = self._angles()
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def _angles(self) -> torch.Tensor:
        """[max_len, head_dim] float32: each position times each frequency, twice (the rotate-half layout)."""
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling).to(self.cos.device)
        positions = torch.arange(self.max_len, dtype=torch.float32, device=self.cos.device)
        return torch.cat((torch.outer(positions, inv_freq),) * 2, dim=-1)

    def float32_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position in float32 (the buffers take the model's dtype), for the fused CPU op."""
        if self.cos.dtype == torch.float32:
            return self.cos, self.sin
        cached = getattr(self, "_float32_tables", None)
        if cached is None or cached[0].device != self.cos.device:
            angles = self._angles()
            cached = self._float32_tables = (angles.cos(), angles.sin())
        return cached

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped to broadcast over heads; looked up once per step, not per layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; cos, sin: [T, 1, head_dim]."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
