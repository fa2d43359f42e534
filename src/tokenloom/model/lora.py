"""LoRA adapters over the decoder's linears, many in one batch (multi-LoRA, as vLLM and S-LoRA serve them).

An adapter adds ``scale * B @ A`` to a linear's weight. It is never merged: the base linear (plain, packed or int8)
runs over every row of the step, and each adapter's low-rank delta ``(x[rows] @ A.T) @ B.T`` is added to the rows of
its own requests, so requests of different adapters and of none share one forward. Our linears are fused (q/k/v in
one, gate/up in one), so an adapter's A matrices of a fused linear are stacked and its B matrices placed block-
diagonally, scale folded in, both kept in the model's dtype. On the CPU one operator (csrc/lora.cpp) adds every
row's delta under its own adapter in one call per linear; elsewhere each adapter's rows are two small matmuls.

Adapters are read from PEFT's files (``adapter_config.json``, ``adapter_model.safetensors`` or ``.bin``). What we do
not serve is refused by name when the adapter is loaded, never half-applied: DoRA, adapted embeddings or LM head
(``modules_to_save``, ``lora_embedding_*``), LoRA biases, ``fan_in_fan_out`` layouts, a rank above
``max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenloom.lora import LoRARequest
from tokenloom.model import cpu_kernel
from tokenloom.model.config import ModelConfig

# Each fused linear of a decoder layer and the checkpoint's projections it holds, in output order.
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
PROJECTIONS = frozenset(p for members in FUSED_TARGETS.values() for p in members)
RANK_MULTIPLE = 16  # ranks padded with zeros to this (csrc/lora.cpp)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """What adapter_config.json says that decides how an adapter applies."""

    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    target_modules: tuple[str, ...]

    def scale(self, module: str, rank: int) -> float:
        """PEFT's scaling of one module: its alpha (alpha_pattern first) over its rank, or its square root."""
        alpha = _pattern_value(self.alpha_pattern, module, self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The adapter's config, checked against what we serve; ValueError, saying what is refused, otherwise."""
    file = Path(path) / "adapter_config.json"
    try:
        raw: dict[str, Any] = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the LoRA adapter's config {file}: {error}") from error
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {raw.get('peft_type')!r} is not LoRA")
    refused = {
        "use_dora": "DoRA adapters are not served",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D) layouts are not served",
        "modules_to_save": "adapters that replace whole modules (modules_to_save) are not served",
    }
    for key, why in refused.items():
        if raw.get(key):
            raise ValueError(f"{file}: {why}")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{file}: LoRA biases (bias={raw['bias']!r}) are not served")
    targets = raw.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    config = AdapterConfig(
        rank=int(raw.get("r", 8)),
        alpha=float(raw.get("lora_alpha", 8)),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
        alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
        target_modules=tuple(targets),
    )
    largest = max([config.rank, *config.rank_pattern.values()])
    if largest > max_rank:
        raise ValueError(f"{file}: the adapter's rank {largest} is above max_lora_rank={max_rank}")
    return config


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name it ends, whole dotted parts."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass
class LoRAWeights:
    """One adapter, ready to apply: for each (layer, fused linear) it adapts, A transposed [in, rank] and B
    transposed [rank, out], scale folded into B, the rank padded with zeros to a multiple of 16, in the model's
    dtype, contiguous on its device."""

    name: str
    path: str
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.pairs.values() for t in pair)


def load_adapter(
    request: LoRARequest, model: ModelConfig, max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRAWeights:
    """Reads and checks an adapter against the model's shapes; ValueError saying what does not fit."""
    config = read_adapter_config(request.lora_path, max_rank)
    tensors = _read_tensors(Path(request.lora_path))
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in PROJECTIONS:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: weight {key!r} adapts a module we do not serve")
        layer, projection, side = int(match.group(1)), match.group(2), match.group(3)
        if layer >= model.num_layers:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {key!r} names layer {layer}; the model has "
                             f"{model.num_layers}")  # fmt: skip
        found.setdefault((layer, projection), {})[side] = tensor
    shapes = projection_shapes(model)
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for target, members in FUSED_TARGETS.items():
        for layer in range(model.num_layers):
            parts = [(p, found[(layer, p)]) for p in members if (layer, p) in found]
            if parts:
                pairs[(layer, target)] = _fused_pair(request.lora_name, layer, target, parts, shapes, config)
    if not pairs:
        raise ValueError(f"LoRA adapter {request.lora_name!r} at {request.lora_path} holds no LoRA weights")
    on_device = {key: _transposed_and_padded(a, b, dtype, device) for key, (a, b) in pairs.items()}
    return LoRAWeights(request.lora_name, request.lora_path, on_device)


def adapter_bytes(model: ModelConfig, rank: int, element_size: int) -> int:
    """The most one adapter of this rank can hold loaded: every projection of every layer adapted, each fused
    linear's A [in, members x rank] and block-diagonal B [members x rank, out], ranks padded."""
    shapes = projection_shapes(model)
    per_layer = 0
    for members in FUSED_TARGETS.values():
        fused_rank = -(-len(members) * rank // RANK_MULTIPLE) * RANK_MULTIPLE
        per_layer += (shapes[members[0]][1] + sum(shapes[p][0] for p in members)) * fused_rank
    return model.num_layers * per_layer * element_size


def _transposed_and_padded(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [R, K] and B [N, R] -> A^T [K, R'] and B^T [R', N], R' the rank padded with zeros to a multiple of 16 (the
    CPU operator's registers hold 16 sums)."""
    padded = -(-a.shape[0] // RANK_MULTIPLE) * RANK_MULTIPLE
    a_t = torch.zeros(a.shape[1], padded)
    a_t[:, : a.shape[0]] = a.T
    b_t = torch.zeros(padded, b.shape[0])
    b_t[: a.shape[0]] = b.T
    return a_t.to(device, dtype), b_t.to(device, dtype)


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = path / "adapter_model.safetensors", path / "adapter_model.bin"
    if safetensors.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors))
    if pickled.is_file():
        return dict(torch.load(pickled, map_location="cpu", weights_only=True))
    raise ValueError(f"{path} holds no adapter_model.safetensors or adapter_model.bin")


def projection_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each checkpoint projection a LoRA may adapt (an adapter's B is [out, r], its A [r, in])."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    hidden, inter = model.hidden_size, model.intermediate_size
    return {
        "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
        "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter),
    }  # fmt: skip


def _fused_pair(
    name: str,
    layer: int,
    target: str,
    parts: list[tuple[str, dict[str, torch.Tensor]]],
    shapes: dict[str, tuple[int, int]],
    config: AdapterConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused linear's A (the members' A stacked) and B (their scaled B's block-diagonal, zero rows for members
    the adapter leaves alone)."""
    members, block = FUSED_TARGETS[target], target.split(".")[0]
    offsets = np.cumsum([0] + [shapes[p][0] for p in members]).tolist()
    total_rank = 0
    checked: list[tuple[int, torch.Tensor, torch.Tensor, float]] = []
    for projection, sides in parts:
        if set(sides) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {projection} has lora_A or lora_B alone")
        a, b = sides["A"].float(), sides["B"].float()
        out_features, in_features = shapes[projection]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(
                f"LoRA adapter {name!r}: layer {layer}'s {projection} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"the model needs [r, {in_features}] and [{out_features}, r]: an adapter of another model?"
            )
        module = f"model.layers.{layer}.{block}.{projection}"
        checked.append((members.index(projection), a, b, config.scale(module, rank)))
        total_rank += rank
    a_stack = torch.cat([a for _, a, _, _ in checked])
    b_block = torch.zeros(offsets[-1], total_rank)
    column = 0
    for index, a, b, scale in checked:
        b_block[offsets[index] : offsets[index + 1], column : column + a.shape[0]] = b * scale
        column += a.shape[0]
    return a_stack, b_block


NOT_ADAPTED = (torch.empty(0, 0), torch.empty(0, 0))  # the operator's A and B of an adapter that skips a linear


@dataclass
class LoRAStep:
    """The adapters of the step being run, set by the runner before each forward and read by every LoRALinear in
    it: for the CPU operator each row's adapter (its index in `adapters`, -1: none), elsewhere each adapter's rows
    (None: every row)."""

    adapters: list[LoRAWeights] = field(default_factory=list)
    adapter_of: torch.Tensor | None = None
    rows: list[torch.Tensor | None] = field(default_factory=list)


class LoRALinear(nn.Module):
    """A decoder linear with the step's adapters' deltas added to their rows' outputs."""

    def __init__(self, base: nn.Module, layer: int, target: str, step: LoRAStep) -> None:
        super().__init__()
        assert not getattr(base, "gated", False), "an adapter's delta is added before silu(gate) * up, not after"
        self.base, self.key, self.step = base, (layer, target), step
        # A packed or int8 base's forward for 2-D rows of unit stride, called straight (no module dispatch).
        self._rows_forward = getattr(base, "rows_forward", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows_forward = self._rows_forward
        y = rows_forward(x) if rows_forward is not None and x.dim() == 2 and x.stride(-1) == 1 else self.base(x)
        step = self.step
        if not step.adapters:
            return y
        if step.adapter_of is not None and x.stride(-1) == 1 and y.stride(-1) == 1:
            pairs = [adapter.pairs.get(self.key, NOT_ADAPTED) for adapter in step.adapters]
            torch.ops.tokenloom.lora_add(y, x, [a for a, _ in pairs], [b for _, b in pairs], step.adapter_of)
            return y
        for adapter, rows in zip(step.adapters, step.rows, strict=True):
            pair = adapter.pairs.get(self.key)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y += (x @ a) @ b
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a) @ b)
        return y


def attach(layers: nn.ModuleList, step: LoRAStep) -> None:
    """Wraps every adaptable linear of the decoder layers (whatever form the base took: plain, packed, int8)."""
    for index, layer in enumerate(layers):
        for target in FUSED_TARGETS:
            owner_name, name = target.split(".")
            owner = getattr(layer, owner_name)
            setattr(owner, name, LoRALinear(getattr(owner, name), index, target, step))


def adapter_rows(names: list[str | None], counts: np.ndarray) -> dict[str, np.ndarray]:
    """Each adapter's rows of a step whose requests, in row order, run under `names` with `counts` rows each."""
    if not any(names):
        return {}
    ends = np.cumsum(counts)
    groups: dict[str, list[np.ndarray]] = {}
    for name, end, count in zip(names, ends.tolist(), counts.tolist(), strict=True):
        if name is not None:
            groups.setdefault(name, []).append(np.arange(end - count, end))
    return {name: np.concatenate(parts) for name, parts in groups.items()}


class AdapterSet:
    """The adapters this runner holds: at most `capacity`, least recently used dropped first, for requests to come;
    an adapter stays while a live request uses it, even beyond `capacity`."""

    def __init__(self, model: ModelConfig, max_rank: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.model, self.max_rank, self.capacity, self.dtype, self.device = model, max_rank, capacity, dtype, device
        self.step = LoRAStep()
        self.use_operator = (
            device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_kernel.has_lora_operator()
        )
        self._loaded: OrderedDict[str, LoRAWeights] = OrderedDict()
        self._users: dict[str, int] = {}
        self._adapter_of: dict[str, str] = {}  # live request id -> its adapter's name

    def retain(self, request_id: str, request: LoRARequest) -> None:
        """Loads the adapter if it is not held (ValueError if it cannot be) and counts the live request as its user."""
        held = self._loaded.get(request.lora_name)
        if held is not None and held.path != request.lora_path and request.lora_name not in self._users:
            del self._loaded[request.lora_name]  # unused: the name now stands for the adapter at the new path
            held = None
        if held is not None and held.path != request.lora_path:
            raise ValueError(f"the LoRA adapter {request.lora_name!r} is loaded from {held.path}, not "
                             f"{request.lora_path}; one name stands for one adapter")  # fmt: skip
        if held is None:
            self._loaded[request.lora_name] = load_adapter(request, self.model, self.max_rank, self.dtype, self.device)
        self._loaded.move_to_end(request.lora_name)
        self._users[request.lora_name] = self._users.get(request.lora_name, 0) + 1
        self._adapter_of[request_id] = request.lora_name
        self._evict()

    def release(self, request_id: str) -> None:
        """The request has ended: its adapter may be dropped once no live request uses it."""
        name = self._adapter_of.pop(request_id, None)
        if name is None:
            return
        left = self._users[name] - 1
        if left:
            self._users[name] = left
        else:
            del self._users[name]
        self._evict()

    def _evict(self) -> None:
        idle = [name for name in self._loaded if name not in self._users]  # least recently used first
        for name in idle[: max(0, len(self._loaded) - self.capacity)]:
            del self._loaded[name]

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    def activate(self, rows: dict[str, np.ndarray], num_rows: int) -> None:
        """Sets the step's adapters and their rows before a forward (none: the base model alone)."""
        step = self.step
        step.adapters = [self._loaded[name] for name in rows]
        if not rows:
            step.adapter_of, step.rows = None, []
        elif self.use_operator:
            adapter_of = np.full(num_rows, -1, dtype=np.int32)
            for index, chosen in enumerate(rows.values()):
                adapter_of[chosen] = index
            step.adapter_of = torch.from_numpy(adapter_of)
        else:
            step.rows = [None if len(i) == num_rows else torch.from_numpy(i).to(self.device) for i in rows.values()]
