"""What every generating endpoint shares: validation, admission (tenant limits, the queue), n > 1 forks, the
stream of chunks (SSE, usage, disconnects) and the whole-response path. An endpoint supplies its ResponseShape: how
its outputs are worded, whole and as chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from tokenloom.beam_search import BeamSearch, BeamSearchParams
from tokenloom.engine.async_engine import AsyncEngine, RequestError
from tokenloom.engine.client import InvalidField
from tokenloom.engine.request_stream import RequestStream
from tokenloom.engine.structured_output import InvalidGrammar
from tokenloom.model.loader import Tokenizer
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import SamplingParams, StructuredOutputsParams
from tokenloom.server.beam_choices import BeamSearchChoices, StepSubmit
from tokenloom.server.errors import APIError
from tokenloom.server.forked_choices import ForkedChoices
from tokenloom.server.guard import Message
from tokenloom.server.protocol import DetokenizeRequest, StreamOptions, TokenizeRequest, _Common
from tokenloom.server.response_budget import response_charge
from tokenloom.server.state import ServerState, logger
from tokenloom.server.streaming import (
    Lease,
    ResponseShape,
    UsageCount,
    api_error_of,
    collect_finals,
    sse_response,
)
from tokenloom.server.tenants import Tenant


async def serve_generation(
    state: ServerState,
    raw: Request,
    body: _Common,
    prompts: list[list[int]],
    logprobs: int | None,
    shape: ResponseShape,
    structured: StructuredOutputsParams | None = None,
) -> Response:
    """The one generate path of both endpoints: admit, then stream the chunks or answer with the whole output.

    Each prompt gets body.n choices, numbered prompt by prompt; usage counts each prompt once, as OpenAI does.
    """
    prompts = _truncated(prompts, body.truncate_prompt_tokens, state.engine.max_model_len)
    response_id, request_id = _ids(shape, raw, body)
    created = int(time.time())
    counting = UsageCount(sum(len(p) for p in prompts), body.n, state.prompt_tokens_details)
    async with _admitted(state, raw, body, prompts, logprobs, structured, request_id) as (streams, lease):
        if body.stream:
            options = body.stream_options or StreamOptions()
            if state.options.force_include_usage:
                options = options.model_copy(update={"include_usage": True})
            frames = shape.sse_frames(
                streams, logprobs is not None, response_id, created, state.served_name(body.model), counting, options
            )
            return await sse_response(shape, frames, lease.transfer(), raw.receive)
        finals = await collect_finals(streams, raw.receive)
    response = _whole(state.served_name(body.model), shape, response_id, created, counting, finals, logprobs)
    # Straight to JSON bytes: model_dump() then json.dumps held a third copy of a response (its logprobs, mostly).
    return Response(response.model_dump_json(), media_type="application/json")


def _ids(shape: ResponseShape, raw: Request, body: _Common) -> tuple[str, str]:
    """The response's id (after the shape's prefix: the client's X-Request-Id, else the body's request_id, else a new
    one, as vLLM names it) and its engine requests' (unique even where clients reuse a name)."""
    named = raw.headers.get("x-request-id") or body.request_id
    raw.state.request_id = base = named or uuid.uuid4().hex  # what --enable-request-id-headers sends back
    response_id = f"{shape.id_prefix}{base}"
    return response_id, response_id if named is None else f"{response_id}-{uuid.uuid4().hex[:8]}"


async def generate_in_background(
    state: ServerState,
    raw: Request,
    body: _Common,
    prompt: list[int],
    logprobs: int | None,
    shape: ResponseShape,
    structured: StructuredOutputsParams | None,
    named: tuple[str, int],
    started: Callable[[], None],
    ended: Callable[[BaseModel | APIError], None],
) -> asyncio.Task[None]:
    """serve_generation's whole response, generated in a task of its own that no hang-up cancels (the Responses API's
    background mode). The request is admitted here, and a refusal raised to the caller; then the task holds its
    lease, calls `started` at its first output and `ended` last, with the shape's whole response or the APIError
    that cut it. Cancelling the task aborts the request. named: the response's id and creation time."""
    request_id, created = named
    prompts = _truncated([prompt], body.truncate_prompt_tokens, state.engine.max_model_len)
    counting = UsageCount(len(prompts[0]), 1, state.prompt_tokens_details)
    admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def generate() -> None:
        try:
            async with _admitted(state, raw, body, prompts, logprobs, structured, request_id) as (streams, _):
                admitted.set_result(None)
                finals = await collect_finals([_calling_at_first(s, started) for s in streams], _no_hang_up)
            named_model = state.served_name(body.model)
            outcome: BaseModel | APIError = _whole(named_model, shape, request_id, created, counting, finals, logprobs)
        except APIError as error:
            if not admitted.done():
                admitted.set_exception(error)
                return
            outcome = error
        except Exception:
            logger.exception("background request %s failed", request_id)
            outcome = APIError(500, "the server failed while generating this response", None, "server_error")
        except BaseException as error:  # cancelled: before admission, the caller hears it
            if not admitted.done():
                admitted.set_exception(error)
            raise
        ended(outcome)

    task = asyncio.create_task(generate(), name=f"background {request_id}")
    await admitted
    return task


def _whole(
    model_name: str,
    shape: ResponseShape,
    request_id: str,
    created: int,
    counting: UsageCount,
    finals: list[RequestOutput],
    logprobs: int | None,
) -> BaseModel:
    usage = counting.of(sum(len(final.outputs[0].token_ids) for final in finals), dict(enumerate(finals)))
    return shape.response(request_id, created, model_name, finals, logprobs is not None, usage)


async def _calling_at_first(
    stream: AsyncIterator[RequestOutput], call: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    first = True
    async for output in stream:
        if first:
            call()
            first = False
        yield output


async def _no_hang_up() -> Message:
    """A background request's `receive`: no client waits on it, so none can hang up."""
    await asyncio.get_running_loop().create_future()  # never done: cancelled when the outputs are whole
    raise AssertionError("unreachable")


@asynccontextmanager
async def _admitted(
    state: ServerState,
    raw: Request,
    body: _Common,
    prompts: list[list[int]],
    logprobs: int | None,
    structured: StructuredOutputsParams | None,
    request_id: str,
) -> AsyncIterator[tuple[list[AsyncIterator[RequestOutput]], Lease]]:
    """Applies the tenant's caps and limits, then admits the request's choices to the engine; yields their streams.

    A tenant's concurrency cap counts sequences (each prompt's n choices), held for the request's whole life.

    Caps apply to what the request will really do, after defaults are filled in: a request that leaves out
    max_tokens gets the tenant's cap, not the rest of the context. The tenant's concurrency slot is held until
    the request ends: here for a plain response, or by the streaming response once the lease is transferred.
    """
    tenant: Tenant = raw.state.tenant
    n = body.n
    params, charge = _params_within_limits(state, tenant, body, prompts, logprobs, structured)
    if state.log_requests:
        _log_received(request_id, tenant, n, prompts, params, state.max_log_len)
    lease = Lease(functools.partial(_give_back, state, tenant, len(prompts) * n, charge))  # the sequences taken
    priority = _priority(body.priority, tenant)
    arrival_time: float | None = getattr(raw.state, "arrival_time", None)
    submitted: list[RequestStream] = []

    async def submit(prompt: list[int], q: SamplingParams, rid: str, first: bool = True) -> RequestStream:
        stream = await _submit(state, body, tenant, prompt, q, rid, priority, arrival_time, first)
        submitted.append(stream)
        return stream

    try:
        streams: list[AsyncIterator[RequestOutput]] = []
        single = len(prompts) == 1 and n == 1
        for i, (prompt, q) in enumerate(zip(prompts, params, strict=True)):
            if body.use_beam_search:
                step = _beam_step_submitter(state, body, tenant, priority, arrival_time)
                streams.extend(_beam_search_choices(state, body, prompt, q, step, f"{request_id}-{i}"))
                continue
            first = await submit(prompt, q, request_id if single else f"{request_id}-{i}-0")
            if n == 1:
                streams.append(first)
                continue

            # The other choices arrive when they are forked, so a queue timeout counts from then.
            async def the_rest(prompt: list[int] = prompt, q: SamplingParams = q, i: int = i) -> list[RequestStream]:
                return [await submit(prompt, _choice_params(q, j), f"{request_id}-{i}-{j}", False) for j in range(1, n)]

            streams.extend(ForkedChoices(first, the_rest, n).streams)
        yield streams, lease
    except BaseException:
        for stream in submitted:  # what was admitted before the failure is aborted (read or not), not left running
            await stream.aclose()
        raise
    finally:
        lease.release()


def _log_received(
    request_id: str, tenant: Tenant, n: int, prompts: list[list[int]], params: list[SamplingParams], most: int | None
) -> None:
    for prompt, q in zip(prompts, params, strict=True):
        shown = prompt if most is None else prompt[:most]
        logger.info("Received request %s (tenant %s, n=%d): prompt_token_ids: %s, params: %s",
                    request_id, tenant.name, n, shown, q)  # fmt: skip


def _beam_step_submitter(
    state: ServerState, body: _Common, tenant: Tenant, priority: int, arrival_time: float | None
) -> StepSubmit:
    """How a beam search submits a step's request: its first step's requests arrived with the client's request."""

    async def step(prompt: list[int], q: SamplingParams, rid: str, first: bool) -> RequestStream:
        return await _submit(state, body, tenant, prompt, q, rid, priority, arrival_time, first)

    return step


def _params_within_limits(
    state: ServerState,
    tenant: Tenant,
    body: _Common,
    prompts: list[list[int]],
    logprobs: int | None,
    structured: StructuredOutputsParams | None,
) -> tuple[list[SamplingParams], int]:
    """Each prompt's sampling parameters, after the context check and the tenant's caps, and the request's charge of
    the response budget; the charge, the tenant's tokens and its sequences are taken (given back by the request's
    lease). A refusal is counted and raised."""
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
            asked = body.sampling_params(max_tokens, logprobs, state.sampling_defaults, structured)
            params.append(_logprobs_resolved(state, asked))  # before the charge, which grows with them
        tokens = sum((len(p) + q.max_tokens) * n for p, q in zip(prompts, params, strict=True))
        lengths = [len(p) for p in prompts]
        charge = response_charge(lengths, params, n, bool(body.stream), state.engine.hidden_size)
        state.response_budget.take_or_refuse(charge)
        try:
            limiter.acquire(tenant, tokens, sequences)
        except APIError:
            state.response_budget.give_back(charge)
            raise
    except APIError as error:
        metrics.rejected_request(error.code or "invalid", tenant.name)
        raise
    for q in params:
        metrics.admitted_request(q.max_tokens, n)
    return params, charge


def _logprobs_resolved(state: ServerState, params: SamplingParams) -> SamplingParams:
    try:
        return state.engine.with_logprobs_resolved(params)
    except InvalidField as error:
        raise APIError(400, str(error), error.field, "invalid_value") from error


def _give_back(state: ServerState, tenant: Tenant, sequences: int, charge: int) -> None:
    """What an admitted request took: its tenant's sequences and its charge of the response budget."""
    state.limiter.release(tenant, sequences)
    state.response_budget.give_back(charge)


def _beam_search_choices(
    state: ServerState, body: _Common, prompt: list[int], params: SamplingParams, step: StepSubmit, request_id: str
) -> list[AsyncIterator[RequestOutput]]:
    """The prompt's n choices as the n best beams of one search (use_beam_search), its max_tokens and logprobs."""
    if params.structured_outputs is not None:
        message = "structured output (response_format, structured_outputs, a forced tool) is not supported with "
        raise APIError(400, message + "use_beam_search", "use_beam_search", "unsupported")
    try:
        search_params = BeamSearchParams(body.n, params.max_tokens, body.ignore_eos, params.temperature,
                                         body.length_penalty, body.include_stop_str_in_output)  # fmt: skip
        search = BeamSearch(prompt, search_params, state.engine.eos_token_ids, params.logprobs)
        search.check_logprobs(state.engine.max_logprobs)
    except ValueError as error:
        raise APIError(400, f"use_beam_search with n={body.n}: {error}", "n", "invalid_value") from error
    return BeamSearchChoices(search, step, request_id, state.engine.decode).streams


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice j of n: its own random stream (a seeded request stays reproducible, its choices differ)."""
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed ^ j)


def check_model(body: _Common | TokenizeRequest | DetokenizeRequest, state: ServerState) -> None:
    served = body.model == state.model_name or body.model in state.aliases or state.adapters.get(body.model)
    if body.model is not None and not served:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {state.model_name!r}",
            "model",
            "model_not_found",
        )


def _priority(requested: int | None, tenant: Tenant) -> int:
    """Lower runs first: a request may ask to run after its tenant's priority, never before it."""
    return tenant.priority if requested is None else max(requested, tenant.priority)


async def tokenized(state: ServerState, prompt: str | list[int]) -> list[int]:
    """Tokenizes in a worker thread, so a long prompt never stalls the event loop (and /health with it), within the
    server's text budget."""
    try:
        size = len(prompt) if isinstance(prompt, str) else 0
        prompt_ids = await state.text_budget.run(size, state.engine.tokenize, prompt)
    except ValueError as error:
        raise APIError(400, str(error), "prompt", "invalid_value") from error
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
    return prompt_ids


def _truncated(prompts: list[list[int]], keep: int | None, max_model_len: int) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: each prompt's last `keep` tokens (-1: max_model_len's worth)."""
    if keep is None:
        return prompts
    keep = max_model_len if keep == -1 else keep
    if not 1 <= keep <= max_model_len:
        message = f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the model's context length)"
        raise APIError(400, message, "truncate_prompt_tokens", "invalid_value")
    return [prompt[-keep:] for prompt in prompts]


def require_tokenizer(engine: AsyncEngine) -> Tokenizer:
    if engine.tokenizer is None:
        raise APIError(400, "this model has no tokenizer; send token ids", None, "unsupported")
    return engine.tokenizer


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


def _wake_every(state: ServerState, body: _Common) -> int | None:
    """How many new tokens a choice's stream holds before its reader is woken (AsyncEngine.submit): a streamed
    response's interval, the server's or the request's if higher; a whole response's reader only at its ends."""
    return max(state.stream_interval, body.stream_interval or 1) if body.stream else None


async def _submit(
    state: ServerState,
    body: _Common,
    tenant: Tenant,
    prompt_ids,
    params,
    request_id: str,
    priority: int,
    arrival_time: float | None,
    first: bool,
) -> RequestStream:
    """Submits one of a client request's engine requests: its ``first`` arrived with the client's request and passes
    the queue limits; the others (later choices, later beam steps) arrive now and go on with it."""
    engine, metrics, wake_every = state.engine, state.metrics, _wake_every(state, body)
    try:
        return await engine.submit(
            prompt_ids, params, request_id, priority, tenant.name, arrival_time if first else None, wake_every,
            state.adapters.get(body.model), continues=not first, cache_salt=tenant.cache_salt(body.cache_salt),
        )  # fmt: skip
    except RequestError as error:
        metrics.rejected_request(error.reason.value, tenant.name)
        raise api_error_of(error) from error
    except InvalidGrammar as error:
        metrics.rejected_request("invalid", tenant.name)
        raise APIError(400, str(error), "response_format", "invalid_value") from error
    except ValueError as error:
        metrics.rejected_request("invalid", tenant.name)
        raise APIError(400, str(error), getattr(error, "field", "prompt"), "invalid_value") from error
