"""Checkpoints quantized in the compressed-tensors format (llm-compressor's, which vLLM serves: W4A16, W8A16, W8A8,
FP8), read by dequantizing each quantized linear's weight at load time.

A quantized linear ships its codes and their scales instead of ``weight``: ``weight_packed`` (int32 words, each
holding 32 / bits codes, code i of a row at bit i * bits of its words, offset by 2^(bits - 1)) with ``weight_shape``
for the pack-quantized format; ``weight`` as int8 codes (int-quantized, naive-quantized) or float8 e4m3 values
(float-quantized). ``weight_scale`` is per tensor, per output channel or per group of inputs, and an asymmetric
scheme adds ``weight_zero_point`` (packed along the output dimension when the weights are). Each weight becomes
(code - zero point) x scale in float32, as the format's own library decompresses it, and then the model's dtype (or
8-bit again under --quantization int8): the checkpoint loads and serves, without its memory saving. Activation
quantization (W8A8's dynamic per-token int8, a static input scale) is not reproduced, and its scales are dropped:
activations run in the model's dtype unless --quantization int8 is given. The compressed-tensors library itself is
not needed.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

METHOD = "compressed-tensors"
FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight")
# Activation quantization's parameters (static input or output scales, the KV cache's), for what is not reproduced.
ACTIVATION_PARTS = frozenset({"input_scale", "input_zero_point", "input_global_scale", "output_scale",
                              "output_zero_point", "k_scale", "v_scale"})  # fmt: skip


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization: which linears it targets, and how their codes read."""

    targets: tuple[str, ...]
    num_bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    format: str

    def matches(self, module: str) -> bool:
        """vLLM's and the library's reading of targets: a class name (every linear is a Linear), "re:" a pattern on
        the module's name, or its name (only modules shipped quantized are asked)."""
        for target in self.targets:
            if target == "Linear" or target == module:
                return True
            if target.startswith("re:") and re.match(target[3:], module):
                return True
        return False

    def parts(self) -> tuple[str, ...]:
        """The tensors a linear of this scheme ships, besides its bias."""
        codes = ("weight_packed", "weight_shape") if self.format == "pack-quantized" else ("weight",)
        return (*codes, "weight_scale", *(() if self.symmetric else ("weight_zero_point",)))


def weight_schemes(quantization_config: dict[str, Any]) -> list[WeightScheme]:
    """The config groups of a checkpoint's quantization_config, each checked (ValueError naming what is not read)."""
    default_format = quantization_config.get("format")
    schemes = []
    for name, group in (quantization_config.get("config_groups") or {}).items():
        weights = group.get("weights")
        if weights is None:
            continue  # activations only: the weights are plain
        fmt = group.get("format") or default_format
        if fmt not in FORMATS:
            raise ValueError(
                f"compressed-tensors format {fmt!r} (config group {name}) is not read; {', '.join(FORMATS)} are"
            )
        if (weights.get("type"), fmt == "float-quantized") not in (("int", False), ("float", True)):
            raise ValueError(f"compressed-tensors: {weights.get('type')} weights in the {fmt} format are not read")
        bits = int(weights["num_bits"])
        if (fmt == "pack-quantized" and bits not in (2, 4, 8)) or (fmt == "float-quantized" and bits != 8):
            raise ValueError(f"compressed-tensors: {bits}-bit weights in the {fmt} format are not read")
        if weights.get("actorder") in ("group", "dynamic", True):  # columns in groups by a g_idx map, not in order
            raise ValueError("compressed-tensors: weights with actorder 'group' (a weight_g_idx) are not read")
        strategy = weights.get("strategy") or "tensor"
        if strategy not in ("tensor", "channel", "group"):
            raise ValueError(f"compressed-tensors: the {strategy} weight strategy is not read (tensor, channel, group)")
        schemes.append(WeightScheme(tuple(group.get("targets") or ()), bits, bool(weights.get("symmetric", True)),
                                    strategy, weights.get("group_size"), fmt))  # fmt: skip
    if quantization_config.get("kv_cache_scheme"):
        logger.warning("compressed-tensors: the checkpoint's kv_cache_scheme is not used (see --kv-cache-dtype)")
    return schemes


def quantized_modules(keys: Iterable[str]) -> set[str]:
    """The modules a checkpoint ships quantized: those with a weight scale (the ignored ones, an LM head say, ship
    a plain weight)."""
    return {key.rpartition(".")[0] for key in keys if key.endswith(".weight_scale")}


def dequantized(
    tensors: Iterable[tuple[str, torch.Tensor]], schemes: list[WeightScheme], quantized: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each quantized linear's parts replaced by its float32 ``weight``."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors:
        module, _, part = key.rpartition(".")
        if part in ACTIVATION_PARTS:
            continue
        if module not in quantized or part not in PARTS:
            yield key, tensor
            continue
        scheme = _scheme_of(module, schemes)
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if all(name in parts for name in scheme.parts()):
            yield f"{module}.weight", _weight(pending.pop(module), scheme)
    if pending:
        module, parts = next(iter(pending.items()))
        raise ValueError(f"compressed-tensors: {module} ships {sorted(parts)}, not all of what its scheme needs")


def _scheme_of(module: str, schemes: list[WeightScheme]) -> WeightScheme:
    scheme = next((scheme for scheme in schemes if scheme.matches(module)), None)
    if scheme is None:
        raise ValueError(f"compressed-tensors: {module} ships a weight scale, and no config group targets it")
    return scheme


def _weight(parts: dict[str, torch.Tensor], scheme: WeightScheme) -> torch.Tensor:
    """(code - zero point) x scale, in float32."""
    if scheme.format == "pack-quantized":
        shape = tuple(int(n) for n in parts["weight_shape"].tolist())
        codes = unpack_int32(parts["weight_packed"], scheme.num_bits, shape[1]).float()
    else:
        codes = parts["weight"].float()  # int8 codes, or float8 values
    scale = _per_column(parts["weight_scale"].float(), codes.shape, scheme)
    if scheme.symmetric:
        return codes * scale
    zero_point = parts["weight_zero_point"]
    if scheme.format == "pack-quantized" and zero_point.dtype == torch.int32:  # packed along the output dimension
        zero_point = unpack_int32(zero_point.t().contiguous(), scheme.num_bits, codes.shape[0]).t()
    return (codes - _per_column(zero_point.float(), codes.shape, scheme)) * scale


def _per_column(values: torch.Tensor, shape: torch.Size, scheme: WeightScheme) -> torch.Tensor:
    """A scale or zero point broadcast to the weight's shape: one per tensor, per row, or per group of columns."""
    if scheme.strategy == "group":
        assert scheme.group_size is not None, "a group strategy names its group size"
        return values.repeat_interleave(scheme.group_size, dim=1)[:, : shape[1]]
    return values.reshape(-1, 1) if values.numel() == shape[0] else values.reshape(())


def unpack_int32(packed: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """Signed codes from int32 words, 32 / num_bits to a word, the first in the lowest bits; the first `columns`."""
    assert packed.dtype == torch.int32 and 32 % num_bits == 0, "bit widths that divide a word"
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * num_bits
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    return (codes.reshape(packed.shape[0], -1)[:, :columns] - (1 << (num_bits - 1))).to(torch.int8)
