"""Where an fp8 KV cache loses top-1 agreement (issue 24): K or V, and whether smoothing or rotating K helps.

    .venv/bin/python benchmarks/kv_fp8_ablation.py [--new-tokens 160]

kv_accuracy.py's teacher-forced decode pass on the real model in bf16 (the plain-PyTorch attention, a bf16 cache),
with this step's K and/or V replaced before the cache write by their round trip through an 8-bit code with one
scale per (token, KV head), as the 8-bit cache stores them: so one side can be quantized without the other. The
variants for K: as is; "smoothed", the layer's mean K per channel (from three other prompts, after RoPE) subtracted
before quantizing and added back (exact for attention, which is unchanged by a shift of every key's score by the same
q . mean); "rotated", K times a 64 x 64 Hadamard matrix before quantizing and back after (q . k is unchanged by a
rotation of both); "first N kept", the first N positions of each sequence (the attention sink) left in bf16, as
KVQuant and IntactKV keep them; "query-weighted", each key's values rounded one after another with GPTQ's error
feedback under the metric E[q q^T] of the queries that read it (measured on the three other prompts, after RoPE), so
the rounding errors that survive lie where queries rarely point. Prints top-1 agreement with transformers' float32
logits, the misses, and the mean KL divergence of our distribution from transformers' (more sensitive than top-1
counts at a few hundred positions). `--only - query-weighted` runs the variants whose K preparation is named.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import torch
from kv_accuracy import CHATS, step_logits, teacher_sequences

from tokenloom import EngineConfig, LLMEngine, SamplingParams
from tokenloom.core.request import Request
from tokenloom.model import llama

CODES = {"int8": (torch.int8, 127.0), "e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
# (K code, V code, how K is prepared)
VARIANTS = [
    (None, None, "-"), ("e4m3", "e4m3", "-"), ("e4m3", None, "-"), (None, "e4m3", "-"), ("e4m3", "e4m3", "smoothed"),
    ("e4m3", "e4m3", "rotated"), ("e4m3", "e4m3", "smoothed+rotated"), ("e5m2", "e5m2", "-"),
    ("e5m2", "e5m2", "smoothed"), ("int8", "int8", "-"), ("int8", "int8", "smoothed"),
    ("e4m3", "e4m3", "first 1 kept"), ("e4m3", "e4m3", "first 4 kept"), ("e5m2", "e5m2", "first 1 kept"),
    ("e4m3", "e4m3", "query-weighted"), ("e4m3", None, "query-weighted"), ("int8", "int8", "query-weighted"),
]  # fmt: skip


def round_trip(x: torch.Tensor, code: str) -> torch.Tensor:
    """x [T, H, d] through one code per value and one float32 scale per (token, head), back in x's dtype."""
    values = x.float()
    scale = values.abs().amax(-1, keepdim=True).clamp_min(1e-30) / CODES[code][1]
    return (to_codes(values / scale, code) * scale).to(x.dtype)


def to_codes(scaled: torch.Tensor, code: str) -> torch.Tensor:
    dtype, max_code = CODES[code]
    scaled = scaled.clamp(-max_code, max_code)
    return scaled.round() if dtype == torch.int8 else scaled.to(dtype).float()


def query_weighted_round_trip(x: torch.Tensor, code: str, factor: torch.Tensor) -> torch.Tensor:
    """round_trip, each value's rounding error carried into the key's later values as GPTQ carries a weight row's:
    factor [H, d, d] is the upper Cholesky factor of the inverse of each KV head's E[q q^T]."""
    values = x.float()
    scale = values.abs().amax(-1, keepdim=True).clamp_min(1e-30) / CODES[code][1]
    left, codes = values / scale, torch.empty_like(values)
    for i in range(values.shape[-1]):
        codes[..., i] = to_codes(left[..., i], code)
        carried = (left[..., i] - codes[..., i]) / factor[:, i, i]
        left[..., i + 1 :] -= carried[..., None] * factor[:, i, i + 1 :]
    return (codes * scale).to(x.dtype)


def error_factor(second_moment: torch.Tensor, damping: float = 0.01) -> torch.Tensor:
    """[H, d, d] E[q q^T] -> the upper Cholesky factor of each head's damped inverse, as GPTQ takes it."""
    h = second_moment.double()
    h = h + damping * h.diagonal(dim1=-2, dim2=-1).mean(-1)[:, None, None] * torch.eye(h.shape[-1], dtype=h.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()


def rows_kept(kept: torch.Tensor, original: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
    """original's rows where kept [T], changed's elsewhere, in original's shape."""
    return torch.where(kept.view(-1, *[1] * (original.dim() - 1)), original, changed.reshape(original.shape))


def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


class FakeQuant:
    """Wraps llama.write_kv: each layer's K and V round-tripped as the variant says before they are written."""

    def __init__(self, num_layers: int, head_dim: int) -> None:
        self.num_layers, self.head_dim = num_layers, head_dim
        self.calls = 0
        self.variant: tuple[str | None, str | None, str] = (None, None, "-")
        self.means: list[torch.Tensor] | None = None
        self.collected: list[list[torch.Tensor]] | None = None
        self.queries: list[list[torch.Tensor]] | None = None
        self.factors: list[torch.Tensor] = []
        self.rotation = hadamard(head_dim)
        self.write_kv, self.apply_rotary = llama.write_kv, llama.apply_rotary
        llama.write_kv, llama.apply_rotary = self, self.rotary

    def rotary(self, q, k, cos, sin):
        q, k = self.apply_rotary(q, k, cos, sin)
        if self.queries is not None:  # each KV head's queries: its group of query heads, after RoPE
            layer = sum(map(len, self.queries)) % self.num_layers  # one call a layer, in order
            grouped = q.float().view(q.shape[0], k.shape[1], -1, self.head_dim).transpose(0, 1)
            self.queries[layer].append(grouped.reshape(k.shape[1], -1, self.head_dim))
        return q, k

    def __call__(self, cache_k, cache_v, k, v, slots, meta, head_dim):
        layer = self.calls % self.num_layers
        self.calls += 1
        k3 = k.reshape(k.shape[0], -1, self.head_dim)
        if self.collected is not None:  # the first token's K is an outlier (the attention sink): left out
            self.collected[layer].append(k3[1:].float())
        k_code, v_code, how = self.variant
        kept = slots < (int(how.split()[1]) if how.startswith("first") else 0)  # blocks from 0: slot = position
        if k_code is not None:
            k = rows_kept(kept, k, self.prepared_round_trip(k3, k_code, how, layer))
        if v_code is not None:
            v = rows_kept(kept, v, round_trip(v.reshape(v.shape[0], -1, self.head_dim), v_code))
        return self.write_kv(cache_k, cache_v, k, v, slots, meta, head_dim)

    def prepared_round_trip(self, k: torch.Tensor, code: str, how: str, layer: int) -> torch.Tensor:
        assert self.means is not None, "calibrate first"
        if how == "query-weighted":
            return query_weighted_round_trip(k, code, self.factors[layer])
        mean = self.means[layer] if "smoothed" in how else torch.zeros_like(self.means[layer])
        rotation = self.rotation if "rotated" in how else torch.eye(self.head_dim)
        x = ((k.float() - mean) @ rotation).to(k.dtype)
        return ((round_trip(x, code).float() @ rotation.T) + mean).to(k.dtype)

    def calibrate(self, engine: LLMEngine, prompts: list[str]) -> None:
        self.collected = [[] for _ in range(self.num_layers)]
        self.queries = [[] for _ in range(self.num_layers)]
        for prompt in prompts:
            ids = engine.tokenizer.encode(prompt)
            self.calls = 0
            step_logits(engine, Request("calibration", ids, SamplingParams()), 0, len(ids))
        self.means = [torch.cat(keys).mean(0) for keys in self.collected]
        for queries in self.queries:
            q = torch.cat(queries, 1)
            self.factors.append(error_factor(q.transpose(1, 2) @ q / q.shape[1]))
        self.collected = self.queries = None


def measure(engine: LLMEngine, sequences: list[tuple[list[int], int, torch.Tensor]]) -> tuple[int, int, float]:
    """Top-1 agreements, positions and the summed KL(transformers || ours), each position a decode step."""
    agree = total = 0
    kl = 0.0
    for ids, prompt_len, reference in sequences:
        request = Request("x", ids, SamplingParams())
        bounds = [0, *range(prompt_len, len(ids)), len(ids)]
        ours = torch.cat([step_logits(engine, request, a, b) for a, b in itertools.pairwise(bounds)])
        ours, theirs = ours[prompt_len:].float().log_softmax(-1), reference[prompt_len:]
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        kl += float((theirs.exp() * (theirs - ours)).sum())
        total += len(ids) - prompt_len
    return agree, total, kl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--only", nargs="*", help="variants whose K preparation is one of these (default: all)")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_kwargs(num_kv_blocks=64, attention_backend="torch"))
    sequences = [(ids, n, logits.log_softmax(-1)) for ids, n, logits in teacher_sequences(engine, args.new_tokens)]
    config = engine.model_config
    fake = FakeQuant(config.num_layers, config.head_dim)
    fake.calibrate(engine, CHATS)
    print("| K | V | K prepared | top-1 | misses | mean KL x 1e3 |\n|---|---|---|---:|---:|---:|")
    for variant in [v for v in VARIANTS if not args.only or v[2] in args.only]:
        fake.variant, fake.calls = variant, 0
        agree, total, kl = measure(engine, sequences)
        k_code, v_code, how = variant
        print(f"| {k_code or 'bf16'} | {v_code or 'bf16'} | {how} | {agree / total:.1%} | {total - agree} | "
              f"{kl / total * 1e3:.2f} |", flush=True)  # fmt: skip
    engine.shutdown()


if __name__ == "__main__":
    main()
