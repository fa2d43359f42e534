"""A reasoning model's thoughts apart from its answer (vLLM's ``--reasoning-parser``): the text a reply writes
between ``<think>`` and ``</think>`` goes to the message's ``reasoning`` (and, under its older name,
``reasoning_content``; a Responses API reasoning item), the rest is its ``content``, which tool calls are read from.

Two families, as vLLM names them:
- ``deepseek_r1`` (DeepSeek-R1 and its distills, Qwen3's thinking-only models): the template may open the thought in
  the prompt, so the reply thinks from its first token until ``</think>``; a reply cut before it is all thought.
- ``qwen3`` (Qwen3's hybrid models): the reply thinks only if it begins with ``<think>`` (``enable_thinking`` false
  makes a plain answer); one cut while thinking is all thought.

A stream is split as it comes (ReasoningStream): text that may be the start of a tag is held back until the next
token says whether it is one, as a stop string's possible start is held back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

from tokenloom.server.tool_parsers import held_back

START, END = "<think>", "</think>"
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


@dataclass(frozen=True)
class ReasoningParser:
    name: ReasoningParserName

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply as its thought (None if it has none) and its answer."""
        thought, answer = ReasoningStream(self).feed(text, last=True)
        return thought or None, answer


class ReasoningStream:
    """Splits a reply into thought and answer as its text grows: each call gives what is new of each. Only the
    characters that may begin a tag are kept between calls; once the answer begins, deltas pass through."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._held = ""  # text not given out yet: it may begin <think> (at the start) or </think>
        self._at_start = True  # whether the reply may still open a thought
        self._answering = False

    def feed(self, delta: str, last: bool) -> tuple[str, str]:
        """The new thought and the new answer once `delta` is added; `last`: the reply is whole."""
        if self._answering:
            return "", delta
        text, self._held = self._held + delta, ""
        if self._at_start:
            if not last and not text.startswith(START) and START.startswith(text):
                self._held = text  # "<th": the reply may be opening a thought
                return "", ""
            self._at_start = False
            if text.startswith(START):
                text = text.removeprefix(START)
            elif self.parser.name == "qwen3":  # no thought opened: all answer
                self._answering = True
                return "", text
        thought, closed, answer = text.partition(END)
        if closed:
            self._answering = True
            return thought, answer
        if not last:
            keep = held_back(text, END)
            text, self._held = text[: len(text) - keep], text[len(text) - keep :]
        return text, ""


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    assert name in (None, *get_args(ReasoningParserName)), name
    return None if name is None else ReasoningParser(cast(ReasoningParserName, name))


def thinks_first(prompt_end: str) -> bool:
    """Whether a reply begins in a thought, from the end of its prompt's text: unless the prompt closes one after the
    last it opens (as Qwen3's template with enable_thinking false ends with an empty thought). Text, not ids: a
    tokenizer without the tags as tokens of their own splits them differently in context."""
    return prompt_end.rfind(END) <= prompt_end.rfind(START)
