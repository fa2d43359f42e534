"""The FastAPI application: OpenAI-compatible completions and chat, models, health, readiness, metrics, version.

Every error leaves as OpenAI's body, {"error": {"message", "type", "param", "code"}}, whatever raised it. A
request's failure is its own: the engine fails it alone, the others go on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import tokenloom
from tokenloom.config import ServerConfig
from tokenloom.engine.async_engine import AsyncEngine, Rejection, RequestRejected
from tokenloom.engine.structured_output import InvalidGrammar
from tokenloom.model.loader import Tokenizer
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams
from tokenloom.server.guard import Guard, Receive, until_disconnected
from tokenloom.server.metrics import ServerMetrics, escape_label_value
from tokenloom.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    StreamOptions,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    _Common,
)
from tokenloom.server.tenants import RESERVED_NAME as OPERATOR_TENANT
from tokenloom.server.tenants import Tenant, TenantLimiter
from tokenloom.server.tool_calls import ForcedTool, forced_tool, new_call_id
from tokenloom.server.tool_parsers import ToolCallParser, tool_parser

T = TypeVar("T")
logger = logging.getLogger("tokenloom.requests")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
        (413, "Request body too large"),
        (429, "Over a rate, concurrency or queue limit (see Retry-After)"),
        (503, "Waited too long in the queue, or the server is shutting down"),
    )
}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "invalid_body"}


@dataclass
class ServerState:
    """What the routes share, on ``app.state.tokenloom``."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    limiter: TenantLimiter
    version_info: dict[str, Any]
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # from a generation_config.json
    aliases: tuple[str, ...] = ()  # more names clients may give as `model` (--served-model-name a b)
    tool_call_parser: ToolCallParser | None = None  # tool_choice "auto" is served only with one
    log_requests: bool = False
    max_log_len: int | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))  # /v1/models: when this server started


router = APIRouter()


def build_app(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    model_name: str,
    api_keys: list[str] | None = None,
    tenants: list[Tenant] | None = None,
    max_body_bytes: int = ServerConfig.max_body_bytes,
    version_info: dict[str, Any] | None = None,
    sampling_defaults: dict[str, float] | None = None,
    aliases: tuple[str, ...] = (),
    tool_call_parser: str | None = None,
    log_requests: bool = False,
    max_log_len: int | None = None,
    root_path: str = "",
) -> FastAPI:
    """With api_keys or tenants, every endpoint but /health and /ready needs a bearer key."""
    app = FastAPI(title="tokenloom", version=tokenloom.__version__, root_path=root_path)
    app.state.tokenloom = ServerState(
        engine,
        metrics,
        model_name,
        TenantLimiter(),
        version_info or {},
        dict(sampling_defaults or {}),
        aliases,
        tool_parser(tool_call_parser) if tool_call_parser else None,
        log_requests,
        max_log_len,
    )
    default_tenant = Tenant(name=OPERATOR_TENANT, keys=tuple(api_keys or ()))
    key_owners = [(key.encode(), t) for t in [default_tenant, *(tenants or [])] for key in t.keys]
    route_paths = frozenset(getattr(route, "path", "") for route in router.routes)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.add_middleware(
        Guard,
        max_body_bytes=max_body_bytes,
        key_owners=key_owners,
        default_tenant=default_tenant,
        on_reject=lambda reason: metrics.rejected_request(reason, ""),
        on_response=metrics.http_request,
        handler_of=lambda path: path if path in route_paths else "none",
    )
    app.include_router(router)
    app.openapi = lambda: _openapi_with_our_errors(app)  # type: ignore[method-assign]
    return app


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.tokenloom
    return state


async def _api_error(_: Request, error: APIError) -> JSONResponse:
    return _error_response(error)


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    return _error_response(_validation_api_error(error))


async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    code = _HTTP_CODES.get(error.status_code, "http_error")
    return _error_response(APIError(error.status_code, str(error.detail), None, code, dict(error.headers or {})))


@router.get("/health")
async def health(raw: Request) -> JSONResponse:
    """Liveness: 503 from the moment the engine is gone (the server then exits), as vLLM's /health."""
    if not _state(raw).engine.healthy:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(raw: Request) -> JSONResponse:
    state = _state(raw)
    if state.engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not state.engine.healthy:
        return JSONResponse({"status": "engine_unavailable"}, status_code=503)
    return JSONResponse({"status": "ready", "model": state.model_name})


@router.get("/version")
async def version(raw: Request) -> dict[str, Any]:
    state = _state(raw)
    return {"version": tokenloom.__version__, **state.version_info, **state.engine.describe()}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(raw: Request) -> Response:
    """Everything for the operator (an --api-key key, or anyone where no key is set); a tenant's key reads the
    samples labelled with its own tenant only, so no tenant learns the others' names or traffic."""
    text = _state(raw).metrics.render()
    tenant: Tenant | None = raw.state.tenant
    if tenant is not None and tenant.name != OPERATOR_TENANT:
        text = only_tenant(text, tenant.name)
    return Response(text, media_type="text/plain; version=0.0.4")


def only_tenant(exposition: bytes, name: str) -> bytes:
    """The exposition without the samples that carry another tenant's label."""
    own = f'tenant="{escape_label_value(name)}"'.encode()
    lines = exposition.split(b"\n")
    return b"\n".join(line for line in lines if b'tenant="' not in line or own in line)


@router.get("/v1/models")
async def models(raw: Request) -> ModelList:
    state = _state(raw)
    names = (state.model_name, *state.aliases)
    max_len = state.engine.max_model_len
    return ModelList(data=[ModelCard(id=name, created=state.created_at, max_model_len=max_len) for name in names])


@router.post("/v1/completions", responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES})
async def completions(body: CompletionRequest, raw: Request) -> Response:
    state = _state(raw)
    _check_model(body, state)
    body.refuse_unsupported()
    structured = body.structured_output()
    prompts = [await _tokenized(state.engine, prompt) for prompt in body.prompts()]
    shape = _CompletionShape(state.engine.tokenizer, body.echo)
    return await _generate(state, raw, body, prompts, body.logprobs, shape, structured)


@router.post("/v1/chat/completions", responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES})
async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
    state = _state(raw)
    _check_model(body, state)
    body.refuse_unsupported()
    tokenizer = state.engine.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
    forced = forced_tool(body, auto_parsed=state.tool_call_parser is not None)
    parser = state.tool_call_parser if body.tools and body.tool_choice in (None, "auto") else None
    structured = forced.spec if forced is not None else body.structured_output()
    conversation = [m.for_template() for m in body.messages]
    tools = [tool.model_dump() for tool in body.tools] if body.tools and body.tool_choice != "none" else None
    prompt_ids = await _templated(tokenizer, conversation, tools=tools)
    top = body.top_logprobs if body.top_logprobs is not None else 0
    logprobs = top if body.logprobs else None
    return await _generate(state, raw, body, [prompt_ids], logprobs, _ChatShape(tokenizer, forced, parser), structured)


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, raw: Request) -> TokenizeResponse:
    """As vLLM's: a prompt's tokens (or a conversation's, through the chat template), counted."""
    state = _state(raw)
    _check_model(body, state)
    tokenizer = _require_tokenizer(state.engine)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "send exactly one of prompt and messages", "prompt", "invalid_value")
    if body.messages is not None:
        conversation = [m.for_template() for m in body.messages]
        ids = await _templated(tokenizer, conversation, body.add_generation_prompt)
    else:
        ids = list(await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens))
    strs = [tokenizer.convert_ids_to_tokens(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    state = _state(raw)
    _check_model(body, state)
    tokenizer = _require_tokenizer(state.engine)
    vocab = state.engine.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", "tokens", "invalid_value")
    return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))


class _CompletionShape:
    """How /v1/completions words a request's outputs: whole, and as stream chunks. With ``echo`` the prompt comes
    first (in the first chunk of a stream), with its tokens' logprobs when logprobs are asked for."""

    chunk_object, id_prefix = "text_completion", "cmpl"

    def __init__(self, tokenizer: Tokenizer | None, echo: bool = False) -> None:
        self.tokenizer = tokenizer
        self.echo = echo

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        choices = []
        for index, final in enumerate(finals):
            completion = final.outputs[0]
            prefix, lp, offset = self._echoed(final, logprobs)
            if logprobs:
                lp = _joined(lp, _completion_logprobs(final, self.tokenizer, 0, offset)[0])
            choices.append(
                CompletionChoice(
                    index=index, text=prefix + completion.text, logprobs=lp, finish_reason=completion.finish_reason
                )
            )
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)

    async def chunks(
        self, stream: AsyncIterator[RequestOutput], logprobs: bool
    ) -> AsyncIterator[tuple[dict[str, Any], RequestOutput]]:
        """A chunk for every step that gave the request a token, as vLLM streams: its text may be empty (the bytes of
        an unfinished character, or text held back while it may begin a stop string), but the client learns the
        token came (TTFT is timed on it). Each carries the logprobs of the tokens since the last, when asked for."""
        sent_tokens, text_offset, first = 0, 0, True
        async for delta, finish_reason, output in _text_deltas(stream):
            prefix, lp = "", None
            if first:
                prefix, lp, text_offset = self._echoed(output, logprobs)
                first = False
            if logprobs:
                new, text_offset = _completion_logprobs(output, self.tokenizer, sent_tokens, text_offset)
                lp = _joined(lp, new)
                sent_tokens = len(output.outputs[0].token_ids)
            yield {"index": 0, "text": prefix + delta, "logprobs": lp, "finish_reason": finish_reason}, output

    def _echoed(self, output: RequestOutput, logprobs: bool) -> tuple[str, dict[str, Any] | None, int]:
        """(the prompt's text, its logprobs, the text offset after it) under echo; else nothing."""
        if not self.echo:
            return "", None, 0
        prompt = output.prompt if output.prompt is not None else _decoded(self.tokenizer, output.prompt_token_ids)
        if not logprobs:
            return prompt, None, len(prompt)
        body, offset = _prompt_logprobs(output, self.tokenizer)
        return prompt, body, offset


def _joined(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two runs of completion logprobs as one (prompt, then completion)."""
    return second if first is None else {key: first[key] + second[key] for key in second}


def _decoded(tokenizer: Tokenizer | None, token_ids: list[int]) -> str:
    return "" if tokenizer is None else str(tokenizer.decode(token_ids))


class _ChatShape:
    """How /v1/chat/completions words a request's outputs: whole, and as stream chunks (role with the first).

    Under a forced tool choice the output is the call: a named function's arguments stream as tool-call deltas;
    "required" calls (a JSON array until it closes) are sent whole when the output ends.
    """

    chunk_object, id_prefix = "chat.completion.chunk", "chatcmpl"

    def __init__(
        self, tokenizer: Tokenizer | None, tool: ForcedTool | None = None, parser: ToolCallParser | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.tool = tool
        self.parser = parser  # tool_choice "auto": calls are read out of the reply

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        choices = []
        for index, final in enumerate(finals):
            completion = final.outputs[0]
            message, finish_reason = AssistantMessage(content=completion.text), completion.finish_reason
            calls = self.tool.calls(completion.text) if self.tool is not None else None
            if calls is not None:
                message = AssistantMessage(content=None, tool_calls=calls)
                finish_reason = self.tool.finish_reason if self.tool and finish_reason == "stop" else finish_reason
            elif self.parser is not None:
                parsed = self.parser.parse(completion.text)
                if parsed.calls:
                    message = AssistantMessage(content=parsed.content, tool_calls=parsed.calls)
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            lp = _chat_logprobs(final, self.tokenizer) if logprobs else None
            choices.append(ChatChoice(index=index, message=message, logprobs=lp, finish_reason=finish_reason))
        return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices, usage=usage)

    async def chunks(
        self, stream: AsyncIterator[RequestOutput], logprobs: bool
    ) -> AsyncIterator[tuple[dict[str, Any], RequestOutput]]:
        """Each content chunk carries the logprobs of the tokens that arrived since the last one, when asked for."""
        sent_tokens, tool = 0, self.tool

        def choice(delta: dict[str, Any], finish_reason: str | None, output: RequestOutput) -> dict[str, Any]:
            nonlocal sent_tokens
            lp = None
            if logprobs and len(output.outputs[0].token_ids) > sent_tokens:
                lp = _chat_logprobs(output, self.tokenizer, sent_tokens)
                sent_tokens = len(output.outputs[0].token_ids)
            return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}

        first, shown, parser = True, 0, self.parser
        async for delta, finish_reason, output in _text_deltas(stream):
            if parser is not None:  # content as far as it cannot begin a call; the calls once the reply is whole
                text = output.outputs[0].text
                parsed = parser.parse(text) if finish_reason else None
                end = parser.streamable_end(text) if parsed is None or parsed.calls else len(text)
                delta, shown = text[shown:end], max(shown, end)
                if first or delta:
                    yield (
                        choice({"role": "assistant", "content": delta} if first else {"content": delta}, None, output),
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
                    yield choice(_required_delta(tool, output.outputs[0].text), None, output), output
                    calls_made = tool.calls(output.outputs[0].text) is not None and finish_reason == "stop"
                    yield choice({}, tool.finish_reason if calls_made else finish_reason, output), output
                continue
            if first:  # the role goes with the first token, as vLLM sends it, so TTFT is timed right
                yield choice({"role": "assistant", **_content_delta(tool, delta, first=True)}, None, output), output
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
        return {"role": "assistant", "content": text}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"index": i, **call.model_dump()} for i, call in enumerate(calls)],
    }


_Shape = _CompletionShape | _ChatShape


async def _generate(
    state: ServerState,
    raw: Request,
    body: _Common,
    prompts: list[list[int]],
    logprobs: int | None,
    shape: _Shape,
    structured: StructuredOutputsParams | None = None,
) -> Response:
    """The one generate path of both endpoints: admit, then stream the chunks or answer with the whole output.

    Each prompt gets body.n choices, numbered prompt by prompt; usage counts each prompt once, as OpenAI does.
    """
    request_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    prompt_tokens = sum(len(p) for p in prompts)
    async with _admitted(state, raw, body, prompts, logprobs, structured, request_id) as (streams, lease):
        if body.stream:
            options = body.stream_options or StreamOptions()
            chunks = _envelopes(
                shape, streams, logprobs is not None, request_id, created, state.model_name, prompt_tokens, options
            )
            return await _sse(chunks, lease.transfer(), raw.receive)
        finals = await _collect(streams, raw.receive)
    usage_body = _usage(prompt_tokens, finals)
    response = shape.response(request_id, created, state.model_name, finals, logprobs is not None, usage_body)
    return JSONResponse(response.model_dump())


async def _envelopes(
    shape: _Shape,
    streams: list[AsyncIterator[RequestOutput]],
    logprobs: bool,
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    options: StreamOptions,
) -> AsyncGenerator[dict[str, Any]]:
    """Each chunk of every choice as it comes (with the usage so far, under continuous_usage_stats); then, if asked,
    the usage of all of them."""
    latest: dict[int, RequestOutput] = {}
    async for index, choice, output in _merged(shape, streams, logprobs):
        latest[index] = output
        usage = _usage(prompt_tokens, list(latest.values())).model_dump() if options.continuous_usage_stats else None
        yield _envelope(request_id, shape.chunk_object, created, model, [{**choice, "index": index}], usage)
    if options.include_usage and latest:
        usage = _usage(prompt_tokens, list(latest.values())).model_dump()
        yield _envelope(request_id, shape.chunk_object, created, model, [], usage)


async def _merged(
    shape: _Shape, streams: list[AsyncIterator[RequestOutput]], logprobs: bool
) -> AsyncIterator[tuple[int, dict[str, Any], RequestOutput]]:
    """(choice index, chunk, output) of every choice, interleaved as they come; the first failure ends them all."""
    if len(streams) == 1:  # the common case needs no tasks
        async for choice, output in shape.chunks(streams[0], logprobs):
            yield 0, choice, output
        return
    queue: asyncio.Queue[tuple[int, dict[str, Any], RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for choice, output in shape.chunks(stream, logprobs):
                await queue.put((index, choice, output))
            await queue.put(None)
        except Exception as error:  # RequestRejected, APIError: handed to the reader, which stops the others
            await queue.put(error)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # a hang-up or a failure: the other choices' requests are aborted with their streams
        await asyncio.gather(*tasks, return_exceptions=True)


@asynccontextmanager
async def _admitted(
    state: ServerState,
    raw: Request,
    body: _Common,
    prompts: list[list[int]],
    logprobs: int | None,
    structured: StructuredOutputsParams | None,
    request_id: str,
) -> AsyncIterator[tuple[list[AsyncIterator[RequestOutput]], _Lease]]:
    """Applies the tenant's caps and limits, then admits the request's choices to the engine; yields their streams.

    A tenant's concurrency cap counts sequences (each prompt's n choices), held for the request's whole life.

    Caps apply to what the request will really do, after defaults are filled in: a request that leaves out
    max_tokens gets the tenant's cap, not the rest of the context. The tenant's concurrency slot is held until
    the request ends: here for a plain response, or by the streaming response once the lease is transferred.
    """
    tenant: Tenant = raw.state.tenant
    max_model_len, limiter, metrics, n = state.engine.max_model_len, state.limiter, state.metrics, body.n
    requested = body.requested_max_tokens()
    for prompt in prompts:
        _check_context(len(prompt), requested, max_model_len)
    try:
        params = []
        sequences = len(prompts) * n
        for prompt in prompts:
            limiter.check_caps(tenant, len(prompt), requested, sequences)
            max_tokens = _default_max_tokens(requested, tenant, len(prompt), max_model_len)
            params.append(body.sampling_params(max_tokens, logprobs, state.sampling_defaults, structured))
        tokens = sum((len(p) + q.max_tokens) * n for p, q in zip(prompts, params, strict=True))
        limiter.acquire(tenant, tokens, sequences)
    except APIError as error:
        metrics.rejected_request(error.code or "invalid", tenant.name)
        raise
    for q in params:
        metrics.admitted_request(q.max_tokens, n)
    if state.log_requests:
        for prompt, q in zip(prompts, params, strict=True):
            shown = prompt if state.max_log_len is None else prompt[: state.max_log_len]
            logger.info("Received request %s (tenant %s, n=%d): prompt_token_ids: %s, params: %s",
                        request_id, tenant.name, n, shown, q)  # fmt: skip
    lease = _Lease(lambda: limiter.release(tenant, sequences))
    priority = _priority(body.priority, tenant)
    arrival_time: float | None = getattr(raw.state, "arrival_time", None)
    submitted: list[AsyncGenerator[RequestOutput]] = []

    async def submit(
        prompt: list[int], q: SamplingParams, rid: str, arrival: float | None = arrival_time
    ) -> AsyncGenerator[RequestOutput]:
        stream = await _submit(state.engine, metrics, tenant, prompt, q, rid, priority, arrival)
        assert isinstance(stream, AsyncGenerator)  # the front's stream: closing it aborts the request
        submitted.append(stream)
        return stream

    try:
        streams: list[AsyncIterator[RequestOutput]] = []
        single = len(prompts) == 1 and n == 1
        for i, (prompt, q) in enumerate(zip(prompts, params, strict=True)):
            first = await submit(prompt, q, request_id if single else f"{request_id}-{i}-0")
            if n == 1:
                streams.append(first)
                continue

            # The other choices arrive when they are forked, so a queue timeout counts from then.
            async def the_rest(prompt: list[int] = prompt, q: SamplingParams = q, i: int = i) -> list[AsyncGenerator]:
                return [await submit(prompt, _choice_params(q, j), f"{request_id}-{i}-{j}", None) for j in range(1, n)]

            streams.extend(_Fork(first, the_rest, n).streams)
        yield streams, lease
    except BaseException:
        for stream in submitted:  # what was admitted before the failure is aborted, not left running
            await stream.aclose()
        raise
    finally:
        lease.release()


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own random stream (a seeded request stays reproducible, its choices differ)."""
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed ^ j)


class _Fork:
    """One prompt's n choices, sharing the prompt's KV blocks: one prefill, n decodes.

    The first choice is admitted at once; the others when it has its first token, by which time the prompt's full
    blocks are in the prefix cache, so they take those blocks by reference (the block pool's ref counts) and compute
    only the prompt's last, partial block again. Without prefix caching each choice computes its prompt.
    """

    def __init__(
        self,
        first: AsyncIterator[RequestOutput],
        admit_rest: Callable[[], Awaitable[list[AsyncGenerator[RequestOutput]]]],
        n: int,
    ) -> None:
        self._first, self._admit_rest = first, admit_rest
        self._rest: list[AsyncGenerator[RequestOutput]] = []
        self._failure: BaseException | None = None
        self._admitted = asyncio.Event()
        self.streams: list[AsyncIterator[RequestOutput]] = [self._leader(), *(self._follower(j) for j in range(n - 1))]

    async def _leader(self) -> AsyncIterator[RequestOutput]:
        try:
            async for output in self._first:
                if not self._admitted.is_set():
                    try:
                        self._rest = await self._admit_rest()
                    except Exception as error:
                        self._failure = error
                        raise
                    finally:
                        self._admitted.set()
                yield output
        finally:
            if not self._admitted.is_set():  # ended before its first token: the others cannot start
                self._failure = RequestRejected(Rejection.REQUEST_FAILED, "the request's first choice did not start")
                self._admitted.set()

    async def _follower(self, j: int) -> AsyncIterator[RequestOutput]:
        await self._admitted.wait()
        if self._failure is not None:
            raise self._failure
        async for output in self._rest[j]:
            yield output


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_api_error(error: RequestValidationError) -> APIError:
    errors = list(error.errors())
    first = _most_telling(errors) if errors else {}
    if first.get("type") == "extra_forbidden":
        where = [str(part) for part in first.get("loc", ("body", "?"))[1:]]
        message = f"Unrecognized request argument supplied: {'.'.join(where)}"
        return APIError(400, message, where[0], "unknown_field")
    if first.get("type") == "json_invalid":
        return APIError(
            400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None, "invalid_json"
        )
    location = [str(p) for p in first.get("loc", ())[1:]]
    param = location[0] if location else None  # the field, not pydantic's union branch
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
    return APIError(400, message, param, "invalid_value")


def _most_telling(errors: list[Any]) -> Any:
    """The error to report: where a field is a union (stop: a string or a list), the branch whose type the value
    had says what is wrong ("at most 64 items"), not the branches it was never meant for ("should be a string")."""
    first = errors[0]
    if not str(first.get("type", "")).endswith("_type"):
        return first
    field = tuple(first.get("loc", ()))[:2]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    return next((e for e in same_field if not str(e.get("type", "")).endswith("_type")), first)


def _openapi_with_our_errors(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents 422 for validation errors; tokenloom answers them with 400 in OpenAI's shape."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _check_model(body: _Common | TokenizeRequest | DetokenizeRequest, state: ServerState) -> None:
    if body.model is not None and body.model != state.model_name and body.model not in state.aliases:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )


def _priority(requested: int | None, tenant: Tenant) -> int:
    """Lower runs first: a request may ask to run after its tenant's priority, never before it."""
    return tenant.priority if requested is None else max(requested, tenant.priority)


async def _tokenized(engine: AsyncEngine, prompt: str | list[int]) -> list[int]:
    """Tokenizes in a worker thread, so a long prompt never stalls the event loop (and /health with it)."""
    try:
        prompt_ids = await asyncio.to_thread(engine.tokenize, prompt)
    except ValueError as error:
        raise APIError(400, str(error), "prompt", "invalid_value") from error
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
    return prompt_ids


def _require_tokenizer(engine: AsyncEngine) -> Tokenizer:
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; send token ids", None, "unsupported")
    return engine.tokenizer


async def _templated(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    try:
        ids = await asyncio.to_thread(_template_ids, tokenizer, conversation, generation_prompt, tools)
    except Exception as error:  # the template itself refuses a conversation (roles out of order, ...)
        raise APIError(400, f"the chat template could not render these messages: {error}", "messages") from error
    prompt_ids = list(ids)
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "messages", "invalid_value")
    return prompt_ids


def _template_ids(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        conversation, tools=tools, add_generation_prompt=generation_prompt, tokenize=True
    )
    return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids


def _check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    wanted = prompt_len + (max_tokens or 1)
    if wanted > max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the request has {prompt_len} "
            f"prompt tokens and asks for {max_tokens or 1} more",
            "messages" if max_tokens is None else "max_tokens",
            "context_length_exceeded",
        )


def _default_max_tokens(requested: int | None, tenant: Tenant, prompt_len: int, max_model_len: int) -> int:
    """What the client asked for, else the rest of the context, never more than the tenant's cap."""
    if requested is not None:
        return requested
    rest = max_model_len - prompt_len
    return min(rest, tenant.max_tokens) if tenant.max_tokens is not None else rest


async def _submit(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    tenant: Tenant,
    prompt_ids,
    params,
    request_id: str,
    priority: int,
    arrival_time: float | None,
):
    try:
        return await engine.submit(prompt_ids, params, request_id, priority, tenant.name, arrival_time)
    except RequestRejected as error:
        metrics.rejected_request(error.reason.value, tenant.name)
        raise _rejected(error) from error
    except InvalidGrammar as error:
        metrics.rejected_request("invalid", tenant.name)
        raise APIError(400, str(error), "response_format", "invalid_value") from error
    except ValueError as error:
        metrics.rejected_request("invalid", tenant.name)
        raise APIError(400, str(error), getattr(error, "field", "prompt"), "invalid_value") from error


_REJECTION_STATUS = {
    Rejection.QUEUE_FULL: 429,
    Rejection.QUEUED_TOKENS_FULL: 429,
    Rejection.SERVER_DRAINING: 503,
    Rejection.ENGINE_UNAVAILABLE: 503,
    Rejection.QUEUE_TIMEOUT: 503,
    Rejection.SERVER_SHUTDOWN: 503,
    Rejection.ENGINE_ERROR: 500,
    Rejection.REQUEST_FAILED: 500,
}


def _rejected(error: RequestRejected) -> APIError:
    """The engine's reason as HTTP: 429 for full queues (with Retry-After), 503 while unavailable, 500 on failure."""
    headers = {"Retry-After": str(max(1, round(error.retry_after)))} if error.retry_after is not None else None
    return APIError(_REJECTION_STATUS[error.reason], error.message, None, error.reason.value, headers)


async def _unless_disconnected(work: Awaitable[T], receive: Receive) -> T:
    """Awaits `work`, or cancels it (aborting its request) and raises a 499 as soon as the client hangs up."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "client disconnected", None, "client_disconnected")
    finally:
        for pending in (task, watch):
            pending.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _collect(streams: list[AsyncIterator[RequestOutput]], receive: Receive) -> list[RequestOutput]:
    """Each choice's final output; a hang-up aborts them at once (their KV blocks and the tenant slot are freed)."""

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        assert final is not None
        return final

    async def every_last() -> list[RequestOutput]:
        if len(streams) == 1:
            return [await last(streams[0])]
        try:
            async with asyncio.TaskGroup() as group:  # one failing choice cancels the others (and aborts them)
                tasks = [group.create_task(last(stream)) for stream in streams]
        except BaseExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        return [task.result() for task in tasks]

    try:
        return await _unless_disconnected(every_last(), receive)
    except RequestRejected as error:
        raise _rejected(error) from error


class _Lease:
    """A tenant's concurrency slot, released exactly once, by whoever holds it last."""

    def __init__(self, release: Callable[[], None] | None) -> None:
        self._release = release

    def transfer(self) -> _Lease:
        moved, self._release = _Lease(self._release), None
        return moved

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


def _usage(prompt_tokens: int, finals: list[RequestOutput]) -> Usage:
    """OpenAI's count: each prompt once, every choice's completion."""
    completion = sum(len(final.outputs[0].token_ids) for final in finals)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


async def _sse(chunks: AsyncGenerator[dict[str, Any]], lease: _Lease, receive: Receive) -> StreamingResponse:
    """Commits to 200 only once the request has its first output: a queue timeout before it is a real 503."""
    try:
        first = [await _unless_disconnected(anext(chunks), receive)]
    except StopAsyncIteration:
        first = []
    except (APIError, RequestRejected) as error:
        lease.release()
        await chunks.aclose()
        if isinstance(error, RequestRejected):
            raise _rejected(error) from error
        raise

    async def events() -> AsyncIterator[str]:
        try:
            for chunk in first:
                yield f"data: {json.dumps(chunk)}\n\n"
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestRejected as error:  # failed or cut after the stream began: the client still hears why
            yield f"data: {json.dumps(_rejected(error).body())}\n\n"
        finally:
            lease.release()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def _text_deltas(stream: AsyncIterator[RequestOutput]):
    """(new text, finish reason or None, output) for each output of a request, until it finishes."""
    sent = 0
    async for output in stream:
        completion = output.outputs[0]
        delta, sent = completion.text[sent:], len(completion.text)
        yield delta, completion.finish_reason, output


def _envelope(request_id: str, kind: str, created: int, model: str, choices: list, usage=None) -> dict[str, Any]:
    body = {"id": request_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _chat_logprobs(output: RequestOutput, tokenizer: Tokenizer | None, start: int = 0) -> dict[str, Any]:
    """OpenAI's chat logprobs of the output's tokens from `start` on."""
    completion = output.outputs[0]
    content = []
    for token_id, entry in zip(completion.token_ids[start:], (completion.logprobs or [])[start:], strict=False):
        text = _token_text(tokenizer, token_id)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank or 0)
        content.append(
            {
                "token": text,
                "logprob": entry[token_id].logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": _token_text(tokenizer, t),
                        "logprob": lp.logprob,
                        "bytes": list(_token_text(tokenizer, t).encode()),
                    }
                    for t, lp in top
                ],
            }
        )
    return {"content": content}


def _completion_logprobs(
    output: RequestOutput, tokenizer: Tokenizer | None, start: int = 0, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """OpenAI's completion logprobs of the output's tokens from `start` on, whose text begins at `offset`; and the
    offset after them (for the next stream chunk)."""
    completion = output.outputs[0]
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(completion.token_ids[start:], (completion.logprobs or [])[start:], strict=False):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id].logprob)
        top_logprobs.append({_token_text(tokenizer, t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, offset


def _prompt_logprobs(output: RequestOutput, tokenizer: Tokenizer | None) -> tuple[dict[str, Any], int]:
    """Completion logprobs of the prompt's tokens (the first has none: nothing predicts it), and the offset after."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    for token_id, entry in zip(output.prompt_token_ids, entries, strict=True):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry[token_id].logprob)
        top = None if entry is None else {_token_text(tokenizer, t): lp.logprob for t, lp in entry.items() if lp.rank}
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, offset
