"""tokenloom: an LLM inference engine built around continuous batching over a paged KV cache."""

import os

# OpenMP's default busy-wait made decode 5x slower whenever another process shared the cores; it must be set
# before torch starts its thread pool, so before the first torch import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom.beam_search import BeamSearchOutput, BeamSearchParams
from tokenloom.config import EngineConfig
from tokenloom.engine.llm import LLM
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.lora import LoRARequest
from tokenloom.outputs import (
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineConfig",
    "LLMEngine",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringRequestOutput",
]
