"""The FastAPI application: the routers of the endpoint modules (completions.py, chat.py, responses_api.py,
embeddings.py, score.py, tokenization.py, health.py: models, health, readiness, metrics, version) over the shared
serving base (serving.py, streaming.py), behind the guard (guard.py: body size, keys, tenants) and the error
handlers here.

Every error leaves as OpenAI's body, {"error": {"message", "type", "param", "code"}}, whatever raised it. A
request's failure is its own: the engine fails it alone, the others go on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

import tokenloom
from tokenloom.engine.async_engine import AsyncEngine
from tokenloom.server import (
    chat,
    classify,
    completions,
    embeddings,
    health,
    lora_routes,
    responses_api,
    score,
    tokenization,
)
from tokenloom.server.errors import APIError
from tokenloom.server.guard import Guard
from tokenloom.server.metrics import ServerMetrics
from tokenloom.server.reasoning import reasoning_parser
from tokenloom.server.request_ids import RequestIdHeaders
from tokenloom.server.response_budget import ResponseBudget
from tokenloom.server.response_store import ResponseStore
from tokenloom.server.state import ServerState, VllmOptions
from tokenloom.server.tenants import RESERVED_NAME as OPERATOR_TENANT
from tokenloom.server.tenants import Tenant, TenantLimiter
from tokenloom.server.text_budget import TextBudget
from tokenloom.server.tool_parsers import tool_parser
from tokenloom.server_config import ServerConfig

ENDPOINT_MODULES = (health, completions, chat, embeddings, classify, score, responses_api, tokenization, lora_routes)
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "invalid_body"}


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
    reasoning_parser_name: str | None = None,
    log_requests: bool = False,
    max_log_len: int | None = None,
    root_path: str = "",
    stream_interval: int = ServerConfig.stream_interval,
    max_inflight_body_bytes: int = ServerConfig.max_inflight_body_bytes,
    max_inflight_response_bytes: int = ServerConfig.max_inflight_response_bytes,
    body_timeout: float = ServerConfig.body_timeout,
    responses_store_bytes: int = ServerConfig.responses_store_bytes,
    replica_id: str | None = None,
    prompt_tokens_details: bool = False,
    vllm_options: VllmOptions | None = None,
) -> FastAPI:
    """With api_keys or tenants, every endpoint but /health and /ready needs a bearer key."""
    options = vllm_options or VllmOptions()
    on = options.fastapi_docs  # /docs, /redoc and the schema, unless --disable-fastapi-docs
    app = FastAPI(title="tokenloom", version=tokenloom.__version__, root_path=root_path,
                  docs_url="/docs" if on else None, redoc_url="/redoc" if on else None,
                  openapi_url="/openapi.json" if on else None)  # fmt: skip
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
        stream_interval,
        ResponseStore(responses_store_bytes) if responses_store_bytes else None,
        prompt_tokens_details,
        replica_id,
        TextBudget.for_bodies_up_to(max_body_bytes),
        ResponseBudget(max_inflight_response_bytes),
        reasoning_parser=reasoning_parser(reasoning_parser_name),
        options=options,
    )
    routers = [m.router for m in ENDPOINT_MODULES]
    guard = functools.partial(Guard, max_body_bytes=max_body_bytes, max_inflight_body_bytes=max_inflight_body_bytes,
                              body_timeout=body_timeout)  # fmt: skip
    _add_guard(app, guard, metrics, routers, api_keys, tenants)
    if options.request_id_headers:
        app.add_middleware(RequestIdHeaders)
    _add_routes(app, routers)
    return app


def _add_guard(
    app: FastAPI,
    guard: Callable[..., Guard],
    metrics: ServerMetrics,
    routers: list[APIRouter],
    api_keys: list[str] | None,
    tenants: list[Tenant] | None,
) -> None:
    """The guard in front of every route: body sizes and deadlines (``guard``'s), bearer keys and their tenants."""
    default_tenant = Tenant(name=OPERATOR_TENANT, keys=tuple(api_keys or ()))
    app.add_middleware(
        guard,
        key_owners=[(key.encode(), t) for t in [default_tenant, *(tenants or [])] for key in t.keys],
        default_tenant=default_tenant,
        on_reject=lambda reason: metrics.rejected_request(reason, ""),
        on_response=metrics.http_request,
        handler_of=_handler_of([route for router in routers for route in router.routes]),
    )


def _add_routes(app: FastAPI, routers: list[APIRouter]) -> None:
    """The endpoints, the handlers that word every error as OpenAI does, and the schema that says so."""
    for router in routers:
        app.include_router(router)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, _http_error)  # type: ignore[arg-type]
    app.openapi = lambda: _openapi_with_our_errors(app)  # type: ignore[method-assign]


async def _api_error(_: Request, error: APIError) -> JSONResponse:
    return _error_response(error)


def _handler_of(routes: list[Any]) -> Callable[[str], str]:
    """A path as a bounded metrics label: its route's path (a template's, for /v1/responses/{response_id}), or
    "none" for any unknown path."""
    exact = frozenset(route.path for route in routes if "{" not in route.path)
    templates = [(route.path_regex, route.path) for route in routes if "{" in route.path]

    def handler_of(path: str) -> str:
        if path in exact:
            return path
        return next((template for regex, template in templates if regex.match(path)), "none")

    return handler_of


async def _validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
    return _error_response(_validation_api_error(error))


async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
    code = _HTTP_CODES.get(error.status_code, "http_error")
    return _error_response(APIError(error.status_code, str(error.detail), None, code, dict(error.headers or {})))


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
