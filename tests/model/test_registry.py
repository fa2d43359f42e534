"""The model registry: one entry per family, read by the config reader, the loader, the planner's parameter count,
tensor-parallel sharding and the GGUF converter; a new variant is one entry."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.advisor.plan import parameter_count
from tokenloom.model.config import ModelConfig
from tokenloom.model.loader import load_model
from tokenloom.model.parallel import TensorParallelGroup, shard_hf_weights
from tokenloom.model.registry import (
    FAMILIES,
    LLAMA_MODEL,
    GGUFLayout,
    ModelFamily,
    TensorParallelLayout,
    UnsupportedModelError,
    family_of,
    gguf_family,
    gguf_names,
)


def _hf_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_the_planner_counts_the_parameters_the_loaded_model_has(tiny_checkpoints, arch):
    # As loaded, before an engine packs its linears' weights into kernel layouts (no longer parameters then).
    model = load_model(str(tiny_checkpoints[arch]), None, torch.float32, torch.device("cpu")).model
    loaded = sum(p.numel() for p in model.parameters())
    assert parameter_count(ModelConfig.from_hf(_hf_config(tiny_checkpoints[arch]))) == loaded


def test_each_family_sets_its_own_features():
    def features(architecture: str, **hf) -> dict:
        return family_of([architecture]).features(hf)

    assert features("LlamaForCausalLM")["sliding_window"] is None
    assert features("MistralForCausalLM", sliding_window=4096)["sliding_window"] == 4096
    assert features("MistralForCausalLM", sliding_window=4096, use_sliding_window=False)["sliding_window"] is None
    assert features("Qwen2ForCausalLM")["qkv_bias"] and not features("Qwen2ForCausalLM", attention_bias=True)["o_bias"]
    assert features("Qwen3ForCausalLM")["qk_norm"] and not features("LlamaForCausalLM")["qk_norm"]
    assert family_of(["SomethingElse", "Qwen3ForCausalLM"]).architecture == "Qwen3ForCausalLM"
    with pytest.raises(UnsupportedModelError, match="tokenloom runs LlamaForCausalLM, MistralForCausalLM"):
        family_of(["GPT2LMHeadModel"])


def test_a_new_variant_is_one_registry_entry(tiny_llama, tmp_path, monkeypatch):
    """A Llama variant with an always-on sliding window of 48 tokens: the entry alone makes it load, serve, plan."""
    windowed = tmp_path / "windowed"
    shutil.copytree(tiny_llama, windowed)
    hf = _hf_config(windowed) | {"architectures": ["WindowedLlamaForCausalLM"], "sliding_window": 48}
    (windowed / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_hf(hf)

    def windowed_features(config: dict) -> dict:
        return {**family_of(["LlamaForCausalLM"]).features(config), "sliding_window": config["sliding_window"]}

    monkeypatch.setitem(
        FAMILIES, "WindowedLlamaForCausalLM", ModelFamily("WindowedLlamaForCausalLM", LLAMA_MODEL, windowed_features)
    )
    config = ModelConfig.from_hf(hf)
    assert config.architecture == "WindowedLlamaForCausalLM" and config.sliding_window == 48
    assert parameter_count(config) == parameter_count(ModelConfig.from_hf(_hf_config(tiny_llama)))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 33, 2, 9, 41, 7]}
    with LLM(str(windowed), num_kv_blocks=16) as variant:
        assert variant.engine.max_model_len == 48  # the window bounds the context, as Mistral's does
        got = variant.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(tiny_llama), num_kv_blocks=16) as plain:  # inside the window the two are the same model
        assert plain.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids == got


def test_sharding_splits_as_the_family_layout_says():
    weights = [
        ("model.layers.0.self_attn.q_proj.weight", torch.arange(8.0).reshape(4, 2)),
        ("model.layers.0.self_attn.o_proj.weight", torch.arange(8.0).reshape(2, 4)),
        ("model.layers.0.self_attn.o_proj.bias", torch.ones(2)),
        ("model.norm.weight", torch.ones(2)),
    ]
    rank1 = TensorParallelGroup(rank=1, world_size=2)
    llama = dict(shard_hf_weights(iter(weights), rank1, family_of(["LlamaForCausalLM"]).tensor_parallel))
    assert llama["model.layers.0.self_attn.q_proj.weight"].tolist() == [[4.0, 5.0], [6.0, 7.0]]  # rows
    assert llama["model.layers.0.self_attn.o_proj.weight"].tolist() == [[2.0, 3.0], [6.0, 7.0]]  # columns
    assert llama["model.layers.0.self_attn.o_proj.bias"].tolist() == [0.0, 0.0]  # added once, by rank 0
    assert llama["model.norm.weight"].tolist() == [1.0, 1.0]  # replicated
    only_q = TensorParallelLayout(column_parallel=("q_proj",), row_parallel=())
    other = dict(shard_hf_weights(iter(weights), rank1, only_q))
    assert other["model.layers.0.self_attn.o_proj.weight"].shape == (2, 4)  # not split under this layout


def test_the_gguf_converter_reads_the_families_from_the_registry(monkeypatch):
    assert gguf_family("llama") is FAMILIES["LlamaForCausalLM"]
    assert FAMILIES["LlamaForCausalLM"].gguf == GGUFLayout("llama", "llama", permuted_qk=True)
    assert gguf_family("qwen3") is FAMILIES["Qwen3ForCausalLM"] and gguf_family("gpt2") is None
    entry = ModelFamily(
        "NewForCausalLM", LLAMA_MODEL, family_of(["LlamaForCausalLM"]).features, gguf=GGUFLayout("new", "new", False)
    )
    monkeypatch.setitem(FAMILIES, "NewForCausalLM", entry)
    assert gguf_family("new") is entry and gguf_names() == ["llama", "qwen2", "qwen3", "new"]
