"""The code's version, for /version and for what a measurement records beside its numbers."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path


def git_commit() -> str:
    """The short commit of the tokenloom checkout, or "unknown" outside one."""
    with contextlib.suppress(OSError):
        result = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip()
    return "unknown"
