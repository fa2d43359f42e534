"""What a streamed token costs the server's event loop, by stream interval (issue 23: serving a fast device).

    .venv/bin/python benchmarks/stream_cost.py [--concurrency 64,256] [--max-tokens 256] [--intervals 1,4,16]
                                               [--fast-engine] [--server-args FLAGS]... [--tokenloom-source CHECKOUT]

On a GPU the engine makes tokens faster than a Python HTTP front may send them: every streamed token is a chunk to
serialize and a socket write on the server's event loop, one thread whatever the cores. This serves a tiny random
Llama (2 layers of 64, SmolLM2's tokenizer and vocabulary, so it speaks text; on a CPU its head over the
49,152-token vocabulary is most of the engine thread's time) with `tokenloom serve`, sends C concurrent chat
requests of --max-tokens tokens each (ignore_eos, greedy) from a minimal asyncio client that counts the events
without parsing them, and reads the CPU seconds of each server thread from /proc: the event loop's (the main thread)
per token is the figure; the engine's thread and the rest are printed beside it. Rows: streamed with each
`stream_interval` (the request field; `--stream-interval` sets the server's floor), and not streamed.
`--tokenloom-source` serves another checkout's code (a `git worktree` of an earlier commit), one more set of rows,
alternated with this one's. Wall tok/s is shown too, but on two cores the client and the engine share them with the
loop: the CPU per token is what carries to a bigger host.

`--fast-engine` serves the same model with a 512-token vocabulary and no tokenizer (completions of token ids, their
text empty, a chunk a token all the same): its steps take a millisecond or two, as a small model's on a GPU, so the
host is all there is, and wall tok/s is the figure. Each `--server-args` starts one more server with those flags
(`--core-process`: the engine core in a process of its own, out of the event loop's GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenloom.bench.local_server import LocalServer
from tokenloom.bench.provenance import git_commit, machine_info

TICK = os.sysconf("SC_CLK_TCK")


def tiny_model(directory: Path, fast: bool) -> Path:
    """The tiny Llama: with SmolLM2's tokenizer and 49,152-token vocabulary, or (fast) 512 tokens and no tokenizer."""
    import torch
    import transformers

    from tokenloom.model.loader import resolve_checkpoint_dir

    directory = directory.with_name(directory.name + ("-fast" if fast else ""))
    if (directory / "config.json").exists():
        return directory
    vocab = dict(vocab_size=512, eos_token_id=511, bos_token_id=0) if fast else dict(vocab_size=49152, eos_token_id=2,
                                                                                      bos_token_id=1)  # fmt: skip
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=True, **vocab,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    real = resolve_checkpoint_dir(None)[1]
    for name in () if fast else ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (real / name).exists():
            shutil.copy(real / name, directory / name)
    return directory


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except FileNotFoundError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / TICK
    return seconds


async def one_request(port: int, max_tokens: int, stream: bool, interval: int, fast: bool) -> int:
    """Sends one request over a raw connection (chat; with no tokenizer, a completion of token ids); returns the
    events (stream) or the bytes read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body: dict = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}
    if fast:
        path, body["prompt"] = b"/v1/completions", [5, 6, 7, 8]
    else:
        path, body["messages"] = b"/v1/chat/completions", [{"role": "user", "content": "Tell me a story."}]
    if stream and interval > 1:
        body["stream_interval"] = interval
    payload = json.dumps(body).encode()
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n" % path
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    await writer.drain()
    received = b""
    while chunk := await reader.read(1 << 16):
        received += chunk
    writer.close()
    status = int(received.split(b" ", 2)[1]) if received.startswith(b"HTTP/1.1 ") else 0
    if status != 200:
        raise RuntimeError(f"the server answered {status}: {received[-300:]!r}")
    return received.count(b"data:") if stream else len(received)


async def load(port: int, concurrency: int, max_tokens: int, stream: bool, interval: int, fast: bool) -> None:
    await asyncio.gather(*(one_request(port, max_tokens, stream, interval, fast) for _ in range(concurrency)))


def measure(server: LocalServer, concurrency: int, max_tokens: int, stream: bool, interval: int, fast: bool) -> dict:
    pid = server.process.pid
    before, started = thread_cpu_seconds(pid), time.perf_counter()
    asyncio.run(load(server.port, concurrency, max_tokens, stream, interval, fast))
    wall, after = time.perf_counter() - started, thread_cpu_seconds(pid)
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    tokens = concurrency * max_tokens
    main = spent.pop(pid, 0.0)
    busiest = max(spent.values(), default=0.0)  # the engine's thread (with --core-process, the core's outputs')
    return {
        "tok_s": tokens / wall, "loop_us": main / tokens * 1e6, "engine_us": busiest / tokens * 1e6,
        "rest_us": (sum(spent.values()) - busiest) / tokens * 1e6,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--intervals", default="1,4,16")
    parser.add_argument("--fast-engine", action="store_true", help="a 512-token vocabulary and no tokenizer")
    parser.add_argument("--server-args", action="append", default=None, help="one server's flags (repeatable)")
    parser.add_argument("--tokenloom-source", type=Path, default=None)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/tokenloom-stream-cost-model"))
    args = parser.parse_args()
    model = tiny_model(args.model_dir, args.fast_engine)
    servers: list[tuple[str, dict[str, str], list[str]]] = [
        (f"this code ({git_commit()}) {flags}".rstrip(), {}, flags.split()) for flags in args.server_args or [""]
    ]
    if args.tokenloom_source is not None:
        source = args.tokenloom_source.resolve()
        command = ["git", "-C", str(source), "rev-parse", "--short", "HEAD"]
        commit = subprocess.run(command, capture_output=True, text=True)
        servers.append((f"{source.name} ({commit.stdout.strip()})", {"PYTHONPATH": str(source / "src")}, []))
    print(f"{machine_info().get('cpu', '')}, load {os.getloadavg()[0]:.2f}")
    print("| server | requests | response | out tok/s (wall) | event loop us/token | engine thread | other threads |")
    print("|---|---:|---|---:|---:|---:|---:|")
    cases = [(True, int(i)) for i in args.intervals.split(",")] + [(False, 1)]
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        for name, env, flags in servers:
            serve_args = ["--model", str(model), "--max-num-seqs", str(concurrency), "--max-model-len", "4096", *flags]
            with LocalServer(*serve_args, env=env) as server:
                asyncio.run(load(server.port, 8, 16, True, 1, args.fast_engine))  # warm-up
                for stream, interval in cases:
                    shown = f"streamed, interval {interval}" if stream else "not streamed"
                    try:
                        row = measure(server, concurrency, args.max_tokens, stream, interval, args.fast_engine)
                    except RuntimeError as error:  # an older checkout refuses the field
                        print(f"| {name} | {concurrency} | {shown} | {str(error)[:60]} | | | |", flush=True)
                        continue
                    print(
                        f"| {name} | {concurrency} | {shown} | {row['tok_s']:,.0f} | {row['loop_us']:.1f} | "
                        f"{row['engine_us']:.1f} | {row['rest_us']:.1f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
