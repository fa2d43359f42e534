"""What a loaded model's weights hold in memory, as served: every tensor its modules keep (parameters, and the forms
the engine made of them at load time: packed layouts, 8-bit codes, scales and code sums, a GGUF's blocks, an LM
head's own copy), each storage once. A module whose tensors are not weights says so (``holds_weights = False``: the
rotary tables, which the context length sizes). The start-up log says the figure (as vLLM's "Model loading took X
GiB"), and the planner's count (advisor/plan.py) is tested against it."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def held_weight_bytes(model: nn.Module) -> int:
    """The bytes of every distinct storage the model's modules hold (shared ones, as a tied embedding, once)."""
    storages: dict[int, int] = {}
    for module in model.modules():
        if not getattr(module, "holds_weights", True):
            continue
        for tensor in _tensors_of(module):
            key, size = _storage_of(tensor)
            storages[key] = size
    return sum(storages.values())


def _tensors_of(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters(recurse=False)
    yield from module.buffers(recurse=False)
    for value in vars(module).values():  # forms kept as plain attributes: packed weights, codes, scales, blocks
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from (item for item in value if isinstance(item, torch.Tensor))


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(an identity of the tensor's memory, its bytes); oneDNN's packed tensors have no storage to share, so each is
    its own, of its elements' bytes."""
    if tensor.is_mkldnn or tensor.device.type == "meta":
        return id(tensor), tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()
