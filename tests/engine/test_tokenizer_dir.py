"""vLLM's --tokenizer: a checkpoint that ships no tokenizer served with the tokenizer (and chat template) of another
local directory, as a GGUF is served with its original model's; a directory that holds none, or a tokenizer with
more tokens than the model, refused at start with a clear message."""

from __future__ import annotations

import shutil

import httpx
import pytest
from server_process import ServerProcess

from tokenloom import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CHAT = [{"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def weights_only(tiny_chat_model, tmp_path_factory):
    """The tiny chat model's weights and config, without its tokenizer or chat template."""
    directory = tmp_path_factory.mktemp("weights-only")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_chat_model / name, directory / name)
    return directory


def test_a_checkpoint_without_a_tokenizer_takes_another_directorys(tiny_chat_model, weights_only):
    expected = LLM(str(tiny_chat_model), dtype="float32").chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0]
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(str(weights_only), dtype="float32").generate("Hello", GREEDY, use_tqdm=False)
    llm = LLM(str(weights_only), dtype="float32", tokenizer=str(tiny_chat_model))
    got = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0]  # the chat template came with the tokenizer
    assert got.token_ids == expected.token_ids and got.text == expected.text


def test_a_tokenizer_directory_that_holds_none_or_too_many_tokens_is_refused(tiny_chat_model, weights_only, tiny_llama):
    with pytest.raises(FileNotFoundError, match="not a local directory holding a tokenizer"):
        LLM(str(tiny_chat_model), tokenizer=str(weights_only))
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        LLM(str(tiny_chat_model), tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ValueError, match="has 49152 tokens; the model's vocabulary"):
        LLM(str(tiny_llama), tokenizer=str(tiny_chat_model))


def test_the_server_chats_through_the_tokenizer_it_was_given(tiny_chat_model, weights_only):
    expected = LLM(str(tiny_chat_model), dtype="float32").chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].text
    flags = ("--served-model-name", "tiny", "--tokenizer", str(tiny_chat_model))
    with ServerProcess("--model", str(weights_only), *flags) as proc:
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected
