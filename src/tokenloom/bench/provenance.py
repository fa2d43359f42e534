"""What a measurement needs beside its numbers to be repeatable: the machine and the code's version."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

from tokenloom.version import git_commit

__all__ = ["cpu_flags", "git_commit", "machine_info"]


def cpu_flags() -> str:
    """The CPU's vector extensions (AVX, AMX, FMA), as benchmarks note them beside a figure."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""
    return " ".join(sorted(f for f in flags.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma"))))


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "python": platform.python_version(),
        "torch": None,
        "torch_threads": None,
    }
    with contextlib.suppress(ImportError):
        import torch

        info["torch"], info["torch_threads"] = torch.__version__, torch.get_num_threads()
    return info
