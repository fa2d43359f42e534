"""Which LoRA adapter a request runs under: vLLM's ``LoRARequest``, with its field names, so code written for
``vllm.lora.request.LoRARequest`` passes ours unchanged. Plain data: it crosses threads and processes with the
request, and the scheduler reads it without knowing any tensor."""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.speculative_config import require


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive id and where its PEFT files are (``adapter_config.json`` and
    ``adapter_model.safetensors`` or ``.bin``). The name is the adapter's identity in the engine: its KV blocks are
    shared only with requests of the same name, and one name stands for one path."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None  # what /v1/models gives as the adapter's parent

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, not {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"the LoRA adapter {self.lora_name!r} needs a path")


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT's files) over the base model, requests of different adapters and of none in one
    batch; each adapter's delta is added to its own rows, never merged into the weights. The step then runs eagerly
    (no compiled step, no CUDA graphs), on one rank."""
    max_loras: int = 1
    """The most distinct adapters in one step (vLLM's flag): a waiting request of another adapter waits until one
    leaves the running batch. Each adapter in a step costs two small matmuls per linear over its rows."""
    max_lora_rank: int = 16
    """The largest rank an adapter may have; a larger one is refused when it is loaded."""
    max_cpu_loras: int | None = None
    """The most adapters kept loaded (in the model's dtype on its device), least recently used dropped first; an
    adapter of a live request stays loaded even beyond it. None: max_loras."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"{name} must be a positive integer")
        cpu = self.max_cpu_loras
        require(cpu is None or (isinstance(cpu, int) and cpu >= self.max_loras), "max_cpu_loras must be >= max_loras")

    @property
    def kept_adapters(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
