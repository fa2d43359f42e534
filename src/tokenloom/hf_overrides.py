"""What ``--hf-overrides`` may hold (vLLM's JSON over a checkpoint's config.json): only the keys that serve a causal
LM as a reranker whose classifier is made from rows of its LM head, as vLLM serves Qwen3-Reranker:

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

(or, for any architecture, ``"method": "from_2_way_softmax"`` with the two tokens, or ``"no_post_processing"`` with
one). A prompt's score is then sigmoid(logit("yes") - logit("no")) at its last token (one token: the sigmoid of its
logit), and /score and /rerank read each (query, document) pair as one prompt, the two texts joined, as vLLM's
"LLM as reranker" does. Any other key would change the model itself, and is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tokenloom.speculative_config import parse_json_option, require

CLASSIFIER_SUFFIX = "ForSequenceClassification"


@dataclass(frozen=True)
class HFOverrides:
    architectures: tuple[str, ...] = ()
    """One name ending in ForSequenceClassification: the model scores its prompts instead of only generating."""
    classifier_from_token: tuple[str, ...] = ()
    """The one or two tokens whose LM-head rows make the classifier: [no, yes] scores sigmoid(yes - no)."""
    is_original_qwen3_reranker: bool = False
    """vLLM's name for method from_2_way_softmax, for Qwen3-Reranker."""
    method: Literal["from_2_way_softmax", "no_post_processing"] | None = None
    """How the tokens' logits score: from_2_way_softmax, two tokens [no, yes], sigmoid(yes - no); no_post_processing,
    one token, sigmoid of its logit."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "architectures", tuple(self.architectures))
        object.__setattr__(self, "classifier_from_token", tuple(self.classifier_from_token))
        tokens = self.classifier_from_token
        require(
            len(self.architectures) == 1 and self.architectures[0].endswith(CLASSIFIER_SUFFIX),
            f"hf_overrides: architectures must name one *{CLASSIFIER_SUFFIX} (a reranker made from the LM head)",
        )
        require(
            len(tokens) in (1, 2) and all(isinstance(t, str) and t for t in tokens),
            "hf_overrides: classifier_from_token must list one or two tokens (a checkpoint's own classification "
            "head is not loaded: the classifier is made from the LM head's rows for these tokens)",
        )
        method = "from_2_way_softmax" if self.is_original_qwen3_reranker else self.method
        require(
            method is not None,
            "hf_overrides: classifier_from_token needs method (from_2_way_softmax or no_post_processing) or "
            "is_original_qwen3_reranker",
        )
        require(
            method in ("from_2_way_softmax", "no_post_processing"),
            "hf_overrides: method must be from_2_way_softmax or no_post_processing",
        )
        require(
            len(tokens) == (2 if method == "from_2_way_softmax" else 1),
            f"hf_overrides: {method} reads "
            + ('two tokens, ["no", "yes"]' if method == "from_2_way_softmax" else "one token (one score a prompt)"),
        )

    @classmethod
    def parse(cls, value: HFOverrides | dict[str, Any] | str | None) -> HFOverrides | None:
        """From what a caller gives: an HFOverrides, a dict (``LLM(hf_overrides={...})``) or its JSON."""
        return parse_json_option(cls, value, "hf_overrides", " (a reranker's only)")
