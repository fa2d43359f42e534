"""Incremental detokenization: text grows token by token, multi-byte characters and leading spaces intact.

Decoding one token at a time breaks both: a character split over two byte-level tokens decodes to U+FFFD, and
SentencePiece-style tokenizers drop a token's leading space when it is decoded alone. With a fast (Rust)
tokenizer, its own incremental decoder (``tokenizers.decoders.DecodeStream``) does this at ~0.8 us a token (the
window below: ~5.5 us; measured in benchmarks/host_overhead.py's terms, RESULTS.md). Otherwise each step decodes a
short window of recent tokens twice, with and without the new ones, and emits the difference once it no longer
ends in a replacement character.

The text is kept as pieces (``Text``), not one string grown by ``+=``: an attribute's string is copied whole at every
append, which made each token cost the length of the text so far (O(n^2) over a long reply). A stream's delta and a
stop string's search read only the tail.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders

DecodeStream = getattr(decoders, "DecodeStream", None)  # tokenizers >= 0.21; before it, the window alone


class Text:
    """A growing text: an append costs its piece, a range near the end its own length, and the whole text one copy
    of it when it grew since the last read.

    Recent pieces are joined into a chunk every ``CHUNK_PIECES`` appends, so each character is copied once more and
    the number of string objects stays small (a reply of 16,000 tokens holds ~60 chunks)."""

    CHUNK_PIECES = 256

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._recent: list[str] = []
        self._whole = ""  # the text as last read whole (its first len(_whole) characters)
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def append(self, piece: str) -> None:
        if not piece:
            return
        self._recent.append(piece)
        self.length += len(piece)
        if len(self._recent) >= self.CHUNK_PIECES:
            self._chunks.append("".join(self._recent))
            self._recent = []

    def __str__(self) -> str:
        if len(self._whole) < self.length:
            self._whole += self._tail(len(self._whole))
        return self._whole

    def between(self, start: int, end: int | None = None) -> str:
        """Characters [start, end) (end: the length)."""
        start, end = max(0, start), self.length if end is None else min(end, self.length)
        if start >= end:
            return ""
        if len(self._whole) == self.length or 2 * start < self.length:  # from early on: read whole, kept
            return str(self)[start:end]
        return self._tail(start)[: end - start]

    def _tail(self, start: int) -> str:
        """The text from `start` to its end, joined from the last pieces back."""
        recent = self._recent
        if recent and self.length - len(recent[-1]) <= start:  # a step's delta: within the last piece
            return recent[-1][start - self.length :] if start < self.length else ""
        taken: list[str] = []
        position = self.length  # where the pieces taken so far begin
        for pieces in (recent, self._chunks):
            for piece in reversed(pieces):
                if position <= start:
                    break
                taken.append(piece)
                position -= len(piece)
        return "".join(reversed(taken))[start - position :]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.pieces = Text()
        self._prefix_offset = 0  # window start: decoded only as context
        self._read_offset = 0  # tokens before this are already in self.text
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None and DecodeStream is not None:
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

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
                self.pieces.append(delta)
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
        self.pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """The whole text so far (a copy of it, joined, when it grew since the last read)."""
        return str(self.pieces)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens) if token_ids else ""
