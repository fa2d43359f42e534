"""vLLM's ``POST /score`` and ``POST /rerank`` (also ``/v1/score``, ``/v1/rerank`` and Cohere's ``/v2/rerank``). With
an embedding model each text is embedded once (pooled.py) and a pair's score is the cosine similarity of its two
vectors (scoring.py); with a reranker (--hf-overrides) each pair is one prompt, its two texts joined, and its score
the classifier's. /score pairs text_1 with text_2 (1:1, 1:N or N:N); /rerank orders documents by their
score against a query, the best first. Both take vLLM's max_tokens_per_query and max_tokens_per_doc (each side's
text cut to its first tokens), /score its four spellings of the two sides, /rerank Jina's and Cohere's
return_documents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tokenloom.outputs import RequestOutput
from tokenloom.scoring import cosine, score_pairs
from tokenloom.server.chat import templated
from tokenloom.server.errors import APIError
from tokenloom.server.pooled import COMMON_FIELDS, PooledList, PooledRequest, PooledShape, checked_state, prompts_only
from tokenloom.server.protocol import MAX_CHOICES, ChatTemplateOptions, Text
from tokenloom.server.response_models import Usage
from tokenloom.server.serving import require_tokenizer, serve_generation, tokenized
from tokenloom.server.state import ERROR_RESPONSES, ServerState

router = APIRouter()
Texts = Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]


# vLLM's names for a score's two sides, one pair of them per request.
SIDES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"), ("queries", "items"))
TRUNCATING = frozenset({"max_tokens_per_query", "max_tokens_per_doc", "instruction", "chat_template_kwargs"})


class ScoringRequest(PooledRequest):
    """What /score and /rerank share: vLLM's truncation of each side before the pair is scored, and what a reranker's
    score template reads (--chat-template: the pair as a query message and a document message)."""

    max_tokens_per_query: Annotated[int, Field(ge=0)] = 0  # a query's first this many tokens; 0: all
    max_tokens_per_doc: Annotated[int, Field(ge=0)] = 0  # a document's first this many tokens; 0: all
    instruction: Text | None = None  # vLLM's: the template's `instruction`, as chat_template_kwargs would give it
    chat_template_kwargs: dict[str, Any] | None = None

    def template_variables(self) -> dict[str, Any]:
        given = dict(self.chat_template_kwargs or {})
        return given if self.instruction is None else {"instruction": self.instruction, **given}


class ScoreRequest(ScoringRequest):
    FIELDS = COMMON_FIELDS | TRUNCATING | {name for side in SIDES for name in side}
    ENDPOINT = "a score"

    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    def sides(self) -> tuple[list[str], list[str]]:
        """The texts on each side, from the one pair of vLLM's names the request uses."""
        named = {name for side in SIDES for name in side if getattr(self, name) is not None}
        given = [side for side in SIDES if set(side) == named]
        if len(given) != 1:
            message = "send text_1 and text_2 (or data_1 and data_2, queries and documents, queries and items)"
            raise APIError(400, message, "text_1", "invalid_value")
        first, second = (getattr(self, name) for name in given[0])
        return _listed(first), _listed(second)


def _listed(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


class RerankRequest(ScoringRequest):
    FIELDS = COMMON_FIELDS | TRUNCATING | {"query", "documents", "top_n", "return_documents"}
    ENDPOINT = "a rerank"

    query: Text
    documents: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)]
    top_n: Annotated[int, Field(ge=0)] = 0  # the best this many; 0: all, as vLLM's
    return_documents: bool = True  # Jina's and Cohere's: false leaves each result's document out


@router.post("/score", responses=ERROR_RESPONSES)
@router.post("/v1/score", responses=ERROR_RESPONSES)
async def score(body: ScoreRequest, raw: Request) -> Response:
    state = checked_state(body, raw)
    firsts, seconds = body.sides()
    try:
        pairs = score_pairs(len(firsts), len(seconds))
    except ValueError as error:
        raise APIError(400, str(error), "text_1", "invalid_value") from error
    texts = await _cut(state, body, firsts, seconds)
    prompts, scorer = await _prompts_and_scorer(state, body, texts, pairs)
    return await serve_generation(state, raw, body, prompts, None, ScoreShape(scorer))


@router.post("/rerank", responses=ERROR_RESPONSES)
@router.post("/v1/rerank", responses=ERROR_RESPONSES)
@router.post("/v2/rerank", responses=ERROR_RESPONSES)
async def rerank(body: RerankRequest, raw: Request) -> Response:
    state = checked_state(body, raw)
    pairs = score_pairs(1, len(body.documents))
    texts = await _cut(state, body, [body.query], body.documents)
    prompts, scorer = await _prompts_and_scorer(state, body, texts, pairs)
    shown = body.documents if body.return_documents else None
    return await serve_generation(state, raw, body, prompts, None, RerankShape(shown, body.top_n, scorer))


async def _cut(state: ServerState, body: ScoringRequest, firsts: list[str], seconds: list[str]) -> list[str]:
    """Both sides' texts, each cut to its side's first max_tokens_per_query or max_tokens_per_doc tokens."""
    limits = [body.max_tokens_per_query] * len(firsts) + [body.max_tokens_per_doc] * len(seconds)
    texts = [*firsts, *seconds]
    if not any(limits):
        return texts
    tokenizer = require_tokenizer(state.engine)
    cut = []
    for text, limit in zip(texts, limits, strict=True):
        ids = await state.text_budget.run(len(text), tokenizer.encode, text, add_special_tokens=False) if limit else []
        cut.append(tokenizer.decode(ids[:limit]) if len(ids) > limit else text)
    return cut


Scorer = Callable[[list[list[float]]], list[float]]  # each pair's score, from the vectors of the prompts served


async def _prompts_and_scorer(
    state: ServerState, body: ScoringRequest, texts: list[str], pairs: list[tuple[int, int]]
) -> tuple[list[list[int]], Scorer]:
    """The prompts to serve and how their vectors score the pairs: each text embedded, a pair scored by the cosine
    of its two vectors; or, with a reranker, each pair one prompt (its two texts joined, as vLLM's) scored by it."""
    if state.engine.classifier is None:
        ids = [await tokenized(state, text) for text in texts]
        return ids, lambda vectors: [cosine(vectors[a], vectors[b]) for a, b in pairs]
    classifier = state.engine.classifier
    if not classifier.scores_pairs:
        raise APIError(400, f"this classifier has {classifier.classifier_labels} labels, not a score: /classify "
                       "answers its probabilities", "model", "unsupported")  # fmt: skip
    body.score_with(classifier)
    if state.options.score_template:
        joined = [await _templated_pair(state, body, texts[a], texts[b]) for a, b in pairs]
    else:
        joined = [await tokenized(state, texts[a] + texts[b]) for a, b in pairs]
    return joined, lambda vectors: [vector[0] for vector in vectors]


async def _templated_pair(state: ServerState, body: ScoringRequest, query: str, document: str) -> list[int]:
    """A pair through the server's --chat-template, as vLLM renders it: a "query" message and a "document" one, the
    request's chat_template_kwargs (and instruction) beside them, no assistant's turn opened."""
    options = ChatTemplateOptions(add_generation_prompt=False, chat_template_kwargs=body.template_variables())
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    return await templated(state.text_budget, require_tokenizer(state.engine), messages, options)


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(PooledList):
    data: list[ScoreData]
    usage: Usage


class ScoreShape(PooledShape):
    """How /score words its outputs: one score a pair, in the order of text_2."""

    id_prefix = "score-"

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        scores = self.scorer([self.vector(final) for final in finals])
        data = [ScoreData(index=i, score=value) for i, value in enumerate(scores)]
        counted = prompts_only(usage)
        return ScoreResponse(id=request_id, created=created, model=model, data=data, usage=counted)


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class RerankShape(PooledShape):
    """How /rerank words its outputs: the documents by their score against the query, the best first (the first
    given first among equals), top_n of them."""

    id_prefix = "rerank-"

    def __init__(self, documents: list[str] | None, top_n: int, scorer: Scorer) -> None:
        self.documents, self.top_n, self.scorer = documents, top_n, scorer  # documents None: left out

    def response(
        self, request_id: str, created: int, model: str, finals: list[RequestOutput], logprobs: bool, usage: Usage
    ) -> BaseModel:
        scores = self.scorer([self.vector(final) for final in finals])
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: self.top_n or None]
        shown = self.documents
        results = [RerankResult(index=i, document=None if shown is None else RerankDocument(text=shown[i]),
                                relevance_score=scores[i]) for i in order]  # fmt: skip
        counted = RerankUsage(prompt_tokens=usage.prompt_tokens, total_tokens=usage.prompt_tokens)
        return RerankResponse(id=request_id, model=model, usage=counted, results=results)
