"""The compiled step: the layer stack through ``torch.compile`` (inductor), one graph for every batch size.

The graph takes token ids and positions; the token dimension is dynamic, so the step compiles once for
single-token batches and once for the rest, not per batch size (inductor's generated code takes the size as an
argument). Attention is an opaque operator that reads the cache and the metadata from the forward context, so
the graph never changes with the batch's make-up. What inductor adds over the eager path: the norms, the rotary
embedding, the SiLU and the residual adds fused into a few C++/Triton loops, and no Python between the ops. The
prepacked CPU linears stay ours (prepack.py): inductor's own prepacking (freezing) makes its graphs uncacheable.
Its artifacts are cached on disk under $TOKENLOOM_CACHE, so a second start reuses them (on our 2-core CPU: 47 s
cold, 9 s warm). ``enforce_eager`` (``--enforce-eager``, vLLM's name) chooses; by default CUDA compiles and the
CPU does not, where the C++ operators already fuse the small ops and the compiled step measured no faster.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tokenloom.model.gguf_convert import cache_root
from tokenloom.model.llama import CausalLM

CompiledForward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compile_model(model: CausalLM, device: torch.device) -> CompiledForward:
    """Returns forward(input_ids, positions) -> the final residual stream, compiled on first call per size class."""
    _point_caches_at_tokenloom_cache()
    compiled = torch.compile(model, fullgraph=True, dynamic=False)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] > 1:  # one graph for every size above one; a single token gets its own
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        return compiled(input_ids, positions)

    return forward


def _point_caches_at_tokenloom_cache() -> None:
    """Inductor's and triton's on-disk caches live beside the converted weights and the built operators."""
    root = cache_root() / "compile"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(root / "triton")
