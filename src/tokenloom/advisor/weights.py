"""The weights as the engine holds them, planned: the forms it makes of a model's parameters on each device (packed
copies of the LM head, 8-bit codes with their scales and what the int8 kernels keep beside them), counted from the
model's shape alone, and what a decode step streams of them. model/footprint.py measures the same in a loaded engine;
the tests hold the two equal."""

from __future__ import annotations

from typing import Protocol

import torch

from tokenloom.model import platform
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import parameter_counts
from tokenloom.model.prepack import can_prepack, small_batch_copies_pay, takes_f32_layout
from tokenloom.model.quantization import ROTATION_BLOCK, fits_own_kernels, int8_kernel_isa, int8_kernels


class Accelerator(Protocol):
    """What the counts ask of a device (plan.Accelerator): its name, "cpu" for this machine."""

    @property
    def name(self) -> str: ...


CPU = torch.device("cpu")
ELEMENT_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1}
TORCH_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
SCALE_BYTES = 4  # a float32 scale (or an int32 code sum) per output feature of an 8-bit linear


def weights_as_served(cfg: ModelConfig, dtype: str, device: Accelerator) -> int:
    """The bytes the engine's weights hold at `dtype` on `device` (model/footprint.py measures them in a loaded
    engine, and the start-up log says them): the parameters at the dtype's bytes, and
    - with 8-bit weights (--quantization int8 | fp8), the decoder's linears at a byte and a scale per output, the
      rest (embedding, norms, an untied head) in the model's dtype; on a CPU, an int8 copy of the LM head for the
      approximate logits (quantization.int8_head) and what the int8 kernels keep beside each linear
      (_int8_kernel_bytes);
    - with 16- or 32-bit weights on a CPU whose linears are packed (prepack.can_prepack), the LM head's packed copy
      beside its plain weight, which a tied embedding and the logits' refinement read (two with AMX in bf16:
      _head_copies); but none in float32 where the packed head gives its rows back (prepack.takes_f32_layout: the
      embedding looks its tokens up there).
    (With AMX, bf16 decoder linears that oneDNN runs, misfits of our AMX kernel's multiples of 32, also keep our
    layout for steps of a few rows, in models under 2 GiB: not counted.)"""
    counts = parameter_counts(cfg)
    head = cfg.vocab_size * cfg.hidden_size
    if ELEMENT_BYTES[dtype] > 1:
        held = counts.parameters * ELEMENT_BYTES[dtype]
        return held + head * ELEMENT_BYTES[dtype] * _head_copies(cfg, dtype, device)
    rest = (counts.parameters - counts.linear_weights) * ELEMENT_BYTES[auto_dtype(device)]
    held = counts.linear_weights + counts.linear_outputs * SCALE_BYTES + rest
    if device.name == "cpu" and dtype == "int8" and int8_kernel_isa() is not None:
        shapes = list(counts.linear_shapes)
        if fits_own_kernels(cfg.vocab_size, cfg.hidden_size):  # the head's int8 copy (quantization.int8_head)
            held += head + cfg.vocab_size * SCALE_BYTES
            shapes.append((cfg.vocab_size, cfg.hidden_size))
        held += _int8_kernel_bytes(shapes)
    return held


def _int8_kernel_bytes(shapes: list[tuple[int, int]]) -> int:
    """What quantization.Int8Linear keeps on this CPU beside the codes and scales of [N, K] linears, in the forms
    quantization.int8_kernels chooses: a float sign per input where K splits into rotation blocks; code sums for our
    kernels' layout, per output (and per activation group where there is one); oneDNN's packing (a byte a weight, an
    int64 zero point per output) where a step reaches it."""
    wide = int8_kernel_isa() == "avx2"  # the engine's int8: 8-bit activations where the CPU multiplies bytes
    held = 0
    for n, k in shapes:
        kernels = int8_kernels(n, k, wide)
        held += SCALE_BYTES * k * (k % ROTATION_BLOCK == 0)
        if kernels.own:
            held += SCALE_BYTES * n * (k // kernels.activation_group if kernels.activation_group else 1)
        if kernels.onednn:
            held += n * k + 8 * n
    return held


def _head_copies(cfg: ModelConfig, dtype: str, device: Accelerator) -> int:
    """The packed copies of the LM head the engine holds beside its plain weight (16- or 32-bit weights on a CPU,
    CausalLM.prepack_weights): none where a float32 head gives its rows back, else one, and with AMX a bf16 head's
    small-step copy in our layout beside oneDNN's, in models under 2 GiB (prepack.small_batch_copies_pay)."""
    if device.name != "cpu" or ELEMENT_BYTES[dtype] == 1 or not can_prepack(CPU, TORCH_DTYPES[dtype]):
        return 0
    torch_dtype = TORCH_DTYPES[dtype]
    if takes_f32_layout(torch_dtype, cfg.vocab_size):
        return 0
    head_and_linears = (cfg.vocab_size * cfg.hidden_size + parameter_counts(cfg).linear_weights) * ELEMENT_BYTES[dtype]
    return 1 + (torch_dtype == torch.bfloat16 and small_batch_copies_pay(head_and_linears))


def weights_read_per_step(cfg: ModelConfig, held: int, dtype: str, device: Accelerator, gguf_blocks: bool) -> int:
    """Of the weights held, what a decode step streams: all but the embedding table (of which it reads a row a token)
    where the LM head is held apart from it: a head of its own, or on a CPU the head's own copy (packed beside the
    plain table, or int8). A GGUF's blocks serve a tied head and the lookups alike; an untied one's embedding is
    estimated at the file's mean bytes a weight."""
    tied = cfg.tie_word_embeddings
    if gguf_blocks:
        return held if tied else held - cfg.vocab_size * cfg.hidden_size * held // parameter_counts(cfg).parameters
    apart = not tied or (ELEMENT_BYTES[dtype] == 1 and device.name == "cpu") or _head_copies(cfg, dtype, device) > 0
    if not apart:
        return held  # the head is the table
    element = ELEMENT_BYTES[dtype if ELEMENT_BYTES[dtype] > 1 else auto_dtype(device)]
    return held - cfg.vocab_size * cfg.hidden_size * element


def auto_dtype(device: Accelerator) -> str:
    """The engine's dtype auto: bf16 on accelerators and on a CPU that multiplies bf16 natively, else float32."""
    return "bf16" if device.name != "cpu" or platform.cpu_has_native_bf16() else "fp32"  # the engine's lookup
