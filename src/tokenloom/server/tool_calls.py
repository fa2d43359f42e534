"""Tool calls by structured output: a forced tool choice decodes the call under the tool's JSON schema.

``tool_choice`` as OpenAI defines it:
- a named function: the output is that function's arguments, decoded under its ``parameters`` schema; the reply
  carries one tool call and finish_reason "stop", as OpenAI answers a forced function.
- ``"required"``: the output is a JSON array of ``{"name", "parameters"}`` objects, one of the tools each (one
  object only when ``parallel_tool_calls`` is false), as vLLM decodes it; finish_reason "tool_calls".
- ``"none"``: plain text.
- ``"auto"`` (the default once tools are given): the model decides, and a parser of its family's format
  (``--enable-auto-tool-choice --tool-call-parser``, server/tool_parsers.py) reads the calls out of its reply;
  without one it answers 400, as vLLM does.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.errors import APIError
from tokenloom.server.protocol import ChatCompletionRequest, FunctionCall, Tool, ToolCall

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ForcedTool:
    """How a request's output becomes tool calls."""

    mode: Literal["named", "required"]
    spec: StructuredOutputsParams
    name: str | None = None  # the named function

    @property
    def finish_reason(self) -> str:
        return "stop" if self.mode == "named" else "tool_calls"

    def calls(self, text: str) -> list[ToolCall] | None:
        """The tool calls in a finished output. A named function's output is its call whatever its state (cut
        short by max_tokens, its arguments are what was written, with finish_reason "length", as vLLM answers);
        "required" calls are None unless the array is complete."""
        if self.mode == "named":
            assert self.name is not None
            return [ToolCall(id=new_call_id(), function=FunctionCall(name=self.name, arguments=text))]
        try:
            decoded = json.loads(text)
        except ValueError:
            return None
        return [
            ToolCall(id=new_call_id(), function=FunctionCall(name=i["name"], arguments=json.dumps(i["parameters"])))
            for i in decoded
        ]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_tool(body: ChatCompletionRequest, auto_parsed: bool = False) -> ForcedTool | None:
    """What the request's tools and tool_choice ask the output to be (None: text, or with ``auto_parsed`` text that
    a tool-call parser reads calls from); 400 for what cannot be met."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    if choice == "none":
        return None
    if (choice is None or choice == "auto") and auto_parsed:
        return None
    if choice is None or choice == "auto":
        raise APIError(
            400,
            'tool_choice "auto" (the default once tools are given) needs a parser of the model\'s tool-call format, '
            "which this server was not started with (--enable-auto-tool-choice --tool-call-parser hermes|llama3_json); "
            'ask for "required", a named function, or "none"',
            "tool_choice",
            "unsupported",
        )
    if body.structured_output() is not None:
        raise APIError(400, "a forced tool_choice decodes the call as JSON; drop response_format", "response_format")
    if choice == "required":
        return ForcedTool("required", StructuredOutputsParams(json=_calls_schema(tools, body.parallel_tool_calls)))
    by_name = {tool.function.name: tool for tool in tools}
    name = choice.function.name
    if name not in by_name:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    parameters = by_name[name].function.parameters or EMPTY_PARAMETERS
    return ForcedTool("named", StructuredOutputsParams(json=parameters), name)


def _calls_schema(tools: list[Tool], parallel: bool | None) -> dict[str, Any]:
    """A JSON array of calls, each one of the tools by name with its parameters (vLLM's shape for "required")."""
    one_of = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or EMPTY_PARAMETERS,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
    if parallel is False:
        schema["maxItems"] = 1
    return schema
