"""OpenAI's Responses API (``POST /v1/responses``) as tokenloom reads and writes it: the request, read as the chat
completion it amounts to (instructions a system message first, input items as messages, function calls and their
outputs as an assistant's tool calls and tool messages), and the response object with its output items.

A response is kept (response_store.py) unless its request says ``store: false`` or the server keeps none; then
``previous_response_id`` continues its conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from tokenloom.server.errors import APIError
from tokenloom.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Text,
    Tool,
    ToolCall,
    _Body,
    _Strict,
)


class ContentPart(_Strict):
    type: Text  # input_text (what clients send), output_text (an earlier reply sent back)
    text: Text | None = None


class MessageItem(_Strict):
    """A message (``type`` may be left out, as OpenAI's "easy" input messages do)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(part.type not in ("input_text", "output_text", "text") or part.text is None for part in self.content):
            raise APIError(400, "only text content parts (input_text, output_text) are supported", "input",
                           "unsupported")  # fmt: skip
        return "".join(part.text or "" for part in self.content)


class FunctionCallItem(_Strict):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text


class FunctionCallOutputItem(_Strict):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return MessageItem(role="user", content=self.output).text()


class ReasoningInputItem(_Strict):
    """An earlier reply's thought sent back (as OpenAI's clients send a response's output items): accepted and left
    out of the conversation, as chat templates leave out a past turn's thought."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: Text | None = None
    status: Text | None = None


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if kind in ("message", "function_call", "function_call_output", "reasoning") else "unsupported"


ConversationItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="unsupported_item",
                  custom_error_message="input items are messages, function_call, function_call_output and reasoning"),
]  # fmt: skip


class FunctionTool(_Strict):
    """A function tool, in the Responses API's flat shape (chat completions nest it under ``function``)."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _tool_kind(tool: Any) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "unsupported"


# OpenAI's built-in tools (web_search, file_search, mcp, ...) run on OpenAI's side; a model server has none of them.
_ONLY_FUNCTIONS = Discriminator(
    _tool_kind,
    custom_error_type="unsupported_tool",
    custom_error_message="only function tools are supported (not OpenAI's built-in tools)",
)
Tools = Annotated[list[Annotated[Annotated[FunctionTool, Tag("function")], _ONLY_FUNCTIONS]], Field(max_length=128)]


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: Text


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ReasoningConfig(_Strict):
    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: None = None  # a summary of the thought (auto, concise, detailed) is OpenAI's to write: refused
    generate_summary: None = None


class TextConfig(_Strict):
    format: TextFormat = Field(default_factory=TextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice
# Fields OpenAI's Responses API has that tokenloom does not implement: refused by name when set, never dropped.
UNSUPPORTED = ("conversation", "prompt", "max_tool_calls", "context_management")
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` a model server can honour


class ResponsesRequest(_Body):
    model: Text | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    tools: Tools | None = None
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    # "auto": the conversation's earliest items dropped until it fits the context (OpenAI's); the default refuses.
    truncation: Literal["auto", "disabled"] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None  # vLLM's: lower runs first
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None  # vLLM's: as chat's
    store: bool | None = None  # false: the response is not kept (response_store.py)
    # Accepted and ignored, as chat completions ignore them.
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    safety_identifier: Text | None = None
    stream_options: dict[str, Any] | None = None  # OpenAI's include_obfuscation: no obfuscation is ever added
    include: list[Text] | None = None  # OUTPUT_LOGPROBS only
    top_logprobs: Annotated[int, Field(ge=-1)] | None = None  # alternatives per token, with OUTPUT_LOGPROBS
    previous_response_id: Text | None = None  # the kept response whose conversation this continues
    background: bool | None = None  # generated apart from this request; polled, or cancelled (responses_background.py)
    reasoning: ReasoningConfig | None = None  # its effort goes to the chat template, as chat's reasoning_effort
    # Refused when set (UNSUPPORTED).
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    context_management: Any = None

    def refuse_unsupported(self) -> None:
        for name in UNSUPPORTED:
            if getattr(self, name) not in (None, False, [], 0):
                raise APIError(400, f"{name} is not supported by tokenloom's /v1/responses", name, "unsupported")
        for item in self.include or []:
            if item != OUTPUT_LOGPROBS:
                raise APIError(400, f"include {item!r} is not supported (only {OUTPUT_LOGPROBS!r})", "include",
                               "unsupported")  # fmt: skip
        if self.logprobs() is not None and self.tools and self.tool_choice != "none":
            raise APIError(400, "output logprobs with tools are not supported", "include", "unsupported")

    def logprobs(self) -> int | None:
        """How many alternatives each output token's logprobs carry, if the output's logprobs are asked for."""
        return (self.top_logprobs or 0) if OUTPUT_LOGPROBS in (self.include or []) else None

    def input_items(self) -> list[ConversationItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [item for item in self.input if not isinstance(item, ReasoningInputItem)]

    def chat_request(self, earlier: Sequence[ConversationItem] = (), drop: int = 0) -> ChatCompletionRequest:
        """The chat completion this request amounts to, after the earlier conversation it continues (that of its
        previous_response_id), less its first `drop` items: the same sampling, tools and output format."""
        sampling = {name: getattr(self, name) for name in ("temperature", "top_p") if getattr(self, name) is not None}
        tools = [_chat_tool(tool) for tool in self.tools] if self.tools else None
        return ChatCompletionRequest(
            model=self.model,
            messages=self.messages(earlier, drop),
            max_completion_tokens=self.max_output_tokens,
            stream=self.stream,
            tools=tools,
            tool_choice=_chat_tool_choice(self.tool_choice) if tools else None,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=self._response_format(),
            priority=self.priority,
            cache_salt=self.cache_salt,
            reasoning_effort=self.reasoning.effort if self.reasoning is not None else None,
            **sampling,
        )

    def messages(self, earlier: Sequence[ConversationItem] = (), drop: int = 0) -> list[ChatMessage]:
        """Its instructions (an earlier response's are not carried over, as OpenAI's), then the conversation less
        its first `drop` items (and the calls' outputs that would then lead it, their calls gone)."""
        messages = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        items = [*earlier, *self.input_items()][drop:]
        while drop and items and isinstance(items[0], FunctionCallOutputItem):
            items.pop(0)
        for item in items:
            if isinstance(item, MessageItem):
                messages.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
            else:  # an earlier call joins the assistant's turn it belongs to
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        if not messages:
            raise APIError(400, "the input holds no message", "input", "invalid_value")
        return messages

    def _response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.name is None or fmt.json_schema is None:
            raise APIError(400, "a json_schema text format needs a name and a schema", "text.format", "invalid_value")
        schema = JSONSchemaFormat.model_validate(
            {"name": fmt.name, "description": fmt.description, "schema": fmt.json_schema, "strict": fmt.strict}
        )
        return ResponseFormat(type="json_schema", json_schema=schema)


def _chat_tool(tool: FunctionTool) -> Tool:
    function = FunctionDefinition(name=tool.name, description=tool.description, parameters=tool.parameters,
                                  strict=tool.strict)  # fmt: skip
    return Tool(type="function", function=function)


def _chat_tool_choice(choice: ToolChoice) -> Literal["none", "auto", "required"] | NamedToolChoice:
    if isinstance(choice, str):
        return choice
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


# The response object.

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reply's thought (--reasoning-parser), before its message and calls."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # OpenAI's field (a cache it bills writes to); ours writes as it goes, uncounted


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    # The request's settings, echoed as OpenAI echoes them.
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = False  # whether it was kept (response_store.py)
    previous_response_id: str | None = None
    background: bool = False
    reasoning: dict[str, Any] | None = None


def response_settings(request: ResponsesRequest) -> dict[str, Any]:
    """What a response echoes of its request."""
    text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text is not None else None
    choice = request.tool_choice
    echoed = {
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "parallel_tool_calls": request.parallel_tool_calls,
        "metadata": request.metadata,
        "user": request.user,
        "previous_response_id": request.previous_response_id,
        "truncation": request.truncation or "disabled",
        "background": bool(request.background),
        "reasoning": request.reasoning.model_dump(exclude_none=True) if request.reasoning is not None else None,
    }
    return echoed if text is None else {**echoed, "text": text}


def output_as_input(items: Sequence[OutputItem]) -> list[ConversationItem]:
    """A response's output as the input items that continue its conversation."""
    return [
        MessageItem(role="assistant", content=item.content[0].text) if isinstance(item, OutputMessage)
        else FunctionCallItem(type="function_call", call_id=item.call_id, name=item.name, arguments=item.arguments)
        for item in items if not isinstance(item, OutputReasoning)  # a past turn's thought: left out, as templates do
    ]  # fmt: skip


def response_id_prefix(replica_id: str | None) -> str:
    """What a response's id begins with: the replica's id under Ray Serve (replicas/routing.py reads it)."""
    return "resp_" if replica_id is None else f"resp_{replica_id}_"


def input_item_body(item: ConversationItem, suffix: str) -> dict[str, Any]:
    """An input item as OpenAI lists a response's input: with an id (its kind's prefix and `suffix`), a status, and
    a message's text as a content part."""
    if isinstance(item, MessageItem):
        part = "output_text" if item.role == "assistant" else "input_text"
        return {"id": f"msg_{suffix}", "type": "message", "role": item.role, "status": "completed",
                "content": [{"type": part, "text": item.text()}]}  # fmt: skip
    if isinstance(item, FunctionCallItem):
        return {"id": f"fc_{suffix}", "type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments, "status": "completed"}  # fmt: skip
    return {"id": f"fco_{suffix}", "type": "function_call_output", "call_id": item.call_id, "output": item.text(),
            "status": "completed"}  # fmt: skip
