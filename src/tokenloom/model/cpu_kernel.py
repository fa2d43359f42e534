"""An optional compiled kernel for decode attention on CPU, reading K and V straight from the paged cache.

Plain PyTorch must copy each context out of its scattered blocks before it can multiply (a gather), so decode
attention reads the context three times: to copy it, to write the copy, to use it. This kernel reads it once.
It is a few dozen lines of C, built with the system compiler on first use (about a second) and kept in the
tokenloom cache; without a compiler, on any device but the CPU, for dtypes other than float32, or with
TOKENLOOM_CPU_KERNEL=0, the engine
uses the plain PyTorch path in attention.py, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenloom.model.gguf_convert import cache_root

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* One request's query (all heads) over its context. Each cached row (all KV heads of one token, contiguous)
   is read once and serves every query head, so a block's rows stream through in order. HD is the head size
   when known at compile time (the dot products then unroll fully), else 0. */
static inline void attend_seq(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t ctx,
    int64_t num_heads, int64_t group, int64_t row, int64_t head_dim, int64_t block_size, float scale,
    float *out, const int HD)
{
    const int64_t hd = HD ? HD : head_dim;
    float *scores = (float *)malloc(sizeof(float) * num_heads * ctx);
    float *acc = (float *)calloc(num_heads * hd, sizeof(float));
    for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const float *k_block = k_cache + table[b] * block_size * row;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t j = 0; j < n; ++j) {
            const float *k_row = k_block + j * row;
            for (int64_t h = 0; h < num_heads; ++h) {
                const float *qh = q + h * hd, *k = k_row + (h / group) * hd;
                float dot = 0.0f;
                for (int64_t d = 0; d < hd; ++d) dot += qh[d] * k[d];
                scores[h * ctx + t0 + j] = dot * scale;
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        float *s = scores + h * ctx;
        float max = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < ctx; ++t) max = s[t] > max ? s[t] : max;
        for (int64_t t = 0; t < ctx; ++t) { s[t] = expf(s[t] - max); sum += s[t]; }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; ++t) s[t] *= inv;
    }
    for (int64_t t0 = 0, b = 0; t0 < ctx; t0 += block_size, ++b) {
        const float *v_block = v_cache + table[b] * block_size * row;
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
        for (int64_t j = 0; j < n; ++j) {
            const float *v_row = v_block + j * row;
            for (int64_t h = 0; h < num_heads; ++h) {
                const float w = scores[h * ctx + t0 + j];
                const float *v = v_row + (h / group) * hd;
                float *a = acc + h * hd;
                for (int64_t d = 0; d < hd; ++d) a[d] += w * v[d];
            }
        }
    }
    for (int64_t i = 0; i < num_heads * hd; ++i) out[i] = acc[i];
    free(scores);
    free(acc);
}

/* One query row per request, at the end of its context of ctx_lens[i] tokens; requests are split over threads. */
void paged_decode_attention_f32(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
    int64_t max_blocks, const int64_t *ctx_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *out, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
        const float *qs = q + seq * num_heads * head_dim;
        float *o = out + seq * num_heads * head_dim;
        const int64_t *table = block_tables + seq * max_blocks;
        const int64_t ctx = ctx_lens[seq];
        if (head_dim == 64)
            attend_seq(qs, k_cache, v_cache, table, ctx, num_heads, group, row, 64, block_size, scale, o, 64);
        else if (head_dim == 128)
            attend_seq(qs, k_cache, v_cache, table, ctx, num_heads, group, row, 128, block_size, scale, o, 128);
        else
            attend_seq(qs, k_cache, v_cache, table, ctx, num_heads, group, row, head_dim, block_size, scale, o, 0);
    }
}
"""

# -march=native: the kernel is built on the machine that runs it. -lm last: vectorised expf lives in libmvec.
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-lm"]

_library: ctypes.CDLL | None = None
_tried = False


def kernel_enabled() -> bool:
    return os.environ.get("TOKENLOOM_CPU_KERNEL", "1") != "0"


def load_kernel() -> ctypes.CDLL | None:
    """Builds (once per source version) and loads the kernel; None if it cannot be had here."""
    global _library, _tried
    if _tried:
        return _library
    _tried = True
    if not kernel_enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found; decode attention uses the plain PyTorch path")
        return None
    # -march=native code must never run on another CPU, so the CPU is part of the key.
    identity = SOURCE + compiler + " ".join(FLAGS) + _cpu_identity()
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"paged_attention-{digest}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as error:
        logger.warning("could not build the CPU attention kernel (%s); using the plain PyTorch path", error)
        return None
    function = library.paged_decode_attention_f32
    function.restype = None
    function.argtypes = (
        [ctypes.c_void_p] * 4
        + [ctypes.c_int64, ctypes.c_void_p]
        + [ctypes.c_int64] * 5
        + [
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
    )
    _library = library
    return library


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    return "".join(line for line in lines if line.startswith(("model name", "flags")))[:4096]


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "kernel.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS[:-1], str(source), FLAGS[-1], "-o", str(built)], check=True, capture_output=True
        )
        os.replace(built, target)


def usable_for(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and load_kernel() is not None


def paged_decode_attention(
    q: torch.Tensor,
    cache_k: torch.Tensor,
    cache_v: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q: [D, heads, d] contiguous float32; block_tables: [D, max_blocks]; context_lens: [D]. Returns [D, heads, d]."""
    library = load_kernel()
    assert library is not None
    q = q.contiguous()
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    library.paged_decode_attention_f32(
        q.data_ptr(),
        cache_k.data_ptr(),
        cache_v.data_ptr(),
        block_tables.data_ptr(),
        block_tables.shape[1],
        context_lens.data_ptr(),
        num_seqs,
        num_heads,
        cache_k.shape[1] // head_dim,
        head_dim,
        block_size,
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out
