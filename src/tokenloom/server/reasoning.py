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

START, END = "<think>", "</think>"
ReasoningParserName = Literal["deepseek_r1", "qwen3"]


@dataclass(frozen=True)
class ReasoningParser:
    name: ReasoningParserName

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply as its thought (None if it has none) and its answer."""
        thought, answer, _ = self._split(text, whole=True)
        return thought or None, answer

    def _split(self, text: str, whole: bool) -> tuple[str | None, str, bool]:
        """(thought, answer, undecided): the thought and answer so far; undecided while the text may still be the
        start of a tag that decides between them (never for a whole reply)."""
        opened = text.startswith(START)
        if not whole and not opened and START.startswith(text):
            return None, "", True  # "<th": the reply may be opening a thought
        if self.name == "qwen3" and not opened:
            return None, text, False
        body = text.removeprefix(START)
        thought, closed, answer = body.partition(END)
        if closed or whole:
            return thought, answer, False
        return body[: len(body) - _held(body)], "", False


def _held(text: str) -> int:
    """How many characters at the text's end may begin the closing tag."""
    return next((n for n in range(min(len(END) - 1, len(text)), 0, -1) if END.startswith(text[-n:])), 0)


class ReasoningStream:
    """Splits a reply into thought and answer as its text grows: each call gives what is new of each."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._text = ""
        self._thought_sent = 0
        self._answer_sent = 0

    def feed(self, delta: str, last: bool) -> tuple[str, str]:
        """The new thought and the new answer once `delta` is added; `last`: the reply is whole."""
        self._text += delta
        thought, answer, undecided = self.parser._split(self._text, whole=last)
        if undecided:
            return "", ""
        new_thought = (thought or "")[self._thought_sent :]
        new_answer = answer[self._answer_sent :]
        self._thought_sent += len(new_thought)
        self._answer_sent += len(new_answer)
        return new_thought, new_answer


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    assert name in (None, *get_args(ReasoningParserName)), name
    return None if name is None else ReasoningParser(cast(ReasoningParserName, name))


def thinks_first(prompt_end: str) -> bool:
    """Whether a reply begins in a thought, from the end of its prompt's text: unless the prompt closes one after the
    last it opens (as Qwen3's template with enable_thinking false ends with an empty thought). Text, not ids: a
    tokenizer without the tags as tokens of their own splits them differently in context."""
    return prompt_end.rfind(END) <= prompt_end.rfind(START)
