"""N tokenloom replicas behind Ray Serve's HTTP proxy, with prefix-aware routing (routing.py).

    tokenloom serve [MODEL] --ray --num-replicas 2 [--ray-address auto] [--request-router prefix]

Two deployments, as Ray Serve LLM splits them:

    Ray's HTTP proxy -> Ingress (one replica; FastAPI) --handle, routed--> EngineReplica x N (each a whole server)

The ingress reads a request's body (within max_body_bytes, body_timeout and max_inflight_body_bytes, as a single
server does) and hands method, path, headers and body to an engine replica through a deployment handle; the
handle's request router sees the body, so it can route by the prompt. Each replica runs tokenloom's own FastAPI
app in process (the same validation, errors, streaming and limits as `tokenloom serve`) and streams the ASGI
messages back; the ingress replays them. A client that hangs up cancels the handle's stream, which cancels the
app's request in the replica and aborts it.

`/metrics` at the ingress is every replica's exposition merged, each sample with a `replica` label; replicas
push theirs to a small actor once a second. Autoscaling (`--num-replicas 0`) is Ray Serve's own, on ongoing
requests per replica (the queue a replica holds).

Nothing here uses `from __future__ import annotations`: FastAPI reads the ingress's signatures after Ray has
pickled the class by value, where a string annotation would no longer resolve.
"""

import asyncio
import json
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.config import AutoscalingConfig, HTTPOptions, RequestRouterConfig

from tokenloom.config import EngineConfig
from tokenloom.server.errors import APIError
from tokenloom.server.guard import BodyReader
from tokenloom.server.launch import build_server
from tokenloom.server.metrics import escape_label_value
from tokenloom.server_config import ServerConfig

logger = logging.getLogger(__name__)

APP_NAME = "tokenloom"
BOARD_NAME = "tokenloom-metrics-board"
METRICS_PUSH_S = 1.0
METRICS_STALE_S = 5.0  # a replica silent this long is gone from /metrics
INGRESS_MAX_ONGOING_REQUESTS = 4096
WAITING_REQUEST_TOKENS = 512  # what a waiting request is counted as in a replica's outstanding tokens
# What a request in flight on a replica that died hears: the engine was lost under it, as a single server's
# clients hear it when its engine core dies.
# (Its body, not the exception: Ray pickles the deployments with what they use, and an APIError does not unpickle.)
REPLICA_LOST_STATUS = 503
REPLICA_LOST = APIError(
    REPLICA_LOST_STATUS, "the engine replica serving this request died", None, "engine_unavailable"
).body()
ROUTERS = {
    "prefix": "tokenloom.replicas.routing:PrefixAwareRouter",
    "power_of_two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
}


def build_ray_app(server: ServerConfig, engine: EngineConfig) -> Any:
    """The Ray Serve application: the ingress bound to N (or autoscaled) engine replicas."""
    engines = EngineReplica.options(**replica_options(server, engine))
    # The ingress only forwards: it must never be what limits the requests in flight (Ray's default is 5).
    ingress = Ingress.options(max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
    limits = (server.max_body_bytes, server.max_inflight_body_bytes, server.body_timeout)
    return ingress.bind(engines.bind(server, engine), limits)


def replica_options(server: ServerConfig, engine: EngineConfig) -> dict[str, Any]:
    """The engine replicas' deployment options: how many (or autoscaling), the router, each one's resources."""
    options: dict[str, Any] = {
        "max_ongoing_requests": 4 * engine.scheduler.max_num_seqs,
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTERS[server.request_router], request_routing_stats_period_s=1.0
        ),
    }
    if server.num_replicas == 0:  # Ray Serve scales on ongoing requests per replica: a full batch each
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=1, max_replicas=server.max_replicas, target_ongoing_requests=engine.scheduler.max_num_seqs
        )
    else:
        options["num_replicas"] = server.num_replicas
    if engine.model.device != "cpu":  # each replica's node must hold its tensor-parallel ranks' accelerators
        options["ray_actor_options"] = {"num_cpus": 1, "num_gpus": engine.parallel.tensor_parallel_size}
    else:  # Ray sets an actor's OMP_NUM_THREADS (torch's threads) to its CPUs: the cores shared out by replica
        per_node = server.num_replicas or server.max_replicas
        cores = engine.model.num_threads or max(1, (os.cpu_count() or 1) // per_node)
        options["ray_actor_options"] = {"num_cpus": cores}
    return options


def start_ray(server: ServerConfig) -> None:
    """Joins the cluster at --ray-address, or starts a local one; Serve's proxy listens on host:port."""
    if not ray.is_initialized():
        ray.init(
            address=server.ray_address,
            include_dashboard=False,
            logging_level=logging.WARNING,
            log_to_driver=server.log_level in ("debug", "info"),  # the actors' logs, on this process's stdout
        )
    serve.start(http_options=HTTPOptions(host=server.host, port=server.port))


def serve_on_ray(server: ServerConfig, engine: EngineConfig) -> int:
    start_ray(server)
    serve.run(build_ray_app(server, engine), name=APP_NAME, route_prefix="/")
    logger.info("serving %d replica(s) behind Ray Serve on %s:%d", server.num_replicas, server.host, server.port)
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_until_complete(stop.wait())
    serve.shutdown()
    return 0


# ---- in-process ASGI calls ----------------------------------------------------------------------------------


ASGI_MESSAGES_AHEAD = 8  # response messages an app may send before its caller has read them


async def call_asgi(app: Any, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """Runs one forwarded HTTP request through an ASGI app; yields its response messages as they are sent.

    The client never disconnects from the app's point of view; cancelling this generator (the caller hung up)
    cancels the app's task instead.
    """
    # Bounded, so that a caller that reads slowly holds the app's stream back (which then keeps only its latest
    # output) instead of this queue keeping every chunk the app sends.
    messages: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue(maxsize=ASGI_MESSAGES_AHEAD)
    body_given = False

    async def receive() -> dict[str, Any]:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request["body"], "more_body": False}
        await asyncio.Event().wait()  # no disconnect: the caller cancels instead
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(request), receive, send)
        except BaseException as error:  # the app raised: the caller hears it
            await messages.put(error)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if isinstance(message, BaseException):
                raise message
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": list(message.get("headers", []))}
            elif message["type"] == "http.response.body":
                yield {"body": message.get("body", b"")}
                if not message.get("more_body", False):
                    return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _scope(request: dict[str, Any]) -> dict[str, Any]:
    path = request["path"]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request["method"],
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": request.get("query_string", b""),
        "root_path": "",
        "headers": request["headers"],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
        "state": {},
    }


# ---- /metrics across replicas -------------------------------------------------------------------------------


def merge_expositions(texts: dict[str, str]) -> str:
    """Prometheus expositions of several replicas (by replica id) as one: each family once (HELP, TYPE), every
    replica's samples, each with its `replica` label (tokenloom's families carry it; process metrics gain it)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            # A counter's family is named without _total, its samples with it: the header takes the samples' name.
            name = f"{family.name}_total" if family.type == "counter" else family.name
            entry = families.setdefault(name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": sample.labels.get("replica", replica)}
                rendered = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in sorted(labels.items()))
                entry[2].append(f"{sample.name}{{{rendered}}} {_number(sample.value)}")
    lines = []
    for name, (doc, kind, samples) in families.items():
        lines += [f"# HELP {name} {escape_label_value(doc)}", f"# TYPE {name} {kind}", *samples]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return repr(float(value)) if value == value else "NaN"


async def _relayed(messages: Any, event_stream: bool) -> AsyncIterator[bytes]:
    """The replica's body as it comes. If the replica dies mid-stream, an event stream still ends as the engine's
    own streams end on a failure: an OpenAI error event, then [DONE]; any other body is cut (the client sees a
    short read)."""
    try:
        async for message in messages:
            if message.get("body"):
                yield message["body"]
    except Exception as error:
        logger.error("replica failed mid-response: %r", error)
        if event_stream:
            yield f"data: {json.dumps(REPLICA_LOST)}\n\ndata: [DONE]\n\n".encode()


# ---- the deployments (last: Ray pickles them when they are decorated, with what the module holds by then) ----


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest /metrics exposition of each live replica, by replica id; one not heard from for a while (a
    replica that was replaced or died) drops out."""

    def __init__(self) -> None:
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.monotonic(), text)

    def drop(self, replica: str) -> None:
        self.texts.pop(replica, None)

    def all(self) -> dict[str, str]:
        fresh_since = time.monotonic() - METRICS_STALE_S
        return {replica: text for replica, (at, text) in self.texts.items() if at >= fresh_since}


def metrics_board() -> Any:
    return MetricsBoard.options(name=BOARD_NAME, namespace=APP_NAME, get_if_exists=True, lifetime="detached").remote()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EngineReplica:
    """One whole tokenloom server (engine, async engine, app), called with forwarded HTTP requests."""

    def __init__(self, server: ServerConfig, engine: EngineConfig) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app, self.async_engine = build_server(server, engine, replica_id=self.replica_id)
        self.block_size = engine.cache.block_size
        self.async_engine.start()
        self.board = metrics_board()
        threading.Thread(target=self._push_metrics, name="metrics-push", daemon=True).start()

    async def __call__(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for message in call_asgi(self.app, request):
            yield message

    def record_routing_stats(self) -> dict[str, float]:
        """What the router orders the other replicas by: KV tokens held, plus an estimate for the queue."""
        stats = self.async_engine.stats()
        outstanding = stats.kv_blocks_in_use * self.block_size + stats.num_waiting * WAITING_REQUEST_TOKENS
        return {"outstanding_tokens": float(outstanding)}

    def _push_metrics(self) -> None:
        metrics = self.app.state.tokenloom.metrics
        while True:
            self.board.put.remote(self.replica_id, metrics.render().decode())
            time.sleep(METRICS_PUSH_S)

    def __del__(self) -> None:
        self.board.drop.remote(self.replica_id)
        self.async_engine.shutdown()


ingress_app = FastAPI(title="tokenloom (Ray Serve ingress)")


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(ingress_app)
class Ingress:
    def __init__(self, engine: Any, limits: tuple[int, int, float]) -> None:
        """limits: the server's max_body_bytes, max_inflight_body_bytes and body_timeout, as a single server reads
        bodies (guard.py); a replica's own app applies them again to what it is handed."""
        self.engine = engine.options(stream=True)
        max_body_bytes, max_inflight_body_bytes, body_timeout = limits
        self.bodies = BodyReader(max_body_bytes, lambda reason: None, max_inflight_body_bytes, body_timeout)
        self.board = metrics_board()

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await self.board.all.remote()
        return PlainTextResponse(merge_expositions(texts), media_type="text/plain; version=0.0.4")

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(self, path: str, request: Request) -> Response:
        try:
            body = await self.bodies.read(request.receive)
        except APIError as error:
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        if body is None:
            return Response(status_code=400)  # the client left before its body was whole: no one reads this
        try:  # the body's bytes of the ingress's budget, given back once a replica has the request
            forwarded = {
                "method": request.method,
                "path": "/" + path,
                "query_string": request.url.query.encode(),
                "headers": [(k.encode(), v.encode()) for k, v in request.headers.items()],
                "body": body,
            }
            messages = self.engine.remote(forwarded)
            try:
                start = await messages.__anext__()
            except Exception as error:  # the replica died (or could not be reached) before the response began
                logger.error("replica failed before responding to %s /%s: %r", request.method, path, error)
                return JSONResponse(REPLICA_LOST, status_code=REPLICA_LOST_STATUS)
        finally:
            self.bodies.budget.give_back(len(body))
        headers = {k.decode(): v.decode() for k, v in start.get("headers", []) if k.lower() != b"content-length"}
        event_stream = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_relayed(messages, event_stream), status_code=start["status"], headers=headers)
