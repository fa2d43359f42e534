#!/usr/bin/env bash
# The serving scorecards in RESULTS.md: each trace against baseline / token-budget / sequence-cap / static servers,
# one `tokenloom bench matrix` each, on the embedded model. Run one at a time on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
TL=.venv/bin/tokenloom
OUT=benchmarks/runs
mkdir -p "$OUT"
CONFIGS="baseline: ; budget: --max-num-batched-tokens 256; seqs: --max-num-seqs 8; static: --batching static"
$TL bench trace --kind chat --num-requests 32 --seed 0 -o "$OUT/chat-32.jsonl"
$TL bench trace --kind long --num-requests 6 --seed 0 -o "$OUT/long-6.jsonl"
$TL bench trace --kind agent --num-requests 32 --seed 0 -o "$OUT/agent-32.jsonl"
$TL bench trace --kind mixed --num-requests 32 --seed 0 -o "$OUT/mixed-32.jsonl"
for trace in chat-32 long-6 agent-32; do
  echo "== $trace (uptime: $(uptime))"
  $TL bench matrix --trace "$OUT/$trace.jsonl" --rate inf --slo ttft=10,e2e=120 --configs "$CONFIGS" \
    -o "$OUT/$trace" --duration-limit 900
done
echo "== mixed-32 (uptime: $(uptime))"
$TL bench matrix --trace "$OUT/mixed-32.jsonl" --rate inf --slo ttft=10,e2e=120 \
  --configs "continuous: --max-num-seqs 16; static: --batching static --max-num-seqs 16" -o "$OUT/mixed-32" \
  --duration-limit 900
echo "== done (uptime: $(uptime))"
