"""Health, readiness, version, metrics and the model list: the endpoints that never touch the engine's step."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import tokenloom
from tokenloom.server.errors import APIError
from tokenloom.server.metrics import escape_label_value
from tokenloom.server.response_models import ModelCard, ModelList
from tokenloom.server.state import ERROR_RESPONSES, server_state
from tokenloom.server.tenants import RESERVED_NAME as OPERATOR_TENANT
from tokenloom.server.tenants import Tenant

router = APIRouter()


@router.get("/health")
async def health(raw: Request) -> JSONResponse:
    """Liveness: 503 from the moment the engine is gone (the server then exits), as vLLM's /health."""
    if not server_state(raw).engine.healthy:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(raw: Request) -> JSONResponse:
    state = server_state(raw)
    if state.engine.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not state.engine.healthy:
        return JSONResponse({"status": "engine_unavailable"}, status_code=503)
    return JSONResponse({"status": "ready", "model": state.model_name})


@router.get("/version")
async def version(raw: Request) -> dict[str, Any]:
    state = server_state(raw)
    return {"version": tokenloom.__version__, **state.version_info, **state.engine.describe()}


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus_metrics(raw: Request) -> Response:
    """Everything for the operator (an --api-key key, or anyone where no key is set); a tenant's key reads the
    samples labelled with its own tenant only, so no tenant learns the others' names or traffic."""
    text = server_state(raw).metrics.render()
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
    state = server_state(raw)
    names = (state.model_name, *state.aliases)
    max_len = state.engine.max_model_len
    base = [
        ModelCard(id=name, created=state.created_at, max_model_len=max_len, root=state.engine.model_path)
        for name in names
    ]
    return ModelList(data=base + state.adapters.cards(state.created_at, max_len))


@router.get("/v1/models/{model:path}", responses=ERROR_RESPONSES)
async def model(model: str, raw: Request) -> ModelCard:
    """OpenAI's retrieve: one card of the list (a served name, an alias or a loaded adapter), else a 404."""
    for card in (await models(raw)).data:
        if card.id == model:
            return card
    state = server_state(raw)
    raise APIError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}", "model",
                   "model_not_found")  # fmt: skip
