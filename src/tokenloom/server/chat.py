"""``POST /v1/chat/completions``: chat templating, tool calls, and how its outputs are worded, whole and streamed."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenloom.model.loader import Tokenizer
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.server.errors import APIError
from tokenloom.server.logprobs import (
    TokenLogprobs,
    chat_logprobs_body,
    chat_logprobs_of,
    generated_logprobs,
    logprob_namer,
    vllm_prompt_logprobs,
)
from tokenloom.server.protocol import ChatCompletionRequest, ChatTemplateOptions
from tokenloom.server.reasoning import END, ReasoningParser, ReasoningStream, thinks_first
from tokenloom.server.response_models import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    ChunkObject,
    Usage,
)
from tokenloom.server.serving import check_model, serve_generation
from tokenloom.server.state import ERROR_RESPONSES, ServerState, server_state
from tokenloom.server.streaming import ChoiceChunks, text_deltas
from tokenloom.server.text_budget import TextBudget
from tokenloom.server.tool_calls import ForcedTool, forced_tool, new_call_id
from tokenloom.server.tool_parsers import ToolCallParser, reply_calls

router = APIRouter()
PROMPT_END_TOKENS = 64  # where a template opens or closes the reply's thought: the prompt's last tokens


@router.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})
async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
    state = server_state(raw)
    check_model(body, state)
    body.refuse_unsupported()
    prepared = await prepared_chat(state, body)
    top = body.top_logprobs if body.top_logprobs is not None else 0
    logprobs = top if body.logprobs else None
    by_id = state.names_tokens_by_id(body.return_tokens_as_token_ids)
    shape = ChatShape(prepared.tokenizer, prepared.forced, prepared.parser, by_id,
                      body.prompt_logprobs is not None, prepared.reasoning, body.include_reasoning,
                      body.return_token_ids, _reply_role(state.options.response_role, body))  # fmt: skip
    return await serve_generation(state, raw, body, [prepared.prompt_ids], logprobs, shape, prepared.structured)


def _reply_role(response_role: str, body: ChatCompletionRequest) -> str:
    """As vLLM's: the server's role for a reply that opens the assistant's turn; else the continued message's."""
    return response_role if body.add_generation_prompt else body.messages[-1].role


@dataclass
class PreparedChat:
    """A chat request made ready to generate: its prompt through the template, and how its output is read."""

    tokenizer: Tokenizer
    prompt_ids: list[int]
    forced: ForcedTool | None  # tool_choice "required" or a named function: the output is the call
    parser: ToolCallParser | None  # tool_choice "auto" with a parser: calls are read out of the reply
    structured: StructuredOutputsParams | None
    reasoning: ReasoningParser | None = None  # --reasoning-parser: the reply's thought apart from its answer


async def prepared_chat(state: ServerState, body: ChatCompletionRequest) -> PreparedChat:
    """The chat template applied to the conversation and its tools, the output's grammar (a forced tool call's, or
    the response format's), and the parser of calls in a free reply. Shared by /v1/chat/completions and
    /v1/responses."""
    tokenizer = chat_template_tokenizer(state, "use /v1/completions")
    forced = forced_tool(body, auto_parsed=state.tool_call_parser is not None)
    parser = state.tool_call_parser if body.tools and body.tool_choice in (None, "auto") else None
    structured = forced.spec if forced is not None else body.structured_output()
    conversation = [m.for_template() for m in body.messages]
    tools = [tool.model_dump() for tool in body.tools] if body.tools and body.tool_choice != "none" else None
    prompt_ids = await templated(state.text_budget, tokenizer, conversation, body, tools=tools)
    reasoning, structured = _reasoning_and_grammar(state.reasoning_parser, structured, tokenizer, prompt_ids)
    return PreparedChat(tokenizer, prompt_ids, forced, parser, structured, reasoning)


def chat_template_tokenizer(state: ServerState, instead: str) -> Tokenizer:
    """The model's tokenizer, if it has a chat template to put messages through; else a 400 saying what to do."""
    tokenizer = state.engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"this model has no chat template; {instead}", "messages")
    return tokenizer


def _reasoning_and_grammar(
    parser: ReasoningParser | None, structured: StructuredOutputsParams | None, tokenizer: Tokenizer,
    prompt_ids: list[int],
) -> tuple[ReasoningParser | None, StructuredOutputsParams | None]:  # fmt: skip
    """With a grammar, a reply that begins in a thought thinks freely: the grammar starts after its `</think>`, and
    all before it is its thought (deepseek_r1's reading), as vLLM does. One whose prompt has closed the thought
    follows the grammar from its first token, a thought only where it opens one (qwen3's reading)."""
    if parser is None or structured is None:
        return parser, structured
    if thinks_first(tokenizer.decode(prompt_ids[-PROMPT_END_TOKENS:])):
        end = tuple(tokenizer.encode(END, add_special_tokens=False))  # one added token in the models that think so
        return ReasoningParser("deepseek_r1"), dataclasses.replace(structured, starts_after=end)
    return ReasoningParser("qwen3"), structured


class ChatShape(ChoiceChunks):
    """How /v1/chat/completions words a request's outputs: whole, and as stream chunks (role with the first).

    Under a forced tool choice the output is the call: a named function's arguments stream as tool-call deltas;
    "required" calls (a JSON array until it closes) are sent whole when the output ends.
    """

    chunk_object: ChunkObject = "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_ids_in_choice = False  # vLLM sends a chat's prompt ids once, beside the choices

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        tool: ForcedTool | None = None,
        parser: ToolCallParser | None = None,
        token_ids_as_text: bool = False,
        prompt_logprobs: bool = False,
        reasoning: ReasoningParser | None = None,
        show_thought: bool = True,
        token_ids: bool = False,
        role: str = "assistant",
    ) -> None:
        self.role = role  # the reply's (--response-role, or the continued message's)
        self.namer = logprob_namer(tokenizer, token_ids_as_text)  # names the logprobs' tokens
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: the response carries the prompt's
        self.tool = tool
        self.parser = parser  # tool_choice "auto": calls are read out of the reply
        self.reasoning = reasoning  # the thought is the message's reasoning; calls are read from the answer
        self.show_thought = show_thought  # vLLM's include_reasoning: false drops the thought, the answer stays apart
        self.token_ids = token_ids  # vLLM's return_token_ids

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        choices = []
        for index, final in enumerate(finals):
            completion = final.outputs[0]
            thought, answer = self.reasoning.split(completion.text) if self.reasoning else (None, completion.text)
            thought = thought if self.show_thought else None
            content, calls = reply_calls(answer, self.tool, self.parser)
            shown = content if content or not thought else None
            message = AssistantMessage(role=self.role, content=shown, tool_calls=calls or [], reasoning=thought,
                                       reasoning_content=thought)  # fmt: skip
            finish_reason = completion.finish_reason
            if calls is not None and finish_reason == "stop":
                finish_reason = self.tool.finish_reason if self.tool is not None else "tool_calls"
            lp = chat_logprobs_body(final, self.namer) if logprobs else None
            ids = completion.token_ids if self.token_ids else None
            choices.append(ChatChoice(index=index, message=message, logprobs=lp, finish_reason=finish_reason,
                                      token_ids=ids))  # fmt: skip
        prompt_lp = vllm_prompt_logprobs(finals[0], self.namer) if self.prompt_logprobs else None
        prompt_ids = finals[0].prompt_token_ids if self.token_ids else None
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage,
                                      prompt_logprobs=prompt_lp, prompt_token_ids=prompt_ids)  # fmt: skip

    async def chunks(
        self, stream: AsyncIterator[RequestOutput], logprobs: bool
    ) -> AsyncIterator[tuple[ChatStreamChoice, RequestOutput]]:
        """Each content chunk carries the logprobs of the tokens that arrived since the last one, when asked for."""
        tool = self.tool
        unsent: list[TokenLogprobs] = []  # tokens come with each output; a chunk carries those not sent yet

        def choice(delta: dict[str, Any], finish_reason: str | None, output: RequestOutput) -> ChatStreamChoice:
            lp = None
            if unsent:
                lp = chat_logprobs_of(unsent)
                unsent.clear()
            return ChatStreamChoice(index=0, delta=ChatDelta(**delta), logprobs=lp, finish_reason=finish_reason)

        first, shown, parser, text = True, 0, self.parser, ""
        thinking = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        async for delta, finish_reason, output in text_deltas(stream):
            if logprobs:
                completion = output.outputs[0]
                unsent += generated_logprobs(completion.token_ids, completion.logprobs or [], self.namer)
            if thinking is not None:  # the thought goes out as it comes; what follows reads the answer alone
                thought, delta = thinking.feed(delta, last=finish_reason is not None)
                if thought and self.show_thought:
                    role = {"role": self.role} if first else {}
                    yield choice({**role, "reasoning": thought, "reasoning_content": thought}, None, output), output
                    first = False
            if parser is not None or tool is not None:
                text += delta  # what these read whole: the reply so far
            if parser is not None:  # content as far as it cannot begin a call; the calls once the reply is whole
                parsed = parser.parse(text) if finish_reason else None
                end = parser.streamable_end(text) if parsed is None or parsed.calls else len(text)
                delta, shown = text[shown:end], max(shown, end)
                if first or delta:
                    yield (
                        choice({"role": self.role, "content": delta} if first else {"content": delta}, None, output),
                        output,
                    )
                    first = False
                if parsed is not None:
                    if parsed.calls:
                        calls = [{"index": i, **call.model_dump()} for i, call in enumerate(parsed.calls)]
                        yield choice({"tool_calls": calls}, None, output), output
                        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
                    yield choice({}, finish_reason, output), output
                continue
            if tool is not None and tool.mode == "required":
                if finish_reason:  # the array is only whole at the end
                    yield choice({"role": self.role, **_required_delta(tool, text)}, None, output), output
                    calls_made = tool.calls(text) is not None and finish_reason == "stop"
                    yield choice({}, tool.finish_reason if calls_made else finish_reason, output), output
                continue
            if first:  # the role goes with the first token, as vLLM sends it, so TTFT is timed right
                yield choice({"role": self.role, **_content_delta(tool, delta, first=True)}, None, output), output
                first = False
            elif delta:
                yield choice(_content_delta(tool, delta, first=False), None, output), output
            if finish_reason:
                yield choice({}, finish_reason, output), output


def _content_delta(tool: ForcedTool | None, delta: str, first: bool) -> dict[str, Any]:
    """A stream chunk's delta: text, or a named function's arguments as they grow (its id and name first)."""
    if tool is None:
        return {"content": delta}
    function: dict[str, Any] = {"arguments": delta}
    call: dict[str, Any] = {"index": 0, "function": function}
    if first:
        call.update(id=new_call_id(), type="function")
        function["name"] = tool.name
    return {"content": None, "tool_calls": [call]} if first else {"tool_calls": [call]}


def _required_delta(tool: ForcedTool, text: str) -> dict[str, Any]:
    calls = tool.calls(text)
    if calls is None:  # cut short: what was decoded, as text
        return {"content": text}
    return {
        "content": None,
        "tool_calls": [{"index": i, **call.model_dump()} for i, call in enumerate(calls)],
    }


async def templated(
    budget: TextBudget,
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    options: ChatTemplateOptions,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    options.check_template_options()
    template_kwargs = options.chat_template_kwargs or {}
    if options.reasoning_effort is not None:  # as vLLM hands it over (gpt-oss's template reads it); the kwargs win
        template_kwargs = {"reasoning_effort": options.reasoning_effort, **template_kwargs}
    # Template variables only: apply_chat_template's own arguments (chat_template above all) are not the client's.
    taken = sorted(set(template_kwargs) & set(inspect.signature(tokenizer.apply_chat_template).parameters))
    if taken:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
    arguments = dict(template_kwargs, add_generation_prompt=options.add_generation_prompt,
                     continue_final_message=options.continue_final_message, tools=tools)  # fmt: skip
    try:
        ids = await budget.run(_text_size(conversation, tools), _template_ids, tokenizer, conversation, arguments)
    except Exception as error:  # the template itself refuses a conversation (roles out of order, ...)
        raise APIError(400, f"the chat template could not render these messages: {error}", "messages") from error
    prompt_ids = list(ids)
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "messages", "invalid_value")
    return prompt_ids


def _text_size(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """About the characters a conversation and its tools put through the template (what the text budget counts)."""
    return sum(len(str(value)) for message in conversation for value in message.values()) + len(str(tools or ""))


def _template_ids(tokenizer: Tokenizer, conversation: list[dict[str, Any]], arguments: dict[str, Any]) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, tokenize=True, **arguments)
    return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
