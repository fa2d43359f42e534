"""What distinct JSON schemas cost in memory, with and without a limit on the grammar compiler's cache.

    .venv/bin/python benchmarks/grammar_memory.py [--schemas 400] [--limits 8M,none]

Each schema has 150 integer properties (distinct names, so nothing is reused); each limit runs in a fresh
interpreter so its RSS is the compiler's alone. Prints the RSS growth every 100 schemas and the cache's size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, sys, time
from tokenloom.config import StructuredOutputsConfig
from tokenloom.engine.structured_output import GrammarCompiler
from tokenloom.model.loader import resolve_checkpoint_dir
from tokenloom.sampling_params import StructuredOutputsParams
from transformers import AutoTokenizer

limit, count = int(sys.argv[1]), int(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint_dir(None)[1])
compiler = GrammarCompiler(tokenizer, 49152, [2], StructuredOutputsConfig(grammar_cache_bytes=limit))
compiler.compile(StructuredOutputsParams(regex="a+"))  # loads xgrammar and the tokenizer's tables

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

start, started, rows = rss(), time.monotonic(), []
for k in range(count):
    schema = {"type": "object", "properties": {f"s{k}_{i}": {"type": "integer"} for i in range(150)}}
    compiler.compile(StructuredOutputsParams(json=schema))
    if (k + 1) % 100 == 0:
        rows.append([k + 1, (rss() - start) / 2**20, compiler.cache_bytes() / 2**20, time.monotonic() - started])
print(json.dumps(rows))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemas", type=int, default=400)
    parser.add_argument("--limits", default="8M,none", help="cache limits: bytes with K/M/G, or none")
    args = parser.parse_args()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    for text in args.limits.split(","):
        limit = 1 << 50 if text == "none" else int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        done = subprocess.run([sys.executable, "-c", CHILD, str(limit), str(args.schemas)], capture_output=True,
                              text=True, check=True)  # fmt: skip
        print(f"cache limit {text}:")
        for schemas, growth, cache, seconds in json.loads(done.stdout.strip().splitlines()[-1]):
            print(f"  {schemas:4d} schemas: RSS +{growth:7.1f} MiB, cache {cache:7.1f} MiB ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
