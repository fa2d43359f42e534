"""vLLM's routes that load and unload LoRA adapters at run time, where ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set
(vLLM's switch; without it they answer 404, as vLLM's are then absent), and to the operator's keys only (--api-key;
a tenant's key gets 403): what a server holds is not a tenant's to change. Not behind --ray, where each replica is a
server of its own. An unloaded adapter's running requests
finish under it; new ones naming it get 404."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tokenloom.server.errors import APIError
from tokenloom.server.response_models import ErrorResponse
from tokenloom.server.state import ERROR_RESPONSES, server_state
from tokenloom.server.tenants import RESERVED_NAME as OPERATOR_TENANT
from tokenloom.server.tenants import Tenant

RUNTIME_UPDATES_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

router = APIRouter()
RESPONSES = {**ERROR_RESPONSES, 403: {"model": ErrorResponse, "description": "A tenant's key"}}


class LoadLoRAAdapter(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapter(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _runtime_updates_allowed(raw: Request) -> None:
    tenant: Tenant | None = raw.state.tenant
    if tenant is not None and tenant.name != OPERATOR_TENANT:
        raise APIError(403, "only the operator's keys (--api-key) load and unload adapters", None, "permission_error")
    if server_state(raw).replica_id is not None:  # one replica behind Ray Serve's router: the others would not know
        raise APIError(400, "behind --ray, adapters are served from the start (--lora-modules) on every replica; one "
                       "loaded at run time would reach a single replica", None, "invalid_request")  # fmt: skip
    if os.environ.get(RUNTIME_UPDATES_ENV, "").lower() not in ("1", "true"):
        raise APIError(404, f"adapters are loaded at run time only where {RUNTIME_UPDATES_ENV}=True", None,
                       "not_found")  # fmt: skip


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=RESPONSES)
async def load_lora_adapter(body: LoadLoRAAdapter, raw: Request) -> str:
    _runtime_updates_allowed(raw)
    try:
        server_state(raw).adapters.add(body.lora_name, body.lora_path)
    except ValueError as error:
        raise APIError(400, str(error), "lora_path", "invalid_value") from error
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=RESPONSES)
async def unload_lora_adapter(body: UnloadLoRAAdapter, raw: Request) -> str:
    _runtime_updates_allowed(raw)
    try:
        server_state(raw).adapters.remove(body.lora_name)
    except KeyError as error:
        raise APIError(404, f"no LoRA adapter is named {body.lora_name!r}", "lora_name", "not_found") from error
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
