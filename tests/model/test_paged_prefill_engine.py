"""Chunks with a past read in the paged cache (one operator call a layer) give exactly what gathering them gave."""

import pytest
import torch

from tokenloom import LLM, BeamSearchParams, SamplingParams
from tokenloom.model import step_inputs
from tokenloom.model.attention import uses_prefill_op

PAGED = step_inputs.StepInputBuilder.pages_prefills


def run(model, dtype: str, paged: bool, monkeypatch) -> tuple[list, list, int]:
    monkeypatch.setattr(step_inputs.StepInputBuilder, "pages_prefills", PAGED if paged else property(lambda s: False))
    calls = []
    original = step_inputs.StepInputBuilder._paged_prefills
    monkeypatch.setattr(step_inputs.StepInputBuilder, "_paged_prefills",
                        lambda self, rows, *rest: calls.append(len(rows)) or original(self, rows, *rest))  # fmt: skip
    prefix = list(range(300, 380))
    prompts = [[*prefix, 7, 8, 9], [*prefix, 10, 11], list(range(1000, 1090))]
    # A budget of 32 tokens chunks every prompt; the first request leaves the prefix cached for the second.
    with LLM(str(model), dtype=dtype, attention_backend="cpu", max_num_batched_tokens=32, block_size=16) as llm:
        assert llm.engine.core.runner.inputs.use_prefill_op
        params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
        outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        [beams] = llm.beam_search([{"prompt_token_ids": prompts[2]}], BeamSearchParams(beam_width=2, max_tokens=5))
    tokens = [o.outputs[0].token_ids for o in outputs] + [b.tokens for b in beams.sequences]
    logprobs = [o.outputs[0].logprobs for o in outputs] + [b.cum_logprob for b in beams.sequences]
    return tokens, logprobs, sum(calls)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_chunks_equal_gathered_ones_bit_for_bit(real_model_dir, dtype, monkeypatch):
    if not uses_prefill_op("cpu", getattr(torch, dtype), 64):
        pytest.skip(f"the {dtype} prefill operator is not in use here (no AVX-512; for bf16 no AVX-512 BF16, or AMX)")
    gathered_tokens, gathered_logprobs, none = run(real_model_dir, dtype, False, monkeypatch)
    paged_tokens, paged_logprobs, chunks = run(real_model_dir, dtype, True, monkeypatch)
    assert none == 0 and chunks >= 10  # chunked prompts, a prefix hit and every beam step went to the operator
    assert paged_tokens == gathered_tokens
    assert paged_logprobs == gathered_logprobs  # the same sums in the same order: not merely close
