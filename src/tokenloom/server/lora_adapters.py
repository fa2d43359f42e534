"""LoRA adapters served by name, as vLLM serves them: given at start (``--lora-modules name=path``, or vLLM's JSON
form), listed by /v1/models with the base model as their parent, chosen by a request's ``model``; and, where
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set (vLLM's switch), loaded and unloaded at run time through
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``. The adapters' weights load in the engine core, when the
first request of each arrives (model/lora.py); here each is checked once, when it is named. The routes that change
them at run time are lora_routes.py's."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenloom.lora import LoRARequest
from tokenloom.server.response_models import ModelCard


def parse_lora_modules(specs: tuple[str, ...] | list[str]) -> list[tuple[str, str, str | None]]:
    """(name, path, base model name) of each ``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``;
    ValueError saying which one is malformed."""
    modules = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                raw: dict[str, Any] = json.loads(spec)
                modules.append((str(raw["name"]), str(raw["path"]), raw.get("base_model_name")))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"--lora-modules {spec!r}: JSON needs a name and a path ({error})") from error
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: give name=path or a JSON object")
        modules.append((name, path, None))
    return modules


class ServedAdapters:
    """The adapters a request may name, each checked (its config read) by `check` when it is added."""

    def __init__(self, check: Callable[[LoRARequest], None], base_model_name: str, reserved: set[str]) -> None:
        self._check, self.base_model_name, self._reserved = check, base_model_name, reserved
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """ValueError if the name is taken (by the base model or another adapter) or the adapter cannot be served."""
        if name in self._reserved or name in self._by_name:
            raise ValueError(f"the name {name!r} is already served")
        lora = LoRARequest(name, self._next_id, path, base_model_name or self.base_model_name)
        self._check(lora)
        self._by_name[name] = lora
        self._next_id += 1
        return lora

    def remove(self, name: str) -> None:
        """KeyError if no adapter has the name. Requests already running under it finish under it."""
        del self._by_name[name]

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def cards(self, created: int, max_model_len: int) -> list[ModelCard]:
        return [
            ModelCard(
                id=lora.lora_name,
                created=created,
                max_model_len=max_model_len,
                root=lora.lora_path,
                parent=lora.base_model_name,
            )
            for lora in self._by_name.values()
        ]
