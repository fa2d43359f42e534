"""Why W8A8 loses top-1 agreement on SmolLM2-135M, and what rotating the inputs buys (issue 24).

    .venv/bin/python benchmarks/int8_activation_study.py [--new-tokens 160]

Simulated quantization ("fake quant") inside transformers' float32 model, teacher-forced over the prompts of
kv_accuracy.py: each decoder linear's weight is rounded to per-channel int8 codes and, where the variant says so,
its input to per-token (or per-group) int8 codes, in float32 arithmetic; then top-1 agreement with the unquantized
model is counted over the positions after the prompts. The variants:
  weights only             per-channel int8 weights, float activations (W8A16)
  W8A8                     and per-token activations, as --quantization int8 was before the rotation
  W8A8 smoothed            SmoothQuant, alpha 0.5, its per-channel maxima from three calibration texts
  W8A8 rotated             the 64-block Walsh-Hadamard rotation with random signs: what --quantization int8 does
  weights only, rotated    the same rotation, float activations
  W8A8 full rotation       a random orthogonal K x K rotation (an upper bound for rotations; too costly online)
  W8A8 groups of 32        rotated, and one activation scale per 32 inputs (not an int8 GEMM oneDNN can run)

With --ablation, where the loss is instead: W8A8 rotated everywhere but one kind of linear (q/k/v, o, gate/up, down),
which keeps float activations (its weights still int8, rotated); and the LM head quantized as well (rotated int8
weights, with float or int8 activations), which the engine leaves in bf16.

With --activation-codes, the weights rounded by GPTQ (as the engine does) and the activations' int8 codes made
five ways: one symmetric scale per token (what the engine did before), asymmetric per token (a zero point), per token
clipped where a smaller scale has the smaller squared error, and one scale per 64 or per 192 inputs of a token (64:
the rotation's block, what the engine now does where the CPU has VNNI and no AMX).

With --per-layer, the other way round: rotated int8 weights with float activations everywhere (W8A16), and 8-bit
activations in one kind of linear, or in one decoder layer, at a time; beside top-1, the mean KL divergence from the
float32 model's next-token distribution (x 1e3), which adds up over where the loss comes from where top-1 flips.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(__file__))
from kv_accuracy import PROMPTS

from tokenloom.model.gptq import HessianRecorder, calibration_ids, gptq_codes
from tokenloom.model.loader import resolve_checkpoint_dir
from tokenloom.model.quantization import per_channel, rotate, rotation_signs

CALIBRATION = [
    "Machine learning is a field of study in artificial intelligence concerned with statistical algorithms that "
    "learn from data and generalise to unseen data.",
    "<|im_start|>user\nHow do I sort a list in Python?<|im_end|>\n<|im_start|>assistant\nUse sorted() or "
    "list.sort(). For example:\n```python\nnums = [3, 1, 2]\nnums.sort()\n```",
    "The history of Rome spans more than two and a half thousand years, from an Italic settlement to an empire.",
]
Transform = Callable[[torch.Tensor], torch.Tensor]


def fake_weight(w: torch.Tensor) -> torch.Tensor:
    scaled, scale = per_channel(w, 127.0)
    return scaled.round().clamp(-127, 127) * scale[:, None]


def fake_tokens(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    parts = x.unflatten(-1, (-1, group)) if group else x
    scale = parts.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    out = (parts / scale).round().clamp(-127, 127) * scale
    return out.flatten(-2) if group else out


def asymmetric_tokens(x: torch.Tensor) -> torch.Tensor:
    """Codes 0-255 over [min, max] of each token (a zero point), scaled back."""
    low, high = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((high - low) / 255).clamp(min=1e-12)
    zero = (-low / scale).round()
    return ((x / scale).round() + zero).clamp(0, 255).sub(zero) * scale


def clipped_tokens(x: torch.Tensor) -> torch.Tensor:
    """Per token, the scale among amax x (1, 0.95, ..., 0.7) / 127 whose codes have the smallest squared error."""
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    best, best_error = None, None
    for ratio in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
        scale = amax * ratio / 127
        codes = (x / scale).round().clamp(-127, 127) * scale
        error = (codes - x).pow(2).sum(-1, keepdim=True)
        if best is None or best_error is None:
            best, best_error = codes, error
        else:
            better = error < best_error
            best, best_error = torch.where(better, codes, best), torch.where(better, error, best_error)
    assert best is not None
    return best


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


class FakeQuantLinear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, into: Transform, activations: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.into, self.activations = into, activations
        self.weight = torch.nn.Parameter(fake_weight(into(weight)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.activations(self.into(x)), self.weight)


def block_rotation(k: int) -> Transform:
    signs = rotation_signs(k)
    assert signs is not None
    return lambda t: rotate(t, signs)


def full_rotation(k: int) -> Transform:
    q = torch.linalg.qr(torch.randn(k, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64))[0]
    q32 = q.float()
    return lambda t: t @ q32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--ablation", action="store_true", help="which linears' 8-bit activations cost the most")
    parser.add_argument("--per-layer", action="store_true", help="8-bit activations one kind, one layer at a time")
    parser.add_argument("--gptq", action="store_true", help="weights rounded by GPTQ against calibration inputs")
    parser.add_argument(
        "--activation-codes", action="store_true", help="GPTQ weights; activation scales per token, or per group"
    )
    parser.add_argument(
        "--calibration", choices=["engine", "sampled", "both"], default="engine",
        help="GPTQ's inputs: the engine's calibration text, the model's own samples from SEEDS, or both",
    )  # fmt: skip
    args = parser.parse_args()
    path = resolve_checkpoint_dir(None)[1]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    sequences = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            generated = model.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)[0]
            sequences.append((generated, len(ids), torch.log_softmax(model(generated[None]).logits[0], -1)))
    linears = {name: m for name, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)}
    parents = {name: (model.model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]) for name in linears}
    maxima = calibrate(model, tokenizer, linears)
    gptq = args.gptq or args.activation_codes
    hessians = rotated_hessians(model, tokenizer, linears, args.calibration) if gptq else {}

    def agreement() -> tuple[float, float]:
        """Top-1 agreement, and the mean KL divergence (x 1e3) from the float32 model's distribution."""
        agree = total = 0
        divergence = 0.0
        with torch.inference_mode():
            for ids, prompt_len, reference in sequences:
                ours = torch.log_softmax(model(ids[None]).logits[0], -1)[prompt_len:]
                theirs = reference[prompt_len:]
                agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
                divergence += float((theirs.exp() * (theirs - ours)).sum())
                total += len(ids) - prompt_len
        return agree / total, divergence / total * 1e3

    variants: dict[str, Callable[[str, torch.nn.Linear], torch.nn.Module]] = {
        "weights only": lambda n, m: FakeQuantLinear(m.weight, identity, identity),
        "W8A8": lambda n, m: FakeQuantLinear(m.weight, identity, fake_tokens),
        "W8A8 smoothed": lambda n, m: SmoothedLinear(m.weight, maxima[n]),
        "W8A8 rotated": lambda n, m: FakeQuantLinear(m.weight, block_rotation(m.in_features), fake_tokens),
        "weights only, rotated": lambda n, m: FakeQuantLinear(m.weight, block_rotation(m.in_features), identity),
        "W8A8 full rotation": lambda n, m: FakeQuantLinear(m.weight, full_rotation(m.in_features), fake_tokens),
        "W8A8 rotated, groups of 32": lambda n, m: FakeQuantLinear(
            m.weight, block_rotation(m.in_features), lambda t: fake_tokens(t, 32)
        ),
    }
    if args.ablation:
        variants = ablations()
    if args.per_layer:
        variants = one_at_a_time(model.config.num_hidden_layers)
    if args.gptq:
        variants = {
            f"W8A8 rotated, GPTQ weights ({args.calibration} calibration)": lambda n, m: GptqLinear(
                m.weight, hessians[n], fake_tokens
            ),
        }
    if args.activation_codes:
        schemes: dict[str, Transform] = {
            "weights only": identity,
            "one scale per token": fake_tokens,
            "asymmetric per token": asymmetric_tokens,
            "per token, clipped": clipped_tokens,
            "one scale per 64 inputs": lambda t: fake_tokens(t, 64),
            "one scale per 192 inputs": lambda t: fake_tokens(t, 192),
        }
        variants = {f"GPTQ weights, activations: {name}": gptq_with(hessians, codes) for name, codes in schemes.items()}
    positions = sum(len(ids) - n for ids, n, _ in sequences)
    print(f"top-1 agreement with the float32 model over {positions} positions (float32 arithmetic)")
    print("| variant | top-1 | mean KL x 1e3 |\n|---|---:|---:|")
    for label, make in variants.items():
        for name, linear in linears.items():
            parent, attr = parents[name]
            setattr(parent, attr, make(name, linear))
        head = model.lm_head
        if label.startswith("LM head"):
            model.lm_head = lm_head_variant(label, head)
        top1, divergence = agreement()
        print(f"| {label} | {top1:.1%} | {divergence:.2f} |", flush=True)
        model.lm_head = head
    for name, linear in linears.items():
        parent, attr = parents[name]
        setattr(parent, attr, linear)


def rotated(m: torch.nn.Linear, activations: Transform) -> torch.nn.Module:
    return FakeQuantLinear(m.weight, block_rotation(m.in_features), activations)


KINDS = {"q/k/v": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate/up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}  # fmt: skip


def ablations() -> dict[str, Callable[[str, torch.nn.Linear], torch.nn.Module]]:
    """W8A8 rotated but for one kind of linear, which keeps float activations; then the LM head quantized too."""

    def all_but(kind: str) -> Callable[[str, torch.nn.Linear], torch.nn.Module]:
        return lambda n, m: rotated(m, identity if n.rsplit(".", 1)[1] in KINDS[kind] else fake_tokens)

    variants = {"W8A8 rotated (the engine)": lambda n, m: rotated(m, fake_tokens)}
    variants |= {f"W8A8 rotated, {kind} with float activations": all_but(kind) for kind in KINDS}
    variants |= {
        "LM head int8 weights, float activations (and W8A8 rotated)": lambda n, m: rotated(m, fake_tokens),
        "LM head W8A8 (and W8A8 rotated)": lambda n, m: rotated(m, fake_tokens),
    }
    return variants


def one_at_a_time(num_layers: int) -> dict[str, Callable[[str, torch.nn.Linear], torch.nn.Module]]:
    """W8A16 rotated everywhere, then 8-bit activations in one kind of linear, or one layer, at a time."""

    def int8_inputs_where(chosen: Callable[[str], bool]) -> Callable[[str, torch.nn.Linear], torch.nn.Module]:
        return lambda n, m: rotated(m, fake_tokens if chosen(n) else identity)

    def layer(name: str) -> int:
        return int(name.split(".")[1])  # layers.<i>.self_attn.q_proj

    variants = {
        "W8A16 rotated": int8_inputs_where(lambda n: False),
        "W8A8 rotated": int8_inputs_where(lambda n: True),
    }
    for kind, names in KINDS.items():
        variants[f"8-bit inputs to {kind} only"] = int8_inputs_where(lambda n, kind=names: n.rsplit(".", 1)[1] in kind)
    for i in range(num_layers):
        variants[f"8-bit inputs in layer {i} only"] = int8_inputs_where(lambda n, i=i: layer(n) == i)
    return variants


def lm_head_variant(label: str, head: torch.nn.Linear) -> torch.nn.Module:
    """The LM head as int8 rotated weights (a copy: tied embeddings stay as they are)."""
    return rotated(head, fake_tokens if "W8A8" in label.split("(")[0] else identity)


class SmoothedLinear(torch.nn.Module):
    """SmoothQuant: x / s and W * s, s = max|x|^alpha / max|w|^(1 - alpha) per input channel."""

    def __init__(self, weight: torch.Tensor, maxima: torch.Tensor, alpha: float = 0.5) -> None:
        super().__init__()
        w = weight.detach()
        self.s = (maxima.clamp(min=1e-5) ** alpha / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
        self.weight = torch.nn.Parameter(fake_weight(w * self.s), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(fake_tokens(x / self.s), self.weight)


def calibrate(model, tokenizer, linears: dict[str, torch.nn.Linear]) -> dict[str, torch.Tensor]:
    """Each linear's largest |input| per channel over the calibration texts."""
    maxima: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module, inputs, output) -> None:
            seen = inputs[0].reshape(-1, inputs[0].shape[-1]).abs().amax(0)
            maxima[name] = torch.maximum(maxima.get(name, seen), seen)

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    with torch.inference_mode():
        for text in CALIBRATION:
            model(torch.tensor([tokenizer.encode(text)]))
    for handle in handles:
        handle.remove()
    return maxima


class GptqLinear(torch.nn.Module):
    """Rotated int8 weights rounded by GPTQ against the rotated calibration inputs' Hessian."""

    def __init__(self, weight: torch.Tensor, hessian: torch.Tensor, activations: Transform) -> None:
        super().__init__()
        self.into, self.activations = block_rotation(weight.shape[1]), activations
        w = self.into(weight.detach())
        _, scale = per_channel(w, 127.0)
        self.weight = torch.nn.Parameter(gptq_codes(w, hessian, scale) * scale[:, None], requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.activations(self.into(x)), self.weight)


def gptq_with(hessians: dict[str, torch.Tensor], codes: Transform) -> Callable[[str, torch.nn.Linear], torch.nn.Module]:
    return lambda name, m: GptqLinear(m.weight, hessians[name], codes)


SEEDS = ["Here is a short story:", "<|im_start|>user\nExplain how a hash map works.<|im_end|>\n<|im_start|>assistant\n",
         "import numpy as np\n", "The weather today", "A list of facts about the ocean:\n1.",
         "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n"]  # fmt: skip


def rotated_hessians(model, tokenizer, linears: dict[str, torch.nn.Linear], source: str) -> dict[str, torch.Tensor]:
    """X^T X of each linear's rotated inputs over the engine's calibration sequences (gptq.calibration_ids), the
    model's own sampled continuations of SEEDS, or both."""
    recorders = {n: HessianRecorder(m.in_features) for n, m in linears.items()}
    rotations = {n: block_rotation(m.in_features) for n, m in linears.items()}

    def hook(name: str):
        return lambda module, inputs, output: recorders[name].add(rotations[name](inputs[0]))

    torch.manual_seed(0)
    texts = []
    if source in ("engine", "both"):
        texts += [torch.tensor(ids) for ids in calibration_ids(tokenizer, model.config.vocab_size)]
    with torch.inference_mode():
        for seed in SEEDS if source in ("sampled", "both") else []:
            ids = torch.tensor([tokenizer.encode(seed)])
            texts.append(model.generate(ids, max_new_tokens=192, do_sample=True, temperature=0.8, top_p=0.95)[0])
    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    with torch.inference_mode():
        for ids in texts:
            model(ids[None])
    for handle in handles:
        handle.remove()
    return {n: r.sum for n, r in recorders.items()}


if __name__ == "__main__":
    main()
