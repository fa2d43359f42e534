"""Weights prepacked once for oneDNN, for bfloat16 linears on CPU.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout inside every call.
Reordering once at load time (what inductor's freezing does) took 11-20% off the model's matmuls at decode batch
sizes on our AVX-512 BF16 machine (measured per layer shape, 32 and 64 rows). Elsewhere (float32, other devices,
a torch without oneDNN) the model keeps its plain ``nn.Linear`` layers.

The compiled step (compiled.py) cannot take a oneDNN tensor as a graph input, and inductor's own prepacking
(freezing) makes its graphs uncacheable; so in a compiled graph a packed layer is the opaque operator
``tokenloom::packed_linear``, which finds its weight by a number, as vLLM's oneDNN handles do.
"""

from __future__ import annotations

import itertools
import weakref

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


_packed_weights: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("tokenloom::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _packed_weights[handle], bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, handle: int, bias: torch.Tensor | None, out_features: int):
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """A linear layer whose weight lives only in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), DECODE_ROWS_HINT)
        self.handle = next(_handles)  # numbered in build order: the same in every start, so compiled graphs cache
        _packed_weights[self.handle] = self.packed
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle, self.bias, self.out_features)
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
