"""The README's blocks run as written, in order, from a directory laid out as the repository root.

``bash`` blocks run in bash (``make test`` is skipped: it is what runs this; ``make serve`` is started in the
background and waited for on 127.0.0.1:8000, as a reader would leave it running); ``python`` blocks run in the
project's interpreter; a plain block of ``$ command`` lines and their output runs each command and checks its
first line of output. Bounded: every command has a timeout, and the README keeps its examples small.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import httpx
import pytest
from server_process import poll_until

REPO = Path(__file__).resolve().parents[1]
SERVE_URL = "http://127.0.0.1:8000"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.DOTALL | re.MULTILINE)
COMMAND_TIMEOUT_S = 600


def readme_blocks() -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall((REPO / "README.md").read_text())]


def test_every_runnable_block_uses_a_command_that_exists_without_an_active_venv():
    """Pasted into a fresh shell, `tokenloom` alone is not on PATH: the README writes .venv/bin/tokenloom."""
    for lang, body in readme_blocks():
        lines = body.splitlines() if lang == "bash" else [ln[2:] for ln in body.splitlines() if ln.startswith("$ ")]
        for line in lines:
            assert not re.match(r"\s*tokenloom\b", line), f"bare tokenloom in the README: {line}"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _wait_for_health(process: subprocess.Popen, timeout: float = 300.0) -> None:
    def status() -> int:
        assert process.poll() is None, "make serve exited"
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{SERVE_URL}/health", timeout=1).status_code
        return 0

    assert poll_until(status, lambda code: code == 200, timeout=timeout) == 200, "make serve did not answer /health"


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    assert done.returncode == 0, (
        f"{command[-1][:400]}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    )
    return done


@pytest.mark.real_model
def test_the_readme_runs_as_written(tmp_path):
    if not (REPO / ".venv" / "bin" / "tokenloom").exists():
        pytest.skip("the README's commands use the repository's .venv, which make test creates")
    if not _port_free(8000):
        pytest.fail("port 8000 is taken; the README serves there")
    for name in (".venv", "Makefile", "pyproject.toml", "benchmarks", "src", "README.md"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    server: subprocess.Popen | None = None
    try:
        for lang, body in readme_blocks():
            if lang == "bash":
                lines = [ln for ln in body.splitlines() if ln.split("#")[0].strip() != "make test"]
                if lines and lines[0].startswith("make serve"):
                    server = subprocess.Popen(
                        ["make", "serve"], cwd=tmp_path, env=env, start_new_session=True,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                    _wait_for_health(server)
                    continue
                _run(["bash", "-e", "-o", "pipefail", "-c", "\n".join(lines)], tmp_path, env)
            elif lang == "python":
                _run([str(REPO / ".venv" / "bin" / "python"), "-c", body], tmp_path, env)
            else:
                _check_transcript(body, tmp_path, env)
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    assert (tmp_path / "run1.json").exists() and (tmp_path / "sweep" / "sweep.json").exists()


def _check_transcript(body: str, cwd: Path, env: dict[str, str]) -> None:
    """`$ command` lines followed by their output: each runs, and prints what the README shows first."""
    lines = body.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("$ "):
            continue
        printed = _run(["bash", "-e", "-c", line[2:]], cwd, env).stdout.splitlines()
        shown = lines[i + 1] if i + 1 < len(lines) else ""
        assert printed and printed[0] == shown, (line, printed[:3], shown)
