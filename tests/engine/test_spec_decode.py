"""Speculative decoding: proposals from the text, verified in the same step, lossless.

The tiny random model almost never repeats itself, so most tests give the engine a proposer that knows the
answer and corrupts some drafts (``KnowingProposer``): every path (all drafts accepted, a rejection at each
position, the bonus token) then runs often. The real proposers are tested on their own and on the real model.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.core.spec_decode import NgramProposer, SpeculationGate, SuffixProposer
from tokenloom.model.sampler import Sampler, SamplingBatch
from tokenloom.speculative_config import SpeculativeConfig

VOCAB = 512
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = 24


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(VOCAB - 1) for _ in range(rng.randint(3, 40))]} for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


class KnowingProposer:
    """Proposes the reference continuation of each prompt, with every draft token wrong with probability 0.3."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], num_tokens: int = 4, seed: int = 0) -> None:
        self.answers = answers
        self.num_tokens = num_tokens
        self.rng = random.Random(seed)

    def propose(self, request_id: str, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        answer = self.answers.get(tuple(prompt), [])
        drafts = answer[len(output) : len(output) + min(max_tokens, self.num_tokens)]
        return [t if self.rng.random() > 0.3 else (t + 1) % VOCAB for t in drafts]

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        pass


def with_proposer(llm: LLM, proposer) -> LLM:
    llm.engine.core.speculator.proposer = proposer
    llm.engine.core.speculator.gate.dynamic = False
    return llm


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), max_num_seqs=16, max_num_batched_tokens=1024)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    work = prompts(10)
    outputs = token_ids(llm.generate(work, greedy, use_tqdm=False))
    return work, outputs, {tuple(p["prompt_token_ids"]): o for p, o in zip(work, outputs, strict=True)}


UNDER_PRESSURE = dict(max_num_seqs=8, max_num_batched_tokens=32, num_kv_blocks=14, block_size=8)


@pytest.mark.parametrize(
    "config",
    [
        dict(max_num_seqs=16, max_num_batched_tokens=1024),
        dict(max_num_seqs=4, max_num_batched_tokens=20),  # chunked prompts; drafts cut to the budget
        UNDER_PRESSURE,  # preempts, recompute
        dict(UNDER_PRESSURE, preemption_mode="swap", num_swap_blocks=64),
        dict(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=7, max_num_partial_prefills=1),
        dict(max_num_seqs=3, max_num_batched_tokens=32, num_kv_blocks=14, block_size=8, scheduling_policy="fair"),
        dict(max_num_seqs=4, max_num_batched_tokens=64, attention_backend="torch"),
    ],
)
def test_greedy_tokens_are_those_without_speculation(tiny_llama, reference, config):
    work, expected, answers = reference
    llm = with_proposer(LLM(str(tiny_llama), **config, speculative_config=NGRAM), KnowingProposer(answers))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert token_ids(llm.generate(work, greedy, use_tqdm=False)) == expected
    stats = llm.stats()
    assert stats.kv_blocks_in_use == 0 and stats.generated_tokens == 10 * MAX_TOKENS
    accepted, drafted = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert 0.2 * drafted < accepted < drafted, "some drafts accepted, some rejected"
    per_position = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_position) == accepted and list(per_position) == sorted(per_position, reverse=True)
    # Every generated token came from a draft run or a plain decode: fewer steps than tokens.
    assert stats.num_steps < 10 * MAX_TOKENS / 2
    if "num_kv_blocks" in config:
        assert stats.num_preemptions > 0


def test_prefix_hits_and_forks_keep_greedy_tokens(tiny_llama, reference):
    work, expected, answers = reference
    llm = with_proposer(LLM(str(tiny_llama), max_num_seqs=8, block_size=4), KnowingProposer(answers))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert token_ids(llm.generate(work[:4], greedy, use_tqdm=False)) == expected[:4]
    again = token_ids(llm.generate(work[:4], greedy, use_tqdm=False))  # the prompts' blocks are cached now
    assert again == expected[:4] and llm.stats().prefix_cache_hits > 0
    # n > 1 is the server's forks: the same prompt queued n times, sharing its prefix blocks.
    assert token_ids(llm.generate([work[5]] * 3, greedy, use_tqdm=False)) == [expected[5]] * 3
    assert llm.stats().kv_blocks_in_use == 0


def test_max_tokens_stop_tokens_and_logprobs_hold_across_accepted_runs(tiny_llama, reference):
    work, expected, answers = reference
    llm = with_proposer(LLM(str(tiny_llama), max_num_seqs=8), KnowingProposer(answers, num_tokens=6))
    for max_tokens in (1, 2, 5, 11):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        outputs = llm.generate(work, params, use_tqdm=False)
        assert token_ids(outputs) == [e[:max_tokens] for e in expected]
        for output in outputs:
            completion = output.outputs[0]
            assert completion.logprobs is not None and len(completion.logprobs) == max_tokens
            assert all(token in entry for token, entry in zip(completion.token_ids, completion.logprobs, strict=True))
    # A stop token inside an accepted run ends the output there.
    stop = expected[0][7]
    first = expected[0].index(stop)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop])
    (output,) = llm.generate(work[0], params, use_tqdm=False)
    assert output.outputs[0].token_ids == expected[0][: first + 1] and output.outputs[0].finish_reason == "stop"
    assert llm.stats().kv_blocks_in_use == 0


def test_a_stop_string_inside_an_accepted_run_ends_the_text_there(tiny_chat_model):
    llm = LLM(str(tiny_chat_model), max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (plain,) = llm.generate("Once upon a time", greedy, use_tqdm=False)
    tokens, text = plain.outputs[0].token_ids, plain.outputs[0].text
    # The tiny model repeats itself, so a stop string of its first quarter completes inside the first draft run.
    stop = text[: len(text) // 4]
    answers = {tuple(plain.prompt_token_ids): tokens}
    spec = with_proposer(LLM(str(tiny_chat_model), max_num_seqs=4), KnowingProposer(answers, num_tokens=8))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop])
    (want,) = llm.generate("Once upon a time", params, use_tqdm=False)
    (got,) = spec.generate("Once upon a time", params, use_tqdm=False)
    assert got.outputs[0].text == want.outputs[0].text == text[: text.index(stop)]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids and len(want.outputs[0].token_ids) < MAX_TOKENS
    assert got.outputs[0].finish_reason == "stop" and got.outputs[0].stop_reason == stop
    assert spec.stats().spec_decode_num_accepted_tokens > 0


def test_penalised_requests_get_no_drafts(tiny_llama, reference):
    work, _, answers = reference
    llm = with_proposer(LLM(str(tiny_llama), max_num_seqs=8), KnowingProposer(answers))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=0.5)
    llm.generate(work, params, use_tqdm=False)
    assert llm.stats().spec_decode_num_drafts == 0


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": r"[a-f]{3}-[0-9]{2,4}( [a-z]{1,6}){3}"},
        {"json": {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                  "required": ["name", "n"]}},
    ],
)  # fmt: skip
def test_structured_output_keeps_its_tokens_under_speculation(tiny_chat_model, spec):
    """Each verification row is masked by the grammar's state after the drafts before it, and drafts the grammar
    refuses are cut at proposal: the same greedy tokens as without speculation, and every reply matches."""
    from tokenloom.sampling_params import StructuredOutputsParams

    prompts = ["Give me a code", "Describe a cat", "List three words"]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(**spec))
    plain = LLM(str(tiny_chat_model), max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain}
    llm = with_proposer(LLM(str(tiny_chat_model), max_num_seqs=4), KnowingProposer(answers, num_tokens=5))
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(fast) == token_ids(plain)
    assert [o.outputs[0].finish_reason for o in fast] == [o.outputs[0].finish_reason for o in plain]
    stats = llm.stats()
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.kv_blocks_in_use == 0


def test_sampled_tokens_keep_the_distribution_at_temperature_one():
    """ErrorReason sampling with point drafts: the first kept token is distributed as p0, and the second (given the
    first draft was accepted) as p1, whatever the drafts; checked against the exact probabilities."""
    torch.manual_seed(0)
    vocab, draws = 6, 30_000
    p0 = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    p1 = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    sampler = Sampler(torch.device("cpu"), seed=1)
    params = SamplingParams(temperature=1.0)
    batch = SamplingBatch([params] * draws, [None] * draws, [None] * draws)
    logits = torch.stack([p0.log(), p1.log(), p1.log()]).repeat(draws, 1)
    results = sampler.verify(logits, batch, [[0, 4]] * draws)  # drafts: token 0, then token 4
    first = torch.bincount(torch.tensor([r[0].token_id for r in results]), minlength=vocab).float() / draws
    assert (first - p0).abs().max() < 0.012
    after_accept = [r[1].token_id for r in results if r[0].token_id == 0]
    second = torch.bincount(torch.tensor(after_accept), minlength=vocab).float() / len(after_accept)
    assert (second - p1).abs().max() < 0.02
    # Acceptance happens at the rate the target gives the draft: p0[0] for the first.
    assert abs(len(after_accept) / draws - p0[0].item()) < 0.012


def test_greedy_verification_accepts_exactly_the_argmax_prefix():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 5, 1, 7]):
        logits[row, best] = 5.0
    batch = SamplingBatch([SamplingParams(temperature=0)], [None], [None])
    assert [t.token_id for t in sampler.verify(logits, batch, [[3, 5, 2]])[0]] == [3, 5, 1]  # third rejected
    assert [t.token_id for t in sampler.verify(logits, batch, [[3, 5, 1]])[0]] == [3, 5, 1, 7]  # all, and a bonus
    assert [t.token_id for t in sampler.verify(logits, batch, [[4, 5, 1]])[0]] == [3]


def test_sampling_with_speculation_runs_seeded_and_reproducible(tiny_llama, reference):
    work, _, answers = reference
    llm = with_proposer(LLM(str(tiny_llama), max_num_seqs=8), KnowingProposer(answers, seed=1))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3)
    first = token_ids(llm.generate(work, params, use_tqdm=False))
    assert all(len(t) == MAX_TOKENS for t in first)
    assert llm.stats().kv_blocks_in_use == 0 and llm.stats().spec_decode_num_draft_tokens > 0


# ---- the proposers -------------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3))
    prompt = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    # [2, 3] (and [4, 2, 3] does not occur before): its latest earlier occurrence is followed by 7, 8, 4.
    assert proposer.propose("a", prompt, [], 8) == [7, 8, 4]
    assert proposer.propose("a", prompt, [], 2) == [7, 8]
    assert proposer.propose("a", prompt, [7], 8) == [8, 4, 2]  # [2, 3, 7] matched; the index followed the output
    assert proposer.propose("b", [5, 6, 7], [], 8) == []
    exact = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=3, prompt_lookup_max=3))
    assert exact.propose("c", [1, 2, 3, 4, 0, 2, 3], [], 8) == []  # only 2-token matches: below the minimum


def test_suffix_proposes_the_most_frequent_continuation_and_learns_from_finished_outputs():
    config = SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=8,
        suffix_decoding_min_token_prob=0.3,
        suffix_decoding_max_spec_factor=4,  # the match is 2 tokens: up to 8 proposed
    )
    proposer = SuffixProposer(config)
    # After [5, 6]: 7, 8 twice, 7, 9 once: 7 (prob 1), then 8 (2/3), then the two 8-continuations agree on 1.
    prompt = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7, 8, 1, 3, 5, 6]
    assert proposer.propose("a", prompt, [], 8)[:3] == [7, 8, 1]
    proposer.finished("a", [40, 41, 42, 43, 44])
    # A new request whose text ends as that output began: the global index proposes its continuation.
    assert proposer.propose("b", [11, 12, 40, 41], [], 8) == [42, 43, 44]
    # A match of m tokens proposes at most m * max_spec_factor.
    short = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=0.5))
    short.finished("x", list(range(100, 130)))
    assert short.propose("y", [100, 101, 102, 103], [], 20) == [104, 105]


def test_the_gate_lets_drafts_through_at_low_load_and_holds_poor_ones_at_high_load():
    gate = SpeculationGate(dynamic=True)
    for tokens in (1, 8, 64, 256, 1, 64):
        gate.observe_step(tokens, 0.010 + 0.0002 * tokens)  # 10 ms a step, 0.2 ms a token
    assert gate.allows("r", 1)  # prior 0.5 against a per-token share of 2%
    gate.observe_verification("r", 4, 1)
    gate.observe_verification("r", 4, 1)
    assert gate.acceptance("r") < 0.4
    assert gate.allows("r", 4)
    assert not gate.allows("r", 256)  # 256 tokens: 84% of the step grows with them
    assert SpeculationGate(dynamic=False).allows("r", 10_000)


def test_speculative_config_is_checked_and_read_as_vllm_spells_it():
    from tokenloom.config import EngineConfig

    config = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    spec = config.speculative.speculative_config
    assert spec is not None and spec.num_lookup == (5, 5) and spec.num_tokens == 4
    assert config.to_dict()["speculative_config"]["method"] == "ngram"
    suffix = SpeculativeConfig.parse({"method": "suffix"})
    assert suffix is not None and suffix.num_tokens == suffix.suffix_decoding_max_tree_depth == 24
    for bad, message in [
        ('{"method": "ngram"}', "num_speculative_tokens must be given"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"num_speculative_tokens": 2, "lookahead": 1}', "unknown key"),
        ("{", "not valid JSON"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ]:
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_kwargs(speculative_config=bad)


def test_ngram_speculation_on_the_real_model_copies_a_passage_with_the_same_tokens(real_model_dir):
    """float32, greedy: the same reply with and without speculation, and most drafts accepted on a copy task."""
    passage = (
        "The river Loom rises in the northern hills and flows south through three valleys. In spring its "
        "waters carry snowmelt, and the mills along its banks run day and night."
    )
    messages = [{"role": "user", "content": f"Here is a passage:\n\n{passage}\n\nCopy the passage word for word."}]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    common = dict(dtype="float32", max_num_seqs=2)
    (plain,) = LLM(str(real_model_dir), **common).chat([messages], greedy, use_tqdm=False)
    spec = LLM(str(real_model_dir), **common, speculative_config=dict(NGRAM, dynamic=False))
    (fast,) = spec.chat([messages], greedy, use_tqdm=False)
    assert fast.outputs[0].token_ids == plain.outputs[0].token_ids
    stats = spec.stats()
    assert stats.spec_decode_num_accepted_tokens > 0.5 * stats.spec_decode_num_draft_tokens
    assert stats.num_steps < 48 / 2


def test_the_server_speculates_through_the_core_process_and_counts_it_in_metrics(tiny_chat_model):
    """The tiny chat model repeats itself, so n-gram drafts are accepted; replies equal those of plain decoding,
    streamed chunks carry the usage so far (vLLM's continuous_usage_stats), and /metrics counts the drafts."""
    import json

    import httpx
    import openai
    from server_process import ServerProcess

    messages = [{"role": "user", "content": "Say time time time time time"}]
    (plain,) = LLM(str(tiny_chat_model), dtype="float32").chat([messages], SamplingParams(temperature=0, max_tokens=30))
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2, "dynamic": False})
    args = ("--model", str(tiny_chat_model), "--served-model-name", "tiny", "--core-process")
    with ServerProcess(*args, "--speculative-config", spec) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=30, temperature=0, n=2)
        assert [c.message.content for c in reply.choices] == [plain.outputs[0].text] * 2
        body = {
            "messages": messages, "max_tokens": 30, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
            chunks = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == plain.outputs[0].text
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
        assert counts == sorted(counts) and counts[-1] == chunks[-1]["usage"]["completion_tokens"] == 30
        assert max(b - a for a, b in itertools.pairwise(counts)) > 1, "a chunk carried several tokens"
        accepted = server.metric("tokenloom:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= server.metric("tokenloom:spec_decode_num_draft_tokens_total")
        assert server.metric('tokenloom:spec_decode_num_accepted_tokens_per_pos_total{position="0"}') > 0


def test_two_tensor_parallel_ranks_verify_the_same_drafts(tiny_llama, reference):
    work, expected, answers = reference
    llm = with_proposer(LLM(str(tiny_llama), max_num_seqs=8, tensor_parallel_size=2), KnowingProposer(answers))
    try:
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert token_ids(llm.generate(work, greedy, use_tqdm=False)) == expected
        assert llm.stats().spec_decode_num_accepted_tokens > 0
    finally:
        llm.shutdown()
