"""Tool-call parsers for tool_choice "auto": the model decides between text and calls, in its family's own format.

Chosen as vLLM chooses them (``--enable-auto-tool-choice --tool-call-parser NAME``):

- ``hermes`` (Qwen2.5, Qwen3, Hermes): text, then calls each wrapped as ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, which the checkpoint's chat template teaches the model.
- ``llama3_json`` (Llama 3.1, 3.2): the whole reply is one or more ``{"name": ..., "parameters": {...}}`` objects
  (separated by ``;``), perhaps after ``<|python_tag|>``.
- ``mistral`` (Mistral, Mixtral, Magistral): ``[TOOL_CALLS]`` then a JSON array of calls, or ``name[ARGS]{...}``.
- ``pythonic`` (Llama 3.2's and 4's own format): the reply is a Python list of calls, ``[f(a=1), g()]``.

A reply whose calls do not all parse (cut by max_tokens, malformed) is returned as text, as vLLM does. While a
reply streams, text that may begin a call is held back until it is clear, so no half-written call reaches
``content``.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from tokenloom.server.protocol import FunctionCall, ToolCall
from tokenloom.server.tool_calls import ForcedTool, new_call_id


@dataclass
class ParsedReply:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedReply:
        """A finished reply as text and tool calls."""

    @abstractmethod
    def streamable_end(self, text: str) -> int:
        """How much of a reply still being written can go out as content now: none of it may begin a call."""


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedReply:
        start = text.find(self.START)
        if start < 0:
            return ParsedReply(text)
        calls = []
        bodies = self._CALL.findall(text)
        if len(bodies) != text.count(self.START):
            return ParsedReply(text)  # a call left open: cut short
        for body in bodies:
            call = _call_from(body, arguments_key="arguments")
            if call is None:
                return ParsedReply(text)
            calls.append(call)
        return ParsedReply(text[:start].strip() or None, calls)

    def streamable_end(self, text: str) -> int:
        start = text.find(self.START)
        return start if start >= 0 else len(text) - held_back(text, self.START)


class Llama3JsonParser(ToolCallParser):
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return ParsedReply(text)
        calls, decoder, at = [], json.JSONDecoder(), 0
        while at < len(body):
            try:
                value, end = decoder.raw_decode(body, at)
            except ValueError:
                return ParsedReply(text)
            call = _call_from(value, arguments_key="parameters")
            if call is None:
                return ParsedReply(text)
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return ParsedReply(None, calls)

    def streamable_end(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or head.startswith(self.PYTHON_TAG) or self.PYTHON_TAG.startswith(head):
            return 0  # it may be a call: held until the reply ends
        return len(text)


class MistralParser(ToolCallParser):
    """Mistral's ``[TOOL_CALLS]`` followed by a JSON array of ``{"name", "arguments"}`` objects (v0.3 and the like),
    or by ``name[ARGS]{...}``, one such after each ``[TOOL_CALLS]`` (the newer tokenizers'). Its calls' ids are nine
    letters and digits, which Mistral's templates require of the calls sent back."""

    BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str) -> ParsedReply:
        start = text.find(self.BOT)
        if start < 0:
            return ParsedReply(text)
        body = text[start + len(self.BOT) :]
        calls = self._named_calls(body) if self.ARGS in body else self._array_calls(body)
        return ParsedReply(text) if calls is None else ParsedReply(text[:start].strip() or None, calls)

    def _array_calls(self, body: str) -> list[ToolCall] | None:
        try:
            value, end = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            return None
        if not isinstance(value, list) or not value or body.strip()[end:].strip():
            return None
        calls = [_call_from(item, arguments_key="arguments", call_id=_mistral_id()) for item in value]
        return None if any(call is None for call in calls) else [call for call in calls if call is not None]

    def _named_calls(self, body: str) -> list[ToolCall] | None:
        calls = []
        for part in body.split(self.BOT):
            name, found, arguments = part.partition(self.ARGS)
            call = _call_from({"name": name.strip(), "arguments": arguments.strip()}, "arguments", _mistral_id())
            if not found or call is None or not name.strip():
                return None
            calls.append(call)
        return calls

    def streamable_end(self, text: str) -> int:
        start = text.find(self.BOT)
        return start if start >= 0 else len(text) - held_back(text, self.BOT)


class PythonicParser(ToolCallParser):
    """Llama 3.2's and 4's calls as Python: the whole reply a list of calls with keyword arguments,
    ``[get_weather(city="Paris"), get_time()]`` (perhaps between Llama 4's ``<|python_start|>`` and
    ``<|python_end|>``). Read by Python's parser, never run: each argument must be a literal."""

    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        if not body.startswith("["):
            return ParsedReply(text)
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return ParsedReply(text)
            calls = [self._call(node) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return ParsedReply(text)
        return ParsedReply(None, calls)

    @staticmethod
    def _call(node: ast.expr) -> ToolCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call by name with keyword arguments")
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(arguments) != len(node.keywords):
            raise ValueError("a **mapping is not a literal argument")
        return ToolCall(id=new_call_id(), function=FunctionCall(name=node.func.id, arguments=json.dumps(arguments)))

    def streamable_end(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("[") or head.startswith(self.START) or self.START.startswith(head):
            return 0  # it may be calls: held until the reply ends
        return len(text)


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
}


def tool_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; the parsers are: {', '.join(PARSERS)}")
    return PARSERS[name]()


def _call_from(value: str | Any, arguments_key: str, call_id: str | None = None) -> ToolCall | None:
    """A call from its JSON (text or decoded); None unless it names a function and its arguments are an object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    function = FunctionCall(name=value["name"], arguments=json.dumps(arguments))
    return ToolCall(id=call_id or new_call_id(), function=function)


def held_back(text: str, marker: str) -> int:
    """The length of the longest end of text that is the beginning of marker (it may be a call starting)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def reply_calls(
    text: str, tool: ForcedTool | None, parser: ToolCallParser | None
) -> tuple[str | None, list[ToolCall] | None]:
    """A finished reply as its content and its calls (None: a plain reply): a forced tool's calls (its text if cut
    short of them), or those a parser reads out of a free reply. Chat completions and /v1/responses read it so."""
    if tool is not None:
        calls = tool.calls(text)
        return (text, None) if calls is None else (None, calls)
    if parser is not None:
        parsed = parser.parse(text)
        if parsed.calls:
            return parsed.content, parsed.calls
    return text, None
