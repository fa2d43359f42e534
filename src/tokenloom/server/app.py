"""The FastAPI application: OpenAI-compatible completions and chat, models, health, readiness, metrics, version."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware.base import BaseHTTPMiddleware

import tokenloom
from tokenloom.engine.async_engine import AsyncEngine, RequestRejected
from tokenloom.outputs import RequestOutput
from tokenloom.server.metrics import ServerMetrics
from tokenloom.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tokenloom.server.tenants import Tenant, TenantLimiter

PUBLIC_PATHS = {"/health", "/ready"}


def build_app(
    engine: AsyncEngine,
    metrics: ServerMetrics,
    model_name: str,
    api_keys: list[str] | None = None,
    tenants: list[Tenant] | None = None,
    max_body_bytes: int = 1 << 20,
    version_info: dict[str, Any] | None = None,
) -> FastAPI:
    """With api_keys or tenants, every endpoint but /health and /ready needs a bearer key."""
    app = FastAPI(title="tokenloom", version=tokenloom.__version__)
    llm = engine.engine
    max_model_len = llm.max_model_len
    default_tenant = Tenant(name="default", keys=tuple(api_keys or ()))
    key_owners = [(key.encode(), t) for t in [default_tenant, *(tenants or [])] for key in t.keys]
    limiter = TenantLimiter()

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        location = [str(p) for p in first.get("loc", ())[1:]]
        param = location[0] if location else None  # the field, not pydantic's union branch
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return JSONResponse(APIError(400, message, param, "invalid_value").body(), status_code=400)

    class Guard(BaseHTTPMiddleware):
        """Body size first (413), then the bearer key (401), before any endpoint sees the request."""

        async def dispatch(self, request: Request, call_next):
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > max_body_bytes:
                metrics.rejected.labels(reason="body_too_large", tenant="").inc()
                error = APIError(413, f"request body over {max_body_bytes} bytes", None, "body_too_large")
                return JSONResponse(error.body(), status_code=413)
            tenant = _tenant_of(request, key_owners) if key_owners else default_tenant
            if tenant is None and request.url.path not in PUBLIC_PATHS:
                metrics.rejected.labels(reason="unauthorized", tenant="").inc()
                error = APIError(
                    401, "a valid API key is required (Authorization: Bearer KEY)", None, "invalid_api_key"
                )
                return JSONResponse(error.body(), status_code=401)
            request.state.tenant = tenant
            return await call_next(request)

    app.add_middleware(Guard)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ready", "model": model_name})

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": tokenloom.__version__, **(version_info or {}), "engine_config": llm.config.to_dict()}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenloom",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        body.refuse_unsupported()
        prompt_ids = _checked_prompt(engine, body.single_prompt(), body.max_tokens, max_model_len)
        params = body.sampling_params(_max_tokens(body.max_tokens, len(prompt_ids), max_model_len), body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        async with _admitted(raw.state.tenant, prompt_ids, params, body, request_id) as (stream, lease):
            if body.stream:
                usage = body.stream_options.include_usage if body.stream_options else False
                return _sse(_completion_chunks(stream, request_id, created, model_name, usage), lease.transfer())
            final = await _collect(stream, raw, engine, request_id)
        choice = {
            "index": 0,
            "text": final.outputs[0].text,
            "logprobs": None,
            "finish_reason": final.outputs[0].finish_reason,
        }
        if body.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(final, llm.tokenizer)
        return _envelope(request_id, "text_completion", created, model_name, [choice], _usage(final))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        body.refuse_unsupported()
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt_ids = list(_template_ids(llm.tokenizer, conversation))
        requested = body.max_completion_tokens or body.max_tokens
        _checked_prompt(engine, prompt_ids, requested, max_model_len)
        top = body.top_logprobs if body.top_logprobs is not None else 0
        params = body.sampling_params(
            _max_tokens(requested, len(prompt_ids), max_model_len), top if body.logprobs else None
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        async with _admitted(raw.state.tenant, prompt_ids, params, body, request_id, requested) as (stream, lease):
            if body.stream:
                usage = body.stream_options.include_usage if body.stream_options else False
                return _sse(_chat_chunks(stream, request_id, created, model_name, usage), lease.transfer())
            final = await _collect(stream, raw, engine, request_id)
        completion = final.outputs[0]
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": completion.text},
            "logprobs": _chat_logprobs(final, llm.tokenizer) if body.logprobs else None,
            "finish_reason": completion.finish_reason,
        }
        return _envelope(request_id, "chat.completion", created, model_name, [choice], _usage(final))

    @asynccontextmanager
    async def _admitted(tenant: Tenant, prompt_ids: list[int], params, body, request_id: str, requested=None):
        """Applies the tenant's caps and limits, then admits the request to the engine; yields its stream.

        The tenant's concurrency slot is held until the request ends: here for a plain response, or by the
        streaming response once the lease is transferred to it.
        """
        requested = requested if requested is not None else body.max_tokens
        priority = body.priority if body.priority is not None else tenant.priority
        try:
            limiter.check_caps(tenant, len(prompt_ids), requested)
            limiter.acquire(tenant, len(prompt_ids) + params.max_tokens)
        except APIError as error:
            metrics.rejected.labels(reason=error.code, tenant=tenant.name).inc()
            raise
        lease = _Lease(lambda: limiter.release(tenant))
        try:
            stream = await _submit(engine, metrics, tenant, prompt_ids, params, request_id, priority)
            yield stream, lease
        finally:
            lease.release()

    return app


class _Lease:
    """A tenant's concurrency slot, released exactly once, by whoever holds it last."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def transfer(self) -> _Lease:
        moved, self._release = _Lease(self._release), None
        return moved

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


def _tenant_of(request: Request, key_owners: list[tuple[bytes, Tenant]]) -> Tenant | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    # Compare against every key, in constant time each, so timing says nothing about which was close.
    matches = [t for key, t in key_owners if hmac.compare_digest(token.encode(), key)]
    return matches[0] if matches else None


def _template_ids(tokenizer, conversation: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids


def _checked_prompt(engine: AsyncEngine, prompt: str | list[int], max_tokens: int | None, max_model_len: int):
    try:
        prompt_ids = engine.tokenize(prompt)
    except ValueError as error:
        raise APIError(400, str(error), "prompt", "invalid_value") from error
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens", "invalid_value")
    wanted = len(prompt_ids) + (max_tokens or 1)
    if wanted > max_model_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the request has {len(prompt_ids)} "
            f"prompt tokens and asks for {max_tokens or 1} more",
            "messages" if max_tokens is None else "max_tokens",
            "context_length_exceeded",
        )
    return prompt_ids


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    return requested if requested is not None else max_model_len - prompt_len


async def _submit(
    engine: AsyncEngine, metrics: ServerMetrics, tenant: Tenant, prompt_ids, params, request_id: str, priority: int
):
    try:
        return await engine.submit(prompt_ids, params, request_id, priority, tenant.name)
    except RequestRejected as error:
        metrics.rejected.labels(reason=error.code, tenant=tenant.name).inc()
        raise APIError(error.status, error.message, None, error.code) from error
    except ValueError as error:
        metrics.rejected.labels(reason="invalid", tenant=tenant.name).inc()
        raise APIError(400, str(error), "prompt", "invalid_value") from error


async def _collect(stream: AsyncIterator[RequestOutput], raw: Request, engine: AsyncEngine, request_id: str):
    final = None
    try:
        async for output in stream:
            final = output
            if await raw.is_disconnected():
                engine.abort(request_id)
                raise APIError(499, "client disconnected")
    except RequestRejected as error:
        raise APIError(error.status, error.message, None, error.code) from error
    return final


def _usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(chunks: AsyncIterator[dict[str, Any]], lease: _Lease) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except RequestRejected as error:  # e.g. a queue timeout after the stream began
            yield f"data: {json.dumps(APIError(error.status, error.message, None, error.code).body())}\n\n"
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


async def _completion_chunks(stream, request_id: str, created: int, model: str, include_usage: bool):
    final = None
    async for delta, finish_reason, output in _text_deltas(stream):
        final = output
        if delta or finish_reason:
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
            yield _envelope(request_id, "text_completion", created, model, [choice])
    if include_usage and final is not None:
        yield _envelope(request_id, "text_completion", created, model, [], _usage(final))


async def _chat_chunks(stream, request_id: str, created: int, model: str, include_usage: bool):
    def chunk(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return _envelope(request_id, "chat.completion.chunk", created, model, [choice])

    yield chunk({"role": "assistant", "content": ""}, None)
    final = None
    async for delta, finish_reason, output in _text_deltas(stream):
        final = output
        if delta:
            yield chunk({"content": delta}, None)
        if finish_reason:
            yield chunk({}, finish_reason)
    if include_usage and final is not None:
        yield _envelope(request_id, "chat.completion.chunk", created, model, [], _usage(final))


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)


def _chat_logprobs(output: RequestOutput, tokenizer) -> dict[str, Any]:
    completion = output.outputs[0]
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
        text = _token_text(tokenizer, token_id)
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
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


def _completion_logprobs(output: RequestOutput, tokenizer) -> dict[str, Any]:
    completion = output.outputs[0]
    tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
    for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=False):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id].logprob)
        top_logprobs.append({_token_text(tokenizer, t): lp.logprob for t, lp in entry.items() if lp.rank is not None})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
