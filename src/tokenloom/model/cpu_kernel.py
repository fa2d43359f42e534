"""The CPU operators in ``csrc/`` (``torch.ops.tokenloom.*``), built on first use.

Decode attention: plain PyTorch must copy each context out of its scattered blocks before it can multiply (a
gather), so it reads the context three times: to copy it, to write the copy, to use it. The C++ operator reads it
once, in float32 or bfloat16. Beside it: the fused norms, rotary and SiLU (fused.cpp), prefill attention (float32
with AVX-512, bf16 too with AVX-512 BF16), the bf16 linear with its packed weights (bf16_linear.cpp, used by
prepack.py) only where the compiler targets AVX-512 BF16; the int8 linears (int8_linear.cpp with VNNI, or
int8_linear_avx2.cpp where the CPU has AVX2 but no VNNI, for --quantization int8) and the AMX linears
(amx_int8_linear.cpp, amx_bf16_linear.cpp) only where it targets those; the LoRA adapters' deltas (lora.cpp). They
are built with ``torch.utils.cpp_extension`` (the system C++ compiler and ninja, about
half a minute) into the tokenloom cache, keyed by the sources, the flags, torch's version and the CPU, and
registered with ``torch.library``, so their inputs are checked (dtype, shape, contiguity, index types, block ids).
Without a compiler, on any device but the CPU, for other dtypes, or with TOKENLOOM_CPU_KERNEL=0, the engine uses the
plain PyTorch paths (attention.py, oneDNN or ``F.linear``), which compute the same things and are tested against
them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

from tokenloom.model.gguf_convert import cache_root

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [
    CSRC / name
    for name in (
        "paged_attention.cpp",
        "fused.cpp",
        "prefill_attention.cpp",
        "bf16_linear.cpp",
        "int8_linear.cpp",
        "int8_linear_avx2.cpp",
        "amx_int8_linear.cpp",
        "amx_bf16_linear.cpp",
        "row_topk.cpp",
        "f32_linear.cpp",
        "lora.cpp",
    )
]
HEADERS = [
    CSRC / name
    for name in (
        "work_sharing.h",
        "avx512_exp.h",
        "bf16_vec.h",
        "kv_codes.h",
        "int8_epilogue.h",
        "int8_packing.h",
        "amx_tiles.h",
        "vnni_asm.h",
    )
]
# -march=native: the operator is built on the machine that runs it (the CPU is part of the cache key). -ffast-math
# vectorises float sums and exp (glibc's SIMD expf is declared only under it); it also assumes no infinities, so
# the sources use finite sentinels instead of -inf and clamp exponents that real activations can overflow.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
DTYPES = (torch.float32, torch.bfloat16)

_loaded: bool | None = None


def kernel_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_KERNEL", "1") != "0"


def load_kernel() -> bool:
    """Builds (once per source, flags, torch, CPU and checkout) and registers the operator; False if it cannot be."""
    global _loaded
    if _loaded is not None:
        return _loaded
    _loaded = False
    if not kernel_enabled():
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.info("no C++ compiler found; decode attention uses the plain PyTorch path")
        return False
    from torch.utils import cpp_extension

    identity = "".join(p.read_text() for p in SOURCES + HEADERS) + " ".join(FLAGS) + torch.__version__ + _cpu_identity()
    # The build records its sources' paths: two checkouts sharing one directory would rebuild it in turn (~50 s).
    identity += str(CSRC.resolve())
    name = "tokenloom_attention_" + hashlib.sha256(identity.encode()).hexdigest()[:12]
    build_dir = cache_root() / "kernels" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in SOURCES],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("could not build the CPU attention operator (%s); using the plain PyTorch path", error)
        return False
    _loaded = True
    return True


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "".join(line for line in lines if line.startswith(("model name", "flags")))[:4096]


def has_lora_operator() -> bool:
    """The LoRA deltas' operator (lora.cpp), built for every CPU."""
    return load_kernel() and has_operator("lora_add")


def has_prefill_op(dtype: torch.dtype) -> bool:
    """The prefill operators are built where the compiler targets AVX-512: for float32, and for bfloat16 where it
    also targets AVX-512 BF16."""
    if not (load_kernel() and has_operator("prefill_attention")):
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.tokenloom.prefill_attention_takes_bf16())


@functools.cache
def prefill_op_uses_amx() -> bool:
    """Whether the bf16 prefill operators multiply on AMX tiles (built for such a CPU, the tiles granted)."""
    return has_prefill_op(torch.bfloat16) and bool(torch.ops.tokenloom.prefill_attention_uses_amx())


@functools.cache
def has_row_topk() -> bool:
    """tokenloom::row_topk (every build has it), once the operators are built; asked once, not every step."""
    return load_kernel() and has_operator("row_topk")


def has_operator(name: str) -> bool:
    """Whether tokenloom::name is registered (a build for another CPU may leave some out)."""
    try:
        getattr(torch.ops.tokenloom, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def usable_for(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in DTYPES and load_kernel()


def dequantize_past(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    length: int,
    head_dim: int,
    kv_kind: int,
    block_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """An 8-bit cache's first `length` slots along block_table ([blocks] int64), decoded into out ([length, kv_heads *
    head_dim], float32 or bfloat16): the values kv_quant.dequantize_blocks gives, in one pass."""
    torch.ops.tokenloom.dequantize_past(cache, block_table, length, head_dim, kv_kind, block_size, out)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
    kv_kind: int = 0,
    split_keys: int = 0,
) -> torch.Tensor:
    """q: [D, heads, d]; block_tables: [D, max_blocks] int64; context_lens: [D] int64. Returns [D, heads, d]: `out`
    when given (a slice of the step's output, written in place: no copy), else a new tensor. q's and out's rows may
    be strided, as views into the fused qkv output and the step's output are. kv_kind: an 8-bit cache's
    KVFormat.kind (kv_quant.py), 0 for a cache of q's dtype. split_keys: keys per split of a context (a multiple of
    block_size) where contexts are attended in splits and merged (split-K); 0 lets the operator decide: a context
    of at least 1,024 keys in up to one split per thread, each of 512 keys or more (by context length and thread
    count alone, so a sequence's output does not depend on its batch), none on one thread."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    torch.ops.tokenloom.paged_decode_attention(
        q, cache_k, cache_v, block_tables, context_lens, block_size, scale, out, kv_kind, split_keys
    )
    return out
