"""An LM head held once. On a CPU the engine packs the head's weight for its kernels (prepack.py) or serves it from
a GGUF's blocks (gguf_linear.py); in float32 both forms give the weight's rows back exactly (``weight_rows``), so no
plain copy is kept beside them: a tied embedding looks its tokens up in the head's form, a GGUF's own embedding in
its blocks, and a request's exact logits of a few tokens (prompt_outputs.py) read the head's rows there. A float32
copy of SmolLM2-135M's 49,152 x 576 table is 108 MiB; of Llama-3.2-1B's, 1 GiB."""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn


class WeightRows(Protocol):
    """A form of a weight [N, K] that gives rows of it (token ids, for a vocabulary) exactly, in float32."""

    def weight_rows(self, rows: torch.Tensor) -> torch.Tensor: ...


class RowsEmbedding(nn.Module):
    """nn.Embedding's lookup, from another form of its table (`source`, a module with weight_rows), in `dtype`."""

    def __init__(self, source: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        assert hasattr(source, "weight_rows"), "an embedding looks its rows up in a form that gives them"
        self.source = source
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = cast(WeightRows, self.source).weight_rows(input_ids.reshape(-1))
        return rows.to(self.dtype).view(*input_ids.shape, rows.shape[-1])
