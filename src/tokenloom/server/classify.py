"""vLLM's ``POST /classify`` and ``POST /pooling``. /classify answers for a model served as a classifier (a
*ForSequenceClassification checkpoint's own head, or the reranker --hf-overrides' classifier_from_token makes of a
causal LM, as vLLM serves Qwen3-Reranker): each input's class probabilities (pooling_params.py), with the likeliest
class's label; any other model gets a 400, as vLLM's. /pooling answers with each input's pooled output as it is:
the embedding of an embedding model, the probabilities of a classifier; it takes what /v1/embeddings takes (input
or messages, dimensions, normalize, encoding_format)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tokenloom.outputs import RequestOutput
from tokenloom.server.embeddings import EmbeddingRequest, EmbeddingShape, embedded_prompts
from tokenloom.server.errors import APIError
from tokenloom.server.pooled import (
    COMMON_FIELDS,
    PooledList,
    PooledRequest,
    PooledShape,
    checked_state,
    listed_inputs,
    prompts_only,
)
from tokenloom.server.protocol import Text, TokenId
from tokenloom.server.response_models import Usage
from tokenloom.server.serving import serve_generation, tokenized
from tokenloom.server.state import ERROR_RESPONSES

router = APIRouter()


class ClassificationRequest(PooledRequest):
    FIELDS = COMMON_FIELDS | {"input"}
    ENDPOINT = "a classification"

    input: Text | list[TokenId] | Annotated[list[Text], Field(min_length=1)] | list[list[TokenId]]


class ClassificationData(BaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(PooledList):
    data: list[ClassificationData]
    usage: Usage


@router.post("/classify", responses={200: {"model": ClassificationResponse}, **ERROR_RESPONSES})
async def classify(body: ClassificationRequest, raw: Request) -> Response:
    state = checked_state(body, raw)
    classifier = state.engine.classifier
    if classifier is None:
        raise APIError(
            400, "this model is not a classifier (a *ForSequenceClassification checkpoint is one; --hf-overrides with "
            "classifier_from_token makes one of a causal LM)", "model", "unsupported",
        )  # fmt: skip
    body.score_with(classifier)
    prompts = [await tokenized(state, text) for text in listed_inputs(body.input)]
    return await serve_generation(state, raw, body, prompts, None, ClassificationShape(state.engine.labels))


class ClassificationShape(PooledShape):
    """How /classify words its outputs: the probabilities, and the label of the likeliest class: the checkpoint's
    name for it (id2label), else transformers' default (the classifier made from classifier_from_token has one class,
    LABEL_0)."""

    id_prefix = "classify-"

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        data = [self._classified(i, self.vector(final)) for i, final in enumerate(finals)]
        counted = prompts_only(usage)
        return ClassificationResponse(id=request_id, created=created, model=model, data=data, usage=counted)

    def _classified(self, index: int, probs: list[float]) -> ClassificationData:
        likeliest = max(range(len(probs)), key=probs.__getitem__)
        label = self.labels[likeliest] if likeliest < len(self.labels) else f"LABEL_{likeliest}"
        return ClassificationData(index=index, label=label, probs=probs, num_classes=len(probs))


class PoolingRequest(EmbeddingRequest):
    ENDPOINT = "a pooling"


class PoolingData(BaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(PooledList):
    data: list[PoolingData]
    usage: Usage


@router.post("/pooling", responses={200: {"model": PoolingResponse}, **ERROR_RESPONSES})
async def pooling(body: PoolingRequest, raw: Request) -> Response:
    state = checked_state(body, raw)
    if state.engine.classifier is not None:
        body.score_with(state.engine.classifier)  # a classifier's pooled output is its probabilities
    prompts = await embedded_prompts(state, body)
    return await serve_generation(state, raw, body, prompts, None, PoolingShape(body.encoding_format))


class PoolingShape(EmbeddingShape):
    """How /pooling words its outputs: each input's pooled values, as floats or base64 (as /v1/embeddings)."""

    id_prefix = "pool-"

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        data = [PoolingData(index=i, data=self.encoded(final)) for i, final in enumerate(finals)]
        counted = prompts_only(usage)
        return PoolingResponse(id=request_id, created=created, model=model, data=data, usage=counted)
