"""Shared fixtures: tiny random checkpoints of each supported architecture, and the real embedded model."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors under its interpreter: Triton reads this when it is imported, so before torch.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENLOOM_GPTQ_CACHE", "0")  # every engine rounds by GPTQ itself; test_gptq.py turns it on

from pathlib import Path

import pytest
import torch

from tokenloom.model import platform

TINY_VOCAB = 512


_REAL_BF16_DETECTION = platform.cpu_has_native_bf16


@pytest.fixture(scope="session", autouse=True)
def float32_for_auto():
    """Tests compare against float32 oracles, so dtype "auto" means float32 here whatever the CPU has.

    Session-wide, so module-scoped engines see it too. Tests of the auto choice itself are marked `native_dtype`
    and see the real detection (or mock it).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(platform, "cpu_has_native_bf16", lambda: False)
        yield


@pytest.fixture(autouse=True)
def real_detection_when_asked(request, monkeypatch):
    if "native_dtype" in request.keywords:
        monkeypatch.setattr(platform, "cpu_has_native_bf16", _REAL_BF16_DETECTION)


def _tiny_hf_config(arch: str):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.25,  # spread-out logits, so greedy choices are far from ties
        eos_token_id=TINY_VOCAB - 1,
        bos_token_id=0,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True)
    if arch == "llama3-scaled":
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 500000.0,
        }
        return transformers.LlamaConfig(**common, rope_scaling=rope, rope_theta=500000.0, tie_word_embeddings=False)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    raise ValueError(arch)


TINY_ARCHS = ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"]


def make_tiny_checkpoint(arch: str, directory: Path) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_tiny_hf_config(arch), dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


@pytest.fixture
def two_threads():
    """torch (and the operators' work sharing) on 2 threads: the operator splits long contexts only with a helper to
    take splits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(arch, root / arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once into the local cache."""
    from tokenloom.model.loader import resolve_checkpoint_dir

    return resolve_checkpoint_dir(None)[1]


def hf_oracle(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, real_model_dir) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer and chat template: fast, and it speaks text."""
    import shutil

    import transformers
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("tiny-chat")
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real_model_dir / name).exists():
            shutil.copy(real_model_dir / name, directory / name)
    return directory
