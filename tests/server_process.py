"""Starts `tokenloom serve` as a real process on a free loopback port, and waits for it with a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, startup_timeout: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        self.process = subprocess.Popen([*command, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.process.stdout.read().decode()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError("the server did not come up in time")

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """The value of one sample of /metrics (summed over labels)."""
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"no metric {name}"
        return total

    def wait_for_metric(self, name: str, predicate, timeout: float = 30.0, headers=None) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name, headers)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.05)

    def terminate(self, timeout: float = 60.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
