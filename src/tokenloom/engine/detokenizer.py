"""Incremental detokenization: text grows token by token, multi-byte characters and leading spaces intact.

Decoding one token at a time breaks both: a character split over two byte-level tokens decodes to U+FFFD, and
SentencePiece-style tokenizers drop a token's leading space when it is decoded alone. With a fast (Rust)
tokenizer, its own incremental decoder (``tokenizers.decoders.DecodeStream``) does this at ~0.8 us a token (the
window below: ~5.5 us; measured in benchmarks/host_overhead.py's terms, RESULTS.md). Otherwise each step decodes a
short window of recent tokens twice, with and without the new ones, and emits the difference once it no longer
ends in a replacement character.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders

DecodeStream = getattr(decoders, "DecodeStream", None)  # tokenizers >= 0.21; before it, the window alone


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # window start: decoded only as context
        self._read_offset = 0  # tokens before this are already in self.text
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = DecodeStream(skip_special_tokens=True) if self._backend is not None and DecodeStream else None

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (often "", for a partial character)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:
            return ""
        if self._stream is not None:
            try:
                delta = self._stream.step(self._backend, token_id) or ""
            except Exception:  # an id the tokenizer does not know (a padded vocabulary): the window from here on
                self._stream = None
                return self.add_to_window()
            if delta:
                self.text += delta
                self._prefix_offset = self._read_offset = len(self.token_ids)  # where the window would resume
            return delta
        return self.add_to_window()

    def add_to_window(self) -> str:
        """The window's way: decode the recent tokens with and without the newest, emit the difference."""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""
