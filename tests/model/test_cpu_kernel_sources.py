"""The C++ operators compile for every CPU family they have paths for, not only for the one this machine has: each
is built with -march=native where it runs, so a path for an ISA this machine lacks is otherwise never compiled here
(an AVX2-only helper used on the AVX-512 path once broke the whole build on every AVX-512 CPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils.cpp_extension import include_paths

from tokenloom.model.cpu_kernel import SOURCES

# AVX2 and FMA only; AVX-512 without VNNI or BF16; AVX-512 with VNNI, BF16 and AMX (which covers the VNNI paths).
FAMILIES = ("haswell", "skylake-avx512", "sapphirerapids")


def syntax_errors(source: str, family: str) -> str:
    includes = [arg for path in include_paths() for arg in ("-isystem", path)]
    command = [os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++20", f"-march={family}", "-fopenmp",
               *includes, "-isystem", sysconfig.get_paths()["include"], source]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else f"{source} for -march={family}:\n{done.stderr[-3000:]}"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the paths are x86's")
def test_every_source_compiles_for_every_x86_family():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    jobs = [(str(source), family) for family in FAMILIES for source in SOURCES]
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = [e for e in pool.map(lambda job: syntax_errors(*job), jobs) if e]
    assert not errors, "\n".join(errors)
