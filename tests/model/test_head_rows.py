"""An LM head held once (model/head_rows.py): in float32 on a CPU, the packed head (f32_linear's layout) or a GGUF's
blocks give the weight's rows back exactly, so the engine keeps no plain copy beside them; a tied embedding looks its
tokens up there, a GGUF's own embedding in its blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf_blocks import raw_blocks
from helpers import needs_operator

from tokenloom import LLM, SamplingParams
from tokenloom.model import gguf_linear
from tokenloom.model.footprint import held_weight_bytes
from tokenloom.model.gguf_linear import GGUFLinear, gguf_groups
from tokenloom.model.head_rows import RowsEmbedding
from tokenloom.model.loader import load_model
from tokenloom.model.prepack import PackedLinear, takes_f32_layout

CPU = torch.device("cpu")


def some_rows(n: int) -> torch.Tensor:
    """Every row once, out of order, then a few again (a prompt repeats tokens)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
    return torch.cat([order, order[:7], torch.tensor([0, n - 1, n - 1])])


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "Q6_K", "Q8_0", "Q3_K", "IQ4_XS"])  # 4 and 8 bits, groups 32 and 16
def test_a_gguf_weights_rows_are_its_dequantized_rows_bit_for_bit(fmt):
    n, k = 48, 768 if fmt in gguf_linear.IN_SUPER_BLOCKS else 576
    layer = GGUFLinear(gguf_groups(raw_blocks(fmt, n, k), fmt, (n, k)), None)
    rows = some_rows(n)
    assert torch.equal(layer.weight_rows(rows), layer.dequantized()[rows])
    assert layer.weight_rows(rows[:0]).shape == (0, k)


def test_a_packed_float32_weights_rows_are_the_weights():
    needs_operator()
    if not takes_f32_layout(torch.float32, 64):
        pytest.skip("f32_linear is not built on this CPU")
    weight = torch.randn(64, 40)
    layer = PackedLinear(weight, None)
    assert layer.gives_weight_rows
    rows = some_rows(64)
    assert torch.equal(layer.weight_rows(rows), weight[rows])
    assert not PackedLinear(weight.bfloat16(), None).gives_weight_rows  # bf16's layouts are not kept this way


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # a tied LM head, and one of its own
def test_a_float32_model_holds_its_head_once_with_the_same_embeddings_and_logits(tiny_checkpoints, arch):
    needs_operator()
    model = load_model(str(tiny_checkpoints[arch]), 64, torch.float32, CPU).model
    if not takes_f32_layout(torch.float32, model.config.vocab_size):
        pytest.skip("f32_linear is not built on this CPU")
    table, head = model.embedding_table().detach().clone(), model.head_weight().detach().clone()
    loaded = held_weight_bytes(model)
    model.prepack_weights()
    assert held_weight_bytes(model) == loaded  # the layers' layout is their weights' bytes; no second head
    assert isinstance(model.embed_tokens, RowsEmbedding) == model.head_is_embedding
    if model.head_is_embedding:
        assert model.embed_tokens.source is model.lm_head
    ids = torch.tensor([[3, 0, 511], [7, 7, 100]])
    assert torch.equal(model.embed_tokens(ids), table[ids])
    normed = torch.randn(2, model.config.hidden_size)
    tokens = [5, 400, 5, 17]
    assert torch.equal(model.token_logits(normed, tokens), F.linear(normed, head[tokens]))
    stream = torch.randn(3, model.config.hidden_size)
    normed = F.rms_norm(stream, (stream.shape[-1],), model.norm.weight, model.norm.eps)
    torch.testing.assert_close(model.compute_logits(stream), F.linear(normed, head), rtol=1e-5, atol=1e-4)
    with pytest.raises(AssertionError, match="no plain weight"):
        model.head_weight()


def test_a_bf16_model_keeps_its_plain_head_for_the_refined_logits(tiny_llama):
    model = load_model(str(tiny_llama), 64, torch.bfloat16, CPU).model
    model.prepack_weights()
    assert not isinstance(model.embed_tokens, RowsEmbedding) and model.head_weight().dtype == torch.bfloat16


def test_an_untied_gguf_looks_its_tokens_up_in_its_embeddings_blocks(tmp_path, monkeypatch):
    """A Q4_K_M layout with an output tensor of its own: the embedding's Q8_0 blocks serve the lookups, the output's
    Q6_K blocks the logits; neither keeps a float32 table, and the tokens are the dequantized model's."""
    from test_gguf_linear import assert_the_dequantized_models_outputs, needs_gguf_operator, q4_k_m_gguf

    from tokenloom.model.loader import default_gguf_path

    needs_gguf_operator()
    monkeypatch.setenv("TOKENLOOM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-untied.gguf"
    q4_k_m_gguf(path, default_gguf_path(), head="Q6_K")
    served = LLM(str(path), dtype="float32")
    model = served.engine.core.runner.model
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.bits == 8 and not model.head_is_embedding
    assert isinstance(model.embed_tokens, RowsEmbedding) and isinstance(model.embed_tokens.source, GGUFLinear)
    assert model.embed_tokens.source is not model.lm_head
    assert gguf_linear.served_weight_bytes(path) == held_weight_bytes(model) == served.engine.weight_bytes
    assert_the_dequantized_models_outputs(served, str(path), 12)
    prompt = {"prompt_token_ids": [1, 504, 3458, 282, 4914, 314, 504]}  # a token again: its looked-up row again
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    ours = served.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    dequantized = LLM(str(path), dtype="float32", quantization="none")
    assert ours == dequantized.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
