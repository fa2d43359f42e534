"""Incremental detokenization reproduces the full decode: multi-byte characters and leading spaces intact."""

from __future__ import annotations

import pytest

from tokenloom.engine.detokenizer import IncrementalDetokenizer, Text


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model_dir), local_files_only=True)


@pytest.mark.parametrize(
    "text",
    [
        " Hello world, it's   spaced out.",
        "Café crème brûlée — naïve façade",
        "北京是中国的首都。東京は日本の首都です。",
        "emoji 🎉🚀 and a flag 🇫🇷 in the middle",
        "\n\nnew lines\tand tabs\n",
    ],
)
def test_streamed_deltas_add_up_to_the_full_decode(tokenizer, text):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(t) for t in token_ids]
    assert "".join(deltas) == tokenizer.decode(token_ids) == detokenizer.text
    assert all("\ufffd" not in d for d in deltas)


def test_the_rust_stream_and_the_window_give_the_same_deltas(tokenizer):
    text = "Café 北京 🎉 code: def f(x):\n    return x"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    streamed = IncrementalDetokenizer(tokenizer)
    assert streamed._stream is not None  # a fast tokenizer: its own incremental decoder
    windowed = IncrementalDetokenizer(tokenizer)
    windowed._stream = None
    assert [streamed.add(t) for t in token_ids] == [windowed.add(t) for t in token_ids]


def test_a_stream_that_raises_falls_back_to_the_window(tokenizer):
    class Broken:
        def step(self, backend, token_id):
            raise RuntimeError("unknown id")

    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.add(t) for t in tokenizer.encode(" before", add_special_tokens=False))
    detokenizer._stream = Broken()
    text += "".join(detokenizer.add(t) for t in tokenizer.encode(" and after", add_special_tokens=False))
    assert detokenizer._stream is None and text == " before and after" == detokenizer.text


def test_text_reads_any_range_across_its_chunks(monkeypatch):
    """Pieces are joined into chunks every few appends; a range read from the tail, or the whole, is the plain
    string's, across chunk boundaries and while the whole text has not been read since the last append."""
    monkeypatch.setattr(Text, "CHUNK_PIECES", 4)
    text, plain = Text(), ""
    for i in range(40):
        piece = "" if i % 7 == 3 else f"<{i}>" * (i % 3 + 1)
        text.append(piece)
        plain += piece
        assert len(text) == len(plain)
        for start in range(max(0, len(plain) - 30), len(plain) + 2):
            assert text.between(start) == plain[start:]
            assert text.between(start, len(plain) - 2) == plain[start : len(plain) - 2]
        if i % 5 == 0:
            assert str(text) == plain
    assert text.between(-3, 5) == plain[:5] and text.between(3, 2) == "" and str(text) == plain
