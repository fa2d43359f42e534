"""A tokenloom server started as a child process on a free loopback port, for matrix runs and tests."""

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


class LocalServer:
    def __init__(
        self,
        *args: str,
        startup_timeout: float = 300.0,
        log_level: str = "warning",
        env: dict[str, str] | None = None,
    ) -> None:
        """env: more environment for the server (PYTHONPATH to serve another checkout's code)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "tokenloom.cli", "serve", "--port", str(self.port), "--log-level", log_level]
        environment = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), **(env or {})}
        self.process = subprocess.Popen(
            [*command, *args], env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                output = self.process.stdout.read().decode() if self.process.stdout else ""
                raise RuntimeError(f"the server exited: {output[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the server did not answer /health within {startup_timeout:.0f}s")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM: the server drains and exits; returns its exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.terminate(timeout=30)
        self.stop()
