"""What an embedding request asks of its prompt (vLLM's ``PoolingParams`` for the task "embed"; no torch here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """The prompt's embedding: the final hidden state (after the model's last norm) of its last token, as vLLM pools a
    decoder-only model turned into an embedding model (pooling type LAST), e.g. Qwen3-Embedding or e5-mistral."""

    dimensions: int | None = None  # keep the first `dimensions` values (OpenAI's `dimensions`), then normalize
    normalize: bool = True  # to unit length (vLLM's `use_activation` for embeddings; cosine similarity is then a dot)
    # A reranker's score instead of the vector (hf_overrides.py): the logits of these one or two tokens at the last
    # row, the vector [sigmoid(l[-1] - l[0])] for two, [sigmoid(l)] for one.
    classifier_token_ids: tuple[int, ...] | None = None
    # A classifier checkpoint's own head (score.weight, *ForSequenceClassification) instead: the probabilities of its
    # this many labels at the last row, softmax over them (sigmoid for one label), as vLLM's classify.
    classifier_labels: int | None = None
    independent_labels: bool = False  # a multi-label classifier's: each label's sigmoid

    def __post_init__(self) -> None:
        if self.dimensions is not None and (type(self.dimensions) is not int or self.dimensions < 1):
            raise ValueError("PoolingParams: dimensions must be an integer >= 1")
        if self.classifier_token_ids is not None and len(self.classifier_token_ids) not in (1, 2):
            raise ValueError("PoolingParams: classifier_token_ids holds one or two token ids")
        if self.classifier_labels is not None and (self.classifier_labels < 1 or self.classifier_token_ids):
            raise ValueError("PoolingParams: classifier_labels >= 1, and not with classifier_token_ids")

    @property
    def scores_pairs(self) -> bool:
        """A classifier whose output is one score (a reranker's, or a head of one label): what /score and /rerank read
        of a (query, document) prompt."""
        return self.classifier_token_ids is not None or self.classifier_labels == 1

    def width(self, hidden_size: int) -> int:
        """How many values the output holds, for a model of this hidden size."""
        if self.classifier_token_ids is not None:
            return 1
        if self.classifier_labels is not None:
            return self.classifier_labels
        return min(self.dimensions or hidden_size, hidden_size)
