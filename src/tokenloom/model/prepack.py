"""Weights prepacked once for oneDNN, for bfloat16 linears on CPU.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout inside every call.
Reordering once at load time (what inductor's freezing does) took 11-20% off the model's matmuls at decode batch
sizes on our AVX-512 BF16 machine (measured per layer shape, 32 and 64 rows). Elsewhere (float32, other devices,
a torch without oneDNN) the model keeps its plain ``nn.Linear`` layers.
"""

from __future__ import annotations

import torch
from torch import nn

DECODE_ROWS_HINT = 64  # the batch size oneDNN picks its blocked layout for: a full decode step


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Module):
    """A linear layer whose weight lives only in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), DECODE_ROWS_HINT)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> int:
    """Replaces every nn.Linear under `model` by a PackedLinear; returns how many were packed."""
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                packed += 1
    return packed
