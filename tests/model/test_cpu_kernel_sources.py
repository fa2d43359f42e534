"""The C++ operators compile for every CPU family they have paths for, not only for the one this machine has: each
is built with -march=native where it runs, so a path for an ISA this machine lacks is otherwise never compiled here
(an AVX2-only helper used on the AVX-512 path once broke the whole build on every AVX-512 CPU).

All sources are checked as one translation unit per family: torch's headers, which take most of each parse, are
read once per family instead of once per source and family (98 s -> ~18 s on two cores). Every header any source
includes comes first, at file scope; then each source inside a namespace of its own, so that the names sources keep
to themselves (`namespace { ... }`) do not meet; their own #include lines are then no-ops. Each source's own
includes are still checked where it is built for this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from tokenloom.model.cpu_kernel import SOURCES

# AVX2 and FMA only; AVX-512 without VNNI or BF16; AVX-512 with VNNI and no BF16 (the int8 kernels' bf16 stores
# by integer arithmetic); AVX-512 with VNNI, BF16 and AMX.
FAMILIES = ("haswell", "skylake-avx512", "cascadelake", "sapphirerapids")


def syntax_errors(source: Path, family: str) -> str:
    includes = [arg for path in include_paths() for arg in ("-isystem", path)]
    command = [os.environ.get("CXX", "c++"), "-fsyntax-only", "-std=c++20", f"-march={family}", "-fopenmp",
               *includes, "-isystem", sysconfig.get_paths()["include"], str(source)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else f"{source} for -march={family}:\n{done.stderr[-3000:]}"


def every_source_text() -> str:
    csrc = SOURCES[0].parent
    lines = {line.strip() for path in csrc.iterdir() for line in path.read_text().splitlines()}
    headers = sorted(line.replace('"', f'"{csrc}/', 1) for line in lines if line.startswith("#include"))
    sources = [f'namespace every_source_{i} {{\n#include "{source}"\n}}' for i, source in enumerate(SOURCES)]
    return "\n".join([*headers, *sources]) + "\n"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the paths are x86's")
def test_every_source_compiles_for_every_x86_family(tmp_path):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    every_source = tmp_path / "every_source.cpp"
    every_source.write_text(every_source_text())
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = [e for e in pool.map(lambda family: syntax_errors(every_source, family), FAMILIES) if e]
    assert not errors, "\n".join(errors)
