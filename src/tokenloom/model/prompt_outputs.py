"""What a step computes from a prompt's rows besides the next token: its prompt logprobs, and its embedding.

Both read the final residual stream the forward returns (llama.py), rows of the flat batch: the logprob of each
prompt token is the row before it through the LM head; an embedding request's vector is its last prompt token's row
through the final norm (pooling type LAST), cut to the dimensions asked for and normalized; a reranker's score is
read from the same row through a classifier made of the LM head's rows for one or two tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenloom.core.scheduler_output import ScheduledRequest
from tokenloom.model.llama import CausalLM
from tokenloom.model.sampler import SampledToken, Sampler
from tokenloom.pooling_params import PoolingParams

PROMPT_LOGPROB_ROWS = 256  # rows of prompt logits computed at once: 256 x a 49k vocabulary is 50 MB in float32


def prompt_logprobs(
    model: CausalLM, sampler: Sampler, hidden: torch.Tensor, chunk: ScheduledRequest, first: int
) -> dict[int, SampledToken]:
    """The logprob of each prompt token this chunk's rows predict (the row at position p predicts token p + 1),
    with the top alternatives; logits a slice of rows at a time, so a long chunk never holds [n, vocab] at once."""
    prompt = chunk.request.prompt_token_ids
    top_k = chunk.request.sampling_params.prompt_logprobs or 0
    num_rows = min(chunk.num_tokens, len(prompt) - 1 - chunk.start)
    entries: dict[int, SampledToken] = {}
    for lo in range(0, num_rows, PROMPT_LOGPROB_ROWS):
        hi = min(num_rows, lo + PROMPT_LOGPROB_ROWS)
        logprobs = sampler.prompt_values(model.compute_logits(hidden[first + lo : first + hi]))
        targets = prompt[chunk.start + 1 + lo : chunk.start + 1 + hi]
        index = torch.tensor(targets, device=logprobs.device).unsqueeze(1)
        chosen = logprobs.gather(1, index).squeeze(1).tolist()
        top = logprobs.topk(top_k, dim=-1)
        for row, (ids, values) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
            pairs = list(zip(ids, values, strict=True))
            entries[chunk.start + 1 + lo + row] = SampledToken(targets[row], chosen[row], pairs)
    return entries


def _classifier_score(model: CausalLM, normed: torch.Tensor, token_ids: tuple[int, ...]) -> torch.Tensor:
    """A reranker's score of a prompt from its last row: sigmoid(l[yes] - l[no]) for the tokens (no, yes), or
    sigmoid(l) for one token (hf_overrides.py)."""
    logits = model.token_logits(normed.unsqueeze(0), list(token_ids))[0]
    margin = logits[-1] - logits[0] if len(token_ids) == 2 else logits[0]
    return torch.sigmoid(margin).reshape(1)


def _label_probabilities(model: CausalLM, normed: torch.Tensor, independent: bool) -> torch.Tensor:
    """A classifier checkpoint's probabilities from its head at the last row: softmax over its labels, or a sigmoid
    each where they are independent or one (transformers' *ForSequenceClassification logits at the last token, as
    vLLM's classify activates them)."""
    assert model.score is not None, "the pooling asks for labels of a model with a classification head"
    logits = F.linear(normed, model.score.weight.float())
    return torch.sigmoid(logits) if independent or logits.numel() == 1 else torch.softmax(logits, dim=0)


def embeddings(
    model: CausalLM, hidden: torch.Tensor, rows: list[tuple[str, int, PoolingParams]]
) -> Callable[[], dict[str, list[float]]] | None:
    """Each embedding request's vector from its last prompt token's row, in float32 whatever the model's dtype:
    computed now, on the device, and read to the host by the function returned, when the step is read (so a step that
    holds one does not wait for the device when it is launched). None if the step has none."""
    if not rows:
        return None
    stream = hidden[torch.tensor([row for _, row, _ in rows], device=hidden.device)].float()
    normed = F.rms_norm(stream, (stream.shape[-1],), model.norm.weight.float(), model.norm.eps)
    vectors = []
    for (_, _, params), vector in zip(rows, normed, strict=True):
        if params.classifier_token_ids is not None:
            vectors.append(_classifier_score(model, vector, params.classifier_token_ids))
            continue
        if params.classifier_labels is not None:
            vectors.append(_label_probabilities(model, vector, params.independent_labels))
            continue
        vector = vector[: params.dimensions]
        vectors.append(F.normalize(vector, dim=0) if params.normalize else vector)
    return lambda: {request_id: vector.tolist() for (request_id, _, _), vector in zip(rows, vectors, strict=True)}
