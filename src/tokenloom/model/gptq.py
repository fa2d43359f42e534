"""Rounding int8 weights against their inputs (GPTQ, Frantar et al. 2023), for ``--quantization int8``.

Rounding each weight to its nearest code treats every input channel alike; the error a linear makes is
(W - Q) x, so what matters is the error along the directions its inputs take. GPTQ rounds one input column at a
time and moves the columns not yet rounded to cancel the error just made, weighted by the inverse of the inputs'
second moments H = X^T X: the optimal brain surgeon update, column block by column block. The codes stay
per-output-channel symmetric int8 with round-to-nearest's scales, so every kernel runs them unchanged: only which
code each weight gets differs.

H is measured at load time on calibration text (data/calibration.txt: passages of prose, code, questions and
answers, a list, a letter and arithmetic, written for this purpose, plus two chats where the tokenizer has a chat
template), run through the unquantized model: no data is downloaded, and the same text gives the same codes on
every load and every tensor-parallel rank. On SmolLM2-135M (float32 engine, benchmarks/RESULTS.md, issue 24) it took
top-1 agreement with float32 from 95.4-96.2% to 96.2-96.5% with int8 activations, and from 97.7% to 98.6% with the
AVX2 kernel's 16-bit ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

BLOCK = 32  # columns updated together (GPTQ's lazy batch): a block's error is pushed to the later columns at once
ACT_ORDER = True  # inputs with the most energy rounded first (GPTQ's act-order)
DAMPING = 0.01  # of H's mean diagonal, added to it: keeps the inverse finite where calibration is short
CALIBRATION_TEXT = Path(__file__).with_name("data") / "calibration.txt"
CALIBRATION_CHATS = [
    ("Give me two ideas for a rainy afternoon.", "You could bake bread, or start a jigsaw puzzle with a friend."),
    ("Translate 'good morning' into French.", "In French, 'good morning' is 'bonjour'."),
]
RANDOM_SEQUENCES = (4, 256)  # a checkpoint without a tokenizer: this many seeded random sequences of this length


def gptq_codes(
    weight: torch.Tensor, hessian: torch.Tensor, scale: torch.Tensor, max_code: float = 127.0
) -> torch.Tensor:
    """weight [N, K], hessian [K, K] (X^T X of the inputs the weight sees), scale [N] -> codes [N, K] as float32
    integers in [-max_code, max_code], rounded so that ||X (W - codes * scale)^T|| is small rather than
    ||W - codes * scale||."""
    n, k = weight.shape
    assert hessian.shape == (k, k) and scale.shape == (n,), "one Hessian over the inputs, one scale per output"
    # Transposed, so that a column of the weight is a contiguous row: one input's weights across all outputs.
    w = (weight.detach().float().cpu() / scale.float().cpu()[:, None]).T.contiguous()  # [K, N], in units of codes
    h = hessian.detach().double().cpu().clone()
    dead = torch.diagonal(h) == 0  # an input that was always zero: its weights cannot matter
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h += torch.eye(k, dtype=h.dtype) * DAMPING * torch.diagonal(h).mean()
    # Inputs with the most energy first (GPTQ's act-order): their errors are spread over the most columns after them.
    order = torch.argsort(torch.diagonal(h), descending=True) if ACT_ORDER else torch.arange(k)
    w, h = w[order], h[order][:, order]
    # The upper Cholesky factor of H^-1: its row i says how column i's error moves the later columns.
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    codes = torch.empty_like(w)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block, errors, local = w[start:end].clone(), torch.empty(end - start, n), inverse[start:end, start:end]
        for i in range(end - start):
            rounded = block[i].round().clamp_(-max_code, max_code)
            codes[start + i] = rounded
            torch.div(block[i] - rounded, local[i, i], out=errors[i])
            block[i + 1 :].addr_(local[i, i + 1 :], errors[i], alpha=-1.0)
        w[end:].addmm_(inverse[start:end, end:].T, errors, alpha=-1.0)
    unpermuted = torch.empty_like(codes)
    unpermuted[order] = codes
    return unpermuted.T.to(weight.device)


class HessianRecorder:
    """Sums X^T X of the rows a linear is given, in float64."""

    def __init__(self, in_features: int) -> None:
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).double().cpu()
        self.sum += rows.T @ rows
        self.rows += rows.shape[0]


@contextmanager
def recording_input_hessians(module: nn.Module) -> Iterator[dict[str, HessianRecorder]]:
    """While open, every nn.Linear under module adds its inputs to its recorder, keyed by its name under module."""
    recorders: dict[str, HessianRecorder] = {}

    def recorder(name: str, linear: nn.Linear) -> Any:
        recorders[name] = HessianRecorder(linear.in_features)
        return lambda _module, inputs, _output: recorders[name].add(inputs[0])

    handles = [
        m.register_forward_hook(recorder(name, m)) for name, m in module.named_modules() if isinstance(m, nn.Linear)
    ]
    try:
        yield recorders
    finally:
        for handle in handles:
            handle.remove()


def calibration_ids(tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """The calibration sequences as token ids: the text's passages and the chats, or, for a checkpoint without a
    tokenizer, seeded random ids (the same on every load)."""
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        count, length = RANDOM_SEQUENCES
        return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]
    sequences = [tokenizer.encode(p) for p in CALIBRATION_TEXT.read_text().split("\n===\n")]
    if getattr(tokenizer, "chat_template", None):
        for user, assistant in CALIBRATION_CHATS:
            chat = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
            rendered = tokenizer.apply_chat_template(chat, tokenize=False)
            sequences.append(tokenizer.encode(rendered, add_special_tokens=False))
    return [[t for t in s if 0 <= t < vocab_size] for s in sequences if s]
