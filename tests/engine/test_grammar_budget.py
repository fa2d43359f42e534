"""What a request's grammar may cost: the compiled-grammar cache stays under its byte limit, a spec too large or
too slow to compile is refused with a clear error, and a grammar that can match nothing is the caller's error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tokenloom.config import StructuredOutputsConfig
from tokenloom.engine.structured_output import GrammarCompiler, InvalidGrammar
from tokenloom.sampling_params import StructuredOutputsParams

VOCAB = 49152

# Compiles distinct schemas in a fresh interpreter (its RSS is the compiler's alone) and prints the RSS at each
# third of the run, the cache's size, and the bytes the last third's grammars take, and the largest grammar's.
RSS_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
from tokenloom.config import StructuredOutputsConfig
from tokenloom.engine.structured_output import GrammarCompiler
from tokenloom.sampling_params import StructuredOutputsParams

model, limit, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
compiler = GrammarCompiler(AutoTokenizer.from_pretrained(model), 49152, [2], StructuredOutputsConfig(limit))

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

rss_at, last_third_bytes, largest = [rss()], 0, 0
for k in range(count):
    schema = {"type": "object", "properties": {f"s{k}_{i}": {"type": "integer"} for i in range(150)}}
    grammar = compiler.compile(StructuredOutputsParams(json=schema))
    largest = max(largest, grammar.memory_size_bytes)
    if k >= 2 * count // 3:
        last_third_bytes += grammar.memory_size_bytes
    del grammar
    if (k + 1) % (count // 3) == 0:
        rss_at.append(rss())
print(json.dumps({"rss": rss_at, "cache": compiler.cache_bytes(), "last_third_bytes": last_third_bytes,
                  "largest": largest}))
"""


def compile_distinct_schemas(model: str, limit: int, count: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", RSS_SCRIPT, model, str(limit), str(count)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_grammar_cache_stays_under_its_limit_over_hundreds_of_schemas(tiny_chat_model):
    limit = 8 << 20
    run = compile_distinct_schemas(str(tiny_chat_model), limit, 300)
    assert 0 < run["cache"] <= limit + run["largest"]  # xgrammar evicts once the newest entry is in
    # Without a limit every grammar stays: the last third's ~70 MB would be added to the RSS. Under it, the
    # process has reached its high-water mark and the last third adds next to nothing.
    growth = run["rss"][3] - run["rss"][2]
    assert growth < run["last_third_bytes"] / 4, (growth, run)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    return AutoTokenizer.from_pretrained(tiny_chat_model)


def wide_optional_schema(properties: int, tag: str) -> dict:
    """Optional properties: xgrammar's compile time grows with the square of their number (1,000: ~5 s)."""
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string"} for i in range(properties)}}


def test_a_spec_over_the_size_limit_is_refused_before_compiling(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [2], StructuredOutputsConfig(max_grammar_bytes=1000))
    with pytest.raises(InvalidGrammar, match="over the limit of 1000"):
        compiler.compile(StructuredOutputsParams(json=wide_optional_schema(100, "f")))
    with pytest.raises(InvalidGrammar, match="over the limit"):
        compiler.compile(StructuredOutputsParams(choice=tuple(f"choice {i}" for i in range(200))))
    assert compiler.cache_bytes() == 0  # nothing was compiled
    compiler.compile(StructuredOutputsParams(choice=("yes", "no")))


def test_a_compile_past_its_deadline_is_refused_and_then_refused_at_once(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [2], StructuredOutputsConfig(grammar_compile_timeout=0.3))
    slow = StructuredOutputsParams(json=wide_optional_schema(1200, "slow"))  # several seconds of compiling
    with pytest.raises(InvalidGrammar, match=r"takes longer than 0\.3s to compile"):
        compiler.compile(slow)
    # Whether the overrunning compile has finished in its worker by now depends on the machine: not asserted.
    submitted = []
    real_submit = compiler._pool.submit
    compiler._pool.submit = lambda *args: submitted.append(args) or real_submit(*args)
    with pytest.raises(InvalidGrammar, match="takes longer"):
        compiler.compile(slow)
    assert submitted == []  # the same spec again: refused without compiling
    # A small grammar still compiles while the runaway one finishes in its worker.
    compiler.compile(StructuredOutputsParams(regex="[a-z]{1,5}"))
    assert len(submitted) == 1


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputsParams(grammar="root ::= root"), "matches no text"),
        (StructuredOutputsParams(regex="(unclosed"), "invalid regex"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), "invalid grammar"),
    ],
)
def test_a_grammar_that_cannot_be_met_is_the_callers_error_without_internals(tokenizer, spec, words):
    compiler = GrammarCompiler(tokenizer, VOCAB, [2])
    with pytest.raises(InvalidGrammar, match=words) as caught:
        compiler.compile(spec)
    message = str(caught.value)
    assert ".cc:" not in message and "/project/" not in message and "/cpp/" not in message, message
