"""The ranks of a tensor-parallel engine: rank 0 in the engine's own process, ranks 1..N-1 in worker processes.

Rank 0 is where the engine core runs: it schedules once per step and, before running the step itself, sends the
step's ScheduledRequests (or a swap's block copies) to every worker over ZeroMQ. Every rank then runs the same
forward on its shard (parallel.py), meeting the others at the all-reduces; the workers keep no request state, so
what a step needs is all in its message, and their block tables are rank 0's. Rank 0 alone samples.

A worker that dies is seen before the next step (its process is gone) or by the collective it misses (gloo
reports the closed connection; the group's timeout bounds anything else): the step raises, the engine fails the
requests in flight, reports itself unhealthy, and runs no further step. A worker whose parent is gone exits.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing
import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import zmq

from tokenloom.core.scheduler_output import ScheduledRequest
from tokenloom.ipc import broadcast, child_end, receive, send
from tokenloom.model.llama import CausalLM
from tokenloom.model.parallel import TensorParallelGroup
from tokenloom.model.platform import accelerator_count
from tokenloom.model.quantization import calibration_for
from tokenloom.model.runner import LaunchedStep, ModelRunner
from tokenloom.model.sampler import GrammarMask

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # the workers load their shards (a first start also converts the checkpoint)
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)  # a collective a dead rank never joins fails after this
POLL_MS = 200  # how often an idle worker looks whether its parent is still there


class WorkerDied(RuntimeError):
    """A tensor-parallel rank is gone: the engine can run no further step."""


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker builds its rank from: the same model, cache and seed as rank 0."""

    model: str | None
    max_model_len: int
    dtype: torch.dtype
    device: str
    num_kv_blocks: int
    block_size: int
    num_swap_blocks: int
    seed: int
    world_size: int
    init_method: str
    backend: str
    num_threads: int
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None


def free_local_init_method() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def rank_device(device: str, rank: int) -> torch.device:
    """Rank r's device: device r of the engine's device type when there are that many, else the engine's device
    (the CPU, or ranks sharing one accelerator)."""
    base = torch.device(device)
    return torch.device(base.type, rank) if accelerator_count(base.type) > rank else base


def backend_for(device: str, world_size: int) -> str:
    """The collective backend torch.distributed pairs with the device type (NCCL for CUDA, XCCL for XPU) when every
    rank has a device of its own; gloo otherwise (the CPU, or ranks sharing one accelerator)."""
    device_type = torch.device(device).type
    if accelerator_count(device_type) >= world_size:
        return str(dist.Backend.default_device_backend_map.get(device_type, "gloo"))
    return "gloo"


class TensorParallelWorkers:
    """Ranks 1..N-1: started, joined into the process group with this process as rank 0, and sent each step."""

    def __init__(self, spec: WorkerSpec) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "another tensor-parallel engine in this process still holds torch.distributed's process group: "
                "call its shutdown() (or create it as `with LLM(...) as llm:`) before starting a new one"
            )
        self.spec = spec
        self._context = zmq.Context()
        # The ipc:// sockets live here; the directory goes at shutdown.
        self._socket_dir = tempfile.TemporaryDirectory(prefix="tokenloom-tp-")
        directory = Path(self._socket_dir.name)
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(f"ipc://{directory / 'replies'}")
        self._channels: list[zmq.Socket[bytes]] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch threads or locks
        for rank in range(1, spec.world_size):
            channel = self._context.socket(zmq.PUSH)
            channel.bind(f"ipc://{directory / f'rank{rank}'}")
            self._channels.append(channel)
            args = (spec, rank, f"ipc://{directory / f'rank{rank}'}", f"ipc://{directory / 'replies'}")
            process = spawn.Process(target=_worker_main, args=args, name=f"tokenloom-tp{rank}", daemon=True)
            process.start()
            self._processes.append(process)
        self._failed: str | None = None
        # Every worker says it is running before anyone joins the group, so one that cannot even start is seen
        # here at once, not by a rendezvous that waits out its timeout.
        self._wait_for("started")
        _join_group(spec, rank=0)

    def wait_until_ready(self) -> None:
        """Returns once every worker has built its runner. Rank 0 builds its own first: building one may run
        collectives (the int8 weights' calibration prefills), which pair up only while all ranks build together."""
        self._wait_for("ready")

    def _wait_for(self, word: str) -> None:
        pending = set(range(1, self.spec.world_size))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending and time.monotonic() < deadline:
            if self._replies.poll(POLL_MS):
                kind, rank, detail = receive(self._replies)
                if kind != word:
                    self.shutdown()
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{detail}")
                pending.discard(rank)
            elif not self.healthy:
                self.shutdown()
                raise WorkerDied(f"a tensor-parallel rank exited while starting: {self._failed}")
        if pending:
            self.shutdown()
            raise RuntimeError(f"tensor-parallel ranks {sorted(pending)} were not ready in {STARTUP_TIMEOUT_S:g}s")

    @property
    def healthy(self) -> bool:
        if self._failed is None:
            dead = [p for p in self._processes if not p.is_alive()]
            if dead:
                self._failed = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in dead)
        return self._failed is None

    def send(self, message: tuple[Any, ...]) -> None:
        """Gives every worker the same message, once all are known to be alive."""
        if not self.healthy:
            raise WorkerDied(f"tensor-parallel rank gone: {self._failed}")
        broadcast(self._channels, message)

    def shutdown(self) -> None:
        """Stops the workers (asked, then killed after 5 s) and leaves the process group; safe to call twice."""
        if self._context.closed:
            return
        for channel in self._channels:
            with contextlib.suppress(zmq.Again):  # a dead worker's queue may be full: it is killed below
                send(channel, ("shutdown",), zmq.NOBLOCK)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        for sock in [*self._channels, self._replies]:
            sock.close(linger=0)
        self._context.term()
        self._socket_dir.cleanup()
        self._channels, self._processes = [], []


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: sends each step (and each swap) to the workers, then runs it here and samples."""

    def __init__(
        self, model: CausalLM, workers: TensorParallelWorkers, device: torch.device,
        calibration: list[list[int]] | None = None,
    ) -> None:  # fmt: skip
        """calibration: as ModelRunner's; every rank runs the same sequences (their all-reduces pair up)."""
        spec = workers.spec
        try:
            super().__init__(
                model, spec.num_kv_blocks, spec.block_size, device, spec.dtype, spec.seed, spec.num_swap_blocks,
                attention_backend=spec.attention_backend, kv_cache_dtype=spec.kv_cache_dtype,
                quantization=spec.quantization, calibration=calibration,
            )  # fmt: skip
        except BaseException:
            workers.shutdown()
            raise
        workers.wait_until_ready()
        self.workers = workers

    def launch(self, scheduled: list[ScheduledRequest], grammar: GrammarMask | None = None) -> LaunchedStep:
        self.workers.send(("forward", scheduled))
        return super().launch(scheduled, grammar)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.workers.send(("swap_out", pairs))
        super().swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.workers.send(("swap_in", pairs))
        super().swap_in(pairs)

    @property
    def healthy(self) -> bool:
        return self.workers.healthy

    def shutdown(self) -> None:
        self.workers.shutdown()


def _worker_main(spec: WorkerSpec, rank: int, inputs_path: str, replies_path: str) -> None:
    """Rank `rank`: join the group, load the shard, say ready, then run what rank 0 sends until told to stop."""
    with child_end(inputs_path, replies_path) as (inputs, replies):
        try:
            send(replies, ("started", rank, None))
            torch.set_num_threads(spec.num_threads)
            _join_group(spec, rank)
            runner = _build_rank(spec, rank)
            send(replies, ("ready", rank, None))
            _serve(runner, inputs)
        except Exception:
            send(replies, ("failed", rank, traceback.format_exc()))
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _join_group(spec: WorkerSpec, rank: int) -> None:
    """torch.distributed's default group, every rank of the engine in it; returns once all have joined."""
    dist.init_process_group(
        spec.backend, init_method=spec.init_method, rank=rank, world_size=spec.world_size, timeout=COLLECTIVE_TIMEOUT
    )


def _build_rank(spec: WorkerSpec, rank: int) -> ModelRunner:
    from tokenloom.model.loader import load_model

    device = rank_device(spec.device, rank)
    group = TensorParallelGroup(rank, spec.world_size)
    loaded = load_model(spec.model, spec.max_model_len, spec.dtype, device, group)
    return ModelRunner(
        loaded.model, spec.num_kv_blocks, spec.block_size, device, spec.dtype, spec.seed, spec.num_swap_blocks,
        attention_backend=spec.attention_backend,
        kv_cache_dtype=spec.kv_cache_dtype,
        quantization=spec.quantization,
        calibration=calibration_for(spec.quantization, loaded.tokenizer, loaded.config.vocab_size),
    )  # fmt: skip


def _serve(runner: ModelRunner, inputs: zmq.Socket[bytes]) -> None:
    parent = os.getppid()
    while os.getppid() == parent:  # an engine killed outright leaves no one to follow: end with it
        if not inputs.poll(POLL_MS):
            continue
        message = receive(inputs)
        kind = message[0]
        if kind == "shutdown":
            return
        if kind == "forward":
            runner.forward_only(message[1])
        elif kind == "swap_out":
            runner.swap_out(message[1])
        elif kind == "swap_in":
            runner.swap_in(message[1])
