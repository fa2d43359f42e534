"""Test helpers over LocalServer: read /metrics samples, and poll them with a deadline; requests held open."""

from __future__ import annotations

import select
import socket
import threading
import time

import httpx

from tokenloom.bench.local_server import LocalServer

POLL_INTERVAL_S = 0.05  # between reads of /metrics while waiting, always under a deadline

# 24 blocks of 16 hold 384 tokens: two requests that grow to ~295 tokens each cannot run together.
TINY_KV_POOL_ARGS = ("--max-num-seqs", "4", "--num-kv-blocks", "24", "--block-size", "16", "--max-model-len", "300")


class ServerProcess(LocalServer):
    """A test server: float32 unless the test gives --dtype, since the tests' oracles are float32."""

    def __init__(self, *args: str, **kwargs) -> None:
        super().__init__(*args, *(() if "--dtype" in args else ("--dtype", "float32")), **kwargs)

    def metric(self, name: str, headers: dict[str, str] | None = None, absent: float | None = None) -> float:
        """The value of a sample of /metrics, summed over the labels not given: `name` or `name{label="value",...}`.
        ``absent``: the value where no sample matches yet (a labelled counter before its first count)."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        base, _, wanted = name.partition("{")
        pairs = [p for p in wanted.rstrip("}").split(",") if p]
        total, found = 0.0, False
        for line in text.splitlines():
            if not (line.startswith(base + " ") or line.startswith(base + "{")):
                continue
            labels = line[len(base) :].rsplit(" ", 1)[0]
            if all(pair in labels for pair in pairs):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        if not found and absent is not None:
            return absent
        assert found, f"no metric {name}"
        return total

    def wait_for_metric(self, name: str, predicate, timeout: float = 30.0, headers=None, absent=None) -> float:
        return poll_until(lambda: self.metric(name, headers, absent), predicate, timeout)

    def wait_idle(self, headers: dict[str, str] | None = None) -> None:
        """Nothing runs or waits and no KV block is held: no request outlived its client."""
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert self.wait_for_metric(f"tokenloom:{name}", lambda v: v == 0, headers=headers) == 0, name


def poll_until(read, predicate, timeout: float = 30.0):
    """Reads until predicate(value) holds or the deadline passes; returns the last value read."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if predicate(value) or time.monotonic() > deadline:
            return value
        time.sleep(POLL_INTERVAL_S)


class HeldRequest:
    """A streamed completion that holds its seat (running, or queued) until ``release``, which hangs up: the server
    aborts it at its next token. A test that only needs a request in the way need not wait for it to finish."""

    def __init__(self, url: str, body: dict, headers: dict[str, str] | None = None) -> None:
        self._released = threading.Event()
        self.status: int | None = None
        self._thread = threading.Thread(target=self._hold, args=(url, {**body, "stream": True}, headers))
        self._thread.start()

    def _hold(self, url: str, body: dict, headers: dict[str, str] | None) -> None:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as response:
            self.status = response.status_code
            for _ in response.iter_lines():
                if self._released.is_set():
                    return

    def release(self) -> None:
        self._released.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "a held request did not end"


class StalledBodies:
    """Connections that each send ``part`` (a request's head and some of its body) and stall, each held by the server
    until its body deadline (408). A probe sent beside them may reach the server before a stalled part does and take
    the bytes it needed, so that part is refused (429) instead: ``replace_answered`` puts a new connection in place of
    each one the server has answered, and keeps the statuses they got, for tests that count refusals."""

    def __init__(self, port: int, part: bytes, count: int) -> None:
        self.port, self.part = port, part
        self.replaced_statuses: list[int] = []
        self.sockets = [self._stall() for _ in range(count)]

    def _stall(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        sock.sendall(self.part)
        return sock

    def replace_answered(self) -> None:
        for i, sock in enumerate(self.sockets):
            if select.select([sock], [], [], 0)[0]:
                self.replaced_statuses.append(status_of(response_until_closed(sock)))
                sock.close()
                self.sockets[i] = self._stall()

    def responses(self) -> list[bytes]:
        """What each stalled connection is answered, read until the server closes it."""
        answers = [response_until_closed(sock) for sock in self.sockets]
        for sock in self.sockets:
            sock.close()
        return answers


def response_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])
